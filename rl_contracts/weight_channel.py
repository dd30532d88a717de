"""WeightChannel: a policy's newest weights on one host, passed by reference through shared memory.

The trainer (rank 0) writes each publish as one file in a directory on ``/dev/shm`` (RAM, no disk); engines on the
same host copy the newest version straight into their model's parameters before they generate, or wait for a
version they need. Nothing goes through the driver or the object store, and a publish is one local write: no
per-step actor round trip, no serialisation.

A file is a small header (its serial, the policy version, the tensors' names, dtypes, shapes and byte offsets) and
the tensors' raw bytes, each at a precomputed offset, then one byte per ``chunk_bytes`` chunk of data saying which
chunks changed since the previous write. A tensor that shares its storage with an earlier one (tied embeddings) is
stored once. Both sides map each file once (kept across writes, by inode) and copy with ``Tensor.copy_`` between
views of the mapping and the tensors: a reader fills its own tensors straight from the file
(:meth:`WeightChannel.read_into`), one copy, no intermediate tensors, no unpickling.

A version appears atomically (written under a temporary name, then renamed), so a listing shows only whole writes.
The writer keeps the newest ``keep`` versions and, from the next write on, reuses the oldest one's file (same
layout; never the newest, so not with ``keep=1``) instead of allocating a new one: its pages are already in memory,
so a publish takes no page faults. The header's serial guards a reader against that reuse, seqlock-style: the
writer sets it to -1 before it writes any byte and to the new serial once all are written; a reader checks it before
and after its copy and, when it changed, copies the newest write again (all of it).

With ``delta=True`` the writer compares the new weights with the newest write chunk by chunk and marks the chunks
that changed; into the reused file it writes only the chunks that differ from what the file holds (those changed
since that file's own write). A reader whose weights are the previous write (``have_serial``) copies only the
changed chunks; a reader further behind copies everything.

A channel made by :meth:`WeightChannel.create` belongs to the process that made it (``rl_contracts/scratch.py``):
its directory, ``tq-weights-<pid>-<random>``, is removed by :meth:`WeightChannel.close` (the run's shutdown), at
interpreter exit if nothing closed it, and, when that process was killed outright, by the next ``create`` on the
host.

>>> channel = WeightChannel(tempfile.mkdtemp())  # doctest: +SKIP
>>> channel.write(3, model.state_dict())  # doctest: +SKIP
>>> channel.newest_version()  # doctest: +SKIP
3
>>> serial, version, state = channel.load(min_version=3)  # doctest: +SKIP
>>> stats = channel.read_into(engine_model.state_dict(), have_serial=serial - 1)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import struct
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_contracts.scratch import ScratchDir

_NAME = re.compile(r"^(\d{12})\.v(\d+)\.weights$")  # serial (one per write) and policy version
_MAGIC = b"TQWEIGH1"
_HEAD = struct.Struct("<8sqqqqq")  # magic, serial (-1 while written), version, layout bytes, data bytes, delta flag
_PAGE = 4096  # the data starts on a page
_ALIGN = 64  # each tensor's offset
CHUNK_BYTES = 1 << 20  # the delta's granularity


class WeightChannelTimeout(TimeoutError):
    """No version at least as new as the one asked for appeared in time."""


class WeightLayoutMismatch(ValueError):
    """A reader's tensors do not match the written ones (names or shapes)."""


@dataclass(frozen=True)
class WriteStats:
    """What one :meth:`WeightChannel.write` did: ``changed_chunks`` of ``chunks`` differ from the previous write
    (all of them without ``delta`` or without a previous write of the same layout); ``bytes_written`` went into the
    file; ``reused``: the oldest kept file was reused rather than a new one allocated."""

    serial: int
    version: int
    chunks: int
    changed_chunks: int
    bytes_written: int
    data_bytes: int
    reused: bool
    seconds: float

    @property
    def changed_fraction(self) -> float:
        return self.changed_chunks / self.chunks if self.chunks else 0.0


