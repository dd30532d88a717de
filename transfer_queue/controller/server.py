"""ControllerServer: the controller's serving loop, on one thread.

A ROUTER socket (and the Unix socket beside it) served by the shared poll loop (:mod:`transfer_queue.wire.server`),
handing requests to its :class:`~transfer_queue.controller.requests.RequestTable`, which translates them into calls of
:class:`~transfer_queue.state.queue_state.QueueState`; as periodic work, the state's timers, its orders to the
storage units and their replies, and the units' health.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import threading
import time
import typing
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from transfer_queue.controller.requests import RequestTable
from transfer_queue.errors import (
    CheckpointError,
    JournalError,
    TransferQueueError,
    error_to_wire,
)
from transfer_queue.ops.metrics import ControllerMetrics
from transfer_queue.ops.status import RUN_HISTORY, numeric_row, queue_summary
from transfer_queue.ops.trace import DEFAULT_MAX_EVENTS, RequestTrace
from transfer_queue.ops.why_stuck import why_stuck
from transfer_queue.samplers import SamplerSpec
from transfer_queue.state.journal import Journal
from transfer_queue.state.lost_rows import (
    CopiesMoved,
    RefillPlan,
    RefillStep,
    block_live,
    holders_now,
    missing_on,
    plan_move,
    plan_refill,
    retire_unit,
    start_move,
    still_needed,
)
from transfer_queue.state.placement import replica_units
from transfer_queue.state.queue_state import QueueState
from transfer_queue.state.snapshot import snapshot_state
from transfer_queue.storage.checkpoint import (
    begin_save,
    commit_save,
    write_controller,
)
from transfer_queue.wire import protocol as p
from transfer_queue.wire.auth import secure_client, write_token
from transfer_queue.wire.server import Responder, Server
from transfer_queue.wire.server_sockets import Incoming, Peer
from transfer_queue.wire.sockets import Reply, close_watched, watch

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
# replicas=2: the blocks a restarted unit lost are copied back onto it from their other copy, through the controller's
# connections to the units, one batch at a time (at most REFILL_BLOCKS blocks, or REFILL_BYTES once above one block):
# the serving loop sends a batch's reads and writes without waiting and goes on serving. A batch not done within
# REFILL_TIMEOUT (a unit stopped answering) is given up and tried again; so is a refill waiting for a down unit, every
# REFILL_RETRY seconds. The copies a retired unit (down for good) held are moved onto other units the same way, once no
# refill is due (lost_rows.start_move).
REFILL_BLOCKS = 16
REFILL_BYTES = 64 << 20
REFILL_TIMEOUT = 30.0
REFILL_RETRY = 0.5
# request type -> its wire tag ("get_meta", "commit", ...): the ``kind`` label of the metrics
KINDS: dict[type, str] = {cls: cls.__struct_config__.tag for cls in typing.get_args(p.ControllerRequest)}
# requests that change nothing the journal keeps: reads
_NOT_JOURNALED = (
    p.Hello, p.QueueStatus, p.SaveCheckpoint, p.DeadLetters, p.ProductionStatus, p.ConsumptionStatus,
    p.ListPartitions, p.KvLookup, p.KvList, p.GetCustomMeta, p.LostRows,
)  # fmt: skip
# a get_meta may lease rows of any partition (the one it names, or one it waited for, served in a later pass), and a
# cancel_get_meta hand them back: the journal writes the leases that changed and the partitions whose rows they
# marked; their replies fail if that record cannot be written (the change would not survive a restart)
_LEASES = object()
_ALL = object()  # a request that may change every partition (reset_consumption of all of them)
# a reserve changes no partition the journal keeps (open puts are not kept) but hands out put and block ids, which a
# restarted controller must not hand out again: its record holds the state's fields outside its partitions only (so
# does set_task_options': the task options are one of them)
_COUNTERS = object()


@dataclass
class HeldReply:
    """A reply waiting for the storage units to acknowledge the drops its request caused."""

    reply: Reply
    request_id: int
    value: Any
    awaiting: set[int]
    deadline: float


@dataclass
class PendingSave:
    """A checkpoint between its snapshot (taken on the serving thread) and its commit: the units it waits for (request
    id -> unit), the controller's own file being written, then the commit, each off the serving thread."""

    directory: str
    staging: str
    name: str
    deadline: float
    finish: Callable[[Any, BaseException | None], None]  # answers whoever asked (a client's reply, a Ray call)
    awaiting: dict[int, int] = field(default_factory=dict)
    writing: Future[None] | None = None
    committing: Future[str] | None = None


