"""Same-host payloads through shared memory: memfd segments, handed over a Unix socket once, then named by
descriptors.

A storage unit started with ``QueueConfig.shared_memory`` keeps its payload in :class:`SegmentPool` segments
(``memfd_create``: anonymous, never a name in ``/dev/shm``, so nothing outlives the last process that maps one, not
even after a SIGKILL). On a Unix-socket connection whose client asked for it (the ``SHM_OK`` flag of its messages):

- **get**: a reply's payload frames that lie in segments travel as descriptors ``(segment, offset, length)`` in a
  small table (the last frame); each segment's fd goes to the client once, with ``SCM_RIGHTS`` on the reply's first
  byte. The client maps it (kept per connection) and copies each frame out once, into the array the caller named
  (``into``) or one of its own pool (already faulted in: a get pays no page faults in the steady state). The unit
  keeps the frames it described alive (pinned) until the client's next message on that connection (the client
  sends a 4-byte ``RELEASE`` once it copied): a block cleared meanwhile is not reused under the copy.
- **put**: a reply to a message that carried a payload grants the connection a segment of that size (a *grant*);
  the client's next message of at most that size is copied straight into it and carries only descriptors. The unit
  adopts the granted memory as the message's frames (no second copy) and grants a fresh segment with its reply, so
  the steady state adds no round trip. A message that does not fit the grant travels in-band (and earns a larger
  grant). A unit's grants outstanding, together, stay within its pool's ``max_free_bytes``.

Memory handed out by a pool (:meth:`SegmentPool.take`) goes back to it when the last view of it dies (a finalizer
on the buffer every view holds), so a block's segment is reused only once nothing refers to it: no block, no
queued reply, no pin. Free segments are kept up to ``max_free_bytes`` (already faulted in, so a put or a get into
them takes no page faults), beyond that closed; a client that mapped a closed segment is told to unmap it in its
next reply (``forget``), and unmaps everything of a connection that closes. A client's pool is private memory
(what it copies replies into becomes its caller's tensors). Same-host clients only: the client and the unit trust
each other as processes that both proved the queue's secret.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np

from transfer_queue.errors import InvalidRequest, MalformedMessage

logger = logging.getLogger(__name__)

FRAME_ALIGN = 64  # each frame's offset in a staged segment (any dtype's view over it is aligned)
MIN_SHM_BYTES = 64 << 10  # frames (and staged messages) smaller than this travel in-band: a copy is cheaper
SMALL_ROUND = 64 << 10  # segment sizes are rounded up to this, or to LARGE_ROUND from LARGE_ROUND on
LARGE_ROUND = 2 << 20
MAX_FDS = 64  # segment fds one message may carry
# A copy of at least this many bytes is split over up to COPY_THREADS threads (numpy releases the GIL while it
# copies), as Ray's object store client does (``memcopy_threads``): one core's copy does not reach the memory's
# bandwidth. Below it the hand-off costs more than it saves (on a 2-core machine a 21 MB get and put were 12-14%
# slower split in two, a 252 MB put and get 14% and 7% faster: benchmarks/README.md).
PARALLEL_COPY_BYTES = 64 << 20


def copy_threads_default() -> int:
    """``TRANSFER_QUEUE_COPY_THREADS`` if set (1: no splitting), else the cores this process may run on, at most 4."""
    raw = os.environ.get("TRANSFER_QUEUE_COPY_THREADS", "").strip()
    if raw:
        try:
            threads = int(raw)
        except ValueError:
            threads = 0
        if threads < 1:
            raise InvalidRequest(f"TRANSFER_QUEUE_COPY_THREADS must be an int >= 1, got {raw!r}")
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores))


COPY_THREADS = copy_threads_default()

# flags in the high bits of a message's frame-count word (see transfer_queue.wire.unix_socket)
SHM_OK = 1 << 31  # client -> unit: this connection accepts descriptor replies and grants
TABLE = 1 << 30  # the message's last frame is a ShmTable
RELEASE = 1 << 29  # client -> unit, with no frames: the descriptors of the last reply were copied out
FLAGS = SHM_OK | TABLE | RELEASE


class ShmTable(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a message's payload frames are in shared memory: ``frames`` maps a frame's index to its pieces
    ``(segment, offset, length)`` (its bytes end to end; the frame itself is empty); ``fds``: the segments whose fds
    ride on this message, in order; ``grant``: (segment, bytes) the receiver may stage its next message in;
    ``forget``: segments the receiver must unmap (closed by the unit)."""

    frames: dict[int, list[tuple[int, int, int]]] = {}
    fds: list[int] = []
    grant: tuple[int, int] | None = None
    forget: list[int] = []


