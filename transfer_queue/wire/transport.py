"""Sockets and zero-copy frames, behind one small interface.

Servers (the controller and the storage units) listen twice (:class:`ServerSockets`): a ZeroMQ ROUTER bound to the
node's address (never to every interface) for clients on any host, and a Unix socket
(:mod:`transfer_queue.wire.unix_socket`) for clients on their host, ten times cheaper per message than ZeroMQ over
loopback. Clients talk through a :class:`Transport`:

- ``call_many([(endpoint, frames, request_id), ...], timeout)`` sends every request at once and returns the reply
  frames (buffers) in order; requests to different servers travel in parallel.

Two transports implement it. :class:`BlockingTransport` (the sync client) uses the Unix socket when the server
runs on its host and blocking ZeroMQ DEALER sockets otherwise, one per thread and server at a time, owned by the
transport (a thread that ends hands its sockets back, so a client's connections, and the leases the controller ties
to them, outlive the threads that used them); its coroutines never suspend, so the sync client drives them without
an event loop (and works inside a running one).
:class:`AsyncioTransport` uses ``zmq.asyncio`` for ``AsyncTransferQueueClient``: one DEALER per event loop and
server at a time, owned by the transport likewise (a loop that ends hands its sockets to the next loop, so the
client's connections and leases outlive ``asyncio.run``). With ``shared_memory_bytes``, a BlockingTransport's Unix
sockets ask storage units for shared memory (transfer_queue.wire.shm): payloads then move through memfd segments.
"""

from __future__ import annotations

import asyncio
import itertools
import select
import socket
import threading
import time
import weakref
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message, recv_monitor_message

from transfer_queue.errors import (
    AuthenticationFailed,
    MalformedMessage,
    RequestTimeout,
    ServerGone,
    TransferQueueError,
)
from transfer_queue.wire.auth import secure_client
from transfer_queue.wire.protocol import Endpoint, decode_reply_header
from transfer_queue.wire.shm import ClientMaps, SegmentPool, supported
from transfer_queue.wire.sockets import close_watched, force_tcp_default, monitor_of, watch, with_addresses
from transfer_queue.wire.unix_socket import connect, exchange, send_all

T = TypeVar("T")
Frames = list[Any]


_GONE_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
_HEARTBEAT_MS = 5_000
_HEARTBEAT_TIMEOUT_MS = 20_000
# A DEALER to a server that is gone retries every 100 ms at first, backing off to this: fewer events pile up in the
# monitor of a socket nobody uses any more (a request still learns of a dead server within this long).
_RECONNECT_MAX_MS = 2_000
# How often a thread's call looks at the monitors of its other (idle) sockets and closes those whose server is gone.
_SWEEP_S = 10.0


def _gone_event(monitor: zmq.Socket) -> bool:
    """Read what the monitor has; True if any event says the server is gone."""
    gone = False
    while True:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return gone
        gone = gone or bool(event["event"] & _GONE_EVENTS)


Into = dict[int, Any]  # reply frame index -> a writable uint8 array to receive that frame into, if it fits


class Transport(Protocol):
    def next_request_id(self) -> int: ...

    async def call_many(
        self, calls: Sequence[tuple[Endpoint, Frames, int]], timeout: float, into: Sequence[Into] | None = None
    ) -> list[Frames]: ...

    def close(self) -> None: ...


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (one over :class:`BlockingTransport`) to completion, without a loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("internal error: a blocking-transport coroutine suspended")


