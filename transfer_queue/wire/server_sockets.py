"""The servers' sockets: one ROUTER socket (remote clients, CURVE-authenticated) and a Unix socket (clients on this
host) polled together, with the peers they know and the requests they read (:class:`ServerSockets`)."""

from __future__ import annotations

import contextlib
import errno
import functools
import select
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from transfer_queue.errors import PortInUse, TransferQueueError
from transfer_queue.wire.auth import ZapHandler, secure_server
from transfer_queue.wire.protocol import Endpoint, ray_node_id
from transfer_queue.wire.shm import SegmentPool
from transfer_queue.wire.socket_dirs import SocketDir
from transfer_queue.wire.sockets import HANDSHAKE_FAILED, Reply, close_watched, server_addresses, tcp_address, watch
from transfer_queue.wire.unix_socket import MAX_MESSAGE_BYTES, GatheredFrame, UnixServer

T = TypeVar("T")
Frames = list[Any]


@dataclass(frozen=True)
class Peer:
    """Who sent a message: one connection. ``transport`` is ``"tcp"`` (``key``: the ZeroMQ routing id) or
    ``"unix"`` (``key``: the connection's serial number). A client has one connection per (thread, server)."""

    transport: str
    key: bytes | int

    def __repr__(self) -> str:
        key = self.key.hex() if isinstance(self.key, bytes) else self.key
        return f"Peer({self.transport}:{key})"


@dataclass
class Incoming:
    """One received message: its frames (buffers), who sent it, and how to answer on the way it came."""

    frames: list[Any]
    peer: Peer
    reply: Reply
    error: TransferQueueError | None = None  # refused as it arrived (a bad shared-memory table): answered with it


# poll flags as plain ints: pyzmq's are enum flags, whose operators cost a microsecond each on the serving loop
_POLLIN, _POLLOUT, _POLLERR = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLERR)
_POLLIN_OR_ERR = _POLLIN | _POLLERR


def _zmq_flags(event: int) -> int:
    """An epoll event mask as ZeroMQ's poll flags (a hang-up reads as an error: the reader then finds the EOF)."""
    flags = _POLLIN if event & select.EPOLLIN else 0
    if event & select.EPOLLOUT:
        flags |= _POLLOUT
    if event & (select.EPOLLERR | select.EPOLLHUP):
        flags |= _POLLERR
    return flags


#: How long a server waits for its fixed port while the process before it (a controller Ray restarts) lets go of it.
FIXED_PORT_WAIT_S = 30.0


def _bind_fixed(router: zmq.Socket, address: str, port: int, host: str) -> None:
    """Bind ``router`` to ``address:port``, waiting up to ``FIXED_PORT_WAIT_S`` while the port is taken: the process
    that held it (a controller that died and that Ray restarts at once) may not have let go of it yet."""
    deadline = time.monotonic() + FIXED_PORT_WAIT_S
    while True:
        try:
            router.bind(f"{address}:{port}")
            return
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            if time.monotonic() >= deadline:
                raise PortInUse(
                    f"port {port} of {host} is still taken after {FIXED_PORT_WAIT_S:g} s: another process listens on "
                    f"it (expected the one before this server to let go of it)"
                ) from exc
        time.sleep(0.05)