_encode_table = msgspec.msgpack.Encoder().encode
_decode_table = msgspec.msgpack.Decoder(ShmTable).decode


def encode_table(table: ShmTable) -> bytes:
    return _encode_table(table)


def decode_table(frame: Any) -> ShmTable:
    try:
        return _decode_table(memoryview(frame))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(f"a shared-memory table that does not decode: {exc}") from None


def supported() -> bool:
    """Whether this platform has memfd segments (Linux): elsewhere ``shared_memory`` leaves the sockets alone."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


CopyPair = tuple[np.ndarray, np.ndarray]  # (target, source): uint8 arrays of the same length


class _Copier:
    """The threads large copies are split over (started on first use; a forked child starts its own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    def executor(self, threads: int) -> concurrent.futures.ThreadPoolExecutor:
        """The pool, for a copy over ``threads`` threads (its threads start as copies need them)."""
        with self.lock:
            if self.pool is None:
                workers = max(3, COPY_THREADS - 1, threads - 1)
                self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tq-copy")
            return self.pool

    def forget(self) -> None:  # in a forked child: the parent's threads do not exist there
        self.lock = threading.Lock()
        self.pool = None


_copier = _Copier()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_copier.forget)


def _copy_all(pairs: list[CopyPair]) -> None:
    for target, source in pairs:
        np.copyto(target, source)