def _dealer(ctx: zmq.Context, secret: bytes, address: str) -> zmq.Socket:
    """A DEALER socket to ``address``: authenticated, heartbeats on, its disconnects watched (from before connect: no
    event is missed)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)  # IPv4 addresses too: the server's address may be either
    secure_client(sock, secret)
    sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_MAX_MS)
    watch(sock, _GONE_EVENTS)
    sock.connect(address)
    return sock


def _request_id(frames: Frames) -> int:
    return decode_reply_header(frames[0].buffer if isinstance(frames[0], zmq.Frame) else frames[0]).request_id


def _buffers(frames: Frames) -> Frames:
    return [f.buffer if isinstance(f, zmq.Frame) else f for f in frames]


class BlockingTransport:
    """Unix sockets to servers on this host, blocking DEALER sockets to the others; one socket per (thread,
    server). Its coroutines never suspend.

    Args:
        spin_seconds: over ZeroMQ, poll without sleeping for up to this long before blocking on a reply (trades
            CPU for latency; it only pays on hosts with spare cores).
        secret: the queue's secret (``ControllerInfo.secret``): CURVE over TCP, the HMAC handshake over Unix sockets.
        force_tcp: never use the Unix socket, even to servers on this host (see :func:`force_tcp_default`).
        shared_memory_bytes: > 0: ask storage units on this host for shared memory (``QueueConfig.shared_memory``),
            keeping up to this many free bytes of received payload buffers pooled for reuse; 0: sockets only.
    """

    def __init__(
        self,
        spin_seconds: float = 0.0,
        secret: bytes = b"",
        force_tcp: bool | None = None,
        shared_memory_bytes: int = 0,
    ):
        self._secret = secret
        # what replies are copied out into: private memory, pooled (faulted in once, reused once the caller drops it)
        shm = shared_memory_bytes > 0 and supported()
        self._shm_pool = SegmentPool(shared_memory_bytes, "tq-shm-client", shared=False) if shm else None
        self.force_tcp = force_tcp_default() if force_tcp is None else force_tcp
        self._ctx: zmq.Context = zmq.Context.instance()
        self._local = threading.local()
        self._ids = itertools.count(1)
        self._spin = spin_seconds
        # Each thread uses its own sockets (a socket serves one request at a time), kept in its thread-local. The
        # sockets belong to the client, not to the thread: when a thread ends, its sockets go back to ``_spare`` and
        # the next new thread takes them. Closing them would tell the controller that the client's connections are
        # gone, and after ``disconnect_grace`` it would hand the client's leases to another consumer while the
        # client is alive (docs/architecture.md "Delivery": leases belong to the client instance). So a client
        # keeps as many connections as it ran threads at once, never one per thread it saw, and all of them until
        # close() or its process ends. Weak references let close() reach the sockets of threads still running.
        self._all_sockets: weakref.WeakSet[Any] = weakref.WeakSet()
        self._spare: dict[str, list[dict[Any, Any]]] = {"sockets": [], "unix": []}
        self._closed = False
        self._lock = threading.RLock()  # RLock: a thread-local's finalizer may run while this thread holds it

    def _thread_sockets(self, kind: str) -> dict[Any, Any]:
        sockets = self._local.__dict__.get(kind)
        if sockets is None:
            with self._lock:
                spare = self._spare[kind].pop() if self._spare[kind] else {}
            sockets = self._local.__dict__[kind] = _ThreadSockets(kind, weakref.WeakMethod(self._take_back), spare)
        return sockets

    def _take_back(self, kind: str, sockets: dict[Any, Any]) -> bool:
        """A thread ended: its sockets wait for the next thread (False: the transport is closed, close them)."""
        with self._lock:
            if self._closed:
                return False
            if sockets:
                self._spare[kind].append(sockets)
            return True

    def next_request_id(self) -> int:
        return next(self._ids)

    def _socket(self, address: str) -> zmq.Socket:
        sockets = self._thread_sockets("sockets")
        sock = sockets.get(address)
        if sock is None:
            sock = sockets[address] = _dealer(self._ctx, self._secret, address)
            with self._lock:
                self._all_sockets.add(sock)
        return sock

    def _discard(self, address: str) -> None:
        sock = self._local.__dict__.get("sockets", {}).pop(address, None)
        if sock is not None:
            close_watched(sock)

    def _sweep(self, busy: set[str]) -> None:
        """Close this thread's idle sockets whose server is gone (at most every ``_SWEEP_S``): a socket left to a
        dead server retries for ever, and its monitor keeps the events nobody reads."""
        now = time.monotonic()
        if now < self._local.__dict__.get("swept", 0.0) + _SWEEP_S:
            return
        self._local.__dict__["swept"] = now
        for address, sock in list(self._thread_sockets("sockets").items()):
            if address not in busy and _gone_event(monitor_of(sock)):
                self._discard(address)

    def _local_path(self, endpoint: Endpoint, timeout: float) -> str | None:
        """The Unix socket to take to ``endpoint``, or None for TCP: the server is on this host (same Ray node, or
        same hostname outside Ray, see :meth:`Endpoint.local_path`) and its socket accepts us (the probe: a socket
        file of another host on a shared /tmp, or one left by a dead server, does not). A server that does not
        answer the probe within ``timeout`` is hung: RequestTimeout naming it, as a call over TCP would end."""
        if self.force_tcp:
            return None
        routes = self._local.__dict__.setdefault("routes", {})
        if endpoint not in routes:
            path = endpoint.local_path()
            if path is not None:
                try:
                    self._unix_socket(path, timeout)
                except RequestTimeout as exc:  # (a TimeoutError is an OSError: before the next clause)
                    raise _hung(path, timeout, exc) from None
                except AuthenticationFailed:
                    raise
                except OSError:  # nothing of ours listens there: take TCP (which reports a dead server itself)
                    path = None
            routes[endpoint] = path
        return routes[endpoint]

    def _unix_socket(self, path: str, timeout: float) -> socket.socket:
        sockets = self._thread_sockets("unix")
        sock = sockets.get(path)
        if sock is None:
            maps = None if self._shm_pool is None else ClientMaps(self._shm_pool)
            sock = sockets[path] = connect(path, self._secret, timeout, maps)
            with self._lock:
                self._all_sockets.add(sock)
        return sock

    @property
    def shared_memory(self) -> bool:
        """Whether this client asks storage units on its host for shared memory."""
        return self._shm_pool is not None

    def empty(self, nbytes: int) -> Any:
        """A writable uint8 array of ``nbytes`` to receive a reply into: pooled (faulted in once, reused once the
        caller drops it) with shared memory, else ``np.empty``."""
        return ClientMaps(self._shm_pool).empty(nbytes)

    def _close_dead_mappings(self, busy: set[str]) -> None:
        """Close this thread's idle shared-memory connections whose server hung up (it died, or restarted on another
        path): each maps the dead server's segments, which stay in memory until unmapped."""
        sockets = self._local.__dict__.get("unix", {})
        idle = {
            sock.fileno(): path
            for path, sock in sockets.items()
            if path not in busy and getattr(sock, "shm", None) is not None and sock.shm.maps
        }
        if not idle:
            return
        poller = select.poll()
        for fd in idle:
            poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll(0):  # an idle connection is readable only when its server hung up
            sockets.pop(idle[fd]).close()

    def _unix_calls(
        self, calls: list[tuple[int, str, Frames, int]], timeout: float, into: Sequence[Into] | None = None
    ) -> list[tuple[int, Frames]]:
        """Calls to servers on this host, over their Unix sockets, all interleaved; replies land in ``into``'s
        arrays where given (by position in ``calls``' original order)."""
        deadline = time.monotonic() + timeout
        pairs = []
        if self._shm_pool is not None:
            self._close_dead_mappings({path for _, path, _, _ in calls})
        try:
            for _, path, frames, _ in calls:
                pairs.append((self._unix_socket(path, deadline - time.monotonic()), frames))
        except RequestTimeout as exc:  # it accepted the connection and said nothing: hung (a TimeoutError: first)
            raise _hung(path, timeout, exc) from None
        except AuthenticationFailed as exc:  # the server refused our secret: another queue's controller_info
            raise AuthenticationFailed(f"{[path for _, path, _, _ in calls]}: {exc}") from None
        except OSError as exc:  # nothing listens there: the server is gone (its socket file may linger)
            self._local.__dict__.get("routes", {}).clear()
            raise with_addresses(
                ServerGone(
                    f"cannot reach {[path for _, path, _, _ in calls]}: {exc} (nothing listens there: the server is "
                    "gone)"
                ),
                [path for _, path, _, _ in calls],
            ) from None
        gone: set[int] = set()
        arrays = [into[c[0]] for c in calls] if into else None
        replies, failed = exchange(pairs, max(0.001, deadline - time.monotonic()), arrays, gone)
        for i in failed:  # a socket that timed out or closed may still carry a late reply: never reuse it
            sock = self._local.__dict__["unix"].pop(calls[i][1], None)
            if sock is not None:
                sock.close()
        if failed:
            self._local.__dict__.get("routes", {}).clear()
        if gone:
            paths = sorted({calls[i][1] for i in gone})
            raise with_addresses(
                ServerGone(f"{paths} closed the connection before replying (the server is gone)"), paths
            )
        if failed:
            paths = sorted({calls[i][1] for i in failed})
            raise with_addresses(RequestTimeout(f"no reply within {timeout:.1f} s from {paths}"), paths)
        out = []
        for (position, _, _, request_id), reply in zip(calls, replies, strict=True):
            assert reply is not None
            if _request_id(reply) != request_id:
                raise MalformedMessage(f"a reply to request {_request_id(reply)} came for request {request_id}")
            out.append((position, reply))
        return out

    def post(self, endpoint: Endpoint, frames: Frames, timeout: float = 5.0) -> bool:
        """Send a request that the server does not answer, if that is safe: over this thread's Unix socket to a
        server on this host (what the kernel took is delivered even if this process dies or closes the socket next).
        Returns False where it sent nothing (a server on another host, or the socket failed): the caller makes a
        call instead."""
        try:
            path = self._local_path(endpoint, timeout)
        except RequestTimeout:
            return False
        if path is None:
            return False
        try:
            sock = self._unix_socket(path, timeout)
            send_all(sock, frames, timeout)
        except (OSError, TransferQueueError):  # a half-written message spoils the socket: never reuse it
            stale = self._local.__dict__.get("unix", {}).pop(path, None)
            if stale is not None:
                stale.close()
            self._local.__dict__.get("routes", {}).clear()
            return False
        return True

    async def call_many(
        self, calls: Sequence[tuple[Endpoint, Frames, int]], timeout: float, into: Sequence[Into] | None = None
    ) -> list[Frames]:
        """Replies in order; over Unix sockets, frames named in ``into`` are received into its arrays (over ZeroMQ
        they arrive as ZeroMQ's own buffers, and the caller copies)."""
        results: list[Frames] = [[] for _ in calls]
        local = []
        remote = []
        for i, (endpoint, frames, request_id) in enumerate(calls):
            path = self._local_path(endpoint, timeout)
            if path is not None:
                local.append((i, path, frames, request_id))
            else:
                remote.append((i, endpoint, frames, request_id))
        waiting: dict[int, tuple[int, str, zmq.Socket]] = {}
        if remote:
            self._sweep({endpoint.address() for _, endpoint, _, _ in remote})
        for i, endpoint, frames, request_id in remote:
            address = endpoint.address()
            sock = self._socket(address)
            _gone_event(monitor_of(sock))  # what happened before this request says nothing about it
            sock.send_multipart(frames, copy=False)
            waiting[request_id] = (i, address, sock)
        if local:
            for i, reply in self._unix_calls(local, timeout, into):
                results[i] = reply
        deadline = time.monotonic() + timeout
        sockets = {id(s): s for _, _, s in waiting.values()}
        spin_until = time.monotonic() + self._spin
        while waiting:
            watched = {monitor_of(sock): address for _, address, sock in waiting.values()}
            ready = self._ready([*sockets.values(), *watched], deadline, spin_until)
            if not ready:
                for _, address, _ in waiting.values():
                    self._discard(address)  # late replies die with the socket
                missing = sorted({address for _, address, _ in waiting.values()})
                raise with_addresses(RequestTimeout(f"no reply within {timeout:.1f} s from {missing}"), missing)
            self._raise_if_gone([watched[s] for s in ready if s in watched and _gone_event(s)])
            for sock in ready:
                if sock in watched:
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        entry = waiting.pop(_request_id(frames), None)
                    except MalformedMessage:
                        continue
                    if entry is not None:  # else: a reply to an earlier request that timed out
                        results[entry[0]] = _buffers(frames)
                    if not waiting:
                        break
            sockets = {id(s): s for _, _, s in waiting.values()}
        return results

    def _raise_if_gone(self, addresses: list[str]) -> None:
        """A server whose connection dropped will not answer what it was sent: say so now, not at the timeout."""
        if addresses:
            for address in addresses:
                self._discard(address)
            raise with_addresses(
                ServerGone(
                    f"{sorted(set(addresses))} closed the connection or stopped listening (the server is gone, or its "
                    "host is unreachable)"
                ),
                addresses,
            )

    def _ready(self, sockets: list[zmq.Socket], deadline: float, spin_until: float) -> list[zmq.Socket]:
        while time.monotonic() < spin_until:
            ready = [s for s in sockets if s.poll(0, zmq.POLLIN)]
            if ready:
                return ready
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return []
        if len(sockets) == 1:
            return sockets if sockets[0].poll(int(remaining * 1000) + 1, zmq.POLLIN) else []
        poller = zmq.Poller()
        for s in sockets:
            poller.register(s, zmq.POLLIN)
        return [s for s, _ in poller.poll(int(remaining * 1000) + 1)]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for sock in list(self._all_sockets):
                _close(sock)
            self._all_sockets.clear()
            self._spare = {"sockets": [], "unix": []}
        self._local = threading.local()


