"""QueueState: the controller's request table over the queue's bookkeeping, without Ray or sockets.

The controller actor decodes a request and calls :meth:`QueueState.handle` with a ``respond`` callback. The request
table translates between the wire (:mod:`transfer_queue.protocol`: request structs, packed index arrays, MetaWire)
and the bookkeeping, which knows no wire format and lives in small classes:

- :class:`~transfer_queue.partition_table.PartitionTable`: the live partitions, the step ring, what was cleared;
- :class:`~transfer_queue.put_ledger.PutLedger`: puts between reserve and commit (idempotent commits by put id);
- :class:`~transfer_queue.delivery.Delivery`: leases, acknowledgements, hand-backs, dead letters;
- :class:`~transfer_queue.dp_rounds.DPRounds`: rounds shared by the ranks of a data-parallel world;
- :class:`~transfer_queue.waiting.WaitingRoom`: requests that cannot be served yet (park, retry, expire);
- :class:`~transfer_queue.kv_state.KvState`: keys, tags and single-row clears.

A handler answers at once or, when the request cannot be served yet (rows not ready, the step ring full), parks
it; parked requests are retried when something they wait for changes and answered with a timeout error at their
deadline. Nothing here blocks, so one waiting reader never stalls another client. Messages for storage units (drop
a cleared partition, drop an aborted put's blocks) are queued in ``outbox`` for the actor to send.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from transfer_queue import protocol as p
from transfer_queue.config import QueueConfig
from transfer_queue.delivery import ROUND_OWNER, Delivery, TaskOptions
from transfer_queue.dp_rounds import DPRounds, GetMetaJob
from transfer_queue.errors import (
    InvalidRequest,
    PartitionCleared,
    SamplerError,
    TransferQueueError,
)
from transfer_queue.kv_state import KvState
from transfer_queue.lost_rows import LostRowBook, lose_unit, lost_rows_report
from transfer_queue.metadata import PartitionKey
from transfer_queue.partition import PartitionState
from transfer_queue.partition_table import PartitionTable
from transfer_queue.put_ledger import PutLedger, PutRequest, Reserved
from transfer_queue.reader import MetaReader
from transfer_queue.samplers import BaseSampler, SamplerSpec, make_sampler
from transfer_queue.waiting import WAIT, Parked, Respond, Wait, WaitingRoom

_unpack = p.unpack_indexes


class QueueState:
    """Partitions, the step ring, samplers, open puts, leases and parked requests of one queue."""

    def __init__(
        self, config: QueueConfig, sampler: SamplerSpec | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.config = config
        self.clock = clock
        self.default_sampler = self._checked(make_sampler(sampler))
        self.samplers: dict[str, BaseSampler] = {}
        self.pending_sampler_states: dict[str, dict[str, Any]] = {}  # restored, for tasks not registered again yet
        self.outbox: list[tuple[int, Any]] = []  # (storage unit, request) to send
        self.next_deadline = float("inf")  # earliest deadline of a parked request, open put or lease
        self.caller: Any = None  # the connection of the request being handled (None: unknown, e.g. unit tests)
        self.table = PartitionTable(config)
        self.waiting = WaitingRoom(config.max_waiting_requests, self._describe_failure)
        self.ledger = PutLedger(
            config, self.table, clock, self._wake, self._retry_getters, self._retry_putters, self._send_drop
        )
        self.delivery = Delivery(config, self.table, clock, self._wake, self._retry_getters)
        self.rounds = DPRounds()
        self.kv = KvState(self.table, self.ledger, self._retry_getters)
        self.lost = LostRowBook()  # rows lost with storage units that restarted empty (transfer_queue.lost_rows)
        self.reader = MetaReader(config, self.table, self.ledger, self.delivery, self.rounds, self.sampler_for)
        self._handlers: dict[type, Callable[[Any], Any]] = {
            p.Reserve: self._on_reserve,
            p.Commit: lambda req: p.MetaWire.from_meta(self.ledger.commit(req.put_id)),
            p.Abort: lambda req: self.ledger.abort(req.put_id),
            p.GetMeta: self._on_get_meta,
            p.Release: lambda req: self.delivery.release(
                req.partition_uid, req.task_name, _unpack(req.global_indexes), req.owner
            ),
            p.Ack: lambda req: self.delivery.ack(
                req.partition_uid, req.task_name, _unpack(req.global_indexes), req.owner, req.explicit
            ),
            p.CancelGetMeta: self._on_cancel_get_meta,
            p.SetTaskOptions: self._on_set_task_options,
            p.DeadLetters: lambda req: self.table.known(req.partition).dead_letters(req.task_name),
            p.Clear: lambda req: self.clear(req.partition),
            p.ResetConsumption: self._on_reset_consumption,
            p.ProductionStatus: lambda req: self.table.known(req.partition).production_status(),
            p.ConsumptionStatus: lambda req: self.table.known(req.partition).consumption_status(req.task_name),
            p.ListPartitions: lambda req: list(self.partitions),
            p.ClosePartition: self._on_close_partition,
            p.KvLookup: lambda req: p.MetaWire.from_meta(self.kv.lookup(req.partition, req.keys, req.fields)),
            p.KvList: lambda req: self.kv.list_keys(req.partition, req.with_tags),
            p.KvClear: self._on_kv_clear,
            p.KvTag: lambda req: p.MetaWire.from_meta(self.kv.tag(req.partition, req.keys, req.values)),
            p.SetCustomMeta: lambda req: self.kv.set_custom_meta(
                req.partition_uid, _unpack(req.global_indexes), req.values
            ),
            p.GetCustomMeta: lambda req: self.kv.get_custom_meta(req.partition_uid, _unpack(req.global_indexes)),
            p.ClearSamples: lambda req: self.kv.clear_samples(req.partition_uid, _unpack(req.global_indexes)),
            p.LostRows: lambda req: lost_rows_report(self, self.table.known(req.partition)),
        }

    # ---- the bookkeeping's state, by its former names (the controller, status, snapshots and tests read it) ---
    partitions = property(lambda self: self.table.partitions)
    open_puts = property(lambda self: self.ledger.open_puts)
    committed = property(lambda self: self.ledger.committed)
    down_units = property(lambda self: self.ledger.down_units)
    getters = property(lambda self: self.waiting.getters)
    putters = property(lambda self: self.waiting.putters)
    leases = property(lambda self: self.delivery.leases)
    task_options = property(lambda self: self.delivery.task_options)
    events = property(lambda self: self.delivery.events)
    auto_rounds = property(lambda self: self.rounds.auto_rounds)
    max_cleared_step = property(
        lambda self: self.table.max_cleared_step, lambda self, v: setattr(self.table, "max_cleared_step", v)
    )
    cleared_names = property(
        lambda self: self.table.cleared_names, lambda self, v: setattr(self.table, "cleared_names", v)
    )
    bytes_held = property(lambda self: self.ledger.bytes_held, lambda self, v: setattr(self.ledger, "bytes_held", v))
    _next_uid = property(lambda self: self.table.next_uid, lambda self, v: setattr(self.table, "next_uid", v))
    _next_put = property(lambda self: self.ledger.next_put, lambda self, v: setattr(self.ledger, "next_put", v))
    _next_block = property(lambda self: self.ledger.next_block, lambda self, v: setattr(self.ledger, "next_block", v))

    def _by_uid(self, uid: int) -> PartitionState | None:
        return self.table.by_uid(uid)

    def options(self, task_name: str) -> TaskOptions:
        return self.delivery.options(task_name)

    # ---- samplers ------------------------------------------------------------------------------------------
    def _checked(self, sampler: BaseSampler) -> BaseSampler:
        n = getattr(sampler, "num_n_samples", None)
        if n is not None and n != self.config.num_n_samples:
            raise InvalidRequest(
                f"{type(sampler).__name__}(num_n_samples={n}) does not match the queue's num_n_samples="
                f"{self.config.num_n_samples}"
            )
        return sampler

    def register_sampler(self, task_name: str, sampler: SamplerSpec) -> None:
        if not isinstance(task_name, str) or not task_name:
            raise InvalidRequest(f"task_name must be a non-empty str, got {task_name!r}")
        self.samplers[task_name] = self._checked(make_sampler(sampler))
        saved = self.pending_sampler_states.pop(task_name, None)
        if saved is not None:  # restored from a checkpoint: the task's sampler goes on where it was
            self.samplers[task_name].load_state_dict(saved)

    def sampler_for(self, task_name: str) -> BaseSampler:
        return self.samplers.get(task_name, self.default_sampler)

    # ---- dispatch ------------------------------------------------------------------------------------------
    def handle(self, request: Any, respond: Respond, peer: Any = None) -> None:
        """Answer ``request`` through ``respond(value, error)``, now or (for waits) later.

        ``peer``: the connection it came on (a :class:`~transfer_queue.transport.Peer`; None: unknown, e.g. unit
        tests). Requests that name an ``owner`` tie that connection to their client; :meth:`on_disconnect` of it
        drops its waits and, after a grace, aborts its open puts and hands its leases back.
        """
        owner = getattr(request, "owner", "")
        if owner and peer is not None:
            self.leases.connected(owner, peer)
        handler = self._handlers.get(type(request))
        if handler is None:
            respond(None, InvalidRequest(f"the controller does not handle {type(request).__name__} requests"))
            return
        if isinstance(request, p.Reserve) and peer is not None:
            respond = self._owned_by(peer, respond)
        self.caller = peer
        try:
            result = handler(request)
        except TransferQueueError as exc:
            respond(None, exc)
            return
        finally:
            self.caller = None
        if not isinstance(result, Wait):
            respond(result, None)
            return
        now = self.clock()
        parked = Parked(result.job, respond, now, now + request.timeout, peer)
        key = None if isinstance(request, p.Reserve) else request.partition
        if self.waiting.park(parked, key, type(request).__name__):
            self._wake(parked.deadline)
        elif isinstance(result.job, GetMetaJob):
            self.rounds.forget(result.job)

    def unit_restarted(self, unit: int) -> dict[str, Any]:
        """Storage unit ``unit`` came back empty (Ray restarted it): the rows it held are lost (see
        :mod:`transfer_queue.lost_rows`); returns what was lost and the unit's ``lost_below``."""
        return lose_unit(self, unit)

    def _owned_by(self, peer: Any, respond: Respond) -> Respond:
        """``respond`` that records ``peer`` as the owner of the put it answers with a reservation."""

        def owned(value: Any, error: BaseException | None) -> None:
            if isinstance(value, p.Reservation) and value.put_id in self.open_puts:
                self.open_puts[value.put_id].owner = peer
            respond(value, error)

        return owned

    def _wake(self, deadline: float) -> None:
        self.next_deadline = min(self.next_deadline, deadline)

    def _send_drop(self, unit: int, uid: int, block_ids: list[int], floor: int) -> None:
        self.outbox.append((unit, p.DropBlocks(uid, block_ids, floor)))

    def tick(self) -> float | None:
        """Expire parked requests, abandoned puts and leases; returns the next deadline (``None``: none pending)."""
        now = self.clock()
        self.ledger.expire(now)
        self.waiting.expire(now, self._get_meta_timeout, self._put_timeout, self.rounds.forget)
        self.delivery.expire(now)
        deadlines = [self.leases.next_deadline(), *self.ledger.deadlines(), *self.waiting.deadlines()]
        self.next_deadline = min(deadlines, default=float("inf"))
        return None if self.next_deadline == float("inf") else self.next_deadline

    def on_disconnect(self, peer: Any) -> None:
        """Connection ``peer`` closed (its process died, or it closed its client): its parked requests are dropped
        (nobody reads their answer) and its automatic DP round counters forgotten; its open puts are aborted after
        ``disconnect_grace`` (it may still commit over a new connection), and if it was its client's last
        connection, the client's leases go back after the same grace."""
        deadline = self.clock() + self.config.disconnect_grace
        self.ledger.peer_closed(peer, deadline)
        self.rounds.drop_caller(peer)
        self.waiting.drop_peer(peer, self.rounds.forget)
        if self.leases.disconnected(peer, deadline) is not None:
            self._wake(deadline)

    # ---- retries (the waiting room's one exception boundary runs them) ---------------------------------------
    def _retry_getters(self, key: PartitionKey) -> None:
        self.waiting.retry_getters(key, self._serve_parked_getter, self.rounds.forget)

    def _retry_putters(self) -> None:
        self.waiting.retry_putters(self._serve_parked_putter)

    def _serve_parked_getter(self, parked: Parked) -> Any:
        meta = self.reader.serve(parked.job)
        if meta is None:
            return WAIT
        wire = p.MetaWire.from_meta(meta)
        # how long it waited for rows to be produced: callers tell queue overhead from upstream stages
        wire.extra["wait_s"] = self.clock() - parked.started
        return wire

    def _serve_parked_putter(self, parked: Parked) -> Any:
        reserved = self.ledger.try_reserve(parked.job)
        return WAIT if reserved is None else _reservation(reserved)

    @staticmethod
    def _describe_failure(job: Any, exc: Exception) -> BaseException:
        if isinstance(job, GetMetaJob):  # a bug in a task's sampler: only that task's getter hears of it
            return SamplerError(
                f"the sampler {type(job.sampler).__name__} of task {job.task_name!r} raised {type(exc).__name__}: {exc}"
            )
        return exc

    # ---- puts ----------------------------------------------------------------------------------------------
    def _on_reserve(self, req: p.Reserve) -> Any:
        put = PutRequest(
            req.partition,
            req.num_rows,
            req.fields,
            req.nbytes,
            None if req.group_ids is None else _unpack(req.group_ids),
            req.target_uid,
            None if req.target_indexes is None else _unpack(req.target_indexes),
            None if req.lengths is None else _unpack(req.lengths),
            req.keys,
            req.timeout,
            req.length_fields,
        )
        job = self.ledger.validate(put)
        reserved = self.ledger.try_reserve(job)
        return Wait(job) if reserved is None else _reservation(reserved)

    def _put_timeout(self, parked: Parked) -> BaseException:
        return self.ledger.timeout_error(parked.job[0], parked.deadline - parked.started)

    # ---- get_meta ------------------------------------------------------------------------------------------
    def _on_get_meta(self, req: p.GetMeta) -> Any:
        job = self.reader.job(
            req.partition,
            req.fields,
            req.batch_size,
            req.task_name,
            sampler_params=req.sampler_params,
            get_n_samples=req.get_n_samples,
            timeout=req.timeout,
            lease_s=req.lease_s,
            owner=req.owner,
            call_id=req.call_id,
            peek=req.peek,
            connection=self.caller,
        )
        try:
            meta = self.reader.serve(job)
        except BaseException:
            self.rounds.forget(job)  # a call that failed took no round: the rank stays in step with its peers
            raise
        return Wait(job) if meta is None else p.MetaWire.from_meta(meta)

    def _get_meta_timeout(self, parked: Parked) -> BaseException:
        return self.reader.timeout_error(parked.job, parked.deadline - parked.started)

    def _on_cancel_get_meta(self, req: p.CancelGetMeta) -> None:
        """The client gave up a get_meta: drop it if it still waits, else hand back what it was served."""
        if not req.owner or not req.call_id or req.owner == ROUND_OWNER:
            return
        # never answered: the client stopped listening
        self.waiting.drop_getters(
            lambda parked: parked.job.owner == req.owner and parked.job.call_id == req.call_id, self.rounds.forget
        )
        self.delivery.cancel(req.owner, req.call_id)

    def _on_set_task_options(self, req: p.SetTaskOptions) -> None:
        self.delivery.check_task_name(req.task_name)
        self.delivery.set_options(req.task_name, TaskOptions(req.ack, req.lease_s, req.max_deliveries))

    # ---- clear, reset, close -------------------------------------------------------------------------------
    def clear(self, partition: Any) -> None:
        """Clear a partition: its rows, leases, open puts and payload go (unknown or cleared: a no-op)."""
        key = self.table.check_key(partition)
        part = self.table.remove(key)
        if part is None:
            return  # never opened, or already cleared: it must not mark steps up to ``key`` as cleared
        for waiting in [k for k in self.getters if k != key]:
            if waiting not in self.partitions:  # waits for a partition to open: fails if it now never can
                self._retry_getters(waiting)
        self.leases.drop_partition(part.uid)
        self.ledger.drop_partition(part)
        live, floor = sorted(other.uid for other in self.partitions.values()), self.ledger.block_floor()
        for unit in range(self.config.num_storage_units):
            self.outbox.append((unit, p.DropPartition(part.uid, live, self.table.next_uid - 1, floor)))
        self.rounds.drop_partition(key)
        for parked in self.waiting.take_getters(key):
            parked.respond(None, PartitionCleared(f"{part.name} was cleared while get_meta waited for it"))
        self._retry_putters()

    def _on_reset_consumption(self, req: p.ResetConsumption) -> None:
        parts = list(self.partitions.values()) if req.partition is None else [self.table.known(req.partition)]
        for part in parts:
            part.reset_consumption(req.task_name)
            self.rounds.drop_partition(part.key, req.task_name)
            self._retry_getters(part.key)

    def _on_close_partition(self, req: p.ClosePartition) -> None:
        part = self.table.known(req.partition)
        part.closed = True
        self._retry_getters(part.key)

    def _on_kv_clear(self, req: p.KvClear) -> None:
        if req.keys is None:
            self.clear(req.partition)
        else:
            self.kv.clear_keys(req.partition, req.keys)


def _reservation(reserved: Reserved) -> p.Reservation:
    return p.Reservation(
        reserved.put_id,
        reserved.partition_uid,
        p.pack_indexes(reserved.global_indexes),
        p.pack_indexes(reserved.group_ids),
        [p.Placement(*place) for place in reserved.placements],
    )