@dataclass
class RefillBatch:
    """Blocks being copied back onto restarted unit ``unit``: the reads from their other copy (request id -> step),
    then the writes to ``unit``. Once every one is answered, every block below ``upto`` it lost is on it again. With
    ``move``: blocks of retired unit ``unit`` being copied onto other units (each step's ``target``) instead."""

    unit: int
    upto: int
    deadline: float
    reads: dict[int, RefillStep] = field(default_factory=dict)
    writes: dict[int, RefillStep] = field(default_factory=dict)
    failed: str = ""  # why the batch is given up (it is planned again from where the unit's refill stands)
    move: CopiesMoved | None = None
    blocks: list[int] = field(default_factory=list)  # its blocks, in block id order
    done: set[int] = field(default_factory=set)  # those written (or needing no copy any more)

    def units(self) -> set[int]:
        """The units it reads from and writes to (one going down gives the batch up)."""
        steps = [*self.reads.values(), *self.writes.values()]
        return {step.source for step in steps} | {step.target if self.move else self.unit for step in steps}

    def done_below(self) -> int:
        """Every block of the batch below this is written (``upto`` once all are): a batch given up keeps them."""
        return next((block for block in self.blocks if block not in self.done), self.upto)


class _ControllerResponder(Responder):
    """Frames the controller's replies: every reply header tells the client which storage units are down."""

    __slots__ = ("changes", "server")

    def __init__(self, server: ControllerServer, incoming: Incoming):
        super().__init__(incoming.reply, -1, incoming.peer)
        self.server = server
        self.changes = False  # its request may change what the journal keeps: a failed write fails its reply

    def ok(self, value: Any, buffers: Sequence[Any] = ()) -> None:
        if not self.answered:
            self.answered = True
            self.server._reply(self.reply, self.request_id, value, None, self.changes)

    def fail(self, error: BaseException) -> None:
        if not self.answered:
            self.answered = True
            self.server._reply(self.reply, self.request_id, None, error, self.changes)