class ServerSockets:
    """Where a server listens: a ROUTER on ``host`` (default: the node's address) on a free port, and a Unix
    socket for clients on this host. :meth:`router_messages` and :meth:`unix_messages` return what arrived as
    :class:`Incoming` messages; :meth:`take_disconnects` the peers whose connection closed since the last call (the
    ROUTER reports connects and disconnects through ``ZMQ_ROUTER_NOTIFY``; a Unix connection on EOF or error).

    Replies never block the serving thread: ZeroMQ queues them in its I/O thread, the Unix socket server queues what
    a slow reader does not take at once (:meth:`poll` waits for those sockets to drain too).
    """

    def __init__(
        self,
        host: str | None = None,
        unix: bool = True,
        secret: bytes = b"",
        advertise_host: str | None = None,
        port: int = 0,
        shm_pool: SegmentPool | None = None,
    ):
        bind, advertise = server_addresses(host, advertise_host)  # first: a bad address leaves nothing open
        self.ctx = zmq.Context()
        self.zap: ZapHandler | None = None
        try:  # a port that stays taken (PortInUse) or any other failure to bind leaves nothing open
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self.router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            secure_server(self.router, secret)  # CURVE with keys from the queue's secret (see transfer_queue.wire.auth)
            self.zap = ZapHandler(self.ctx, secret) if secret else None
            if ":" in bind:
                self.router.setsockopt(zmq.IPV6, 1)
            address = f"tcp://[{bind}]" if ":" in bind else f"tcp://{bind}"
            if port:  # a fixed port (a controller started again from its journal binds the one its clients know)
                _bind_fixed(self.router, address, port, bind)
            else:
                port = self.router.bind_to_random_port(address)
        except BaseException:
            if self.zap is not None:
                self.zap.close()
            self.ctx.destroy(linger=0)  # closes the router too
            raise
        self._socket_dir = SocketDir() if unix else None  # removed on close, at exit, or by the next server's sweep
        self.unix = (
            UnixServer(self._socket_dir.socket_path("server.sock"), secret=secret, pool=shm_pool)
            if self._socket_dir
            else None
        )
        self.endpoint = Endpoint(
            tcp_address(advertise, port), self.unix.path if self.unix else None, socket.gethostname(), ray_node_id()
        )
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        if self.zap is not None:
            self.poller.register(self.zap.sock, zmq.POLLIN)
        # ZMQ_ROUTER_NOTIFY is a draft API (not in the released libzmq builds), so connections are followed with a
        # socket monitor: it reports accepted and closed TCP connections by fd, and every message names the fd it
        # came on (ZMQ_SRCFD), which ties an fd to the routing id of its peer. Failed handshakes are counted.
        self._monitor = watch(self.router, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        self.poller.register(self._monitor, zmq.POLLIN)
        self._tcp_by_fd: dict[int, bytes] = {}  # connection fd -> routing id of its peer
        self._fds: dict[int, int] = {}  # Unix fd (listener and connections) -> the epoll flags it is registered with
        self._epoll = select.epoll() if self.unix is not None else None
        if self._epoll is not None:
            self.poller.register(self._epoll.fileno(), zmq.POLLIN)
        self._disconnected: list[Peer] = []
        self._failed_handshakes = 0

    def unauthenticated(self) -> int:
        """Connections refused so far because they did not prove the queue's secret (their frames were never read):
        failed CURVE handshakes, client keys ZAP refused, Unix connections with a wrong or missing answer."""
        zap = self.zap.refused if self.zap is not None else 0
        unix = self.unix.unauthenticated if self.unix is not None else 0
        return self._failed_handshakes + zap + unix

    def register(self, sock: zmq.Socket) -> None:
        """Poll another socket (e.g. the controller's connections to its storage units) with these."""
        self.poller.register(sock, zmq.POLLIN)

    def unregister(self, sock: zmq.Socket) -> None:
        """Stop polling a socket passed to :meth:`register` (before closing it)."""
        self.poller.unregister(sock)

    def limit(self, max_message_bytes: int) -> None:
        """Refuse messages over ``max_message_bytes``: ZeroMQ drops the connection of a peer that sends a larger
        frame (``ZMQ_MAXMSGSIZE``), the Unix socket server one whose header claims more, before allocating."""
        self.router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if self.unix is not None:
            self.unix.max_message_bytes = max_message_bytes

    def poll(self, timeout_ms: int) -> dict[Any, int]:
        """Wait up to ``timeout_ms`` for any socket; returns ``{socket or fd: ZeroMQ poll flags}``. The Unix
        connections sit in an epoll set, itself one fd among the ZeroMQ sockets, so a wake-up costs the same with 10
        connections or 10,000 (a ``zmq_poll`` over every fd would cost each of them, every time)."""
        if self.unix is not None:
            self._apply_unix_changes()
        events = dict(self.poller.poll(timeout_ms))
        if self._epoll is not None and events.pop(self._epoll.fileno(), 0):
            for fd, event in self._epoll.poll(0):
                events[fd] = _zmq_flags(event)
        return events

    def _apply_unix_changes(self) -> None:
        assert self.unix is not None and self._epoll is not None
        for fd, mask in self.unix.take_changes().items():
            if not mask:  # closed: the kernel already took a closed fd out of the set
                if self._fds.pop(fd, None) is not None:
                    with contextlib.suppress(OSError):
                        self._epoll.unregister(fd)
                continue
            try:
                if fd in self._fds:
                    self._epoll.modify(fd, mask)
                else:
                    self._epoll.register(fd, mask)
            except FileNotFoundError:  # the fd was closed and reused since it was registered: register anew
                self._epoll.register(fd, mask)
            except FileExistsError:
                self._epoll.modify(fd, mask)
            self._fds[fd] = mask

    def router_messages(self, events: dict[Any, int], limit: int = 256) -> list[Incoming]:
        """Up to ``limit`` messages waiting on the ROUTER (connect/disconnect notifications are taken in passing)."""
        out: list[Incoming] = []
        if self.zap is not None and self.zap.sock in events:
            self.zap.serve()
        if self._monitor in events:  # before the messages: an fd accepted anew must not unmap its new peer
            self._read_monitor()
        if self.router not in events:
            return out
        while len(out) < limit:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            identity = frames[0].bytes
            fd = frames[-1].get(zmq.SRCFD)
            known = self._tcp_by_fd.get(fd)
            if known != identity:
                if known is not None:  # the fd was reused: its previous peer is gone
                    self._disconnected.append(Peer("tcp", known))
                self._tcp_by_fd[fd] = identity
            reply = functools.partial(self._send_router, frames[0])
            out.append(Incoming([f.buffer for f in frames[1:]], Peer("tcp", identity), reply))
        return out

    def _read_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] & HANDSHAKE_FAILED:
                self._failed_handshakes += 1
                continue
            identity = self._tcp_by_fd.pop(int(event["value"]), None)
            if identity is not None:  # closed, or accepted anew (the close went unseen): that peer is gone
                self._disconnected.append(Peer("tcp", identity))

    def unix_ready(self, events: dict[Any, int]) -> list[int]:
        """Unix connections (and the listener) with something to read; writes that can go on are made here."""
        if self.unix is None:
            return []
        ready = []
        for fd, event in events.items():
            if fd not in self._fds:  # a ZeroMQ socket, or another registered socket
                continue
            if event & _POLLOUT:
                self.unix.on_writable(fd)
            if event & _POLLIN_OR_ERR:
                ready.append(fd)
        return ready

    def unix_messages(self, fd: int) -> list[Incoming]:
        """The complete messages that arrived on Unix socket ``fd`` (accepting connections on the listener)."""
        assert self.unix is not None
        peer = Peer("unix", self.unix.serial(fd)) if fd in self.unix.connections else None
        out = []
        for conn, received in self.unix.on_ready(fd):
            assert peer is not None
            reply = functools.partial(self._send_unix, conn)
            out.append(Incoming(list(received), peer, reply, getattr(received, "error", None)))
        return out

    def drop_unix(self, fd: int) -> None:
        """Close a Unix connection (its peer is reported by :meth:`take_disconnects`)."""
        if self.unix is not None:
            self.unix.drop(fd)

    def take_disconnects(self, now: float | None = None) -> list[Peer]:
        """Peers whose connection closed since the last call (Unix peers that took no reply for the send timeout
        are dropped here first)."""
        if self.unix is not None:
            now = time.monotonic() if now is None else now
            self.unix.drop_stalled(now)
            self.unix.drop_unproven(now)
            self._disconnected.extend(Peer("unix", serial) for serial in self.unix.take_closed())
        gone, self._disconnected = self._disconnected, []
        return gone

    def requests(self, events: dict[Any, int], limit: int = 256) -> Iterator[tuple[list[Any], Reply]]:
        """Every message as ``(frames, reply)`` (the interface before :class:`~transfer_queue.wire.server.Server`)."""
        for incoming in self.router_messages(events, limit):
            yield incoming.frames, incoming.reply
        for fd in self.unix_ready(events):
            for incoming in self.unix_messages(fd):
                yield incoming.frames, incoming.reply
        self.take_disconnects()  # nobody asks for them on this interface: do not let them pile up

    def _send_unix(self, conn: int, frames: Sequence[Any]) -> None:
        assert self.unix is not None
        self.unix.reply(conn, frames)  # a peer that is gone is dropped; a slow one gets it queued

    def _send_router(self, identity: zmq.Frame, frames: Sequence[Any]) -> None:
        try:
            joined: list[Any] = [f.join() if isinstance(f, GatheredFrame) else f for f in frames]  # ZeroMQ: one each
            self.router.send_multipart([identity, *joined], copy=False)
        except zmq.ZMQError:  # the client went away
            pass

    def close(self) -> None:
        close_watched(self.router)
        if self.zap is not None:
            self.zap.close()
        if self.unix is not None:
            self.unix.close()
        if self._epoll is not None:
            self._epoll.close()
        if self._socket_dir is not None:
            self._socket_dir.remove()
        self.ctx.destroy(linger=0)


# What a DEALER's monitor reports that means the server is gone: the connection closed (the process died: its
# kernel closes the socket at once; a silent host is caught by the heartbeat), or nothing listens any more.