def copy_pairs(pairs: Sequence[CopyPair], threads: int | None = None) -> None:
    """Copy each ``source`` into its ``target``; when they add up to ``PARALLEL_COPY_BYTES`` or more, split (by
    bytes, a pair cut where a share ends) over ``threads`` (default ``COPY_THREADS``) threads, this one included.
    Returns once every byte is copied, also when a share failed (then it raises that share's error)."""
    threads = COPY_THREADS if threads is None else threads
    total = sum(target.nbytes for target, _ in pairs)
    if threads < 2 or total < PARALLEL_COPY_BYTES:
        _copy_all(list(pairs))
        return
    share = -(-total // threads)
    shares: list[list[CopyPair]] = [[]]
    room = share
    for target, source in pairs:
        at, n = 0, target.nbytes
        while at < n:
            if room == 0:
                shares.append([])
                room = share
            take = min(room, n - at)
            shares[-1].append((target[at : at + take], source[at : at + take]))
            at += take
            room -= take
    executor = _copier.executor(threads)
    futures = [executor.submit(_copy_all, mine) for mine in shares[1:]]
    try:
        _copy_all(shares[0])
    finally:
        errors = [f.exception() for f in futures]  # waits for each: no thread writes a target after this returns
    for error in errors:
        if error is not None:
            raise error


def segment_size(nbytes: int) -> int:
    """The size of a new segment for ``nbytes``: rounded up to 64 KiB, or to 2 MiB from 2 MiB on."""
    step = LARGE_ROUND if nbytes >= LARGE_ROUND else SMALL_ROUND
    return max(step, -(-nbytes // step) * step)


def aligned(n: int) -> int:
    return -(-n // FRAME_ALIGN) * FRAME_ALIGN


def address_of(buffer: Any) -> tuple[int, int]:
    """(address, bytes) of a contiguous buffer."""
    array = np.frombuffer(buffer, dtype=np.uint8)
    return (array.ctypes.data, array.nbytes) if array.nbytes else (0, 0)


class Segment:
    """One memfd of ``size`` bytes, mapped read-write here; one fd of it stays open while it lives (sent to
    clients): the mmap's own (Python's mmap dups the fd it maps), so a segment costs one fd, not two.
    Not ``shared``: private anonymous memory instead (fd -1), e.g. a client's receive buffers, which it hands to its
    caller as tensors: a process forked from it gets them copy-on-write, as it would ``np.empty``'s."""

    __slots__ = ("address", "array", "fd", "id", "mmap", "owns_fd", "size")

    def __init__(self, segment_id: int, size: int, name: str, shared: bool = True):
        self.id = segment_id
        self.size = size
        if not shared:
            self.fd, self.owns_fd = -1, False
            self.mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.array = np.frombuffer(self.mmap, dtype=np.uint8)
            self.address = self.array.ctypes.data
            return
        self.fd = os.memfd_create(f"{name}-{segment_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.mmap, mapped_fd = _map_finding_its_fd(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.owns_fd = mapped_fd is None
        if mapped_fd is not None:  # the mmap's own fd names the same memfd: ours is one too many
            os.close(self.fd)
            self.fd = mapped_fd
        self.array = np.frombuffer(self.mmap, dtype=np.uint8)
        self.address = self.array.ctypes.data

    def close(self) -> None:
        del self.array
        try:
            self.mmap.close()  # closes the mmap's fd too
        except BufferError:  # a view of it is still alive (never for a pooled segment): unmapped when it dies
            pass
        if self.fd >= 0 and self.owns_fd:
            os.close(self.fd)


def _map_finding_its_fd(fd: int, size: int) -> tuple[mmap.mmap, int | None]:
    """``mmap.mmap(fd, size)`` and the fd it holds (it dups ``fd``: the lowest free number, which is probed first and
    checked after: the same file), or None where another thread took that number meanwhile (then both stay open)."""
    probe = os.dup(fd)
    os.close(probe)
    mapped = mmap.mmap(fd, size)
    try:
        same = os.path.samestat(os.fstat(probe), os.fstat(fd))
    except OSError:
        same = False
    # only this process holds the memfd, made just now: a number naming it other than ``fd`` is the mmap's
    return mapped, probe if same and probe != fd else None


class SegmentPool:
    """Segments handed out as numpy arrays (:meth:`take`), back in the pool when the last view of one dies; at most
    ``max_free_bytes`` of free segments are kept (faulted in, reused first), the rest closed.

    ``name`` prefixes the memfds' names (``/proc/<pid>/maps`` shows ``/memfd:<name>-<id> (deleted)``); ``shared``
    False: private anonymous memory (never sent anywhere). Thread-safe: views die on whatever thread drops them
    last."""

    def __init__(self, max_free_bytes: int, name: str = "tq-shm", shared: bool = True):
        self.max_free_bytes = max_free_bytes
        self.shared = shared
        self.name = f"{name}-{os.getpid()}"
        self._lock = threading.Lock()
        # segments whose last view died, not yet back in the free list: a finalizer only appends here (atomic, no
        # lock), since it may run on a thread that holds the lock (a cyclic-GC pass inside an allocation under it)
        self._returned: collections.deque[int] = collections.deque()
        self._ids = itertools.count(1)
        self.segments: dict[int, Segment] = {}  # every open segment, in use or free
        self._free: list[Segment] = []
        self._freed_at: dict[int, float] = {}  # free segment id -> when it was freed (trim)
        self._starts: list[int] = []  # addresses of the open segments, sorted (locate)
        self._by_start: dict[int, Segment] = {}
        self._in_use: set[int] = set()
        self._closed = False
        self.created = 0  # segments made (a steady state makes none)
        self.reused = 0
        self.granted = 0  # bytes of grants outstanding (at most max_free_bytes: see grant)

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes`` at the start of a segment (a free one that fits, else a new one),
        in use until the array and every view of it are gone."""
        if nbytes < 1:
            raise ValueError(f"a segment holds at least one byte, asked for {nbytes}")
        with self._locked():
            segment = self._pick(nbytes)
            if segment is None:
                segment = Segment(next(self._ids), segment_size(nbytes), self.name, self.shared)
                self.segments[segment.id] = segment
                bisect.insort(self._starts, segment.address)
                self._by_start[segment.address] = segment
                self.created += 1
            else:
                self.reused += 1
            self._in_use.add(segment.id)
        array = np.frombuffer(segment.mmap, dtype=np.uint8, count=nbytes)
        # every view of ``array`` (numpy, torch, memoryview) keeps ``array.base`` alive: when it dies, nothing
        # refers to this memory any more
        weakref.finalize(array.base, self._give_back, segment.id).atexit = False  # nothing to give back at exit
        return array

    def grant(self, nbytes: int) -> np.ndarray | None:
        """Memory a connection may stage its next message in (:meth:`take`), or None when the grants outstanding
        would exceed ``max_free_bytes`` (then the message travels over the socket): grants are memory held outside
        the blocks' byte budget, so they are bounded however many connections put. :meth:`end_grant` when it is
        used or dropped."""
        with self._locked():
            if self.granted + nbytes > self.max_free_bytes:
                return None
            self.granted += nbytes
        try:
            return self.take(nbytes)
        except BaseException:
            self.end_grant(nbytes)
            raise

    def end_grant(self, nbytes: int) -> None:
        with self._locked():
            self.granted -= nbytes

    def _pick(self, nbytes: int) -> Segment | None:
        """The smallest free segment that holds ``nbytes`` and is at most twice what a new one would be."""
        limit = 2 * segment_size(nbytes)
        best = None
        for segment in self._free:
            if nbytes <= segment.size <= limit and (best is None or segment.size < best.size):
                best = segment
        if best is not None:
            self._free.remove(best)
            self._freed_at.pop(best.id, None)
        return best

    def _give_back(self, segment_id: int) -> None:
        """A finalizer: never waits for the lock (this thread may hold it: a GC pass inside an allocation)."""
        self._returned.append(segment_id)
        self._settle()

    def _settle(self) -> None:
        """Drain what was given back if the lock is free now; a holder drains it when it lets go (see _locked)."""
        while self._returned and self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._drain()
            yield
        self._settle()  # given back while this thread held the lock (a finalizer that could not take it)

    def _drain(self) -> None:
        """Under the lock: put the segments whose last view died back in the free list (or close them)."""
        while self._returned:
            segment_id = self._returned.popleft()
            self._in_use.discard(segment_id)
            segment = self.segments.get(segment_id)
            if segment is None:
                continue
            if not self._closed and self._free_bytes() + segment.size <= self.max_free_bytes:
                self._free.append(segment)
                self._freed_at[segment.id] = time.monotonic()
            else:
                self._close(segment)

    def _close(self, segment: Segment) -> None:
        del self.segments[segment.id]
        self._starts.remove(segment.address)
        del self._by_start[segment.address]
        segment.close()

    @property
    def free_bytes(self) -> int:
        with self._locked():
            return self._free_bytes()

    def _free_bytes(self) -> int:
        return sum(s.size for s in self._free)

    def locate(self, buffer: Any) -> tuple[int, int] | None:
        """(segment id, offset) of a buffer that lies wholly inside one segment in use, else None."""
        address, nbytes = address_of(buffer)
        if not nbytes:
            return None
        with self._locked():
            i = bisect.bisect_right(self._starts, address) - 1
            if i < 0:
                return None
            segment = self._by_start[self._starts[i]]
            if segment.id not in self._in_use or address + nbytes > segment.address + segment.size:
                return None
            return segment.id, address - segment.address

    def fd(self, segment_id: int) -> int:
        return self.segments[segment_id].fd

    def array(self, segment_id: int) -> np.ndarray:
        return self.segments[segment_id].array

    def is_open(self, segment_id: int) -> bool:
        with self._locked():
            return segment_id in self.segments

    def trim(self, idle_s: float = 0.0) -> int:
        """Close the free segments unused for ``idle_s`` seconds (0: all); returns the bytes closed."""
        now = time.monotonic()
        with self._locked():
            old = [s for s in self._free if now - self._freed_at.get(s.id, now) >= idle_s]
            for segment in old:
                self._free.remove(segment)
                self._freed_at.pop(segment.id, None)
                self._close(segment)
            return sum(s.size for s in old)

    def close(self) -> None:
        """Close the free segments now and the others once their last view dies."""
        with self._locked():
            self._closed = True
        self.trim()

    def stats(self) -> dict[str, int]:
        with self._locked():
            return {
                "segments": len(self.segments),
                "segment_bytes": sum(s.size for s in self.segments.values()),
                "free_bytes": self._free_bytes(),
                "created": self.created,
                "reused": self.reused,
                "granted_bytes": self.granted,
            }


class UnitConnection:
    """A storage unit's shared-memory state for one client connection: the segments whose fds it sent, the frames
    it pinned for the client's copy, and the grant the client may stage its next message in."""

    def __init__(self, pool: SegmentPool):
        self.pool = pool
        self.sent: set[int] = set()
        self.pins: list[Any] = []
        self.grant: np.ndarray | None = None  # the granted memory (a pool array), while the client may use it
        self.grant_id = 0
        self.want_grant = 0  # bytes to grant with the next reply (what the last message carried)

    def release(self) -> None:
        """The client copied the last reply's descriptors out (or sent its next message): unpin."""
        self.pins = []

    def incoming(self, frames: list[Any], flags: int) -> list[Any]:
        """A request as the unit handles it: a staged one's frames become views of the granted memory (adopted:
        not copied). A descriptor outside the grant, or a table without one, is a protocol violation
        (MalformedMessage)."""
        self.release()
        if flags & TABLE:
            table = decode_table(frames.pop())
            grant = self.grant
            if grant is None:
                raise MalformedMessage("a message staged in shared memory, but this connection holds no grant")
            for i, pieces in table.frames.items():
                if not 2 <= i < len(frames) or len(pieces) != 1 or memoryview(frames[i]).nbytes:
                    raise MalformedMessage(f"frame {i} of a staged message is described wrongly: {pieces}")
                ((segment, offset, length),) = pieces
                if segment != self.grant_id or offset < 0 or length < 0 or offset + length > grant.nbytes:
                    raise MalformedMessage(
                        f"frame {i} lies at {offset}+{length} of segment {segment}; the grant is {grant.nbytes} "
                        f"bytes of segment {self.grant_id}"
                    )
                frames[i] = grant[offset : offset + length]
            staged = sum(aligned(length) for pieces in table.frames.values() for _, _, length in pieces)
            if staged > 0 and 2 * staged <= grant.nbytes:  # far smaller than its grant: a right-sized copy
                with contextlib.suppress(OSError, ValueError):  # no fd or memory for it now: the grant is adopted
                    self._copy_out(frames, sorted(table.frames), staged)
            del grant
            self._end_grant()
            self.want_grant = staged  # the next grant fits what the client stages now, not its largest put
        else:
            sizes = [memoryview(f).nbytes for f in frames[2:]]
            if sum(sizes) >= MIN_SHM_BYTES and flags & SHM_OK:  # it did not fit the grant (the client dropped it)
                self._end_grant()
                self.want_grant = sum(aligned(n) for n in sizes)  # what the client stages it in
        return frames

    def _copy_out(self, frames: list[Any], indexes: list[int], nbytes: int) -> None:
        """Copy staged frames into one right-sized pool buffer (laid out as staged), so a small put does not
        hold a large grant's segment as its block."""
        buffer, at, copies = self.pool.take(nbytes), 0, list[CopyPair]()
        for i in indexes:
            n = memoryview(frames[i]).nbytes
            copies.append((buffer[at : at + n], np.frombuffer(frames[i], dtype=np.uint8)))
            at += aligned(n)
        copy_pairs(copies)
        for i, (target, _) in zip(indexes, copies, strict=True):
            frames[i] = target

    def outgoing(self, frames: Sequence[Any]) -> tuple[list[Any], int, list[int]]:
        """A reply as it goes out: its payload frames that lie in segments as descriptors (pinned until the client's
        next message), a grant when the request earned one, and the fds the client has not seen. Returns (frames,
        flags, fds: new fds the caller owns, see unix_socket.FrameWriter). A frame with ``views`` (a
        unix_socket.GatheredFrame) is described piece by piece. If it raises (no fd or memory left), nothing of
        it is pinned or granted: the caller may send the reply as it is."""
        granted = self.grant is not None
        try:
            return self._outgoing(frames)
        except BaseException:
            self.pins = []
            if not granted:
                self._end_grant()
            raise

    def _outgoing(self, frames: Sequence[Any]) -> tuple[list[Any], int, list[int]]:
        out = list(frames)
        table = ShmTable(frames={}, fds=[], forget=[])
        granting = bool(self.want_grant) and self.grant is None
        budget = MAX_FDS - granting  # new fds one message carries (one kept for the grant)
        new: dict[int, None] = {}  # segments the client has not seen, in order, at most ``budget``
        unsent: dict[int, None] = {}  # those of frames that go in-band: sent ahead while there is room
        for i in range(2, len(out)):
            frame = out[i]
            views = getattr(frame, "views", None)
            if views is None:  # a plain buffer (a GatheredFrame's views may be none: an empty read)
                views = [frame]
            if sum(memoryview(v).nbytes for v in views) < MIN_SHM_BYTES:
                continue
            pieces = []
            for view in views:
                where = self.pool.locate(view)
                if where is None:
                    break
                pieces.append((where[0], where[1], memoryview(view).nbytes))
            else:
                unseen = {s: None for s, _, _ in pieces if s not in self.sent and s not in new}
                if len(new) + len(unseen) > budget:  # more new segments than this message carries: in-band
                    unsent.update(unseen)
                    continue
                new.update(unseen)
                table.frames[i] = pieces
                self.pins.append(frame)
                out[i] = b""
        for segment in unsent:  # their fds go now (up to the budget), so a later read of them needs fewer
            if len(new) >= budget:
                break
            new.setdefault(segment)
        grant = self.pool.grant(self.want_grant) if granting else None
        if grant is not None:
            self.grant = grant
            where = self.pool.locate(grant)
            assert where is not None and where[1] == 0
            self.grant_id = where[0]
            table.grant = (self.grant_id, self.grant.nbytes)
            if self.grant_id not in self.sent:
                new.setdefault(self.grant_id)
        self.want_grant = 0
        table.forget = [s for s in self.sent if not self.pool.is_open(s)]
        table.fds = sorted(new)
        if not table.frames and table.grant is None and not table.forget and not table.fds:
            return out, 0, []
        # dups, owned by the reply's writer (closed once sent): the segment may close before a queued reply goes
        fds: list[int] = []
        try:
            for segment in table.fds:
                fds.append(os.dup(self.pool.fd(segment)))
        except BaseException:
            _close_fds(fds)
            raise
        self.sent.difference_update(table.forget)
        self.sent.update(table.fds)
        return [*out, encode_table(table)], TABLE, fds

    def _end_grant(self) -> None:
        if self.grant is not None:
            self.pool.end_grant(self.grant.nbytes)
            self.grant = None

    def close(self) -> None:
        self.pins = []
        self._end_grant()


class ClientMaps:
    """A client's shared-memory state for one connection to a storage unit: the unit's segments it mapped, the
    grant it may stage its next message in, and the pool its copies land in (shared by the client's connections)."""

    def __init__(self, pool: SegmentPool | None = None):
        self.pool = pool
        self.maps: dict[int, mmap.mmap] = {}
        self.grant: tuple[int, int] | None = None
        # segments registered with CUDA (cudaHostRegister: page-locked, so a GPU reads them by DMA): segment ->
        # address, or 0 where registering failed (copied through host memory instead); unregistered before unmapping
        self.registered: dict[int, int] = {}

    def outgoing(self, frames: Sequence[Any]) -> tuple[list[Any], int]:
        """A request as it goes out: staged in the grant (its payload frames copied into it, descriptors in a table)
        when it fits, else as it is. Returns (frames, flags)."""
        grant = self.grant
        sizes = [memoryview(f).nbytes for f in frames[2:]]
        if grant is None or len(frames) < 3 or sum(sizes) < MIN_SHM_BYTES:
            return list(frames), SHM_OK
        if sum(aligned(n) for n in sizes) > grant[1]:
            self.grant = None  # the unit grants a larger one with its reply
            return list(frames), SHM_OK
        segment, _ = grant
        out, table, at = list(frames), ShmTable(frames={}), 0
        target = np.frombuffer(self.maps[segment], dtype=np.uint8, count=grant[1])
        copies: list[CopyPair] = []
        for i, n in enumerate(sizes, start=2):
            if n:
                copies.append((target[at : at + n], np.frombuffer(out[i], dtype=np.uint8)))
            table.frames[i] = [(segment, at, n)]
            out[i] = b""
            at += aligned(n)
        copy_pairs(copies)
        del target, copies
        self.grant = None
        return [*out, encode_table(table)], SHM_OK | TABLE

    def incoming(self, frames: list[Any], flags: int, fds: list[int], into: dict[int, Any] | None) -> bool:
        """Resolve a reply in place: map the segments whose fds came with it, unmap those it says to forget, keep its
        grant, and copy each described frame out (into ``into[i]`` when its size agrees, else a fresh array of the
        pool). Returns whether it described frames (then the unit waits for RELEASE). MalformedMessage if the table
        names segments this connection does not map, or bytes outside them."""
        try:  # every fd received is closed here, mapped or not (an mmap holds its own)
            if not flags & TABLE:
                return False
            table = decode_table(frames.pop())
            if len(table.fds) != len(fds):
                raise MalformedMessage(f"a reply names {len(table.fds)} segment fds and carries {len(fds)}")
            granted = table.grant[0] if table.grant is not None else None
            for segment, fd in zip(table.fds, fds, strict=True):
                # a segment of blocks is mapped faulted in (a get copies out of it); a fresh grant is not: only the
                # pages a put stages in become resident
                populate = 0 if segment == granted else getattr(mmap, "MAP_POPULATE", 0)
                try:
                    size = os.fstat(fd).st_size
                    self.maps[segment] = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
                except (ValueError, OSError) as exc:
                    raise MalformedMessage(f"segment {segment}'s fd of a reply does not map: {exc}") from None
        finally:
            _close_fds(fds)
        for segment in table.forget:
            self._unmap(segment)
        if table.grant is not None:
            if table.grant[0] not in self.maps or table.grant[1] > len(self.maps[table.grant[0]]):
                raise MalformedMessage(f"a grant of {table.grant} outside the segments this connection maps")
            self.grant = table.grant
        copies: list[CopyPair] = []
        dma: list[tuple[Any, mmap.mmap, int, int]] = []
        for i, pieces in table.frames.items():
            if not 2 <= i < len(frames):
                raise MalformedMessage(f"a shared-memory table describes frame {i} of a {len(frames)}-frame reply")
            for segment, offset, length in pieces:
                mapped = self.maps.get(segment)
                if mapped is None or offset < 0 or length < 0 or offset + length > len(mapped):
                    raise MalformedMessage(f"a descriptor {segment}:{offset}+{length} outside the mapped segments")
            total = sum(length for _, _, length in pieces)
            target = into.get(i) if into else None
            if target is None or target.nbytes != total:
                target = self.empty(total)
            gpu = device_buffer_of(target)
            if gpu is not None and not all(self._register(segment) for segment, _, _ in pieces):
                gpu = None  # the driver refused: through host memory
            at = 0
            for segment, offset, length in pieces:
                if gpu is not None:  # straight from the unit's memory to the GPU: no host copy
                    dma.append((gpu[at : at + length], self.maps[segment], offset, length))
                else:
                    copies.append(
                        (target[at : at + length], np.frombuffer(self.maps[segment], np.uint8, length, offset))
                    )
                at += length
            frames[i] = target if gpu is None else gpu
        copy_pairs(copies)  # every frame's pieces at once: a large reply's copy is spread over threads
        if dma:
            _copy_to_devices(dma)
        return bool(table.frames)

    def _register(self, segment: int) -> bool:
        """Whether ``segment`` is page-locked for CUDA (registered here once; False where the driver refuses)."""
        address = self.registered.get(segment)
        if address is None:
            address, nbytes = address_of(self.maps[segment])
            error = _cuda_register(address, nbytes)
            if error:
                logger.warning("a shared-memory segment could not be page-locked for the GPU (cudaError %d): its "
                               "reads to a GPU go through host memory", error)  # fmt: skip
                address = 0
            self.registered[segment] = address
        return bool(address)

    def _unmap(self, segment: int) -> None:
        address = self.registered.pop(segment, 0)
        if address:
            _cuda_unregister(address)
        _unmap(self.maps.pop(segment, None))

    def empty(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes``: from the pool (faulted in once, reused) when large."""
        if self.pool is not None and nbytes >= MIN_SHM_BYTES:
            return self.pool.take(nbytes)
        return np.empty(nbytes, dtype=np.uint8)

    def close(self) -> None:
        for segment in list(self.maps):
            self._unmap(segment)
        self.grant = None

    def __del__(self) -> None:  # a socket dropped unclosed: its segments page-locked for CUDA are unlocked first
        if self.registered:
            with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone: the process's end unlocks
                self.close()


class DeviceTarget(np.ndarray):
    """A host array a reply frame is received into that also names a GPU buffer of its size (``device_buffer``): a
    frame described in shared memory goes from the unit's segment straight to that buffer by DMA (the segment
    page-locked for CUDA once), and ``incoming`` puts ``device_buffer`` in the frame's place; a frame sent in-band is
    received into the host array."""

    device_buffer: Any  # a contiguous uint8 torch tensor on a GPU, of the host array's nbytes


def device_target(host: np.ndarray, device_buffer: Any) -> DeviceTarget:
    target = host.view(DeviceTarget)
    target.device_buffer = device_buffer
    return target


def device_buffer_of(target: Any) -> Any:
    """The GPU buffer a receive target names (a :class:`DeviceTarget`'s), or None."""
    return getattr(target, "device_buffer", None)


def _cuda_register(address: int, nbytes: int) -> int:
    """Page-lock ``nbytes`` at ``address`` for CUDA (``cudaHostRegister``); returns its cudaError (0: done)."""
    import torch

    return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))


def _cuda_unregister(address: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(address)


def _copy_to_devices(pieces: list[tuple[Any, mmap.mmap, int, int]]) -> None:
    """Copy ``(GPU target, mapping, offset, length)`` pieces by DMA, all queued, then waited for: the unit reuses the
    bytes once the client releases the reply, and its mappings must not be closed under a copy."""
    import torch

    devices = set()
    for target, mapped, offset, length in pieces:
        if length:
            target.copy_(torch.frombuffer(mapped, dtype=torch.uint8, count=length, offset=offset), non_blocking=True)
            devices.add(target.device)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def _unmap(mapped: mmap.mmap | None) -> None:
    if mapped is not None:
        try:
            mapped.close()
        except BufferError:  # a copy in flight on another thread holds a view: unmapped when it is dropped
            pass


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