def _hung(path: str, timeout: float, cause: RequestTimeout) -> RequestTimeout:
    """A server on this host that took the connection and did not answer the handshake within the call's timeout: the
    same error as a request over TCP that got no reply (not AuthenticationFailed: its secret was never checked)."""
    return with_addresses(RequestTimeout(f"no reply within {timeout:.1f} s from {[path]} ({cause})"), [path])


def _close(sock: Any) -> None:
    close_watched(sock) if isinstance(sock, zmq.Socket) else sock.close()


class _ThreadSockets(dict):
    """One thread's sockets by server. When the thread ends (its thread-local goes away) they go back to their
    transport for the next thread, or are closed if the transport is closed or gone."""

    def __init__(self, kind: str, take_back: weakref.WeakMethod, sockets: dict[Any, Any]):
        super().__init__(sockets)
        self._kind = kind
        self._take_back = take_back

    def __del__(self) -> None:
        try:
            take_back = self._take_back()
            if take_back is not None and take_back(self._kind, dict(self)):
                return
            for sock in self.values():
                _close(sock)
        except Exception:  # interpreter shutdown: nothing left to close cleanly
            pass


class AsyncioTransport:
    """DEALER sockets, one per (event loop, server) at a time, each used through its loop's ``zmq.asyncio`` view,
    with a reader task routing replies by id and a watcher task that fails the requests waiting on a server at once
    when its monitor says the server is gone.

    The sockets belong to the transport (the client), not to an event loop: when a loop ends (it is closed, as
    ``asyncio.run`` does), its sockets wait in ``_spare`` and the next loop that calls the same server takes them.
    Closing them would tell the controller that the client's connections are gone, and after ``disconnect_grace``
    it would hand the client's leases to another consumer while the client is alive (docs/architecture.md
    "Delivery": leases belong to the client instance). So a client keeps as many connections per server as it ran
    loops at once, never one per loop it saw, and all of them until close().
    """

    def __init__(self, secret: bytes = b"") -> None:
        self._secret = secret
        self._ctx: zmq.Context = zmq.Context.instance()  # plain sockets, owned here: every loop wraps its own view
        self._ids = itertools.count(1)
        self._raw: dict[tuple[int, str], zmq.Socket] = {}  # the socket each (loop, server) uses
        self._sockets: dict[tuple[int, str], zmq.asyncio.Socket] = {}  # its view in that loop
        self._readers: dict[tuple[int, str], asyncio.Task[None]] = {}
        self._monitors: dict[tuple[int, str], zmq.asyncio.Socket] = {}
        self._pending: dict[tuple[int, str], set[int]] = {}  # request ids waiting on each socket
        self._loops: dict[int, asyncio.AbstractEventLoop] = {}
        self._futures: dict[int, asyncio.Future[Frames]] = {}
        self._spare: dict[str, list[zmq.Socket]] = {}  # sockets of loops that ended, by server address

    def next_request_id(self) -> int:
        return next(self._ids)

    def _socket(self, address: str) -> zmq.asyncio.Socket:
        loop = asyncio.get_running_loop()
        key = (id(loop), address)
        sock = self._sockets.get(key)
        if sock is None:
            self._retire_closed_loops()
            spare = self._spare.get(address)
            if spare:
                raw = spare.pop()
                _gone_event(monitor_of(raw))  # what happened while no loop used it says nothing about what comes
            else:
                raw = _dealer(self._ctx, self._secret, address)
            # a fresh view per loop: one of a loop that ended may hold that loop's futures
            sock = self._sockets[key] = zmq.asyncio.Socket.from_socket(raw)
            monitor = self._monitors[key] = zmq.asyncio.Socket.from_socket(monitor_of(raw))
            self._raw[key] = raw
            self._pending[key] = set()
            self._readers[key] = loop.create_task(self._read(sock))
            self._readers[(key[0], f"{address}#monitor")] = loop.create_task(self._watch(monitor, key))
            self._loops[id(loop)] = loop
        return sock

    async def _watch(self, monitor: zmq.asyncio.Socket, key: tuple[int, str]) -> None:
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if not event["event"] & _GONE_EVENTS:
                continue
            error = with_addresses(
                ServerGone(
                    f"['{key[1]}'] closed the connection or stopped listening (the server is gone, or its host is "
                    "unreachable)"
                ),
                [key[1]],
            )
            for request_id in list(self._pending.get(key, ())):
                future = self._futures.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_exception(error)

    def _retire_closed_loops(self) -> None:
        """The sockets of event loops that have ended go to ``_spare`` for the next loop (a client used through one
        ``asyncio.run`` per call keeps one socket per server, not one per call); a socket whose server went away
        meanwhile is closed (its connection is gone already: the next loop opens a new one)."""
        for loop_id in [i for i, loop in self._loops.items() if loop.is_closed()]:
            del self._loops[loop_id]
            for key in [k for k in self._raw if k[0] == loop_id]:
                raw = self._raw.pop(key)
                del self._sockets[key], self._monitors[key]
                self._pending.pop(key, None)
                self._readers.pop(key, None)
                self._readers.pop((key[0], f"{key[1]}#monitor"), None)
                if _gone_event(monitor_of(raw)):
                    close_watched(raw)
                else:
                    self._spare.setdefault(key[1], []).append(raw)

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                future = self._futures.pop(_request_id(frames), None)
            except MalformedMessage:
                continue
            if future is not None and not future.done():
                future.set_result(frames)

    async def call_many(
        self, calls: Sequence[tuple[Endpoint, Frames, int]], timeout: float, into: Sequence[Into] | None = None
    ) -> list[Frames]:
        """Replies in order (``into`` is not used: ZeroMQ hands back its own buffers)."""
        loop = asyncio.get_running_loop()
        futures = []
        for endpoint, frames, request_id in calls:
            future: asyncio.Future[Frames] = loop.create_future()
            self._futures[request_id] = future
            futures.append(future)
            sock = self._socket(endpoint.address())
            self._pending[(id(loop), endpoint.address())].add(request_id)
            await sock.send_multipart(frames, copy=False)
        try:
            return [_buffers(frames) for frames in await asyncio.wait_for(asyncio.gather(*futures), timeout)]
        except TimeoutError:
            missing = sorted({e.address() for (e, _, _), f in zip(calls, futures, strict=True) if not f.done()})
            raise with_addresses(RequestTimeout(f"no reply within {timeout:.1f} s from {missing}"), missing) from None
        finally:
            for endpoint, _, request_id in calls:
                self._futures.pop(request_id, None)
                self._pending.get((id(loop), endpoint.address()), set()).discard(request_id)

    def close(self) -> None:
        for task in self._readers.values():
            if not task.get_loop().is_closed():
                task.cancel()
        for key, raw in self._raw.items():
            loop = self._loops.get(key[0])
            if loop is not None and not loop.is_closed():  # the loop's views stop watching the sockets first
                loop.remove_reader(raw.FD)
                loop.remove_reader(monitor_of(raw).FD)
            close_watched(raw)
        for spare in self._spare.values():
            for raw in spare:
                close_watched(raw)
        self._raw.clear()
        self._sockets.clear()
        self._monitors.clear()
        self._pending.clear()
        self._readers.clear()
        self._loops.clear()
        self._spare.clear()
