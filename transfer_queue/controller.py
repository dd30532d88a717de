"""TransferQueueController: the Ray actor of the control plane.

A thin shell: a ROUTER socket served by the shared poll loop (transfer_queue.server), handing requests to its
:class:`~transfer_queue.request_table.RequestTable`, which translates them into calls of
:class:`~transfer_queue.queue_state.QueueState` (all bookkeeping lives there, unit-testable without Ray or a wire
format). Ray's own
actor calls (creating it, ``register_sampler``, ``get_info``) are the trusted control channel; everything on the
socket is typed msgpack and nothing received is unpickled. The controller never touches tensor bytes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import typing
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import ray
import zmq
from zmq.utils.monitor import recv_monitor_message

from transfer_queue import protocol as p
from transfer_queue.auth import new_secret, secure_client, write_token
from transfer_queue.checkpoint import (
    CheckpointError,
    begin_save,
    commit_save,
    current_checkpoint,
    read_controller,
    write_controller,
)
from transfer_queue.config import QueueConfig
from transfer_queue.errors import (
    ConfigMismatch,
    InvalidRequest,
    TransferQueueError,
    error_to_wire,
)
from transfer_queue.metrics import ControllerMetrics
from transfer_queue.queue_snapshot import block_map, read_snapshot, restore_state, snapshot_state
from transfer_queue.queue_state import QueueState
from transfer_queue.request_table import RequestTable
from transfer_queue.samplers import SamplerSpec
from transfer_queue.server import Responder, Server
from transfer_queue.status import RUN_HISTORY, numeric_row, queue_summary
from transfer_queue.transport import Incoming, Peer, Reply, close_watched, watch
from transfer_queue.unit_health import UnitWatcher

logger = logging.getLogger(__name__)
# A clear is answered once the storage units dropped the payload, so a BatchMeta from before it can no longer read
# those bytes; a unit that does not acknowledge within this long (at most) is dead or stuck, and the clear is
# answered anyway.
DROP_ACK_WAIT = 10.0
# A storage unit whose host goes silent (a dead node, a network partition) is noticed by ZeroMQ heartbeats on the
# controller's connection to it: no traffic for UNIT_HEARTBEAT_TIMEOUT_MS marks it down. Reconnects are tried every
# UNIT_RECONNECT_MS, each connect attempt given up after UNIT_CONNECT_TIMEOUT_MS, so a partition that heals is
# noticed within seconds.
UNIT_HEARTBEAT_IVL_MS = 1_000
UNIT_HEARTBEAT_TIMEOUT_MS = 4_000
UNIT_RECONNECT_MS = 500
UNIT_CONNECT_TIMEOUT_MS = 2_000
# request type -> its wire tag ("get_meta", "commit", ...): the ``kind`` label of the metrics
KINDS: dict[type, str] = {cls: cls.__struct_config__.tag for cls in typing.get_args(p.ControllerRequest)}


@dataclass
class HeldReply:
    """A reply waiting for the storage units to acknowledge the drops its request caused."""

    reply: Reply
    request_id: int
    value: Any
    awaiting: set[int]
    deadline: float


class _ControllerResponder(Responder):
    """Frames the controller's replies: every reply header tells the client which storage units are down."""

    __slots__ = ("server",)

    def __init__(self, server: ControllerServer, incoming: Incoming):
        super().__init__(incoming.reply, -1, incoming.peer)
        self.server = server

    def ok(self, value: Any, buffers: Sequence[Any] = ()) -> None:
        if not self.answered:
            self.answered = True
            self.server._reply(self.reply, self.request_id, value, None)

    def fail(self, error: BaseException) -> None:
        if not self.answered:
            self.answered = True
            self.server._reply(self.reply, self.request_id, None, error)


