"""Same-host messages over Unix-domain sockets: the fast path next to ZeroMQ's TCP one.

A ZeroMQ round trip on loopback costs ~0.2 ms here, almost all of it handing each message between ZeroMQ's I/O
threads; the same bytes over a plain Unix socket take ~0.02 ms. Clients on the controller's or a storage unit's
host therefore talk to it over a Unix socket, with the same frames as on the wire (``[envelope, body,
*buffers]``).

Framing: ``u32 frame count``, then one ``u64`` length per frame, then the frames back to back. Writes hand the
frames to ``sendmsg`` as they are (tensor memory included: no copy in user space); a read takes what the
socket has (up to ``STAGE_BYTES``) and parses every message in it, each frame into a buffer of its own (a numpy
uint8 array); a large frame's remainder is received straight into that buffer with ``recv_into``, so a received
tensor frame is writable memory that tensors can be built over without another copy.
Limits on frame count and sizes are checked before anything is allocated; a peer that breaks them is dropped.

With shared memory (:mod:`transfer_queue.wire.shm`) the count word's high bits carry flags (``SHM_OK``, ``TABLE``,
``RELEASE``), a message's last frame may be a table of descriptors instead of payload, and a storage unit's reply
may carry segment fds (``SCM_RIGHTS`` on its first byte; a client that asked for shared memory reads headers with
``recvmsg``).
"""

from __future__ import annotations

import array
import contextlib
import itertools
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from transfer_queue.errors import MalformedMessage, RequestTimeout
from transfer_queue.wire.auth import (
    ACCEPTED,
    HANDSHAKE_TIMEOUT,
    PROOF_BYTES,
    REFUSED,
    answer_unix_challenge,
    check_unix_proof,
    new_nonce,
)
from transfer_queue.wire.shm import (
    FLAGS,
    MAX_FDS,
    MIN_SHM_BYTES,
    RELEASE,
    SHM_OK,
    TABLE,
    ClientMaps,
    SegmentPool,
    UnitConnection,
    aligned,
)

MAX_FRAMES = 4096
MAX_MESSAGE_BYTES = 1 << 40  # 1 TiB: a claimed size beyond this is hostile, never allocated
_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
STAGE_BYTES = 64 << 10  # a read takes up to this much at once (parsed into as many messages as it holds)
DIRECT_BYTES = 16 << 10  # a frame's remainder this large is received into the frame, not through the stage
_SEND_CHUNK_FRAMES = 512  # sendmsg takes at most IOV_MAX (1024) buffers per call
Frame = np.ndarray  # a received frame: uint8, writable, owned by whoever holds it
RELEASE_MESSAGE = _COUNT.pack(RELEASE)  # client -> unit: the last reply's descriptors were copied out
_FD_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


class Message(list[Frame]):
    """A received message's frames, with the flags of its count word and the fds that came with it."""

    flags = 0
    fds: list[int] = []  # noqa: RUF012 (replaced per message, never mutated)
    error: MalformedMessage | None = None  # a server's: the message is refused with this (its envelope kept)


class ProtocolViolation(Exception):
    """The peer sent a frame header outside the limits; its connection is closed."""