@dataclass(frozen=True)
class ReadStats:
    """What one :meth:`WeightChannel.read_into` copied: ``bytes_copied`` of the write's ``data_bytes``, in
    ``chunks_copied`` of ``chunks`` chunks (all of them unless the reader was one write behind a delta write)."""

    serial: int
    version: int
    chunks: int
    chunks_copied: int
    bytes_copied: int
    data_bytes: int


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # within the data
    nbytes: int
    alias: str | None  # the earlier entry whose bytes these are (shared storage)


class _Header:
    def __init__(self, raw: bytes, layout: bytes):
        magic, self.serial, self.version, _, self.data_bytes, self.delta = _HEAD.unpack(raw)
        if magic != _MAGIC:
            raise ValueError(f"not a weight channel file: magic {magic!r}, expected {_MAGIC!r}")
        self.layout = layout
        spec = json.loads(layout)
        self.chunk_bytes: int = spec["chunk_bytes"]
        self.entries = [
            _Entry(e["name"], getattr(torch, e["dtype"]), tuple(e["shape"]), e["offset"], e["nbytes"], e["alias"])
            for e in spec["tensors"]
        ]
        self.data_start = _round_up(_HEAD.size + len(layout), _PAGE)
        self.chunks = -(-self.data_bytes // self.chunk_bytes)


class WeightChannel:
    """Versions of a state dict in a directory of one host (see the module docstring).

    Args:
        path: the channel's directory (created if missing); both sides must name the same one.
        keep: versions the writer keeps.
        delta: the writer marks the chunks that changed since the previous write and writes only those it must.
        chunk_bytes: the delta's chunk size.
    """

    def __init__(
        self, path: str | os.PathLike[str], keep: int = 2, delta: bool = False, chunk_bytes: int = CHUNK_BYTES
    ):
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1")
        if chunk_bytes < _ALIGN or chunk_bytes % _ALIGN:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of {_ALIGN}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.delta = delta
        self.chunk_bytes = chunk_bytes
        self.last_write: WriteStats | None = None
        self._owner: ScratchDir | None = None
        # the files this process mapped, by inode: a reused file's pages are mapped once (no page faults per write)
        self._maps: dict[tuple[int, int], tuple[mmap.mmap, torch.Tensor, bool]] = {}

    @classmethod
    def create(cls, prefix: str = "tq-weights-", root: str | None = None, **kwargs: Any) -> WeightChannel:
        """A new channel this process owns, in shared memory (``/dev/shm``, or ``root``; the temporary directory
        where there is none): removed by :meth:`close`, at exit, or by a later ``create`` once this process is dead
        (the channels of dead processes are swept first)."""
        owner = ScratchDir(prefix, root)
        channel = cls(owner.path, **kwargs)
        channel._owner = owner
        return channel

    # ---- writer ------------------------------------------------------------------------------------------------
    def write(self, version: int, state_dict: dict[str, torch.Tensor]) -> WriteStats:
        """Publish ``state_dict`` as policy ``version``: never older than the newest written (the same version may
        be written again, e.g. each evaluation of a warm-up; readers take the newest write)."""
        started = time.perf_counter()
        writes = self._writes()
        newest = writes[-1] if writes else None
        if newest is not None and version < newest[1]:
            raise ValueError(f"version {version} is older than the channel's newest, {newest[1]}")
        serial = newest[0] + 1 if newest is not None else 0
        tensors, layout, data_bytes = self._layout(state_dict)
        data_start = _round_up(_HEAD.size + len(layout), _PAGE)
        chunks = -(-data_bytes // self.chunk_bytes)
        size = data_start + data_bytes + chunks
        final = self.path / f"{serial:012d}.v{version}.weights"
        tmp = self.path / f".{final.name}.{os.getpid()}.tmp"
        headers = {s: self._header(s, v) for s, v in writes}
        # the change marks of the kept writes (None: unknown, all), oldest first
        marks = {s: self._marks(s, v, h) if h is not None and h.layout == layout else None
                 for (s, v), h in zip(writes, headers.values(), strict=True)}  # fmt: skip
        changed = self._changed(tensors, newest, headers, layout, chunks) if self.delta else None
        # the oldest kept write's file is taken over once the channel keeps its count, never the newest (keep=1):
        # readers would find no version while it is rewritten
        oldest = headers[writes[0][0]] if len(writes) >= max(self.keep, 2) else None
        reuse = writes[0] if oldest is not None and oldest.layout == layout else None
        reused = reuse is not None
        if reuse is not None:
            os.replace(self.path / f"{reuse[0]:012d}.v{reuse[1]}.weights", tmp)
            fd = os.open(tmp, os.O_RDWR)
        else:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.pwrite(fd, _HEAD.pack(_MAGIC, -1, version, len(layout), data_bytes, 0), 0)  # invalid while written
            os.ftruncate(fd, size)
            todo = np.ones(chunks, dtype=bool)
            if reuse is not None and changed is not None:
                # the file holds write `reuse`: it lacks the changes of every later write, and this one's
                todo = changed.copy()
                for later, _ in writes:
                    mark_later = marks[later] if later > reuse[0] else None
                    if later > reuse[0] and mark_later is None:  # unknown: all
                        todo[:] = True
                    elif mark_later is not None:
                        todo |= mark_later
            data = self._mapped(fd, size, write=True)[data_start : data_start + data_bytes]
            written = 0
            with torch.no_grad():
                for tensor, lo, hi, at in _pieces(tensors, _runs(todo, self.chunk_bytes, data_bytes)):
                    data[at : at + hi - lo].copy_(tensor[lo:hi])
                    written += hi - lo
            mark = changed if changed is not None else np.ones(chunks, dtype=bool)
            os.pwrite(fd, layout, _HEAD.size)
            os.pwrite(fd, mark.astype(np.uint8).tobytes(), data_start + data_bytes)
            os.pwrite(fd, _HEAD.pack(_MAGIC, serial, version, len(layout), data_bytes, int(changed is not None)), 0)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        for old_serial, old_version in self._writes()[: -self.keep]:
            (self.path / f"{old_serial:012d}.v{old_version}.weights").unlink(missing_ok=True)
        self._forget_unlisted()
        n_changed = int(mark.sum())
        self.last_write = WriteStats(serial, version, chunks, n_changed, written, data_bytes, reused,
                                     time.perf_counter() - started)  # fmt: skip
        return self.last_write

    def _layout(self, state_dict: dict[str, torch.Tensor]) -> tuple[list[tuple[_Entry, torch.Tensor]], bytes, int]:
        """The tensors' bytes (flat uint8 views; a contiguous copy first where a tensor is not contiguous) at
        their offsets, the layout and the data's size."""
        out: list[tuple[_Entry, torch.Tensor]] = []
        spec: list[dict[str, Any]] = []
        seen: dict[tuple[Any, ...], _Entry] = {}
        offset = 0
        for name, tensor in state_dict.items():
            t = tensor.detach()
            key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.device)
            alias = seen.get(key) if t.numel() else None
            nbytes = t.numel() * t.element_size()
            if alias is not None:
                entry = _Entry(name, t.dtype, tuple(t.shape), alias.offset, nbytes, alias.name)
            else:
                entry = _Entry(name, t.dtype, tuple(t.shape), offset, nbytes, None)
                seen[key] = entry
                offset = _round_up(offset + nbytes, _ALIGN)
                out.append((entry, _flat_bytes(t)))
            spec.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                         "offset": entry.offset, "nbytes": nbytes, "alias": entry.alias})  # fmt: skip
        layout = json.dumps({"chunk_bytes": self.chunk_bytes, "tensors": spec}, separators=(",", ":")).encode()
        return out, layout, offset

    def _changed(self, tensors, newest, headers, layout: bytes, chunks: int) -> np.ndarray | None:
        """Chunks whose bytes differ from the newest write's (None: no newest write of this layout)."""
        if newest is None or headers[newest[0]] is None or headers[newest[0]].layout != layout:
            return None
        head = headers[newest[0]]
        try:
            fd = os.open(self.path / f"{newest[0]:012d}.v{newest[1]}.weights", os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = head.data_start + head.data_bytes + head.chunks
            old = self._mapped(fd, size, write=False)[head.data_start : head.data_start + head.data_bytes].numpy()
        finally:
            os.close(fd)
        changed = np.zeros(chunks, dtype=bool)
        step = self.chunk_bytes
        for entry, tensor in tensors:
            data = tensor.numpy() if tensor.device.type == "cpu" else _byte_view(tensor)
            lo, end = entry.offset, entry.offset + entry.nbytes
            while lo < end:
                chunk = lo // step
                hi = min(end, (chunk + 1) * step)
                if not changed[chunk] and not np.array_equal(data[lo - entry.offset : hi - entry.offset], old[lo:hi]):
                    changed[chunk] = True
                lo = hi
        return changed

    # ---- readers -----------------------------------------------------------------------------------------------
    def newest(self) -> tuple[int, int] | None:
        """``(serial, version)`` of the newest write, or None."""
        writes = self._writes()
        return writes[-1] if writes else None

    def newest_version(self) -> int | None:
        """The policy version of the newest write, or None."""
        newest = self.newest()
        return newest[1] if newest is not None else None

    def load(self, min_version: int = 0, timeout: float = 0.0) -> tuple[int, int, dict[str, torch.Tensor]]:
        """The newest write, once its version is at least ``min_version``: ``(serial, version, state_dict)``, the
        tensors new (views of one buffer).

        Raises:
            WeightChannelTimeout: if no such version appears within ``timeout`` seconds.
        """
        serial, version = self.wait(min_version, timeout)
        while True:
            head = self._header(serial, version)
            if head is None:  # reused or pruned between listing and opening: a newer one exists
                serial, version = self.wait(version, timeout)
                continue
            buffer = torch.empty(head.data_bytes, dtype=torch.uint8)
            state: dict[str, torch.Tensor] = {}
            for e in head.entries:
                state[e.name] = (
                    state[e.alias] if e.alias is not None
                    else buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
                )  # fmt: skip
            try:
                stats = self.read_into(state, min_version=version, timeout=timeout)
            except WeightLayoutMismatch:  # a newer write of another layout
                serial, version = self.wait(version, timeout)
                continue
            return stats.serial, stats.version, state

    def read_into(
        self, tensors: dict[str, torch.Tensor], have_serial: int = -1, min_version: int = 0, timeout: float = 0.0
    ) -> ReadStats:
        """Copy the newest write (once its version is at least ``min_version``) into ``tensors`` (e.g. a model's
        ``state_dict()``: its parameters' storage), straight from the file. ``have_serial``: the write ``tensors``
        now hold (-1: none); one behind a delta write, only the changed chunks are copied.

        ``tensors`` must hold exactly the written names with their shapes, except a name whose tensor shares the
        storage of another that is given (tied weights). A CPU contiguous tensor of the written dtype is filled byte
        range by byte range; any other (another dtype or device) is copied and cast whole.

        Raises:
            WeightChannelTimeout: if no such version appears within ``timeout`` seconds.
            WeightLayoutMismatch: if the names or shapes differ from the written ones.
        """
        serial, version = self.wait(min_version, timeout)
        while True:
            path = self.path / f"{serial:012d}.v{version}.weights"
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # reused or pruned between listing and opening: a newer one exists
                serial, version = self.wait(version, timeout)
                continue
            try:
                head = _read_header(fd)
                if head is None or head.serial != serial:
                    serial, version = self.wait(version, timeout)
                    continue
                plan = _plan(head, tensors)
                marks = None
                if head.delta and have_serial == serial - 1 and have_serial >= 0:
                    raw = os.pread(fd, head.chunks, head.data_start + head.data_bytes)
                    marks = np.frombuffer(raw, dtype=np.uint8).astype(bool)
                todo = marks if marks is not None else np.ones(head.chunks, dtype=bool)
                size = head.data_start + head.data_bytes + head.chunks
                data = self._mapped(fd, size, write=False)[head.data_start : head.data_start + head.data_bytes]
                copied = _copy(data, head, plan, todo)
                if _HEAD.unpack(os.pread(fd, _HEAD.size, 0))[1] != serial:  # reused while we copied: torn
                    have_serial = -1
                    serial, version = self.wait(version, timeout)
                    continue
                return ReadStats(serial, version, head.chunks, int(todo.sum()), copied, head.data_bytes)
            finally:
                os.close(fd)

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
        """Delete the channel's files and directory (the owner's side, at the end of a run; idempotent), and drop
        this side's mappings of them (a deleted file's memory is freed once nothing maps it)."""
        self._maps.clear()
        if self._owner is not None:
            self._owner.remove()
        else:
            shutil.rmtree(self.path, ignore_errors=True)

    def _mapped(self, fd: int, size: int, write: bool) -> torch.Tensor:
        """A uint8 tensor over the whole file ``fd`` (``size`` bytes), its mapping kept for the next use of the file."""
        stat = os.fstat(fd)
        inode = (stat.st_dev, stat.st_ino)  # not reused while mapped: the mapping holds the file
        cached = self._maps.get(inode)
        if cached is not None and len(cached[0]) == size and (cached[2] or not write):
            return cached[1]
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=prot)
        with warnings.catch_warnings():  # a read-only mapping: its tensor is only read
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(mm, dtype=torch.uint8)
        if len(self._maps) > self.keep + 2:
            self._forget_unlisted()
        self._maps[inode] = (mm, view, write)
        return view

    def _forget_unlisted(self) -> None:
        """Drop the mappings of files no longer in the channel (unmapped once no copy uses them)."""
        listed: set[tuple[int, int]] = set()
        for name in os.listdir(self.path):
            if _NAME.match(name):
                try:
                    stat = os.stat(self.path / name)
                    listed.add((stat.st_dev, stat.st_ino))
                except FileNotFoundError:
                    pass
        for inode in [i for i in self._maps if i not in listed]:
            del self._maps[inode]

    def _writes(self) -> list[tuple[int, int]]:
        return sorted((int(m.group(1)), int(m.group(2))) for name in os.listdir(self.path) if (m := _NAME.match(name)))

    def _header(self, serial: int, version: int) -> _Header | None:
        """The header of a write, if its file still holds it."""
        try:
            fd = os.open(self.path / f"{serial:012d}.v{version}.weights", os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            head = _read_header(fd)
            return head if head is not None and head.serial == serial else None
        finally:
            os.close(fd)

    def _marks(self, serial: int, version: int, head: _Header) -> np.ndarray | None:
        """The chunks a write changed relative to the one before it (None: unknown)."""
        if not head.delta:
            return None
        try:
            with open(self.path / f"{serial:012d}.v{version}.weights", "rb") as f:
                f.seek(head.data_start + head.data_bytes)
                return np.frombuffer(f.read(head.chunks), dtype=np.uint8).astype(bool)
        except FileNotFoundError:
            return None


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """A uint8 array over ``t``'s bytes (a CPU contiguous copy first where ``t`` is not one)."""
    return _flat_bytes(t.detach().to("cpu")).numpy()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t``'s bytes (of a contiguous copy where ``t`` is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _read_header(fd: int) -> _Header | None:
    raw = os.pread(fd, _HEAD.size, 0)
    if len(raw) < _HEAD.size:
        return None
    fields = _HEAD.unpack(raw)
    if fields[1] < 0:  # being written
        return None
    layout = os.pread(fd, fields[3], _HEAD.size)
    head = _Header(raw, layout)
    return head if head.serial == fields[1] else None


def _runs(todo: np.ndarray, chunk: int, total: int) -> list[tuple[int, int]]:
    """Byte ranges of the marked chunks, consecutive ones merged."""
    if todo.all():
        return [(0, total)] if total else []
    edges = np.flatnonzero(np.diff(np.concatenate(([0], todo.astype(np.int8), [0]))))
    return [(int(a) * chunk, min(int(b) * chunk, total)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _pieces(tensors: list[tuple[_Entry, Any]], runs: list[tuple[int, int]]) -> Iterator[tuple[Any, int, int, int]]:
    """``(target, lo, hi, data offset)``: the parts of each tensor inside the byte ranges (both sorted by offset)."""
    i = 0
    for entry, target in tensors:
        start, end = entry.offset, entry.offset + entry.nbytes
        while i < len(runs) and runs[i][1] <= start:
            i += 1
        j = i
        while j < len(runs) and runs[j][0] < end:
            lo, hi = max(start, runs[j][0]), min(end, runs[j][1])
            yield target, lo - start, hi - start, lo
            j += 1


def _plan(head: _Header, tensors: dict[str, torch.Tensor]) -> list[tuple[_Entry, torch.Tensor, bool]]:
    """``(entry, target, direct)`` per target to fill, sorted by offset; ``direct``: bytes copied straight into it.

    Raises:
        WeightLayoutMismatch: names or shapes differ.
    """
    written = {e.name: e for e in head.entries}
    by_storage: dict[tuple[int, torch.device], str] = {}
    for name, t in tensors.items():
        by_storage.setdefault((t.data_ptr(), t.device), name)
    tied = {n for n, t in tensors.items() if by_storage[(t.data_ptr(), t.device)] != n and t.numel()}
    missing = sorted(set(written) - set(tensors))
    unexpected = sorted(set(tensors) - set(written) - tied)
    shapes = [f"{n}: written {tuple(written[n].shape)}, given {tuple(t.shape)}" for n, t in tensors.items()
              if n in written and tuple(t.shape) != written[n].shape]  # fmt: skip
    if missing or unexpected or shapes:
        raise WeightLayoutMismatch(
            f"the tensors to fill do not match the written ones: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"shapes {shapes[:5]}"
        )
    plan, filled = [], set()
    for e in head.entries:
        t = tensors[e.name]
        if (t.data_ptr(), t.device) in filled and t.numel():
            continue  # tied: the same storage is filled once
        filled.add((t.data_ptr(), t.device))
        direct = t.device.type == "cpu" and t.is_contiguous() and t.dtype == e.dtype
        plan.append((e, t, direct))
    plan.sort(key=lambda p: p[0].offset)
    return plan


def _copy(data: torch.Tensor, head: _Header, plan: list[tuple[_Entry, torch.Tensor, bool]], todo: np.ndarray) -> int:
    """Copy the marked chunks of the mapped ``data`` into the plan's targets; returns the bytes copied."""
    runs = _runs(todo, head.chunk_bytes, head.data_bytes)
    direct = [(e, t.detach().reshape(-1).view(torch.uint8)) for e, t, d in plan if d]
    copied = 0
    with torch.no_grad():
        for target, lo, hi, at in _pieces(direct, runs):
            target[lo:hi].copy_(data[at : at + hi - lo])
            copied += hi - lo
        cast = [(e, t) for e, t, d in plan if not d]
        touched = {id(t) for t, _, _, _ in _pieces(cast, runs)}
        for e, t in cast:
            if id(t) in touched:  # whole: a cast needs whole elements
                t.copy_(data[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape))
                copied += e.nbytes
    return copied