class ControllerServer(Server):
    """Serves a QueueState on the shared poll loop (:class:`~transfer_queue.server.Server`): client requests on its
    ROUTER and Unix sockets, and, as periodic work, the state's timers, its messages to the storage units and their
    acknowledgements. Every step runs inside the base's one exception boundary (logged, counted in ``stats()``)."""

    what = "controller"

    def __init__(
        self,
        state: QueueState,
        session_id: str,
        storage: list[p.Endpoint],
        host: str | None = None,
        secret: bytes = b"",
        save_units: Callable[[str], None] | None = None,
    ):
        super().__init__("tq-controller", p.decode_controller_request, session_id, host, secret)
        self.state = state
        self.requests = RequestTable(state)  # wire requests in, wire answers out
        self._session = session_id  # what the controller's own messages to the storage units carry
        self._save_units = save_units  # every storage unit writes its files under a staging directory
        self._secret = secret
        self._units: list[zmq.Socket] = []
        self._unit_monitors: dict[zmq.Socket, int] = {}
        for unit, endpoint in enumerate(storage):
            self._units.append(self._connect_unit(unit, endpoint))
        self._storage = list(storage)
        # Units Ray restarted (empty, on new ports): every reply tells clients where they are now and which of their
        # blocks are lost. Restarts are applied by the serving thread (it owns the sockets).
        self.restarted_units: dict[int, p.UnitRestart] = {}
        self._restarts_due: list[tuple[int, p.Endpoint, threading.Event, dict[str, Any]]] = []
        # Why each down unit is down (what clients are told); units in _dead never come back (Ray says the actor or
        # its node died), the others are up again when the connection is back.
        self.down_reasons: dict[int, str] = {}
        self._dead: set[int] = set()
        self._ids = itertools.count(1)
        self.metrics = ControllerMetrics()  # recorded on this thread; read by scrapes under ``lock``
        self.run_history: deque[dict[str, float]] = deque(maxlen=RUN_HISTORY)  # an RL run's per-step metrics
        self.endpoints: dict[str, Any] = {}  # the HTTP URLs of the controller and the storage units
        self._held: list[HeldReply] = []
        self._drop_ack_wait = min(DROP_ACK_WAIT, state.config.default_timeout / 2)
        self.start()

    def _connect_unit(self, unit: int, endpoint: p.Endpoint) -> zmq.Socket:
        """A DEALER to storage unit ``unit``, watched: the connection drops when the unit dies, and new puts are
        placed on the others until it is back."""
        dealer = self.sockets.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IPV6, 1)
        dealer.setsockopt(zmq.HEARTBEAT_IVL, UNIT_HEARTBEAT_IVL_MS)
        dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, UNIT_HEARTBEAT_TIMEOUT_MS)
        dealer.setsockopt(zmq.RECONNECT_IVL, UNIT_RECONNECT_MS)
        dealer.setsockopt(zmq.CONNECT_TIMEOUT, UNIT_CONNECT_TIMEOUT_MS)
        secure_client(dealer, self._secret)
        monitor = watch(dealer, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)  # before connect: no event is missed
        dealer.connect(endpoint.address())
        self.sockets.register(dealer)
        self._unit_monitors[monitor] = unit
        self.sockets.register(monitor)
        return dealer

    def restart_unit(self, unit: int, endpoint: p.Endpoint, timeout: float = 30.0) -> dict[str, Any]:
        """Storage unit ``unit`` was restarted by Ray (empty) and now listens at ``endpoint``: connect to it, mark the
        rows it held lost, and mark it up. Returns what was lost (see ``QueueState.unit_restarted``)."""
        done, result = threading.Event(), dict[str, Any]()
        with self.lock:
            self._restarts_due.append((unit, endpoint, done, result))
        if not done.wait(timeout):
            raise TimeoutError(f"the controller's serving thread did not take storage unit {unit}'s restart in time")
        return result

    def _apply_restarts(self) -> None:
        with self.lock:
            due, self._restarts_due = self._restarts_due, []
        for unit, endpoint, done, result in due:
            old = self._units[unit]
            for monitor in [m for m, u in self._unit_monitors.items() if u == unit]:
                del self._unit_monitors[monitor]
                self.sockets.unregister(monitor)
            self.sockets.unregister(old)
            close_watched(old)
            self._units[unit] = self._connect_unit(unit, endpoint)
            with self.lock:
                self._storage[unit] = endpoint
                self._dead.discard(unit)
                self.down_reasons.pop(unit, None)
                self.state.down_units.discard(unit)
                try:
                    result.update(self.state.unit_restarted(unit))
                except Exception:  # a bug: keep serving; the unit is up, its old rows may still be listed
                    logger.exception("marking the rows of restarted storage unit %d lost failed", unit)
                self.restarted_units[unit] = p.UnitRestart(
                    endpoint, int(result.get("lost_below", 0)), int(result.get("restarts", 0))
                )
                self._flush_outbox()
            logger.warning(
                "storage unit %d was restarted and is back at %s; %s rows it held are lost (%s)",
                unit, endpoint.tcp, result.get("rows"), result.get("partitions"),
            )  # fmt: skip
            done.set()

    # ---- the loop's hooks (transfer_queue.server.Server) -------------------------------------------------------
    def next_wakeup(self) -> float:
        return min([self.state.next_deadline, *(h.deadline for h in self._held)]) - time.monotonic()

    def on_disconnect(self, peer: Peer) -> None:
        # a connection closed: its waits are dropped; its leases and open puts go after a grace
        self.state.on_disconnect(peer)

    def periodic(self, events: dict[Any, int]) -> None:
        if self._restarts_due:
            self._guard("storage restarts", self._apply_restarts)
        if time.monotonic() >= self.state.next_deadline:
            self._guard("tick", self.state.tick)
        self._guard("storage messages", self._flush_outbox)
        for dealer in self._units:
            if dealer in events:
                self._guard("storage replies", self._drain_storage_replies, dealer)
        for monitor, unit in self._unit_monitors.items():
            if monitor in events:
                self._guard("storage connections", self._follow_unit, monitor, unit)
        self._guard("held replies", self._send_held, time.monotonic())

    def close_sockets(self) -> None:
        for dealer in self._units:
            close_watched(dealer)
        self.sockets.close()

    def responder(self, incoming: Incoming) -> Responder:
        return _ControllerResponder(self, incoming)

    def handle(self, request: Any, buffers: list[Any], responder: Responder) -> None:
        if isinstance(request, p.Hello):
            hello = {"client_id": request.client_id, "protocol_version": p.PROTOCOL_VERSION}  # never the session
            responder.ok(hello)
            return
        started, kind, metrics = time.perf_counter(), KINDS[type(request)], self.metrics
        if isinstance(request, p.QueueStatus):
            value = self.summary_locked(request.include_run_history)
            metrics.answered(kind, started, request, value, None)
            responder.ok(value)
            return
        if isinstance(request, p.SaveCheckpoint):
            try:
                responder.ok(self.save(request.directory))
            except TransferQueueError as exc:
                responder.fail(exc)
            except Exception as exc:  # a disk or a unit failed: the previous checkpoint stays current
                logger.exception("saving a checkpoint under %s failed", request.directory)
                responder.fail(
                    CheckpointError(
                        f"saving the checkpoint under {request.directory} failed: {type(exc).__name__}: {exc}"
                    ),
                )
            return

        # A clear is answered once the storage units dropped its bytes (if it is answered while being handled).
        hold = isinstance(request, (p.Clear, p.KvClear))
        held: list[tuple[Any, BaseException | None]] = []

        quiet = isinstance(request, p.Ack) and not request.reply  # the client does not read an answer

        def respond(value: Any, error: BaseException | None) -> None:
            metrics.answered(kind, started, request, value, error)
            if quiet:
                if error is not None:
                    logger.info("an acknowledgement nobody waits for failed: %s", error)
                return
            if isinstance(value, p.Reservation) and isinstance(request, p.Reserve):
                self._vouch(value, request.nbytes)
            if hold:
                held.append((value, error))
            else:
                responder(value, error)

        try:
            self.requests.handle(request, respond, responder.peer)
        except Exception as exc:  # a bug, not bad input: answer it, count it and keep serving
            self.counters["failures.request"] += 1
            logger.exception("controller failed on %s", type(request).__name__)
            respond(None, exc)
        hold = False  # answers that come later (a parked request) go out at once
        for value, error in held:
            sent = self._flush_outbox() if error is None else []
            if sent:
                responder.answered = True  # by _send_held, once the units dropped the bytes
                deadline = time.monotonic() + self._drop_ack_wait
                self._held.append(HeldReply(responder.reply, responder.request_id, value, set(sent), deadline))
            else:
                responder(value, error)

    def save(self, directory: str) -> str:
        """Save the queue under ``directory`` (call with :attr:`lock` held: nothing is served meanwhile, so the
        controller's snapshot and the units' payload agree); returns the committed checkpoint's directory."""
        if self._save_units is None:
            raise CheckpointError("this controller cannot reach its storage units to save their payload")
        staging, name = begin_save(directory)
        write_controller(staging, snapshot_state(self.state))
        self._save_units(staging)
        return commit_save(directory, staging, name)

    def _vouch(self, reservation: p.Reservation, nbytes: int) -> None:
        """Sign what the put reserved into each placement, so storage units check what arrives (defect 11)."""
        reservation.placements = [
            msgspec.structs.replace(
                place,
                max_bytes=nbytes,
                token=write_token(
                    self._secret, reservation.partition_uid, place.block_id, place.stop - place.start, nbytes
                ),
            )
            for place in reservation.placements
        ]

    def _reply(self, reply: Reply, request_id: int, value: Any, error: BaseException | None) -> None:
        down = dict(self.down_reasons)  # every reply tells the client which storage units are down
        restarted = dict(self.restarted_units) or None  # ... and which were restarted: where they are, what is lost
        if error is not None:
            header, body = p.ReplyHeader(request_id, *error_to_wire(error), down, restarted), b""
        else:
            header, body = p.ReplyHeader(request_id, down_units=down, restarted_units=restarted), p.encode(value)
        reply([p.encode(header), body])

    def mark_unit(self, unit: int, down: str | None, final: bool = False) -> None:
        """Mark storage unit ``unit`` down (``down``: why) or up again (None); ``final``: it never comes back.

        A down unit gets no new puts, clears do not wait for it, and clients fail reads of its rows at once."""
        with self.lock:
            if down is None:
                if unit in self._dead or unit not in self.down_reasons:
                    return
                logger.warning("storage unit %d is reachable again", unit)
                del self.down_reasons[unit]
                self.state.down_units.discard(unit)
                return
            if final:
                self._dead.add(unit)
            if self.down_reasons.get(unit) != down and (final or unit not in self._dead):
                logger.warning(
                    "storage unit %d (%s) is down: %s; new puts go to the others", unit, self._storage[unit].tcp, down
                )
                self.down_reasons[unit] = down
            self.state.down_units.add(unit)

    def _flush_outbox(self) -> list[int]:
        """Send the state's messages to the storage units; returns the request ids sent."""
        sent = []
        for unit, request in self.requests.take_outbox():
            request_id = next(self._ids)
            envelope = p.Envelope(p.PROTOCOL_VERSION, self._session, request_id)
            try:  # never block the controller on a unit that stopped reading (dead or stuck)
                self._units[unit].send_multipart([p.encode(envelope), p.encode(request)], zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("storage unit %d takes no messages; dropped a %s", unit, type(request).__name__)
                continue
            if unit not in self.state.down_units:  # a unit known to be down is not waited for (it may never answer)
                sent.append(request_id)
        return sent

    def _follow_unit(self, monitor: zmq.Socket, unit: int) -> None:
        """Mark a storage unit down when the connection to it drops, up when it is connected again."""
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.mark_unit(unit, "the controller lost its connection to it")
            else:
                self.mark_unit(unit, None)

    def _drain_storage_replies(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                header = p.decode_reply_header(frames[0])
            except TransferQueueError:
                continue
            if header.error_type:
                logger.warning("a storage unit refused a drop: %s: %s", header.error_type, header.error_message)
            for held in self._held:
                held.awaiting.discard(header.request_id)

    def _send_held(self, now: float) -> None:
        """Answer the held replies whose drops were all acknowledged, or whose wait ran out."""
        if not self._held:
            return
        keep = []
        for held in self._held:
            if held.awaiting and held.deadline > now:
                keep.append(held)
            else:
                self._reply(held.reply, held.request_id, held.value, None)
        self._held = keep

    def connections(self) -> int:
        """Client connections open now (TCP and Unix socket)."""
        unix = self.sockets.unix
        return len(self.sockets._tcp_by_fd) + (len(unix.connections) if unix is not None else 0)

    def summary_locked(self, run_history: bool = False) -> dict[str, Any]:
        """The whole-queue summary (see transfer_queue.status); the caller holds ``lock``."""
        run = list(self.run_history) if run_history else list(self.run_history)[-1:]
        return queue_summary(
            self.state, metrics=self.metrics, clients=self.connections(), run=run, endpoints=self.endpoints
        )

    def summary(self, run_history: bool = False) -> dict[str, Any]:
        with self.lock:
            return self.summary_locked(run_history)

    def record_run_row(self, row: dict[str, Any]) -> None:
        with self.lock:
            self.run_history.append(numeric_row(row))


@ray.remote
class TransferQueueController:
    """The control plane: which fields of which rows are produced, which tasks consumed them, and the samplers.

    It starts ``num_storage_units`` :class:`~transfer_queue.storage.StorageUnit` actors (or attaches the
    ``storage_units`` handles you created and placed yourself) and serves clients over ZeroMQ.

    Args:
        global_batch_size: prompts per global step.
        num_global_batch: steps live at once (the step ring).
        num_n_samples: rows per GRPO group.
        sampler: the default sampler for every task: an instance, a class, or a callable returning one.
        num_storage_units: storage actors to start when ``storage_units`` is not given.
        storage_units: storage actor handles to use instead (placed by you, e.g. one per node).
        storage_unit_options: Ray ``.options(...)`` for the storage actors this controller starts: one dict for
            all, or one per unit (``scheduling_strategy``, ``resources``, ``num_cpus``, ...).
        bind_host: address the controller's socket binds to (default: the node's address as Ray sees it; a wildcard
            such as ``0.0.0.0`` advertises the node's address). Storage units it starts on this node bind it too;
            units on other nodes bind their own node's address. To set each unit's ``bind_host`` and
            ``advertise_host``, start the units yourself and pass ``storage_units``.
        restore_from: a directory ``save_checkpoint`` wrote: start with its partitions, consumption, kv keys,
            samplers' states and payload (onto this controller's storage units, however many).
        **config: the other :class:`~transfer_queue.config.QueueConfig` fields (``storage_unit_bytes``,
            ``default_timeout``, ``put_grace``, ``seqlen_fields``).

    >>> controller = TransferQueueController.remote(global_batch_size=8, num_n_samples=4)  # doctest: +SKIP
    >>> info = ray.get(controller.get_info.remote())  # doctest: +SKIP
    """

    def __init__(
        self,
        global_batch_size: int,
        num_global_batch: int = 1,
        num_n_samples: int = 1,
        sampler: SamplerSpec | None = None,
        *,
        num_storage_units: int | None = None,
        storage_units: list[Any] | None = None,
        storage_unit_options: dict[str, Any] | list[dict[str, Any]] | None = None,
        bind_host: str | None = None,
        restore_from: str | None = None,
        **config: Any,
    ):
        if storage_units is not None and num_storage_units not in (None, len(storage_units)):
            raise InvalidRequest(
                f"num_storage_units={num_storage_units} but {len(storage_units)} storage_units were given"
            )
        units = len(storage_units) if storage_units is not None else (num_storage_units or 2)
        self._config = QueueConfig(
            global_batch_size=global_batch_size,
            num_global_batch=num_global_batch,
            num_n_samples=num_n_samples,
            num_storage_units=units,
            **config,
        )
        state = QueueState(self._config, sampler)
        self._session_id = uuid.uuid4().hex
        self._secret = new_secret()  # handed out through Ray only (get_info, attach); proven on every connection
        self._owns_units = storage_units is None
        if storage_units is None:
            from transfer_queue.runtime import start_storage_units  # runtime imports this module

            # bind_host is an address of this node: units that Ray places on other nodes bind their own
            storage_units = start_storage_units(
                units, storage_unit_options, bind_host, p.ray_node_id(), self._config.storage_unit_max_restarts
            )
        self._units = storage_units
        self._message_limit = limit = self._config.storage_unit_bytes * units + (1 << 20)  # a write never holds more
        endpoints = ray.get(
            [u.attach.remote(self._session_id, i, units, self._secret, limit) for i, u in enumerate(storage_units)]
        )
        incarnations = ray.get([u.incarnation.remote() for u in storage_units])
        if restore_from is not None:
            state = self._restore(restore_from, sampler)
        self._server = ControllerServer(
            state, self._session_id, endpoints, bind_host, self._secret, save_units=self._save_units
        )
        self._watcher = UnitWatcher(
            storage_units,
            [e.node_id for e in endpoints],
            self._server.mark_unit,
            incarnations,
            self._unit_restarted,
            restartable=self._owns_units and self._config.storage_unit_max_restarts > 0,
        )
        self._web = serve_status(self._server, storage_units, self._config.http_host, self._config.http_port)
        self._info = p.ControllerInfo(
            p.PROTOCOL_VERSION, self._session_id, self._server.endpoint, endpoints, self._config.to_dict(), self._secret
        )

    def _unit_restarted(self, unit: int) -> bool:
        """Ray restarted storage unit ``unit`` (the watcher saw a new incarnation): attach it to this session again, on
        its new ports; the rows it held are marked lost. Runs on the watcher's thread."""
        handle = self._units[unit]
        units = len(self._units)
        endpoint = ray.get(
            handle.attach.remote(self._session_id, unit, units, self._secret, self._message_limit), timeout=60
        )
        lost = self._server.restart_unit(unit, endpoint)
        storage = list(self._info.storage_units)
        storage[unit] = endpoint
        self._info = msgspec.structs.replace(self._info, storage_units=storage)
        if self._web is not None:
            try:
                url = ray.get(handle.serve_metrics.remote(self._config.http_host), timeout=30)
                with self._server.lock:
                    urls = list(self._server.endpoints.get("storage_units", []))
                    if unit < len(urls):
                        urls[unit] = url
                        self._server.endpoints = {**self._server.endpoints, "storage_units": urls}
            except Exception:  # metrics only: the unit serves the queue all the same
                logger.exception("storage unit %d: its /metrics endpoint did not start after the restart", unit)
        logger.warning("storage unit %d restarted: %s", unit, lost)
        return True

    def _save_units(self, staging: str) -> None:
        ray.get([unit.save_checkpoint.remote(staging) for unit in self._units])

    def _restore(self, root: str, sampler: SamplerSpec | None) -> QueueState:
        checkpoint = current_checkpoint(root)
        snapshot = read_snapshot(read_controller(checkpoint))
        saved = snapshot["config"]
        for name in ("global_batch_size", "num_n_samples"):
            if saved[name] != getattr(self._config, name):
                raise ConfigMismatch(
                    f"the checkpoint under {root} is of a queue with {name}={saved[name]}; this one has "
                    f"{name}={getattr(self._config, name)}"
                )
        units, old_units = len(self._units), saved["num_storage_units"]
        mapping, blocks = block_map(snapshot, units)
        ray.get(
            [
                unit.restore_checkpoint.remote(
                    checkpoint,
                    [u for u in range(old_units) if u % units == v],
                    {b: n for b, n in mapping.items() if n % units == v},
                )
                for v, unit in enumerate(self._units)
            ]
        )
        logger.info("restored %d partitions from %s onto %d storage units", len(snapshot["partitions"]), root, units)
        return restore_state(snapshot, self._config, sampler, mapping, blocks)

    def save_checkpoint(self, directory: str) -> str:
        """Save the queue under ``directory`` (what ``client.save_checkpoint`` asks); returns its directory."""
        with self._server.lock:
            return self._server.save(directory)

    def get_info(self) -> p.ControllerInfo:
        """What ``TransferQueueClient(client_id=..., controller_info=...)`` needs."""
        return self._info

    def get_config(self) -> dict[str, Any]:
        """The QueueConfig as a dict, plus the default sampler's class name under ``sampler``."""
        return {**self._config.to_dict(), "sampler": type(self._server.state.default_sampler).__name__}

    def register_sampler(self, task_name: str, sampler: SamplerSpec) -> None:
        """Give ``task_name`` its own sampler (instance, class or callable); other tasks keep the default."""
        with self._server.lock:
            self._server.state.register_sampler(task_name, sampler)

    def cpu_seconds(self) -> float:
        """CPU seconds this controller process and its storage units have used so far (the queue's own cost)."""
        return time.process_time() + sum(unit["cpu_s"] for unit in self.storage_stats())

    def server_stats(self) -> dict[str, Any]:
        """The controller's socket counters: ``dropped.unauthenticated`` counts connections refused because they did
        not prove the queue's secret (none of their frames was read); ``storage_units_down`` the units it lost its
        connection to, or that Ray reports dead (placement skips them), and why in ``storage_units_down_reasons``;
        the serving loop's ``requests``, ``disconnects`` and ``failures.<where>`` (transfer_queue.server)."""
        with self._server.lock:
            down = sorted(self._server.state.down_units)
            reasons = dict(self._server.down_reasons)
            restarted = {u: r.restarts for u, r in self._server.restarted_units.items()}
        return {
            **self._server.stats(),
            "storage_units_down": down,
            "storage_units_down_reasons": reasons,
            "storage_units_restarted": restarted,
        }

    def status(self, run_history: bool = False) -> dict[str, Any]:
        """The whole-queue summary (the same as ``client.status()``), through Ray."""
        return self._server.summary(run_history)

    def http_endpoints(self) -> dict[str, Any]:
        """Where the read-only HTTP endpoints listen: ``controller`` (``/metrics``, ``/status``, ``/status.json``) and
        ``storage_units`` (each ``/metrics``); empty when ``http_port=-1``."""
        return dict(self._server.endpoints)

    def record_run_metrics(self, row: dict[str, Any]) -> None:
        """An RL run's metrics of one step (its finite numbers are kept): Prometheus gauges ``transfer_queue_rl_*``
        and the curves of the status page."""
        self._server.record_run_row(row)

    def storage_stats(self) -> list[dict[str, Any]]:
        """Blocks, payload bytes and resident memory of each storage unit. A unit that cannot answer (dead, being
        restarted by Ray, not attached again yet) reports zeros and ``error``: why."""
        refs = [u.stats.remote() for u in self._units]
        out = []
        for unit, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=30))
            except Exception as exc:  # one unit's failure must not hide the others' figures
                zeros = dict.fromkeys(("pid", "cpu_s", "blocks", "bytes", "rss_bytes"), 0)
                out.append({"unit": unit, **zeros, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        return out

    def shutdown(self) -> None:
        """Stop serving and stop the storage units this controller started (again: a no-op)."""
        self._watcher.stop()
        self._server.stop()
        if self._web is not None:
            self._web.stop()
            self._web = None
        if self._owns_units:
            self._owns_units = False
            for ref in [u.shutdown.remote() for u in self._units]:
                try:
                    ray.get(ref, timeout=10)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    pass  # a dead unit (or one on a dead or unreachable node): killed below all the same
            for unit in self._units:
                ray.kill(unit)


def serve_status(server: ControllerServer, units: list[Any], host: str, port: int) -> Any:
    """Start the controller's HTTP endpoint and the storage units' ones; ``None`` when ``port`` is -1."""
    if port < 0:
        return None
    from transfer_queue.status_page import controller_routes
    from transfer_queue.web import HttpEndpoint

    web = HttpEndpoint(controller_routes(server), host, port)
    unit_urls = ray.get([u.serve_metrics.remote(host) for u in units])
    with server.lock:
        server.endpoints = {"controller": web.url, "storage_units": unit_urls}
    return web
