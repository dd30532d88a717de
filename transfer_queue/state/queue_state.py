"""QueueState: the queue's bookkeeping behind the controller, without Ray, sockets or a wire format.

The controller's request table (:class:`~transfer_queue.controller.requests.RequestTable`) decodes a wire request, calls
one of the methods here with plain Python and numpy values, and encodes what comes back. The bookkeeping lives in
small classes that this one composes:

- :class:`~transfer_queue.state.partition_table.PartitionTable`: the live partitions, the step ring, what was cleared;
- :class:`~transfer_queue.state.put_ledger.PutLedger`: puts between reserve and commit (idempotent commits by put id);
- :class:`~transfer_queue.state.delivery.Delivery`: leases, acknowledgements, hand-backs, dead letters;
- :class:`~transfer_queue.state.dp_rounds.DPRounds`: rounds shared by the ranks of a data-parallel world;
- :class:`~transfer_queue.state.waiting.WaitingRoom`: requests that cannot be served yet (park, retry, expire);
- :class:`~transfer_queue.state.kv_state.KvState`: keys, tags and single-row clears.

:meth:`QueueState.serve` answers a call at once or, when it cannot be served yet (rows not ready, the step ring
full), parks it; parked calls are retried when something they wait for changes and answered with a timeout error at
their deadline. Answers are domain values (:class:`~transfer_queue.metadata.BatchMeta`,
:class:`~transfer_queue.state.put_ledger.Reserved`, ...). Nothing here blocks, so one waiting reader never stalls
another client. Orders for storage units (:class:`DropBlocks`, :class:`DropPartition`) are queued in ``outbox`` for the
controller to send.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np

from transfer_queue.config import QueueConfig
from transfer_queue.errors import (
    InvalidRequest,
    PartitionCleared,
    SamplerError,
    TransferQueueError,
)
from transfer_queue.metadata import PartitionKey
from transfer_queue.samplers import BaseSampler, SamplerSpec, make_sampler
from transfer_queue.state.delivery import ROUND_OWNER, Delivery, TaskOptions
from transfer_queue.state.dp_rounds import DPRounds, GetMetaJob
from transfer_queue.state.kv_state import KvState
from transfer_queue.state.lost_rows import LostRowBook, lose_unit
from transfer_queue.state.partition import PartitionState
from transfer_queue.state.partition_table import PartitionTable
from transfer_queue.state.put_ledger import PutLedger, PutRequest, Reserved
from transfer_queue.state.reader import MetaReader
from transfer_queue.state.task_names import TaskNames
from transfer_queue.state.waiting import WAIT, Parked, Respond, Topic, Wait, WaitingRoom

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DropBlocks:
    """An order for a storage unit: drop these blocks of partition ``partition_uid`` (an aborted put, a replaced
    kv value), and every block below ``floor`` that no live put can still reference."""

    partition_uid: int
    block_ids: list[int]
    floor: int


@dataclass(frozen=True)
class DropPartition:
    """An order for a storage unit: drop partition ``partition_uid``; ``live_uids`` are those still open,
    ``max_uid`` the newest uid handed out, ``floor`` as in :class:`DropBlocks`."""

    partition_uid: int
    live_uids: list[int]
    max_uid: int
    floor: int


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
        # the registered samplers as given (cloudpickled), which a journal keeps: a replayed controller registers them
        # again (a spec that does not pickle is not kept: its clients register it again after a restart)
        self.sampler_specs: dict[str, bytes] = {}
        self.outbox: list[tuple[int, DropBlocks | DropPartition]] = []  # (storage unit, order) to send
        self.next_deadline = float("inf")  # earliest deadline of a parked request, open put or lease
        self.caller: Any = None  # the connection of the request being handled (None: unknown, e.g. unit tests)
        self.table = PartitionTable(config)
        self.waiting = WaitingRoom(config.max_waiting_requests, self._describe_failure)
        self.ledger = PutLedger(
            config, self.table, clock, self._wake, self._rows_changed, self._retry_putters, self._send_drop
        )
        self.delivery = Delivery(config, self.table, clock, self._wake, self._retry_getters)
        self.rounds = DPRounds()
        self.kv = KvState(self.table, self.ledger, self._retry_getters)
        self.lost = LostRowBook()  # rows lost with storage units that restarted empty (transfer_queue.state.lost_rows)
        self.task_names = TaskNames(config)  # declared ones, or those seen (a new one may warn)
        self.reader = MetaReader(
            config, self.table, self.ledger, self.delivery, self.rounds, self.sampler_for, self.task_names
        )

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
        self.task_names.announce(task_name)
        self.samplers[task_name] = self._checked(make_sampler(sampler))
        try:
            if self.config.journal_dir is not None:  # only a journal keeps them
                self.sampler_specs[task_name] = cloudpickle.dumps(sampler)
        except Exception as exc:  # a lock, a socket, a generator: kept in memory only
            self.sampler_specs.pop(task_name, None)
            logger.warning("the sampler of task %r does not pickle (%s): the journal does not keep it", task_name, exc)
        saved = self.pending_sampler_states.pop(task_name, None)
        if saved is not None:  # restored from a checkpoint: the task's sampler goes on where it was
            self.samplers[task_name].load_state_dict(saved)

    def sampler_for(self, task_name: str) -> BaseSampler:
        return self.samplers.get(task_name, self.default_sampler)

    # ---- serving one call ------------------------------------------------------------------------------------
    def serve(
        self,
        call: Callable[[], Any],
        respond: Respond,
        peer: Any = None,
        *,
        timeout: float = 0.0,
        wait_key: PartitionKey | None = None,
        kind: str = "",
    ) -> None:
        """Run ``call`` and answer through ``respond(value, error)``: now, or, if it returns a :class:`Wait`, later
        (parked under ``wait_key`` for up to ``timeout`` seconds; ``kind`` names it in errors).

        ``peer``: the connection the call came on (a :class:`~transfer_queue.wire.transport.Peer`; None: unknown, e.g.
        unit tests); :meth:`on_disconnect` of it drops its waits. Queue errors are answers; other exceptions are
        bugs and propagate to the controller's exception boundary.
        """
        self.caller = peer
        try:
            result = call()
        except TransferQueueError as exc:
            respond(None, exc)
            return
        finally:
            self.caller = None
        if not isinstance(result, Wait):
            respond(result, None)
            return
        now = self.clock()
        parked = Parked(result.job, respond, now, now + timeout, peer)
        topic, call_name = None, None
        if isinstance(result.job, GetMetaJob):
            topic, call_name = _topic(result.job), _call(result.job.owner, result.job.call_id)
        if self.waiting.park(parked, wait_key, kind, topic, call_name):
            self._wake(parked.deadline)
        elif isinstance(result.job, GetMetaJob):
            self.rounds.forget(result.job)

    def connected(self, owner: str, peer: Any) -> None:
        """Client ``owner`` speaks on connection ``peer``: when its last connection closes, its leases go back."""
        if owner and peer is not None:
            self.leases.connected(owner, peer)

    def unit_restarted(self, unit: int) -> dict[str, Any]:
        """Storage unit ``unit`` came back empty (Ray restarted it): the rows it held are lost (see
        :mod:`transfer_queue.state.lost_rows`); returns what was lost and the unit's ``lost_below``."""
        return lose_unit(self, unit)

    def owned_by(self, peer: Any, respond: Respond) -> Respond:
        """``respond`` that records ``peer`` as the owner of the put it answers with a reservation: the put is
        aborted if that connection closes before it commits."""

        def owned(value: Any, error: BaseException | None) -> None:
            if isinstance(value, Reserved) and value.put_id in self.open_puts:
                self.open_puts[value.put_id].owner = peer
            respond(value, error)

        return owned

    def clients_gone(self, owners: list[str]) -> None:
        """Clients ``owners`` are gone for good (their process died, as their supervisor knows): their leases go back
        at the next tick, without the disconnect grace. A lease a replayed journal restored has an owner that never
        connected to this controller, so no grace runs for it: without this its rows wait for the lease's deadline."""
        now = self.clock()
        for owner in owners:
            self.leases.orphaned[owner] = now
        self.rounds.owners_gone(owners)  # their replayed DP round counters no longer steer new clients
        self._wake(now)

    def _wake(self, deadline: float) -> None:
        self.next_deadline = min(self.next_deadline, deadline)

    def _send_drop(self, unit: int, uid: int, block_ids: list[int], floor: int) -> None:
        self.outbox.append((unit, DropBlocks(uid, block_ids, floor)))

    def tick(self) -> float | None:
        """Expire parked requests, abandoned puts and leases; returns the next deadline (``None``: none pending)."""
        now = self.clock()
        self.ledger.expire(now)
        self.waiting.expire(now, self._get_meta_timeout, self._put_timeout, self.rounds.forget)
        self.delivery.expire(now)
        deadlines = [self.leases.next_deadline(), *self.ledger.deadlines(), self.waiting.next_deadline()]
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
    def _retry_getters(self, key: PartitionKey, task_name: str | None = None) -> None:
        """Retry the getters of partition ``key`` (of task ``task_name`` only: its rows came back)."""
        wanted = None if task_name is None else (lambda topic: topic.custom or topic.task_name == task_name)
        self.waiting.retry_getters(key, self._serve_parked_getter, self.rounds.forget, wanted)

    def _rows_changed(self, key: PartitionKey, rows: np.ndarray | None = None, fields: list[str] | None = None) -> None:
        """Rows of partition ``key`` changed: retry its getters. A commit names its ``rows`` (local) and ``fields``:
        then only getters of a task whose fields it wrote, and that some of those rows now have all of, are tried,
        unless it was the partition's last write (getters whose fields every row has are then served what is left)."""
        part = self.table.partitions.get(key)
        if rows is None or fields is None or part is None:
            self._retry_getters(key)
            return
        written = set(fields)
        ended = part.sealed and not self.ledger.in_flight(part.uid)

        def wanted(topic: Topic) -> bool:
            if topic.custom or (ended and self.reader.finished(part, topic.task_name, topic.fields)):
                return True
            if topic.fields.isdisjoint(written):
                return False
            mask = part.field_mask(topic.fields)
            if mask < 0:
                return False
            produced = part.produced_mask[rows] & np.uint64(mask)
            return bool(np.any(produced == np.uint64(mask)))

        self.waiting.retry_getters(key, self._serve_parked_getter, self.rounds.forget, wanted)

    def _retry_putters(self) -> None:
        self.waiting.retry_putters(self._serve_parked_putter)

    def _serve_parked_getter(self, parked: Parked) -> Any:
        meta = self.reader.serve(parked.job)
        if meta is None:
            return WAIT
        # how long it waited for rows to be produced: callers tell queue overhead from upstream stages
        meta.extra["wait_s"] = self.clock() - parked.started
        return meta

    def _serve_parked_putter(self, parked: Parked) -> Any:
        reserved = self.ledger.try_reserve(parked.job)
        return WAIT if reserved is None else reserved

    @staticmethod
    def _describe_failure(job: Any, exc: Exception) -> BaseException:
        if isinstance(job, GetMetaJob):  # a bug in a task's sampler: only that task's getter hears of it
            return SamplerError(
                f"the sampler {type(job.sampler).__name__} of task {job.task_name!r} raised {type(exc).__name__}: {exc}"
            )
        return exc

    # ---- puts ----------------------------------------------------------------------------------------------
    def reserve(self, put: PutRequest) -> Reserved | Wait:
        """Reserve rows, bytes and storage blocks for ``put`` (or wait for room in the step ring or the budget)."""
        job = self.ledger.validate(put)
        reserved = self.ledger.try_reserve(job)
        return Wait(job) if reserved is None else reserved

    def _put_timeout(self, parked: Parked) -> BaseException:
        return self.ledger.timeout_error(parked.job[0], parked.deadline - parked.started)

    # ---- get_meta ------------------------------------------------------------------------------------------
    def get_meta(self, partition: Any, fields: list[str], batch_size: int, task_name: str, **options: Any) -> Any:
        """Serve a batch of ``task_name``'s rows of ``partition`` (a :class:`BatchMeta`), or a :class:`Wait` until
        enough are ready; ``options`` are :meth:`MetaReader.job`'s (sampler params, lease, owner, ...)."""
        job = self.reader.job(partition, fields, batch_size, task_name, connection=self.caller, **options)
        try:
            meta = self.reader.serve(job)
        except BaseException:
            self.rounds.forget(job)  # a call that failed took no round: the rank stays in step with its peers
            raise
        return Wait(job) if meta is None else meta

    def _get_meta_timeout(self, parked: Parked) -> BaseException:
        return self.reader.timeout_error(parked.job, parked.deadline - parked.started)

    def cancel_get_meta(self, owner: str, call_id: int) -> None:
        """The client gave up a get_meta: drop it if it still waits, else hand back what it was served."""
        if not owner or not call_id or owner == ROUND_OWNER:
            return
        self.waiting.withdraw(_call(owner, call_id), self.rounds.forget)  # never answered: the client stopped listening
        self.delivery.cancel(owner, call_id)

    def set_task_options(self, task_name: str, options: TaskOptions) -> None:
        self.delivery.check_task_name(task_name)
        self.task_names.announce(task_name)
        self.delivery.set_options(task_name, options)

    # ---- clear, reset, close -------------------------------------------------------------------------------
    def clear(self, partition: Any) -> None:
        """Clear a partition: its rows, leases, open puts and payload go (unknown or cleared: a no-op)."""
        key = self.table.check_key(partition)
        part = self.table.remove(key)
        if part is None:
            return  # never opened, or already cleared: it must not mark steps up to ``key`` as cleared
        for waiting in self.waiting.waited_on():  # waits for a step to open: fails if it now never can
            if not isinstance(waiting, int) or waiting in self.partitions or waiting == key:
                continue
            if waiting <= self.table.max_cleared_step:
                self._retry_getters(waiting)
        self.leases.drop_partition(part.uid)
        self.ledger.drop_partition(part)
        live, floor = sorted(other.uid for other in self.partitions.values()), self.ledger.block_floor()
        for unit in range(self.config.num_storage_units):
            self.outbox.append((unit, DropPartition(part.uid, live, self.table.next_uid - 1, floor)))
        self.rounds.drop_partition(key)
        self.events.forget_idle(self.followed_tasks())  # per-task metric series stay bounded
        for parked in self.waiting.take_getters(key):
            parked.respond(None, PartitionCleared(f"{part.name} was cleared while get_meta waited for it"))
        self._retry_putters()

    def followed_tasks(self) -> set[str]:
        """The task names some live partition follows."""
        return {task for part in self.partitions.values() for task in part.tasks}

    def reset_consumption(self, partition: Any, task_name: str | None) -> None:
        """Make ``task_name``'s rows (every task's with None) of ``partition`` (every partition's with None) ready
        again."""
        parts = list(self.partitions.values()) if partition is None else [self.table.known(partition)]
        for part in parts:
            part.reset_consumption(task_name)
            self.rounds.drop_partition(part.key, task_name)
            self._retry_getters(part.key, task_name)

    def close_partition(self, partition: Any) -> None:
        """No more puts to ``partition``: waiting readers get what is there."""
        part = self.table.known(partition)
        part.closed = True
        self._retry_getters(part.key)

    def kv_clear(self, partition: Any, keys: list[str] | None) -> None:
        """Clear ``keys`` of a kv partition, or (None) the whole partition."""
        if keys is None:
            self.clear(partition)
        else:
            self.kv.clear_keys(partition, keys)


def _topic(job: GetMetaJob) -> Topic:
    """What a parked get_meta waits for (see :class:`~transfer_queue.state.waiting.Topic`). Calls of one task, fields,
    batch size and built-in sampler, outside DP rounds, wait for the same thing: ``MetaReader.select`` makes them wait
    while fewer rows (or whole groups) are ready than the batch and the partition is not finished, whatever else they
    ask. A DP rank may be served by its round's first call; a user's sampler decides for itself."""
    custom = not job.sampler.uses_fast_path
    in_line = not custom and job.dp_group_id is None
    shape = (job.batch_size, job.whole_groups, id(job.sampler)) if in_line else ()
    return Topic(job.task_name, frozenset(job.fields), in_line, custom, shape)


def _call(owner: str, call_id: int) -> Hashable:
    """A client's name for a get_meta (what a cancel names); None when it has none."""
    return (owner, call_id) if owner and call_id and owner != ROUND_OWNER else None