class ControllerServer(Server):
    """Serves a QueueState on the shared poll loop (:class:`~transfer_queue.wire.server.Server`): client requests on its
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
        journal: Journal | None = None,
        port: int = 0,
    ):
        super().__init__("tq-controller", p.decode_controller_request, session_id, host, secret, port=port)
        self.state = state
        # journal_dir: each serving pass's changes are written (one write, fsynced per journal_fsync) before its
        # replies go out (transfer_queue.state.journal)
        self.journal = journal
        self._dirty: set[Any] | None = set()  # partition keys the pass changed (None: maybe all of them)
        self._counters = False  # the pass handed out put or block ids
        # timers or a storage unit's restart changed partitions (leases expired into dead letters, rows lost): the
        # next record also writes every partition with changes marked (PartitionState.mark)
        self._marked = False
        # the pass's replies, sent once its record is written; the bool: its request may have changed journaled state
        self._outgoing: list[tuple[Reply, int, Any, BaseException | None, bool]] = []
        # replicas=2: each unit's partner, on another Ray node where the units run on several (fixed from now on)
        state.ledger.replica_of = replica_units([e.node_id for e in storage], state.config.replicas)
        self.requests = RequestTable(state)  # wire requests in, wire answers out
        self._session = session_id  # what the controller's own messages to the storage units carry
        # one checkpoint at a time: its snapshot on this thread, every file written and committed off it
        self._save: PendingSave | None = None
        self._saves_due: list[tuple[str, Callable[[Any, BaseException | None], None]]] = []
        self._disk = ThreadPoolExecutor(1, thread_name_prefix="tq-controller-save")
        self._secret = secret
        self._units: list[zmq.Socket] = []
        self._unit_monitors: dict[zmq.Socket, int] = {}
        for unit, endpoint in enumerate(storage):
            self._units.append(self._connect_unit(unit, endpoint))
        self._storage = list(storage)
        # Units Ray restarted (empty, on new ports): every reply tells clients where they are now and which of their
        # blocks are lost. Restarts are applied by the serving thread (it owns the sockets).
        self.restarted_units: dict[int, p.UnitRestart] = {}
        book = state.lost  # a controller replaying its journal: the restarts its clients were told of, as they were
        for unit, restarts in book.restarts.items():
            if unit < len(storage):
                self.restarted_units[unit] = p.UnitRestart(
                    storage[unit],
                    book.lost_below.get(unit, 0),
                    restarts,
                    book.refilled_below.get(unit, 0),
                    lost_with=tuple(book.lost_with.get(unit, ())),
                    lost_with_moved=tuple(book.lost_with_moved.get(unit, ())),
                )
        self._restarts_due: list[tuple[int, p.Endpoint, threading.Event, dict[str, Any]]] = []
        self._retires_due: set[int] = set()  # units marked down for good, retired by the serving thread (rows lost)
        # Why each down unit is down (what clients are told); units in _dead never come back (Ray says the actor or
        # its node died), the others are up again when the connection is back.
        self.down_reasons: dict[int, str] = {}
        self._dead: set[int] = set()
        self._ids = itertools.count(1)
        self.metrics = ControllerMetrics()  # recorded on this thread; read by scrapes under ``lock``
        self.state.events.track(self.metrics.gets, self.metrics.get_rows)  # forgotten with idle task names
        self.run_history: deque[dict[str, float]] = deque(maxlen=RUN_HISTORY)  # an RL run's per-step metrics
        self.endpoints: dict[str, Any] = {}  # the HTTP URLs of the controller and the storage units
        self._held: list[HeldReply] = []
        self._refill: RefillBatch | None = None  # replicas=2: the blocks being copied back onto a restarted unit
        self._refill_at = 0.0  # when to plan the next refill batch (later after one was given up or has to wait)
        self._refill_plans: dict[int, RefillPlan] = {}  # unit -> its refill's blocks, planned once per restart
        self._move_plans: dict[int, RefillPlan] = {}  # retired unit -> its copies to move, planned once
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
            if self._refill is not None:  # a batch reading from or writing to the old incarnation is never answered
                self._give_up(self._refill)
            self._move_plans.pop(unit, None)  # retired again later: a move of its own, planned then
            with self.lock:
                self._storage[unit] = endpoint
                self._dead.discard(unit)
                self._retires_due.discard(unit)
                self.down_reasons.pop(unit, None)
                self.state.down_units.discard(unit)
                self._marked = self._counters = True  # its rows lost (marked) and the state's lost rows
                try:
                    result.update(self.state.unit_restarted(unit))
                except Exception:  # a bug: keep serving; the unit is up, its old rows may still be listed
                    logger.exception("marking the rows of restarted storage unit %d lost failed", unit)
                self.restarted_units[unit] = p.UnitRestart(
                    endpoint,
                    int(result.get("lost_below", 0)),
                    int(result.get("restarts", 0)),
                    lost_with=tuple(result.get("lost_with", ())),
                    lost_with_moved=tuple(result.get("lost_with_moved", ())),
                )
                self._flush_outbox()
            logger.warning(
                "storage unit %d was restarted and is back at %s; %s rows it held are lost (%s)",
                unit, endpoint.tcp, result.get("rows"), result.get("partitions"),
            )  # fmt: skip
            done.set()

    def _apply_retirements(self) -> None:
        """The units marked down for good since: retired (``lost_rows.retire_unit``): the rows whose last copy was on
        one are lost, and the restarts that took their other copy tell clients so (``lost_with``)."""
        with self.lock:
            due, self._retires_due = sorted(self._retires_due), set()
            book = self.state.lost
            for unit in due:
                if unit not in self._dead:  # brought back meanwhile
                    continue
                result = retire_unit(self.state, unit)
                self._counters = True  # the units' book changed: the next record holds it (journal_dir)
                self._marked = self._marked or bool(result["rows"])
                for other in result["units"]:
                    restart = self.restarted_units.get(other)
                    if restart is not None:
                        self.restarted_units[other] = msgspec.structs.replace(
                            restart,
                            lost_with=tuple(book.lost_with.get(other, ())),
                            lost_with_moved=tuple(book.lost_with_moved.get(other, ())),
                        )
                if result["rows"]:
                    logger.warning(
                        "storage unit %d is lost for good; %d rows whose other copy was gone already (units %s "
                        "restarted and not refilled yet) are lost (%s)",
                        unit, result["rows"], result["units"], result["partitions"],
                    )  # fmt: skip
            self._flush_outbox()

    # ---- the loop's hooks (transfer_queue.wire.server.Server) -------------------------------------------------------
    def next_wakeup(self) -> float:
        save = [self._save.deadline] if self._save is not None else []
        return min([self.state.next_deadline, *(h.deadline for h in self._held), *save]) - time.monotonic()

    def on_disconnect(self, peer: Peer) -> None:
        # a connection closed: its waits are dropped; its leases and open puts go after a grace
        self.state.on_disconnect(peer)

    def periodic(self, events: dict[Any, int]) -> None:
        if self._restarts_due:
            self._guard("storage restarts", self._apply_restarts)
        if self._retires_due:
            self._guard("storage retirements", self._apply_retirements)
        if time.monotonic() >= self.state.next_deadline:
            self._guard("tick", self._tick)
        self._guard("storage messages", self._flush_outbox)
        for dealer in self._units:
            if dealer in events:
                self._guard("storage replies", self._drain_storage_replies, dealer)
        for monitor, unit in self._unit_monitors.items():
            if monitor in events:
                self._guard("storage connections", self._follow_unit, monitor, unit)
        self._guard("held replies", self._send_held, time.monotonic())
        if self._saves_due:
            with self.lock:
                due, self._saves_due = self._saves_due, []
            for directory, finish in due:
                self._guard("checkpoint", self.start_save, directory, finish)
        if self._save is not None:
            self._guard("checkpoint", self._advance_save, time.monotonic())
        if self.state.ledger.replica_of is not None and (
            self._refill is not None or self.state.lost.refilling() or self._moves_due()
        ):
            self._guard("refill", self._advance_refill, time.monotonic())

    def close_sockets(self) -> None:
        self._disk.shutdown(wait=False, cancel_futures=True)
        if self.journal is not None:
            self.journal.close()
        for dealer in self._units:
            close_watched(dealer)
        self.sockets.close()

    def responder(self, incoming: Incoming) -> Responder:
        return _ControllerResponder(self, incoming)

    # ---- the journal: group commit at the end of each serving pass ------------------------------------------------
    def run_once(self) -> None:
        super().run_once()
        if self.journal is not None:
            with self.lock:
                self._guard("journal", self._journal_pass)

    def register_sampler(self, task_name: str, sampler: SamplerSpec) -> None:
        """Give ``task_name`` its own sampler (from another thread: a Ray call). With a journal, the sampler (as
        given, cloudpickled: ``QueueState.sampler_specs``) is written (and fsynced, unless ``journal_fsync="never"``)
        before this returns, so a replayed controller
        registers it again and loads its journaled state; raises JournalError if that write failed (the sampler is
        registered all the same, and written with the next record)."""
        with self.lock:
            self.state.register_sampler(task_name, sampler)
            if self.journal is None:
                return
            try:
                self.journal.record(self.state, set())
                if self.journal.fsync == "interval":  # not the pass's next fsync: the caller goes on once it returns
                    self.journal.sync()
            except Exception as exc:
                self.counters["failures.journal"] += 1
                raise JournalError(
                    f"the controller could not write its journal under {self.journal.directory} ({exc}); the sampler "
                    f"of task {task_name!r} is registered but may not survive a controller restart"
                ) from exc

    def _tick(self) -> None:
        self.state.tick()
        self._marked = True

    def _touches(self, request: Any) -> Any:
        """The key of the partition ``request`` may change (``_ALL``: any; ``_LEASES``: leases, of any partition; None:
        none the journal keeps)."""
        if isinstance(request, _NOT_JOURNALED):
            return None
        if isinstance(request, (p.GetMeta, p.CancelGetMeta)):
            return _LEASES
        state = self.state
        if isinstance(request, (p.Reserve, p.SetTaskOptions)):  # the state's fields outside its partitions
            return _COUNTERS
        if isinstance(request, (p.Commit, p.Abort)):
            put = state.ledger.open_puts.get(request.put_id)
            return None if put is None else put.key
        uid = getattr(request, "partition_uid", None)
        if uid is not None:
            part = state.table.by_uid(uid)
            return None if part is None else part.key
        if not hasattr(request, "partition"):
            return _ALL
        return _ALL if request.partition is None else request.partition

    def _journal_pass(self) -> None:
        """Write what this pass changed, then send its replies (a reply never tells of a change not written)."""
        assert self.journal is not None
        dirty, self._dirty = self._dirty, set()
        outgoing, self._outgoing = self._outgoing, []
        failed: BaseException | None = None
        try:
            counters, self._counters = self._counters, False
            marked, self._marked = self._marked, False
            self.journal.record(self.state, dirty, counters, marked)  # also partitions created or dropped (a clear)
            self.journal.sync_due()
        except Exception as exc:  # a full disk, a lost mount, or a bug: the pass's replies go out all the same
            # what this pass changed is not (surely) written: the next record writes every partition and the counters
            self._dirty, self._counters, self._marked = None, True, True
            self.counters["failures.journal"] += 1
            logger.exception("the journal under %s could not be written", self.journal.directory)
            failed = JournalError(
                f"the controller could not write its journal under {self.journal.directory} ({exc}); the change was "
                "applied but may not survive a controller restart"
            )
        else:
            self._begin_snapshot()
        for reply, request_id, value, error, changes in outgoing:
            if failed is not None and error is None and changes:  # reads are answered: they changed nothing
                value, error = None, failed
            self._send_reply(reply, request_id, value, error)

    def _begin_snapshot(self) -> None:
        """Begin a snapshot if the log is due one (written by the journal's thread: this one only encodes the state
        and seals the log). One that cannot begin fails no reply: the pass's record is written; the log's segments
        stay and are replayed, and a later pass tries again."""
        assert self.journal is not None
        try:
            if self.journal.snapshot_due():
                self.journal.snapshot(self.state, wait=False)
        except Exception:
            self.journal.stats["snapshot_failures"] += 1
            logger.exception("the journal under %s could not begin a snapshot", self.journal.directory)

    def handle(self, request: Any, buffers: list[Any], responder: Responder) -> None:
        touched = None if self.journal is None else self._touches(request)
        if isinstance(responder, _ControllerResponder):
            responder.changes = touched is not None
        if touched is not None and self._dirty is not None:
            if touched is _ALL:
                self._dirty = None
            elif touched is _COUNTERS:
                self._counters = True
            elif touched is not _LEASES:
                self._dirty.add(touched)
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
            self.start_save(request.directory, responder)  # answered when committed; the others are served meanwhile
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

    # ---- checkpoints: a snapshot here, the files written off this thread, the answer once committed -------------
    def save(self, directory: str) -> str:
        """Save the queue under ``directory`` from another thread (a Ray call); returns the committed checkpoint's
        directory. The serving thread takes the snapshot; this waits for the commit."""
        done, result = threading.Event(), dict[str, Any]()

        def finish(value: Any, error: BaseException | None) -> None:
            result.update(value=value, error=error)
            done.set()

        with self.lock:
            self._saves_due.append((directory, finish))
        if not done.wait(self.state.config.checkpoint_timeout + 60.0):
            raise CheckpointError(f"the checkpoint under {directory} was not answered in time")
        if result["error"] is not None:
            raise result["error"]
        return str(result["value"])

    def start_save(self, directory: str, finish: Callable[[Any, BaseException | None], None]) -> None:
        """Snapshot the bookkeeping now (on the serving thread: consistent with itself), order every storage unit
        to write its blocks as of now, and let the files be written in the background; ``finish`` gets the
        committed checkpoint's directory, or the error."""
        if self._save is not None:
            finish(None, CheckpointError(
                f"a checkpoint is being saved under {self._save.directory}; save again once it is answered"
            ))  # fmt: skip
            return
        try:
            savers = self._savers()
        except CheckpointError as exc:
            finish(None, exc)
            return
        try:
            staging, name = begin_save(directory)
            saved_by = {primary: unit for unit, primaries in savers.items() for primary in primaries or (unit,)}
            blob = snapshot_state(self.state, saved_by)
        except Exception as exc:
            finish(None, _save_failed(directory, exc))
            return
        timeout = self.state.config.checkpoint_timeout
        save = PendingSave(directory, staging, name, time.monotonic() + timeout, finish)
        self._flush_outbox()  # the drops decided before the snapshot go first; those after follow the order
        envelope_session = p.PROTOCOL_VERSION, self._session
        for unit, primaries in savers.items():
            request_id = next(self._ids)
            order = p.SaveUnit(staging, primaries)
            try:  # the same connection as the drops: the unit takes its block table before any later drop
                self._units[unit].send_multipart(
                    [p.encode(p.Envelope(*envelope_session, request_id)), p.encode(order)], zmq.NOBLOCK
                )
            except zmq.Again:
                self._disk.submit(shutil.rmtree, staging, True)
                finish(None, CheckpointError(
                    f"storage unit {unit} takes no messages; the previous checkpoint stays current"
                ))  # fmt: skip
                return
            save.awaiting[request_id] = unit
        save.writing = self._disk.submit(write_controller, staging, blob)
        self._save = save

    def _savers(self) -> dict[int, list[int] | None]:
        """Which units write the checkpoint, and the blocks of which units each writes (None: all it holds). With one
        copy, every unit (all must be up). With replicas=2 each block is saved once: the blocks placed on unit ``u``
        by ``u`` if it is up and holds all of them, else by its replica's unit if that one does, else by a unit the
        copies of a retired holder were moved to if it holds all of them."""
        units = self.state.config.num_storage_units
        down = self.state.down_units
        replica_of = self.state.ledger.replica_of
        if replica_of is None:
            if down:
                unit = min(down)
                raise CheckpointError(
                    f"storage unit {unit} is down ({self.down_reasons.get(unit, 'unreachable')}); the previous "
                    "checkpoint stays current"
                )
            return dict.fromkeys(range(units))
        ids = np.fromiter((b for part in self.state.partitions.values() for b in part.block_nbytes), dtype=np.int64)
        savers: dict[int, list[int] | None] = {}
        for primary in range(units):
            mine = ids[ids % units == primary]
            holders = [primary, replica_of[primary]]
            first, second = holders_now(self.state, mine)  # a retired unit's copies: where they were moved
            moved = sorted({*first.tolist(), *second.tolist()} - set(holders))
            whole = [
                h for h in [*holders, *moved]
                if h not in down and ((first == h) | (second == h)).all()
                and not missing_on(self.state, mine, np.full(len(mine), h, np.int64)).any()
            ]  # fmt: skip
            if not whole:
                why = [
                    f"{h} is down ({self.down_reasons.get(h, 'unreachable')})" if h in down
                    else f"{h} is being refilled with the copies it lost"
                    for h in holders
                ]  # fmt: skip
                raise CheckpointError(
                    f"no storage unit holding the blocks placed on storage unit {primary} holds all of them now "
                    f"(storage unit {'; storage unit '.join(why)}); the previous checkpoint stays current"
                )
            primaries = savers.setdefault(whole[0], [])
            assert primaries is not None
            primaries.append(primary)
        return savers

    def _advance_save(self, now: float) -> None:
        save = self._save
        assert save is not None
        error: BaseException | None = None
        late = [u for u in save.awaiting.values() if u in self.state.down_units]
        if late:
            error = CheckpointError(
                f"storage unit {late[0]} went down during the checkpoint; the previous checkpoint stays current"
            )
        elif save.awaiting and now >= save.deadline:
            error = CheckpointError(
                f"storage unit {min(save.awaiting.values())} did not finish its checkpoint within "
                f"{self.state.config.checkpoint_timeout} s; the previous checkpoint stays current"
            )
        elif save.writing is not None and save.writing.done() and save.writing.exception() is not None:
            error = _save_failed(save.directory, save.writing.exception())
        elif not save.awaiting and save.committing is None and save.writing is not None and save.writing.done():
            save.committing = self._disk.submit(commit_save, save.directory, save.staging, save.name)
            return
        elif save.committing is not None and save.committing.done():
            self._save = None
            if save.committing.exception() is not None:
                save.finish(None, _save_failed(save.directory, save.committing.exception()))
            else:
                save.finish(save.committing.result(), None)
            return
        if error is not None:
            self._save = None
            self._disk.submit(shutil.rmtree, save.staging, True)  # a late unit finds it gone and writes nothing
            save.finish(None, error)

    def _unit_saved(self, request_id: int, header: p.ReplyHeader) -> None:
        save = self._save
        if save is None or request_id not in save.awaiting:
            return
        unit = save.awaiting.pop(request_id)
        if header.error_type:
            self._save = None
            self._disk.submit(shutil.rmtree, save.staging, True)
            save.finish(None, CheckpointError(
                f"storage unit {unit} failed to write its checkpoint: {header.error_type}: {header.error_message}; "
                "the previous checkpoint stays current"
            ))  # fmt: skip

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

    def _reply(
        self, reply: Reply, request_id: int, value: Any, error: BaseException | None, changes: bool = True
    ) -> None:
        if self.journal is not None:  # sent once the pass's journal records are written
            self._outgoing.append((reply, request_id, value, error, changes))
            return
        self._send_reply(reply, request_id, value, error)

    def _send_reply(self, reply: Reply, request_id: int, value: Any, error: BaseException | None) -> None:
        down = dict(self.down_reasons)  # every reply tells the client which storage units are down
        restarted = dict(self.restarted_units) or None  # ... and which were restarted: where they are, what is lost
        # ... and where the copies of retired units were moved
        moved = [p.UnitMove(m.unit, m.to, m.below) for m in self.state.lost.moves] or None
        if error is not None:
            header, body = p.ReplyHeader(request_id, *error_to_wire(error), down, restarted, moved), b""
        else:
            header = p.ReplyHeader(request_id, down_units=down, restarted_units=restarted, moved_units=moved)
            body = p.encode(value)
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
                self._retires_due.add(unit)  # its copies a move has not reached are gone for good (serving thread)
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
            if self._save is not None and header.request_id in self._save.awaiting:
                self._unit_saved(header.request_id, header)
                continue
            refill = self._refill
            if refill is not None and header.request_id in refill.reads:
                self._refill_read(refill, refill.reads.pop(header.request_id), header, frames)
                continue
            if refill is not None and header.request_id in refill.writes:
                self._refill_written(refill, refill.writes.pop(header.request_id), header)
                continue
            if header.error_type:
                logger.warning("a storage unit refused a drop: %s: %s", header.error_type, header.error_message)
            for held in self._held:
                held.awaiting.discard(header.request_id)

    # ---- replicas=2: copying back the blocks a restarted unit lost ----------------------------------------------
    def _advance_refill(self, now: float) -> None:
        """Finish the batch in flight (or give it up), then plan the next one of the first unit that lost blocks it
        has not got back yet, is up, and whose next block's other copy is on a unit that is up."""
        batch = self._refill
        if batch is not None:
            gone = sorted(batch.units() & self.state.down_units) if batch.move else [batch.unit]
            if gone and gone[0] in self.state.down_units:
                batch.failed = f"storage unit {gone[0]} went down"
            elif now >= batch.deadline:
                batch.failed = f"not answered within {REFILL_TIMEOUT} s"
            if batch.failed:
                logger.warning("refilling storage unit %d: a batch was given up (%s); trying again", batch.unit,
                               batch.failed)  # fmt: skip
                self._give_up(batch)
                self._refill_at = now + REFILL_RETRY
                return
            if batch.reads or batch.writes:
                return
            self._refill = None
            if batch.move is not None:
                self._moved(batch.move, batch.upto)
            else:
                self._refilled(batch.unit, batch.upto)
        if now < self._refill_at:
            return
        for unit in self.state.lost.refilling():
            if unit not in self.state.down_units and self._start_refill(unit, now):
                return
        for unit in sorted(self._dead - self._retires_due):  # no refill to send: move the retired units' copies
            if self._start_move(unit, now):
                return
        self._refill_at = now + REFILL_RETRY  # nothing to send now: every refill waits for a down unit

    def _start_refill(self, unit: int, now: float) -> bool:
        """Send the reads of the next batch of blocks ``unit`` lost; False when there is nothing to send now (its
        refill is done, or waits for a down unit holding the other copy of its next block)."""
        book = self.state.lost
        batch = RefillBatch(unit, book.lost_below[unit], now + REFILL_TIMEOUT)
        book.refill_waiting.pop(unit, None)
        plan = self._refill_plans.get(unit)
        if plan is None or plan.restart != book.restarts.get(unit, 0):  # planned once per restart of the unit
            plan = self._refill_plans[unit] = plan_refill(self.state, unit)

        def waits(step: RefillStep) -> bool:
            if step.source not in self.state.down_units:
                return False
            book.refill_waiting[unit] = step.source
            return True

        # skipped: cleared or dropped, or its other copy is gone too (lost rows)
        steps = _next_batch(batch, plan.from_block(book.refilled_below.get(unit, 0)),
                            lambda step: not still_needed(self.state, step), waits)  # fmt: skip
        if not steps:
            self._refilled(unit, batch.upto)  # past the blocks with nothing to copy
            return False
        self._send_reads(batch, steps)
        return True

    def _give_up(self, batch: RefillBatch) -> None:
        """Drop ``batch`` (it is planned again from where its refill or move stands), keeping the copies it wrote
        before its first block not written: they are on their unit (a restart of the unit they were read from must
        not call them lost; one of the unit written to loses them as any of its blocks)."""
        self._refill = None
        if batch.move is not None:
            self._moved(batch.move, batch.done_below())
        else:
            self._refilled(batch.unit, batch.done_below())

    def _send_reads(self, batch: RefillBatch, steps: list[RefillStep]) -> None:
        envelope_session = p.PROTOCOL_VERSION, self._session
        batch.blocks = [step.block for step in steps]
        for step in steps:
            request_id = next(self._ids)
            rows = np.arange(step.num_rows, dtype=np.int64)
            blocks = p.pack_indexes(np.full(step.num_rows, step.block, dtype=np.int64))
            read = p.Read(step.uid, [p.ReadField(name, blocks, p.pack_indexes(rows)) for name in step.fields])
            try:
                self._units[step.source].send_multipart(
                    [p.encode(p.Envelope(*envelope_session, request_id)), p.encode(read)], zmq.NOBLOCK
                )
            except zmq.Again:
                batch.failed = f"storage unit {step.source} takes no messages"
                break
            batch.reads[request_id] = step
        self._refill = batch

    def _refill_read(self, batch: RefillBatch, step: RefillStep, header: p.ReplyHeader, frames: list[bytes]) -> None:
        """A block's other copy arrived: write it to the unit being refilled, if the block is still held. This runs on
        the serving thread, which also decides every drop and sends it on the same connection after this write: a
        block cleared or dropped before is not written back, one dropped after is dropped there too."""
        if not block_live(self.state, step.uid, step.block):
            batch.done.add(step.block)  # no copy needed any more
            return
        if header.error_type:
            batch.failed = f"reading block {step.block} from storage unit {step.source}: {header.error_message}"
            return
        reply = p.decode_as(frames[1], p.ReadReply)
        buffers = frames[2:]
        nbytes = sum(len(b) for b in buffers)
        token = write_token(self._secret, step.uid, step.block, step.num_rows, nbytes)
        write = p.Write(step.uid, step.block, step.num_rows, reply.columns, nbytes, token, refill=True)
        request_id = next(self._ids)
        envelope = p.Envelope(p.PROTOCOL_VERSION, self._session, request_id)
        target = step.target if batch.move is not None else batch.unit
        try:
            self._units[target].send_multipart([p.encode(envelope), p.encode(write), *buffers], zmq.NOBLOCK)
        except zmq.Again:
            batch.failed = f"storage unit {target} takes no messages"
            return
        batch.writes[request_id] = step

    def _refill_written(self, batch: RefillBatch, step: RefillStep, header: p.ReplyHeader) -> None:
        if not header.error_type or not block_live(self.state, step.uid, step.block):
            batch.done.add(step.block)
        if not header.error_type:
            if batch.move is not None:
                self.state.lost.blocks_rereplicated += 1
            else:
                self.state.lost.blocks_refilled += 1
        elif block_live(self.state, step.uid, step.block):
            target = step.target if batch.move is not None else batch.unit
            batch.failed = f"writing block {step.block} to storage unit {target}: {header.error_message}"

    # ---- replicas=2: moving the copies a retired unit held onto other units ---------------------------------------
    def _moves_due(self) -> bool:
        """A retired unit's copies are to be moved (or are being moved)."""
        book = self.state.lost
        return any((move := book.move_of(unit)) is None or not move.done for unit in self._dead)

    def _start_move(self, unit: int, now: float) -> bool:
        """Send the reads of the next batch of retired unit ``unit``'s copies to move (deciding where they go first);
        False when there is nothing to send now (done, or waiting: status's ``cannot_rereplicate`` says why)."""
        book = self.state.lost
        move = book.move_of(unit)
        if move is None:
            made = start_move(self.state, unit, [e.node_id for e in self._storage], self._dead)
            if isinstance(made, str):
                return False
            move = made
            self.state.ledger.moved_to |= set(move.to.values())
            self._counters = True  # the units' book changed: the next record holds it (journal_dir)
            logger.warning("storage unit %d is retired; moving the copies it held (holder of the other copy -> "
                           "new holder: %s)", unit, move.to)  # fmt: skip
        if move.done:
            return False
        plan = self._move_plans.get(unit)
        if plan is None:  # planned once (a replayed controller plans from where the move stands)
            plan = self._move_plans[unit] = plan_move(self.state, move)
        batch = RefillBatch(unit, move.upto, now + REFILL_TIMEOUT, move=move)
        book.cannot_rereplicate.pop(unit, None)

        def waits(step: RefillStep) -> bool:
            down = sorted({step.source, step.target} & self.state.down_units)
            if down:
                book.cannot_rereplicate[unit] = f"storage unit {down[0]} is down (waiting for it)"
            elif book.refilled_below.get(step.target, 0) <= step.block < book.lost_below.get(step.target, 0):
                # a copy written there now would count as missing (missing_on) until the refill passes the block
                book.cannot_rereplicate[unit] = (
                    f"storage unit {step.target} is not refilled up to block {step.block} yet (waiting for it)"
                )
                return True
            return bool(down)

        # skipped: cleared or dropped, or its other copy is gone for good too: nothing to copy
        steps = _next_batch(batch, plan.from_block(move.below),
                            lambda step: not block_live(self.state, step.uid, step.block) or step.source in self._dead,
                            waits)  # fmt: skip
        if not steps:
            self._moved(move, batch.upto)  # past the blocks with nothing to copy
            return False
        self._send_reads(batch, steps)
        return True

    def _moved(self, move: CopiesMoved, upto: int) -> None:
        """Every block below ``upto`` with a copy on retired unit ``move.unit`` has it on its new unit (or needs no
        copy): tell the clients (every reply), which read those copies there from now on."""
        below = min(upto, move.upto)
        if below <= move.below:
            return
        move.below = below
        self._counters = True  # the units' book changed: the next record holds it (journal_dir)
        if move.done:
            self._move_plans.pop(move.unit, None)
            logger.warning("storage unit %d is retired; each block it held a copy of has two copies again", move.unit)

    def _refilled(self, unit: int, upto: int) -> None:
        """Every block below ``upto`` that ``unit`` lost is on it again (or needs no copy): tell the clients, which
        read those blocks from it again."""
        book = self.state.lost
        below = min(upto, book.lost_below.get(unit, 0))
        if below <= book.refilled_below.get(unit, 0):
            return
        book.refilled_below[unit] = below
        self._counters = True  # the units' book changed: the next record holds it (journal_dir)
        restart = self.restarted_units.get(unit)
        if restart is not None:
            self.restarted_units[unit] = msgspec.structs.replace(restart, refilled_below=below)
        if below == book.lost_below[unit]:
            logger.warning("storage unit %d holds a copy of each of its blocks again", unit)

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
        """The whole-queue summary (see transfer_queue.ops.status); the caller holds ``lock``."""
        run = list(self.run_history) if run_history else list(self.run_history)[-1:]
        return queue_summary(
            self.state, metrics=self.metrics, clients=self.connections(), run=run, endpoints=self.endpoints
        )

    def summary(self, run_history: bool = False) -> dict[str, Any]:
        with self.lock:
            return self.summary_locked(run_history)

    def trace_start(self, max_events: int = DEFAULT_MAX_EVENTS) -> bool:
        """Start recording every answered request as a span (a trace already on goes on); returns whether it was
        off."""
        with self.lock:
            if self.requests.trace is not None:
                return False
            self.requests.trace = RequestTrace(max_events)
            return True

    def trace_stop(self) -> list[dict[str, Any]]:
        """Stop recording; returns the spans recorded (see :meth:`trace_events`)."""
        with self.lock:
            trace, self.requests.trace = self.requests.trace, None
            return [] if trace is None else trace.events()

    def trace_events(self) -> list[dict[str, Any]]:
        """The spans recorded so far (tracing goes on); empty when tracing is off."""
        with self.lock:
            return [] if self.requests.trace is None else self.requests.trace.events()

    def why_stuck(self) -> dict[str, Any]:
        """What every parked get_meta and put waits for (transfer_queue.ops.why_stuck)."""
        with self.lock:
            return why_stuck(self.state)

    def record_run_row(self, row: dict[str, Any]) -> None:
        with self.lock:
            self.run_history.append(numeric_row(row))