class GatheredFrame:
    """One frame given as several buffers, sent end to end: a storage unit's read that spans blocks hands each
    block's rows to ``sendmsg`` as they lie instead of copying them into one new buffer first (a fresh allocation
    that paid a page fault per page on every large read). The receiver sees one frame. Paths that need one buffer
    per frame (ZeroMQ) :meth:`join` it."""

    __slots__ = ("nbytes", "views")

    def __init__(self, buffers: Sequence[Any]):
        self.views = [memoryview(b).cast("B") for b in buffers]
        self.nbytes = sum(v.nbytes for v in self.views)

    def join(self) -> np.ndarray:
        out = np.empty(self.nbytes, dtype=np.uint8)
        at = 0
        for view in self.views:
            out[at : at + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
            at += view.nbytes
        return out


def _views(frame: Any) -> list[memoryview]:
    return frame.views if isinstance(frame, GatheredFrame) else [memoryview(frame).cast("B")]


def encode_header(frames: Sequence[Any], flags: int = 0) -> bytes:
    lengths = [f.nbytes if isinstance(f, GatheredFrame) else memoryview(f).nbytes for f in frames]
    return _COUNT.pack(len(frames) | flags) + b"".join(_LENGTH.pack(n) for n in lengths)


class FrameReader:
    """Incremental reader of framed messages from a non-blocking socket (one per connection).

    A read takes up to ``STAGE_BYTES`` at once and parses every whole message in it, so a small message costs one
    ``recv`` (headers, envelope and body together) instead of one per header and frame. A frame's remainder of
    ``DIRECT_BYTES`` or more is received straight into the frame's own buffer (``recv_into``: a payload is never
    staged). A reader that takes fds (``fds=True``) never reads past the message part it is in, so the fds that
    come with a message's first byte are never taken with an earlier message."""

    def __init__(self, into: dict[int, np.ndarray] | None = None, fds: bool = False, allocate: Any = None) -> None:
        # Frame index -> a writable contiguous uint8 array the frame of the next message is received into (used
        # when the sizes agree), so a reply can land where the caller wants it without another copy.
        self._into = into
        self._want_fds = fds  # read with recvmsg, keeping the fds that come with the bytes
        self._allocate = allocate  # nbytes -> a uint8 array for large frames (a storage unit's pool), else np.empty
        self._staged = memoryview(b"")  # bytes read and not parsed yet (the start of the next message, or more)
        self._reset()

    def _reset(self) -> None:
        self._head = bytearray()
        self._fds: list[int] = []
        self._flags = 0
        self._need_head = _COUNT.size
        self._lengths: list[int] | None = None
        self._frames: list[np.ndarray] = []
        self._frame = 0
        self._offset = 0

    def read(self, sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[list[Message], bool]:
        """Read what the socket has; returns (complete messages, whether the peer closed). A header that claims
        more than ``max_bytes`` in all raises ProtocolViolation before anything is allocated. Once a message is
        complete and nothing read is left over, it returns without asking the socket again (the caller's poll says
        when more arrives)."""
        done: list[Message] = []
        while True:
            if not self._staged:
                if done and self.idle:
                    return done, False
                try:
                    if self._frame < len(self._frames) and self._direct():
                        frame = self._frames[self._frame]
                        got = sock.recv_into(frame.data[self._offset :])
                        if got == 0:
                            return done, True
                        self._offset += got
                        self._next_frame(done)
                        continue
                    chunk = self._recv(sock)
                except (BlockingIOError, InterruptedError):
                    return done, False
                if not chunk:
                    return done, True
                self._staged = memoryview(chunk)
            self._consume(done, max_bytes)

    def _direct(self) -> bool:
        """Whether the rest of the current frame is received straight into it (large enough to skip the stage)."""
        return len(self._frames[self._frame]) - self._offset >= DIRECT_BYTES

    def _recv(self, sock: socket.socket) -> bytes:
        if not self._want_fds:
            return sock.recv(STAGE_BYTES)
        # up to the end of the part being read (header or frame): the next message's fds stay in the socket
        if self._lengths is None:
            n = self._need_head - len(self._head)
        else:
            n = len(self._frames[self._frame]) - self._offset
        chunk, ancillary, msg_flags, _ = sock.recvmsg(n, _FD_SPACE, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                self._fds.extend(fds)
        if msg_flags & socket.MSG_CTRUNC:
            self.discard_fds()
            raise ProtocolViolation(f"a message carried more than {MAX_FDS} fds")
        return chunk

    def _consume(self, done: list[Message], max_bytes: int) -> None:
        """Parse the staged bytes: header words into the header, frame bytes into their frames."""
        staged = self._staged
        if self._lengths is None:
            take = min(len(staged), self._need_head - len(self._head))
            self._head += staged[:take]
            self._staged = staged[take:]
            if len(self._head) == self._need_head:
                self._parse_head(max_bytes)
                if self._lengths is not None:
                    self._next_frame(done)
            return
        frame = self._frames[self._frame]
        take = min(len(staged), len(frame) - self._offset)
        frame.data[self._offset : self._offset + take] = staged[:take]
        self._staged = staged[take:]
        self._offset += take
        self._next_frame(done)

    def _next_frame(self, done: list[Message]) -> None:
        """Step past the frames that are complete (empty ones included); a message whose last frame is complete
        goes to ``done``."""
        while self._frame < len(self._frames) and self._offset == len(self._frames[self._frame]):
            self._frame, self._offset = self._frame + 1, 0
        if self._frame == len(self._frames):
            message = Message(self._frames)
            message.flags, message.fds = self._flags, self._fds
            done.append(message)
            self._into = None  # for the first message only
            self._reset()

    def discard_fds(self) -> None:
        """Close the fds received with a message not completed (the connection is dropped)."""
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []

    def _parse_head(self, max_bytes: int) -> None:
        (word,) = _COUNT.unpack_from(self._head)
        self._flags, count = word & FLAGS, word & ~FLAGS
        if self._flags & RELEASE:  # a control message with no frames
            if count or self._flags != RELEASE:
                raise ProtocolViolation(f"a RELEASE message has no frames and no other flag, the peer sent {word:#x}")
            self._lengths, self._frames = [], []
            return
        if self._need_head == _COUNT.size:
            if not 1 <= count <= MAX_FRAMES:
                raise ProtocolViolation(f"a message has 1 to {MAX_FRAMES} frames, the peer claims {count}")
            self._need_head = _COUNT.size + count * _LENGTH.size
            if len(self._head) < self._need_head:
                return
        lengths = [_LENGTH.unpack_from(self._head, _COUNT.size + i * _LENGTH.size)[0] for i in range(count)]
        if sum(lengths) > max_bytes:
            raise ProtocolViolation(f"a message of {sum(lengths)} bytes is over the {max_bytes}-byte limit")
        self._lengths = lengths
        into = self._into or {}
        frames: list[np.ndarray | None] = [into[i] if i in into and into[i].nbytes == n else None for i, n in
                                           enumerate(lengths)]  # fmt: skip
        payload = [i for i in range(2, len(lengths)) if frames[i] is None]
        if self._allocate is not None and self._flags & SHM_OK and any(lengths[i] >= MIN_SHM_BYTES for i in payload):
            # a shared-memory client's payload, end to end in one buffer of the unit's pool (laid out as the client
            # stages its next put in the grant this one earns: the same size, so freed blocks serve as grants)
            try:
                buffer, at = self._allocate(sum(aligned(lengths[i]) for i in payload)), 0
            except (OSError, ValueError):  # no fd or memory for a segment now: plain buffers (below)
                payload = []
            for i in payload:
                frames[i] = buffer[at : at + lengths[i]]
                at += aligned(lengths[i])
        self._frames = [  # not zero-filled: recv_into overwrites every byte
            np.empty(n, dtype=np.uint8) if f is None else f for f, n in zip(frames, lengths, strict=True)
        ]

    @property
    def idle(self) -> bool:
        return self._lengths is None and not self._head and not self._staged


class FrameWriter:
    """Pending outgoing frames of one socket, written as far as the socket takes them (non-blocking)."""

    def __init__(self, frames: Sequence[Any], flags: int = 0, fds: Sequence[int] = ()):
        self._views = [memoryview(encode_header(frames, flags))] + [v for f in frames for v in _views(f)]
        self._views = [v for v in self._views if v.nbytes]
        # sent with the first byte (SCM_RIGHTS). The writer owns them (dups of the sender's, see
        # UnitConnection.outgoing): closed once sent or when the writer is dropped, so a reply queued behind a full
        # socket never sends an fd number its owner closed and the process reused meanwhile
        self._fds = list(fds)

    @property
    def done(self) -> bool:
        return not self._views

    def close(self) -> None:
        """Close the fds not sent (the reply is dropped with its connection)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self.close()

    def write(self, sock: socket.socket) -> None:
        while self._views:
            try:
                if self._fds:
                    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", self._fds).tobytes())]
                    sent = sock.sendmsg(self._views[:_SEND_CHUNK_FRAMES], rights)
                    self.close()  # the peer holds its own copies now
                else:
                    sent = sock.sendmsg(self._views[:_SEND_CHUNK_FRAMES])
            except (BlockingIOError, InterruptedError):
                return
            while sent and self._views:
                if sent >= self._views[0].nbytes:
                    sent -= self._views[0].nbytes
                    self._views.pop(0)
                else:
                    self._views[0] = self._views[0][sent:]
                    sent = 0


def send_all(sock: socket.socket, frames: Sequence[Any], timeout: float) -> None:
    """Write a whole message to a non-blocking socket within ``timeout`` seconds (TimeoutError otherwise)."""
    writer = FrameWriter(frames)
    deadline = time.monotonic() + timeout
    writer.write(sock)
    while not writer.done:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the peer did not take a message within {timeout:.1f} s")
        select.select([], [sock], [], remaining)
        writer.write(sock)


def exchange(
    pairs: Sequence[tuple[socket.socket, Sequence[Any]]],
    timeout: float,
    into: Sequence[dict[int, np.ndarray] | None] | None = None,
    gone: set[int] | None = None,
) -> tuple[list[list[Frame] | None], list[int]]:
    """Send one message on each socket and read one reply from each, all interleaved (a large put to several
    servers moves over all sockets at once). ``into[i]`` maps frame indexes of reply ``i`` to arrays to receive
    them into (see :class:`FrameReader`). Returns the replies (``None`` where none came in time) and the positions
    of the sockets that failed (timed out or closed); those the peer closed are also added to ``gone``."""
    gone = set() if gone is None else gone
    maps: list[ClientMaps | None] = [getattr(sock, "shm", None) for sock, _ in pairs]
    writers = [
        FrameWriter(frames) if m is None else FrameWriter(*m.outgoing(frames))
        for (_, frames), m in zip(pairs, maps, strict=True)
    ]
    readers = [FrameReader(into[i] if into else None, fds=maps[i] is not None) for i in range(len(pairs))]
    replies: list[list[Frame] | None] = [None] * len(pairs)
    failed: set[int] = set()
    deadline = time.monotonic() + timeout
    poller = select.poll()
    index = {sock.fileno(): i for i, (sock, _) in enumerate(pairs)}
    pending = len(pairs)
    for i, (sock, _) in enumerate(pairs):
        try:
            writers[i].write(sock)
        except OSError:  # the server is gone (a broken pipe, a reset connection)
            failed.add(i)
            gone.add(i)
            pending -= 1
            continue
        poller.register(sock, select.POLLIN | (0 if writers[i].done else select.POLLOUT))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        for fd, event in poller.poll(remaining * 1000):
            i = index[fd]
            sock = pairs[i][0]
            if event & (select.POLLERR | select.POLLHUP | select.POLLNVAL) and not event & select.POLLIN:
                failed.add(i)
                gone.add(i)
            if event & select.POLLOUT and i not in failed:
                try:
                    writers[i].write(sock)
                except OSError:
                    failed.add(i)
                    gone.add(i)
                if writers[i].done and i not in failed:
                    poller.modify(sock, select.POLLIN)
            if event & select.POLLIN and i not in failed:
                try:
                    messages, closed = readers[i].read(sock)
                    shm = maps[i]
                    if (
                        messages
                        and shm is not None
                        and shm.incoming(  # descriptors: copied out here, then released
                            messages[0], messages[0].flags, messages[0].fds, into[i] if into else None
                        )
                    ):
                        with contextlib.suppress(OSError):
                            sock.send(RELEASE_MESSAGE)
                except (ProtocolViolation, MalformedMessage, OSError):
                    readers[i].discard_fds()
                    messages, closed = [], True
                if messages:
                    replies[i] = messages[0]
                elif closed:
                    failed.add(i)
                    gone.add(i)
            if replies[i] is not None or i in failed:
                poller.unregister(sock)
                pending -= 1
    failed.update(i for i, reply in enumerate(replies) if reply is None)
    for i in failed:  # a reply cut short (its deadline, a hang-up): the fds that came with its first bytes
        readers[i].discard_fds()
    return replies, sorted(failed)


def listen(path: str) -> socket.socket:
    """A non-blocking listening Unix socket at ``path`` (replacing a stale file)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staging = f"{path}.{os.getpid()}.tmp"
    sock.bind(staging)
    os.chmod(staging, 0o600)  # only this user's processes may talk to the queue
    sock.listen(512)
    os.replace(staging, path)  # the path appears only once connections are accepted
    sock.setblocking(False)
    return sock


class ShmSocket(socket.socket):
    """A client's Unix socket that asks for shared memory: ``shm`` holds what it mapped of the server's segments,
    unmapped when it is closed."""

    __slots__ = ("shm",)
    shm: ClientMaps | None

    def close(self) -> None:
        shm = getattr(self, "shm", None)
        if shm is not None:
            shm.close()
        super().close()


def connect(
    path: str, secret: bytes = b"", timeout: float = HANDSHAKE_TIMEOUT, shm: ClientMaps | None = None
) -> socket.socket:
    """A non-blocking connection to the server at ``path``, authenticated with ``secret`` when given (see
    :mod:`transfer_queue.wire.auth`; AuthenticationFailed if the server refuses the proof; RequestTimeout if it does
    not challenge or answer within ``timeout``, the caller's: it is hung; an OSError, like a refused connection, if
    the server closes it before its challenge: it is gone). With ``shm``, its requests ask for shared memory
    (:class:`ShmSocket`)."""
    sock: socket.socket
    if shm is None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        sock = ShmSocket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.shm = shm
    try:
        sock.settimeout(max(0.001, timeout))
        try:
            sock.connect(path)
        except TimeoutError:  # its backlog is full: it accepts nothing (hung)
            raise RequestTimeout(f"the server accepted no connection within {timeout:.1f} s (it is hung)") from None
        if secret:
            answer_unix_challenge(sock, secret, timeout)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class Connection:
    """One accepted client connection: its reader, its queued replies, and its serial number (fds are reused after
    a close, serials never)."""

    def __init__(self, sock: socket.socket, serial: int, nonce: bytes = b"", pool: SegmentPool | None = None):
        self.sock = sock
        self.serial = serial
        self.nonce = nonce  # the challenge sent on accept; b"" once answered (or when the server has no secret)
        self.proof = b""
        self.accepted_at = time.monotonic()
        self.reader = FrameReader(allocate=None if pool is None else pool.take)
        self.shm = None if pool is None else UnitConnection(pool)
        self.shm_ok = False  # the client asked for shared memory (its messages' SHM_OK flag)
        self.outbox: list[FrameWriter] = []
        self.stalled_since: float | None = None  # when the oldest queued reply stopped moving

    def flush(self) -> None:
        """Write queued replies as far as the socket takes them, without blocking."""
        while self.outbox:
            self.outbox[0].write(self.sock)
            if not self.outbox[0].done:
                if self.stalled_since is None:
                    self.stalled_since = time.monotonic()
                return
            self.outbox.pop(0)
            self.stalled_since = None


class UnixServer:
    """The server side: accepts connections, reads whole messages, queues replies; never blocks on a peer.

    The owning thread polls :meth:`fds` (and :meth:`writable_fds` for POLLOUT) and calls :meth:`on_ready` for each
    ready one; complete messages come back as ``(connection, frames)``; :meth:`reply` answers on a connection. A
    reply the peer does not take at once is queued and written as the socket drains (:meth:`on_writable`), so one
    slow or stuck reader delays nobody else; a peer that takes nothing for ``send_timeout`` seconds is dropped
    (:meth:`drop_stalled`). Closed connections are reported once by :meth:`take_closed` (their serials).
    """

    def __init__(
        self,
        path: str,
        send_timeout: float = 30.0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        secret: bytes = b"",
        pool: SegmentPool | None = None,
    ):
        self.path = path
        self.pool = pool  # shared memory for clients that ask for it (a storage unit's payload), else None
        self.secret = secret
        self.unauthenticated = 0  # connections dropped because they did not prove the secret
        self.listener = listen(path)
        self.send_timeout = send_timeout
        self.max_message_bytes = max_message_bytes
        self.connections: dict[int, Connection] = {}
        self._serials = itertools.count(1)
        self._closed: list[int] = []
        # Kept as they change, so the serving loop's work per wake-up follows what happened, not how many peers
        # are connected: the connections with replies queued (POLLOUT wanted), those that have not proven the
        # secret yet, and what to poll for on each fd whose wish changed since the owner last took them
        # (``select.EPOLLIN``, with ``EPOLLOUT`` while a reply waits for room; 0: closed, poll it no more).
        self.blocked: set[int] = set()
        self._unproven: set[int] = set()
        self._changes: dict[int, int] = {self.listener.fileno(): select.EPOLLIN}
        # ``changes`` is taken by the serving loop before it polls, outside the server's lock, while a reply sent
        # from another thread (under that lock) may add to it: this lock keeps such a change from being lost
        self._changes_lock = threading.Lock()

    def take_changes(self) -> dict[int, int]:
        """The fds whose poll wish changed since the last call, with what to poll for now (0: closed)."""
        with self._changes_lock:
            changes, self._changes = self._changes, {}
        return changes

    def _wish(self, fd: int, mask: int) -> None:
        with self._changes_lock:
            self._changes[fd] = mask

    def fds(self) -> list[int]:
        return [self.listener.fileno(), *self.connections]

    def writable_fds(self) -> list[int]:
        """Connections with replies waiting for room in the socket."""
        return sorted(self.blocked)

    def _flushed(self, fd: int, conn: Connection) -> None:
        """Note whether ``conn`` still has replies queued (its fd polled for POLLOUT) after a flush."""
        if bool(conn.outbox) != (fd in self.blocked):
            (self.blocked.add if conn.outbox else self.blocked.discard)(fd)
            self._wish(fd, select.EPOLLIN | (select.EPOLLOUT if conn.outbox else 0))

    def serial(self, fd: int) -> int:
        return self.connections[fd].serial

    def on_ready(self, fd: int) -> list[tuple[int, list[Frame]]]:
        if fd == self.listener.fileno():
            self._accept()
            return []
        conn = self.connections.get(fd)
        if conn is None:
            return []
        if conn.nonce and not self._read_proof(fd, conn):
            return []
        try:
            received, closed = conn.reader.read(conn.sock, self.max_message_bytes)
            messages = [m for m in (self._shm_incoming(conn, m) for m in received) if m is not None]
        except (ProtocolViolation, MalformedMessage, OSError):
            messages, closed = [], True
        if closed:
            self.drop(fd)
        return [(fd, frames) for frames in messages]

    def _shm_incoming(self, conn: Connection, message: Message) -> list[Frame] | None:
        """A message as the server handles it (a staged one's frames resolved), or None for a RELEASE."""
        if conn.shm is None:
            if message.flags & TABLE:
                raise ProtocolViolation("a message staged in shared memory, to a server that grants none")
            return None if message.flags & RELEASE else message
        if message.flags & RELEASE:
            conn.shm.release()
            return None
        conn.shm_ok = bool(message.flags & SHM_OK)
        try:
            return conn.shm.incoming(list(message), message.flags)
        except MalformedMessage as exc:  # answered as a refused request: the client's unit is not gone
            refused = Message(message[:2])
            refused.error = exc
            return refused

    def _read_proof(self, fd: int, conn: Connection) -> bool:
        """Read the client's answer to the challenge; True once it is proven (frames may follow at once)."""
        try:
            chunk = conn.sock.recv(PROOF_BYTES - len(conn.proof))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            chunk = b""
        conn.proof += chunk
        if chunk and len(conn.proof) < PROOF_BYTES:
            return False
        if chunk and check_unix_proof(self.secret, conn.nonce, conn.proof):
            conn.nonce = b""
            self._unproven.discard(fd)
            try:
                conn.sock.send(ACCEPTED)  # tells the client at connect time, not by a later silent hang-up
            except OSError:
                self.drop(fd)
                return False
            return True
        self.unauthenticated += 1  # a wrong answer, or the peer hung up before answering
        if chunk:  # a wrong answer: told so (a close alone reads as a server gone), best effort
            with contextlib.suppress(OSError):
                conn.sock.send(REFUSED)
        self.drop(fd)
        return False

    def drop_unproven(self, now: float) -> None:
        """Drop connections that have not answered the challenge within the handshake timeout."""
        late = [fd for fd in self._unproven if now - self.connections[fd].accepted_at > HANDSHAKE_TIMEOUT]
        for fd in late:
            self.unauthenticated += 1
            self.drop(fd)

    def on_writable(self, fd: int) -> None:
        conn = self.connections.get(fd)
        if conn is not None:
            try:
                conn.flush()
            except OSError:
                self.drop(fd)
                return
            self._flushed(fd, conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            nonce = b""
            if self.secret:
                nonce = new_nonce()
                try:
                    sock.send(nonce)  # 32 bytes into an empty socket buffer: never blocks
                except OSError:
                    sock.close()
                    continue
            self.connections[sock.fileno()] = Connection(sock, next(self._serials), nonce, self.pool)
            if nonce:
                self._unproven.add(sock.fileno())
            self._wish(sock.fileno(), select.EPOLLIN)

    def reply(self, fd: int, frames: Sequence[Any]) -> bool:
        """Queue a reply on connection ``fd`` and write what the socket takes now; False (and the connection
        dropped) if the peer is gone."""
        conn = self.connections.get(fd)
        if conn is None:
            return False
        writer = None
        if conn.shm is not None and conn.shm_ok:
            try:
                writer = FrameWriter(*conn.shm.outgoing(frames))
            except (OSError, ValueError, MemoryError):  # no fd or memory for it now: the reply goes in-band
                writer = None
        conn.outbox.append(FrameWriter(frames) if writer is None else writer)
        try:
            conn.flush()
        except OSError:
            self.drop(fd)
            return False
        self._flushed(fd, conn)
        return True

    def drop_stalled(self, now: float) -> list[int]:
        """Drop connections whose queued reply has not moved for ``send_timeout`` seconds; returns their fds."""
        stalled = [
            fd
            for fd in self.blocked
            if (since := self.connections[fd].stalled_since) is not None and now - since > self.send_timeout
        ]
        for fd in stalled:
            self.drop(fd)
        return stalled

    def drop(self, fd: int) -> None:
        conn = self.connections.pop(fd, None)
        if conn is not None:
            self.blocked.discard(fd)
            self._unproven.discard(fd)
            self._wish(fd, 0)
            conn.sock.close()
            for writer in conn.outbox:
                writer.close()
            conn.outbox = []
            if conn.shm is not None:
                conn.shm.close()
            self._closed.append(conn.serial)

    def take_closed(self) -> list[int]:
        """Serials of the connections closed since the last call."""
        closed, self._closed = self._closed, []
        return closed

    def close(self) -> None:
        for fd in list(self.connections):
            self.drop(fd)
        self._closed.clear()
        self.listener.close()
        if self.pool is not None:
            self.pool.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
