"""Same-host messages over Unix-domain sockets: the fast path next to ZeroMQ's TCP one.

A ZeroMQ round trip on loopback costs ~0.2 ms here, almost all of it handing each message between ZeroMQ's I/O
threads; the same bytes over a plain Unix socket take ~0.02 ms. Clients on the controller's or a storage unit's
host therefore talk to it over a Unix socket, with the same frames as on the wire (``[envelope, body,
*buffers]``).

Framing: ``u32 frame count``, then one ``u64`` length per frame, then the frames back to back. Writes hand the
frames to ``sendmsg`` as they are (tensor memory included: no copy in user space); reads fill one buffer
per frame (a numpy uint8 array) with ``recv_into``, so a received tensor frame is writable memory that tensors
can be built over without a copy.
Limits on frame count and sizes are checked before anything is allocated; a peer that breaks them is dropped.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

MAX_FRAMES = 4096
MAX_MESSAGE_BYTES = 1 << 40  # 1 TiB: a claimed size beyond this is hostile, never allocated
_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
_SEND_CHUNK_FRAMES = 512  # sendmsg takes at most IOV_MAX (1024) buffers per call
Frame = np.ndarray  # a received frame: uint8, writable, owned by whoever holds it


class ProtocolViolation(Exception):
    """The peer sent a frame header outside the limits; its connection is closed."""


def encode_header(frames: Sequence[Any]) -> bytes:
    lengths = [memoryview(f).nbytes for f in frames]
    return _COUNT.pack(len(frames)) + b"".join(_LENGTH.pack(n) for n in lengths)


class FrameReader:
    """Incremental reader of framed messages from a non-blocking socket (one per connection)."""

    def __init__(self, into: dict[int, np.ndarray] | None = None) -> None:
        # Frame index -> a writable contiguous uint8 array the frame of the next message is received into (used
        # when the sizes agree), so a reply can land where the caller wants it without another copy.
        self._into = into
        self._head = bytearray()
        self._need_head = _COUNT.size
        self._lengths: list[int] | None = None
        self._frames: list[np.ndarray] = []
        self._frame = 0
        self._offset = 0

    def read(self, sock: socket.socket) -> tuple[list[list[Frame]], bool]:
        """Read what the socket has; returns (complete messages, whether the peer closed)."""
        done: list[list[Frame]] = []
        while True:
            try:
                if self._lengths is None:
                    chunk = sock.recv(self._need_head - len(self._head))
                    if not chunk:
                        return done, True
                    self._head += chunk
                    if len(self._head) == self._need_head:
                        self._parse_head()
                elif self._frame < len(self._frames):
                    frame = self._frames[self._frame]
                    got = sock.recv_into(frame.data[self._offset :]) if len(frame) else 0
                    if got == 0 and len(frame):
                        return done, True
                    self._offset += got
                    if self._offset == len(frame):
                        self._frame, self._offset = self._frame + 1, 0
                if self._lengths is not None and self._frame == len(self._frames):
                    done.append(self._frames)
                    self.__init__()  # type: ignore[misc]
            except (BlockingIOError, InterruptedError):
                return done, False

    def _parse_head(self) -> None:
        (count,) = _COUNT.unpack_from(self._head)
        if self._need_head == _COUNT.size:
            if not 1 <= count <= MAX_FRAMES:
                raise ProtocolViolation(f"a message has 1 to {MAX_FRAMES} frames, the peer claims {count}")
            self._need_head = _COUNT.size + count * _LENGTH.size
            if len(self._head) < self._need_head:
                return
        lengths = [_LENGTH.unpack_from(self._head, _COUNT.size + i * _LENGTH.size)[0] for i in range(count)]
        if sum(lengths) > MAX_MESSAGE_BYTES:
            raise ProtocolViolation(f"a message of {sum(lengths)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
        self._lengths = lengths
        into = self._into or {}
        self._frames = [  # not zero-filled: recv_into overwrites every byte
            into[i] if i in into and into[i].nbytes == n else np.empty(n, dtype=np.uint8) for i, n in enumerate(lengths)
        ]

    @property
    def idle(self) -> bool:
        return self._lengths is None and not self._head


class FrameWriter:
    """Pending outgoing frames of one socket, written as far as the socket takes them (non-blocking)."""

    def __init__(self, frames: Sequence[Any]):
        self._views = [memoryview(encode_header(frames))] + [memoryview(f).cast("B") for f in frames]
        self._views = [v for v in self._views if v.nbytes]

    @property
    def done(self) -> bool:
        return not self._views

    def write(self, sock: socket.socket) -> None:
        while self._views:
            try:
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
    writers = [FrameWriter(frames) for _, frames in pairs]
    readers = [FrameReader(into[i] if into else None) for i in range(len(pairs))]
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
                except (ProtocolViolation, OSError):
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


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.setblocking(False)
    return sock


class UnixServer:
    """The server side: accepts connections, reads whole messages, writes replies.

    The owning thread polls :meth:`fds` and calls :meth:`on_ready` for each ready one; complete messages come
    back as ``(connection, frames)``; :meth:`reply` answers on a connection.
    """

    def __init__(self, path: str, send_timeout: float = 30.0):
        self.path = path
        self.listener = listen(path)
        self.send_timeout = send_timeout
        self.connections: dict[int, tuple[socket.socket, FrameReader]] = {}

    def fds(self) -> list[int]:
        return [self.listener.fileno(), *self.connections]

    def on_ready(self, fd: int) -> list[tuple[int, list[Frame]]]:
        if fd == self.listener.fileno():
            self._accept()
            return []
        entry = self.connections.get(fd)
        if entry is None:
            return []
        sock, reader = entry
        try:
            messages, closed = reader.read(sock)
        except (ProtocolViolation, OSError):
            messages, closed = [], True
        if closed:
            self.drop(fd)
        return [(fd, frames) for frames in messages]

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            self.connections[sock.fileno()] = (sock, FrameReader())

    def reply(self, fd: int, frames: Sequence[Any]) -> bool:
        """Send a reply on connection ``fd``; False (and the connection dropped) if the peer is gone or stuck."""
        entry = self.connections.get(fd)
        if entry is None:
            return False
        try:
            send_all(entry[0], frames, self.send_timeout)
            return True
        except (OSError, TimeoutError):
            self.drop(fd)
            return False

    def drop(self, fd: int) -> None:
        entry = self.connections.pop(fd, None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        for fd in list(self.connections):
            self.drop(fd)
        self.listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
