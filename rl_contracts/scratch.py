"""Scratch directories a process owns in shared memory: removed by their owner however it ends, or, when the owner
was killed outright (SIGKILL, an OOM kill), by the next process that makes one on the host.

A directory is named ``<prefix><pid>-<random>`` in ``/dev/shm`` (the temporary directory where there is none) and
holds ``owner.lock``, on which its owner keeps an exclusive ``flock`` for as long as it lives; the kernel drops the
lock with its holder. The owner removes the directory with :meth:`ScratchDir.remove`, which ``atexit`` also calls.
:func:`sweep_dead` removes those of dead owners: the lock can be taken, or (a directory caught before its lock file
existed) the pid in its name is no process. A live owner's directory is never touched.

>>> scratch = ScratchDir("tq-weights-")  # doctest: +SKIP
>>> scratch.path  # doctest: +SKIP
PosixPath('/dev/shm/tq-weights-4242-k3j2h1a0')
>>> scratch.remove()  # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import fcntl
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from transfer_queue.wire.socket_dirs import lock_held

LOCK_NAME = "owner.lock"


def shm_root() -> str | None:
    """``/dev/shm`` where it exists and is writable (RAM, no disk); else None (the temporary directory)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def owner_alive(path: str | os.PathLike[str], pid: int) -> bool:
    """Whether the owner of scratch directory ``path`` (``pid``: the one in its name) may still live: dead only when
    nobody holds its lock (or it has none) **and** the pid in its name is gone. The lock alone is not enough: between
    making the directory and locking it, its owner holds nothing."""
    return bool(lock_held(os.path.join(path, LOCK_NAME), shared=True)) or _pid_alive(pid)


def sweep_dead(prefix: str, root: str | None = None) -> list[str]:
    """Remove the scratch directories named ``<prefix><pid>-...`` under ``root`` (default: :func:`shm_root`, else
    the temporary directory) whose owner is dead; returns their paths."""
    root = root or shm_root() or tempfile.gettempdir()
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)-[^/]+$")
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return removed
    uid = os.getuid()
    for name in names:
        match = pattern.match(name)
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if match is None or not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
            continue  # not one of ours (a link, a file, another user's run on a shared /dev/shm): never touched
        if not owner_alive(path, int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class ScratchDir:
    """A fresh directory ``<root>/<prefix><pid>-<random>`` this process owns (see the module docstring); the dead
    owners' directories of the same prefix are swept first.

    Args:
        prefix: the start of the name; directories of one prefix are swept together.
        root: where (default: :func:`shm_root`, else the temporary directory).
    """

    def __init__(self, prefix: str, root: str | None = None):
        root = root or shm_root() or tempfile.gettempdir()
        sweep_dead(prefix, root)
        self.path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root))
        self._lock = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # blocking: a sweeper may hold it (shared) for an instant
        atexit.register(self.remove)

    def remove(self) -> None:
        """Delete the directory and everything in it (idempotent)."""
        atexit.unregister(self.remove)
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1
