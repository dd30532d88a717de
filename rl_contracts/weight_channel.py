"""WeightChannel: a policy's newest weights on one host, passed by reference through shared memory.

The trainer (rank 0) writes each publish as one file in a directory on ``/dev/shm`` (RAM, no disk);
engines on the same host load the newest version before they generate, or wait for a version they need. Nothing
goes through the driver or the object store, and a publish is one local write: no per-step actor round trip.

A version appears atomically (written under a temporary name, then renamed), so a reader sees a whole file or
none. The writer keeps the newest ``keep`` versions; a reader that opened an older one still reads it whole (an
unlinked file lives until it is closed).

A channel made by :meth:`WeightChannel.create` belongs to the process that made it (``rl_contracts/scratch.py``):
its directory, ``tq-weights-<pid>-<random>``, is removed by :meth:`WeightChannel.close` (the run's shutdown), at
interpreter exit if nothing closed it, and, when that process was killed outright, by the next ``create`` on the
host.

>>> channel = WeightChannel(tempfile.mkdtemp())  # doctest: +SKIP
>>> channel.write(3, model.state_dict())  # doctest: +SKIP
>>> channel.newest_version()  # doctest: +SKIP
3
>>> serial, version, state = channel.load(min_version=3)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import torch

from rl_contracts.scratch import ScratchDir

_NAME = re.compile(r"^(\d{12})\.v(\d+)\.pt$")  # serial (one per write) and policy version


class WeightChannelTimeout(TimeoutError):
    """No version at least as new as the one asked for appeared in time."""


class WeightChannel:
    """Versions of a state dict in a directory of one host (see the module docstring).

    Args:
        path: the channel's directory (created if missing); both sides must name the same one.
        keep: versions the writer keeps.
    """

    def __init__(self, path: str | os.PathLike[str], keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._owner: ScratchDir | None = None

    @classmethod
    def create(cls, prefix: str = "tq-weights-", root: str | None = None) -> WeightChannel:
        """A new channel this process owns, in shared memory (``/dev/shm``, or ``root``; the temporary directory
        where there is none): removed by :meth:`close`, at exit, or by a later ``create`` once this process is dead
        (the channels of dead processes are swept first)."""
        owner = ScratchDir(prefix, root)
        channel = cls(owner.path)
        channel._owner = owner
        return channel

    def write(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Publish ``state_dict`` as policy ``version``: never older than the newest written (the same version may
        be written again, e.g. each evaluation of a warm-up; readers take the newest write)."""
        newest = self.newest()
        if newest is not None and version < newest[1]:
            raise ValueError(f"version {version} is older than the channel's newest, {newest[1]}")
        serial = newest[0] + 1 if newest is not None else 0
        final = self.path / f"{serial:012d}.v{version}.pt"
        tmp = self.path / f".{final.name}.{os.getpid()}.tmp"
        torch.save({name: t.detach().contiguous() for name, t in state_dict.items()}, tmp)
        os.replace(tmp, final)
        for old_serial, old_version in self._writes()[: -self.keep]:
            (self.path / f"{old_serial:012d}.v{old_version}.pt").unlink(missing_ok=True)

    def newest(self) -> tuple[int, int] | None:
        """``(serial, version)`` of the newest write, or None."""
        writes = self._writes()
        return writes[-1] if writes else None

    def newest_version(self) -> int | None:
        """The policy version of the newest write, or None."""
        newest = self.newest()
        return newest[1] if newest is not None else None

    def load(self, min_version: int = 0, timeout: float = 0.0) -> tuple[int, int, dict[str, torch.Tensor]]:
        """The newest write, once its version is at least ``min_version``: ``(serial, version, state_dict)``.

        Raises:
            WeightChannelTimeout: if no such version appears within ``timeout`` seconds.
        """
        serial, version = self.wait(min_version, timeout)
        while True:
            try:
                state = torch.load(self.path / f"{serial:012d}.v{version}.pt", weights_only=True)
                return serial, version, state
            except FileNotFoundError:  # pruned between listing and opening: a newer one exists
                serial, version = self.wait(version, timeout)

    def wait(self, min_version: int, timeout: float) -> tuple[int, int]:
        """``(serial, version)`` of the newest write once its version is at least ``min_version`` (polling).

        Raises:
            WeightChannelTimeout: after ``timeout`` seconds without one.
        """
        deadline, pause = time.monotonic() + timeout, 1e-4
        while True:
            newest = self.newest()
            if newest is not None and newest[1] >= min_version:
                return newest
            if time.monotonic() >= deadline:
                have = newest[1] if newest is not None else None
                raise WeightChannelTimeout(
                    f"no weights of version >= {min_version} in {self.path} after {timeout:.1f} s (newest: {have})"
                )
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def close(self) -> None:
        """Delete the channel's files and directory (the owner's side, at the end of a run; idempotent)."""
        if self._owner is not None:
            self._owner.remove()
        else:
            shutil.rmtree(self.path, ignore_errors=True)

    def _writes(self) -> list[tuple[int, int]]:
        return sorted((int(m.group(1)), int(m.group(2))) for name in os.listdir(self.path) if (m := _NAME.match(name)))