def _save_failed(directory: str, exc: BaseException | None) -> CheckpointError:
    """A disk failure of a save, typed (the previous checkpoint stays current)."""
    if isinstance(exc, CheckpointError):
        return exc
    logger.error("saving a checkpoint under %s failed: %r", directory, exc)
    return CheckpointError(
        f"saving the checkpoint under {directory} failed: {type(exc).__name__}: {exc}; the previous checkpoint "
        "stays current"
    )


def _next_batch(
    batch: RefillBatch,
    steps: Iterable[RefillStep],
    skip: Callable[[RefillStep], bool],
    waits: Callable[[RefillStep], bool],
) -> list[RefillStep]:
    """The next copies of a refill or a move: up to ``REFILL_BLOCKS`` blocks or ``REFILL_BYTES`` bytes of ``steps``,
    leaving out those ``skip`` says need no copy and stopping at the first that ``waits`` for a down unit (the blocks
    before it go now); ``batch.upto`` is set where the batch stopped."""
    taken: list[RefillStep] = []
    nbytes = 0
    for step in steps:
        if skip(step):
            continue
        if len(taken) == REFILL_BLOCKS or nbytes >= REFILL_BYTES or waits(step):
            batch.upto = step.block
            break
        taken.append(step)
        nbytes += step.nbytes
    return taken
