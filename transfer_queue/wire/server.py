"""The serving loop the controller and the storage units share.

A :class:`Server` owns a :class:`~transfer_queue.wire.transport.ServerSockets` and one background thread that polls
them, hands every request to the subclass, runs the subclass's periodic work and reports closed connections.
Everything the subclass does runs inside ONE exception boundary (:meth:`Server._guard`): a failure is logged with
its place, counted in :attr:`Server.counters`, and the loop keeps serving. Without it, one bad frame in a Unix
socket reader or one exception in a timer would end the thread silently and hang the queue.

A request is ``[envelope, body, *buffers]`` (see :mod:`transfer_queue.wire.protocol`). The base checks the envelope
(protocol version, session), decodes the body with the subclass's decoder and calls
``handle(request, buffers, responder)``; the subclass answers through the :class:`Responder` at once or later
(the controller parks requests). A typed error raised by ``handle`` goes back to the caller as that type; any other
exception is a bug: logged, counted, and answered as an internal error. Replies never carry the session id.

Subclasses implement :meth:`Server.handle` and may override :meth:`Server.periodic` (called after every wake-up),
:meth:`Server.next_wakeup` (seconds until the periodic work is due), :meth:`Server.on_disconnect` (a peer's
connection closed: its process died, or it closed the client) and :meth:`Server.responder` (how replies are framed).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from transfer_queue.errors import ProtocolMismatch, SessionMismatch, TransferQueueError, error_to_wire
from transfer_queue.wire import protocol as p
from transfer_queue.wire.server_sockets import Incoming, Peer, ServerSockets
from transfer_queue.wire.shm import SegmentPool
from transfer_queue.wire.sockets import Reply

logger = logging.getLogger(__name__)
POLL_MS = 200  # the longest a loop sleeps without looking at its periodic work
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20  # control messages; storage units accept what their byte budget holds


class Responder:
    """Answers one request, once: :meth:`ok` with a value (and buffers) or :meth:`fail` with an error."""

    __slots__ = ("answered", "peer", "reply", "request_id")

    def __init__(self, reply: Reply, request_id: int, peer: Peer):
        self.reply = reply
        self.request_id = request_id
        self.peer = peer
        self.answered = False

    def ok(self, value: Any, buffers: Sequence[Any] = ()) -> None:
        if not self.answered:
            self.answered = True
            self.reply([p.encode(p.ReplyHeader(self.request_id)), p.encode(value), *buffers])

    def fail(self, error: BaseException) -> None:
        if not self.answered:
            self.answered = True
            self.reply([p.encode(p.ReplyHeader(self.request_id, *error_to_wire(error))), b""])

    def __call__(self, value: Any, error: BaseException | None) -> None:
        """``respond(value, error)``: the callback shape of RequestTable.handle."""
        self.ok(value) if error is None else self.fail(error)


class Server:
    """A poll loop over :class:`ServerSockets` on a background thread, with one exception boundary.

    Args:
        name: the thread's name and the logs' prefix.
        decode: decodes a request body (raises MalformedMessage).
        session_id: the session this server serves (None: none yet, every request is refused until it is set).
        host: the address the ROUTER binds (default: the node's).
        advertise_host: the address clients are told to connect to (default: ``host``, or the node's when ``host``
            is a wildcard such as ``0.0.0.0``).
        secret: the queue's secret; every connection must prove it before a frame is read (transfer_queue.wire.auth).
        max_message_bytes: the largest message accepted (see :meth:`ServerSockets.limit`).
        port: the TCP port to bind (0: a free one).
        shm_pool: shared memory for same-host clients that ask for it (transfer_queue.wire.shm; storage units with
            ``QueueConfig.shared_memory``), else None.

    Call :meth:`start` once the subclass is ready to serve.
    """

    what = "server"  # how errors name this kind of server ("controller", "storage unit")

    def __init__(
        self,
        name: str,
        decode: Callable[[Any], Any],
        session_id: str | None = None,
        host: str | None = None,
        secret: bytes = b"",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        advertise_host: str | None = None,
        port: int = 0,
        shm_pool: SegmentPool | None = None,
    ):
        self.name = name
        self.session_id = session_id
        self._decode = decode
        self.sockets = ServerSockets(host, secret=secret, advertise_host=advertise_host, port=port, shm_pool=shm_pool)
        self.shm_pool = shm_pool
        self.sockets.limit(max_message_bytes)
        self.endpoint = self.sockets.endpoint
        self.lock = threading.RLock()  # held while the subclass's code runs; Ray actor methods take it too
        self.counters: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    # ---- what subclasses implement ------------------------------------------------------------------------
    def handle(self, request: Any, buffers: list[Any], responder: Responder) -> None:
        """Serve one decoded request; answer through ``responder`` (now or later)."""
        raise NotImplementedError

    def periodic(self, events: dict[Any, int]) -> None:
        """Work after each wake-up (timers, other sockets registered with :meth:`ServerSockets.register`)."""

    def next_wakeup(self) -> float:
        """Seconds until :meth:`periodic` must run again (at most POLL_MS later anyway)."""
        return POLL_MS / 1000

    def on_disconnect(self, peer: Peer) -> None:
        """``peer``'s connection closed (its process died, it closed its client, or it was dropped)."""

    # ---- the loop ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)

    @property
    def serving(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def stats(self) -> dict[str, int]:
        """The loop's counters: requests served, failures by place, messages dropped (``dropped.unauthenticated``:
        connections that did not prove the secret, none of their frames read), disconnects."""
        with self.lock:
            base = {"requests": 0, "disconnects": 0}  # present from the start: readers poll them before any event
            return {**base, **self.counters, "dropped.unauthenticated": self.sockets.unauthenticated()}

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self.run_once()
        finally:
            self._guard("close", self.close_sockets)

    def run_once(self) -> None:
        """One wake-up: poll, serve what arrived, report disconnects, run the periodic work."""
        wait = self._guard("next_wakeup", self.next_wakeup)
        wait = POLL_MS / 1000 if wait is None else min(max(wait, 0.0), POLL_MS / 1000)
        events = self.sockets.poll(int(wait * 1000) + (1 if wait > 0 else 0))
        with self.lock:
            for incoming in self.sockets.router_messages(events):
                self._guard("request", self._on_message, incoming)
            for fd in self.sockets.unix_ready(events):
                batch = self._guard("unix reader", self.sockets.unix_messages, fd)
                if batch is None:  # the reader failed on this connection: drop it, serve the others
                    self.sockets.drop_unix(fd)
                    continue
                for incoming in batch:
                    self._guard("request", self._on_message, incoming)
            for peer in self.sockets.take_disconnects():
                self.counters["disconnects"] += 1
                self._guard("on_disconnect", self.on_disconnect, peer)
            self._guard("periodic", self.periodic, events)

    def close_sockets(self) -> None:
        self.sockets.close()

    def _guard(self, where: str, fn: Callable[..., Any], *args: Any) -> Any:
        """THE exception boundary: run ``fn``; on an exception log it, count it under ``failures.<where>``, and
        return None so the loop goes on."""
        try:
            return fn(*args)
        except Exception:
            self.counters[f"failures.{where}"] += 1
            logger.exception("%s: %s failed; still serving", self.name, where)
            return None

    def _on_message(self, incoming: Incoming) -> None:
        frames = incoming.frames
        if len(frames) < 2:
            self.counters["dropped.malformed"] += 1
            return  # not even an envelope and a body: nothing to answer
        responder = self.responder(incoming)
        try:
            envelope = p.decode_envelope(frames[0])
            responder.request_id = envelope.request_id
            self._check_envelope(envelope)
            if incoming.error is not None:
                raise incoming.error
            request = self._decode(frames[1])
        except TransferQueueError as exc:
            self.counters["refused"] += 1
            responder.fail(exc)
            return
        self.counters["requests"] += 1
        try:
            self.handle(request, frames[2:], responder)
        except TransferQueueError as exc:
            responder.fail(exc)
        except Exception as exc:  # a bug, not bad input: answer it, count it, keep serving
            self.counters["failures.request"] += 1
            logger.exception("%s failed on %s", self.name, type(request).__name__)
            responder.fail(exc)

    def responder(self, incoming: Incoming) -> Responder:
        """The Responder that answers ``incoming`` (a subclass may shape its replies, e.g. add to the header)."""
        return Responder(incoming.reply, -1, incoming.peer)

    def _check_envelope(self, envelope: p.Envelope) -> None:
        check_envelope(envelope, self.session_id, self.what)


def check_envelope(envelope: p.Envelope, session_id: str | None, what: str) -> None:
    """Refuse a request of another protocol version or session, without echoing either session id (a reply must
    never tell a stranger what the queue's session is)."""
    if envelope.protocol_version != p.PROTOCOL_VERSION:
        raise ProtocolMismatch(
            f"the client speaks protocol {envelope.protocol_version}, this {what} {p.PROTOCOL_VERSION}; "
            "install the same transfer_queue version on both sides"
        )
    if envelope.session_id != session_id:
        raise SessionMismatch(
            f"the request is for another session than this {what} serves (its controller_info is from a queue that "
            "was restarted or replaced); fetch a fresh controller_info (get_controller().get_info)"
        )
