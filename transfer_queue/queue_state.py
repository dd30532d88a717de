"""QueueState: the controller's state and request handlers, without Ray or sockets.

The controller actor decodes a request and calls :meth:`QueueState.handle` with a ``respond`` callback. A handler
either answers at once or, when the request cannot be served yet (rows not ready, the step ring full), parks it;
parked requests are retried when something they wait for changes (a commit, a clear, a release) and answered with
a timeout error at their deadline. Nothing here blocks, so one waiting reader never stalls another client.

Delivery (see docs/architecture.md "Delivery"): rows a get_meta hands out are leased to the calling client (its
``owner``), not consumed; an ``Ack`` (sent by the client after ``get_data``, or by ``ack``) acknowledges them; a
lease that expires, or whose client's connections all closed, hands its rows back first in line, and after
``max_deliveries`` to the task's dead letters. The leases themselves live in :mod:`transfer_queue.delivery`.

Messages for storage units (drop a cleared partition, drop an aborted put's blocks) are queued in ``outbox``
for the actor to send.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer_queue import protocol as p
from transfer_queue.config import QueueConfig
from transfer_queue.delivery import ROUND_OWNER, Lease, LeaseBook, TaskOptions, check_lease_s
from transfer_queue.errors import (
    FieldAlreadyProduced,
    GetMetaTimeout,
    IncompleteGroups,
    InvalidRequest,
    NotLeased,
    PartitionCleared,
    PutExpired,
    QueueBusy,
    QueueFull,
    SamplerError,
    StaleBatchMeta,
    TransferQueueError,
    UnknownField,
    UnknownKey,
    UnknownPartition,
)
from transfer_queue.lost_rows import LostRowBook, lose_unit, lost_rows_report
from transfer_queue.metadata import BatchMeta, PartitionKey
from transfer_queue.metrics import QueueEvents
from transfer_queue.partition import (
    AVAILABLE,
    COMMITTED,
    CONSUMED,
    DEAD,
    LEASED,
    DPRound,
    PartitionState,
    check_custom_meta,
    describe_partition,
    unique_in_order,
)
from transfer_queue.placement import place_rows
from transfer_queue.samplers import BaseSampler, SamplerSpec, make_sampler
from transfer_queue.selection import ReadyView, checked_shares, select_with_user_sampler

logger = logging.getLogger(__name__)

Respond = Callable[[Any, BaseException | None], None]
WAIT = object()  # an attempt's answer: not possible yet, retry later
MAX_ROWS_PER_PUT = 1 << 24  # bounds the bookkeeping one request can make the controller allocate
MAX_DP_SIZE = 1 << 16  # bounds the shares one DP round is split into
COMMITS_REMEMBERED = 4096  # recent commits whose meta a retried commit (its reply was lost) gets again
# Bounds on what a long run leaves behind (defect 8). A cleared name forgotten: get_meta on it waits for a new put
# (and times out) instead of failing at once. A DP round forgotten: a peer that lags more than this many rounds
# behind opens it anew (and gets other rows).
CLEARED_NAMES_REMEMBERED = 4096
MAX_ROUNDS_PER_PARTITION = 1024


@dataclass
class Wait:
    """A handler's answer: park ``job`` and retry it when something changes."""

    job: Any


@dataclass
class OpenPut:
    """A put between reserve and commit: its rows are reserved, invisible, and freed if it never commits."""

    put_id: int
    key: PartitionKey
    uid: int
    rows: np.ndarray
    names: list[str]
    mask: int
    new_rows: np.ndarray  # bool per row: created by this put (else an existing row gets new fields)
    blocks: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray | None
    nbytes: int
    deadline: float
    keys: list[str] | None = None
    owner: Any = None  # the connection (transport Peer) that reserved it: its close aborts the put


@dataclass
class GetMetaJob:
    """A validated get_meta, retried until it is served or times out."""

    request: p.GetMeta
    sampler: BaseSampler
    params: dict[str, Any]
    whole_groups: bool
    dp_size: int
    dp_rank: int
    dp_group_id: str | None
    auto_round: tuple[AutoRoundCounter, int] | None = None  # (counter, round) when numbered for it


# An automatic DP round counter: (partition, task, dp_rank, caller), the caller being ``world_rank`` when given,
# else the connection: the TP peers of one dp_rank count their own calls, so their k-th calls meet in round k.
AutoRoundCounter = tuple[PartitionKey, str, int, Any]


@dataclass
class Parked:
    job: Any
    respond: Respond
    started: float
    deadline: float
    peer: Any = None  # the connection it came on: a parked request whose connection closed is dropped


@dataclass
class Committed:
    """A commit remembered for a while, so a retried commit (its reply was lost) gets the same meta."""

    wire: p.MetaWire
    uid: int
    until: float


class QueueState:
    """Partitions, the step ring, samplers, open puts and parked requests of one queue."""

    def __init__(
        self, config: QueueConfig, sampler: SamplerSpec | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.config = config
        self.clock = clock
        self.default_sampler = self._checked(make_sampler(sampler))
        self.samplers: dict[str, BaseSampler] = {}
        self.partitions: dict[PartitionKey, PartitionState] = {}
        self.max_cleared_step = -1
        self.cleared_names: dict[str, None] = {}  # the latest cleared string partitions, oldest first (bounded)
        self.open_puts: dict[int, OpenPut] = {}
        self.getters: dict[PartitionKey, list[Parked]] = {}
        self.putters: list[Parked] = []
        self.down_units: set[int] = set()  # storage units the controller lost its connection to: placement skips them
        self.outbox: list[tuple[int, Any]] = []  # (storage unit, request) to send
        self.bytes_held = 0
        self.next_deadline = float("inf")  # earliest deadline of a parked request or open put
        self.auto_rounds: dict[AutoRoundCounter, int] = {}
        self.leases = LeaseBook()
        self.task_options: dict[str, TaskOptions] = {}
        self.committed: dict[int, Committed] = {}  # put id -> its commit, oldest first
        self.pending_sampler_states: dict[str, dict[str, Any]] = {}  # restored, for tasks not registered again yet
        self.caller: Any = None  # the connection of the request being handled (None: unknown, e.g. unit tests)
        self.events = QueueEvents()  # the metrics hook: lease expiries, re-deliveries (transfer_queue.metrics)
        self.lost = LostRowBook()  # rows lost with storage units that restarted empty (transfer_queue.lost_rows)
        self._next_uid = 1
        self._next_put = 1
        self._next_block = 0
        self._handlers: dict[type, Callable[[Any], Any]] = {
            p.Reserve: self._on_reserve,
            p.Commit: self._on_commit,
            p.Abort: self._on_abort,
            p.GetMeta: self._on_get_meta,
            p.Release: self._on_release,
            p.Ack: self._on_ack,
            p.CancelGetMeta: self._on_cancel_get_meta,
            p.SetTaskOptions: self._on_set_task_options,
            p.DeadLetters: self._on_dead_letters,
            p.Clear: self._on_clear,
            p.ResetConsumption: self._on_reset_consumption,
            p.ProductionStatus: self._on_production_status,
            p.ConsumptionStatus: self._on_consumption_status,
            p.ListPartitions: self._on_list_partitions,
            p.ClosePartition: self._on_close_partition,
            p.KvLookup: self._on_kv_lookup,
            p.KvList: self._on_kv_list,
            p.KvClear: self._on_kv_clear,
            p.KvTag: self._on_kv_tag,
            p.SetCustomMeta: self._on_set_custom_meta,
            p.GetCustomMeta: self._on_get_custom_meta,
            p.ClearSamples: self._on_clear_samples,
            p.LostRows: lambda req: lost_rows_report(self, self._known(req.partition)),
        }

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
        if isinstance(result, Wait):
            waiting = len(self.putters) + sum(map(len, self.getters.values()))
            if waiting >= self.config.max_waiting_requests:
                if isinstance(result.job, GetMetaJob):
                    self._forget_auto_round(result.job)
                respond(
                    None,
                    QueueBusy(
                        f"{waiting} requests are waiting in the controller (max_waiting_requests="
                        f"{self.config.max_waiting_requests}); this {type(request).__name__} was refused, not parked"
                    ),
                )
                return
            now = self.clock()
            parked = Parked(result.job, respond, now, now + request.timeout, peer)
            self.next_deadline = min(self.next_deadline, parked.deadline)
            if isinstance(request, p.Reserve):
                self.putters.append(parked)
            else:
                self.getters.setdefault(request.partition, []).append(parked)
        else:
            respond(result, None)

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

    def tick(self) -> float | None:
        """Expire parked requests and abandoned puts; returns the next deadline (``None``: nothing pending)."""
        now = self.clock()
        for put in [put for put in self.open_puts.values() if put.deadline <= now]:
            logger.warning("aborting put %d to %s: its client did not commit in time", put.put_id, put.key)
            self._abort(put)
        for key in list(self.getters):
            keep = []
            for parked in self.getters[key]:
                if parked.deadline <= now:
                    self._forget_auto_round(parked.job)
                    parked.respond(None, self._get_meta_timeout(parked))
                else:
                    keep.append(parked)
            if keep:
                self.getters[key] = keep
            else:
                del self.getters[key]
        keep = []
        for parked in self.putters:
            if parked.deadline <= now:
                parked.respond(None, self._put_timeout(parked))
            else:
                keep.append(parked)
        self.putters = keep
        # rows handed back go in front of the ready ones: the latest lease first, so the oldest ends up in front
        for lease in reversed(self.leases.expired(now)):
            self._give_back(lease, "lease expired")
        for owner in self.leases.take_orphans(now):
            for lease in reversed(self.leases.of_owner(owner)):
                self._give_back(lease, "client disconnected")
        while self.committed:
            put_id, done = next(iter(self.committed.items()))
            if done.until > now:
                break
            del self.committed[put_id]
        deadlines = [self.leases.next_deadline()]
        deadlines += [put.deadline for put in self.open_puts.values()]
        deadlines += [w.deadline for ws in self.getters.values() for w in ws]
        deadlines += [w.deadline for w in self.putters]
        self.next_deadline = min(deadlines, default=float("inf"))
        return None if self.next_deadline == float("inf") else self.next_deadline

    def _forget_auto_round(self, job: GetMetaJob) -> None:
        """A rank's auto-numbered round timed out: its next call takes the same round number again, so the rank
        stays in step with its peers."""
        if job.auto_round is not None:
            counter, number = job.auto_round
            if self.auto_rounds.get(counter) == number + 1:
                self.auto_rounds[counter] = number

    def _retry_getters(self, key: PartitionKey) -> None:
        waiting = self.getters.pop(key, [])
        still = []
        for parked in waiting:
            try:
                result = self._try_get_meta(parked.job)
            except TransferQueueError as exc:
                self._forget_auto_round(parked.job)
                parked.respond(None, exc)
                continue
            except Exception as exc:  # a bug in a task's sampler: only that task's getter hears of it
                job = parked.job
                self._forget_auto_round(job)
                logger.exception("the sampler of task %r failed serving a waiting get_meta", job.request.task_name)
                parked.respond(
                    None,
                    SamplerError(
                        f"the sampler {type(job.sampler).__name__} of task {job.request.task_name!r} raised "
                        f"{type(exc).__name__}: {exc}"
                    ),
                )
                continue
            if result is WAIT:
                still.append(parked)
            else:
                # how long it waited for rows to be produced: callers tell queue overhead from upstream stages
                result.extra["wait_s"] = self.clock() - parked.started
                parked.respond(result, None)
        if still:
            self.getters.setdefault(key, []).extend(still)

    def _retry_putters(self) -> None:
        waiting, self.putters = self.putters, []
        for parked in waiting:
            try:
                result = self._open_and_reserve(parked.job)
            except TransferQueueError as exc:
                parked.respond(None, exc)
                continue
            if result is WAIT:
                self.putters.append(parked)
            else:
                parked.respond(result, None)

    # ---- partitions ----------------------------------------------------------------------------------------
    def _check_key(self, key: Any) -> PartitionKey:
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise InvalidRequest(f"a partition is an int global_step or a str partition_id, got {key!r}")
        if isinstance(key, int) and key < 0:
            raise InvalidRequest(f"global_step must be >= 0, got {key}")
        if isinstance(key, int) and key >= (limit := (1 << 63) // self.config.rows_per_step):
            raise InvalidRequest(f"global_step must be < {limit} (its global indexes must fit in int64), got {key}")
        if isinstance(key, str) and not key:
            raise InvalidRequest("partition_id must be a non-empty str")
        return key

    def _live(self, key: PartitionKey, reopen: bool = False) -> PartitionState | None:
        """The live partition, ``None`` if not opened yet; raises if it was cleared or is behind the window.

        ``reopen``: a put may open a cleared string partition again (a step, once cleared, stays cleared).
        """
        part = self.partitions.get(key)
        if part is not None:
            return part
        if isinstance(key, int) and key <= self.max_cleared_step:
            steps = sorted(k for k in self.partitions if isinstance(k, int))
            raise PartitionCleared(
                f"global_step={key} was cleared or lies behind the live window (steps up to {self.max_cleared_step} "
                f"were cleared; live steps: {steps})"
            )
        if isinstance(key, str) and key in self.cleared_names and not reopen:
            raise PartitionCleared(f"partition_id={key!r} was cleared")
        return None

    def _known(self, key: Any) -> PartitionState:
        key = self._check_key(key)
        part = self.partitions.get(key)
        if part is None:
            live = sorted(self.partitions, key=str)
            raise UnknownPartition(f"{describe_partition(key)} not found; live partitions: {live}")
        return part

    def _open(self, key: PartitionKey, keyed: bool) -> PartitionState | None:
        """Open a partition for a put; ``None`` when the step ring is full (the put waits)."""
        if isinstance(key, int):
            live_steps = [k for k in self.partitions if isinstance(k, int)]
            if len(live_steps) >= self.config.num_global_batch:
                return None
            capacity = self.config.rows_per_step
            base = key * capacity
        else:
            capacity, base = None, 0
        part = PartitionState(
            key,
            self._next_uid,
            capacity,
            self.config.num_n_samples,
            base,
            keyed=keyed,
            max_fields=self.config.max_fields,
            promote_jagged=self.config.promote_jagged,
        )
        self._next_uid += 1
        self.partitions[key] = part
        return part

    @property
    def _byte_budget(self) -> int:
        return self.config.storage_unit_bytes * self.config.num_storage_units

    def _by_uid(self, uid: int) -> PartitionState | None:
        return next((part for part in self.partitions.values() if part.uid == uid), None)

    # ---- puts ----------------------------------------------------------------------------------------------
    def _on_reserve(self, req: p.Reserve) -> Any:
        key = self._check_key(req.partition)
        if not isinstance(req.num_rows, int) or req.num_rows < 1:
            raise InvalidRequest(f"a put needs at least one row, got num_rows={req.num_rows}")
        if req.num_rows > MAX_ROWS_PER_PUT:
            raise InvalidRequest(f"a put holds at most {MAX_ROWS_PER_PUT} rows, got num_rows={req.num_rows}; split it")
        if not req.fields:
            raise InvalidRequest("a put needs at least one field")
        if not 0 < req.timeout < float("inf"):
            raise InvalidRequest(f"timeout must be a finite number of seconds > 0, got {req.timeout}")
        if req.nbytes < 0:
            raise InvalidRequest(f"nbytes must be >= 0, got {req.nbytes}")
        if req.nbytes > self._byte_budget:
            raise QueueFull(
                f"a put of {req.nbytes} bytes can never fit: the storage units hold {self._byte_budget} bytes in all"
            )
        group_ids = None if req.group_ids is None else p.unpack_indexes(req.group_ids)
        lengths = self._cell_lengths(req)
        if req.keys is not None and (len(req.keys) != req.num_rows or len(set(req.keys)) != len(req.keys)):
            raise InvalidRequest(f"a put by key needs {req.num_rows} distinct keys, got {len(req.keys)}")
        n = self.config.num_n_samples
        if req.target_uid is None and req.keys is None and group_ids is None and req.num_rows % n:
            raise IncompleteGroups(
                f"a put of {req.num_rows} rows without group_ids must hold whole groups of num_n_samples={n} "
                f"(got {req.num_rows % n} rows too many); pass group_ids to spread a group over several puts"
            )
        part = self._live(key, reopen=req.target_uid is None)
        if part is not None and req.target_uid is None:  # validate against what the partition holds before waiting
            self._check_use(part, req.keys is not None)
            part.check_schema(req.fields)
            part.check_room(req.num_rows)
        job = (req, group_ids, lengths)
        result = self._open_and_reserve(job)
        return Wait(job) if result is WAIT else result

    @staticmethod
    def _cell_lengths(req: p.Reserve) -> np.ndarray | None:
        """The put's lengths as a (rows x fields) matrix in the order of ``req.fields``: what each cell it writes
        adds to its row's length (a per-row sum is put on the put's first field)."""
        if req.lengths is None:
            return None
        flat = p.unpack_indexes(req.lengths)
        names = list(req.fields)
        cells = np.zeros((req.num_rows, len(names)), dtype=np.int64)
        if req.length_fields is None:
            if len(flat) != req.num_rows:
                raise InvalidRequest(f"lengths has {len(flat)} entries; the put has {req.num_rows} rows")
            cells[:, 0] = flat
            return cells
        unknown = [n for n in req.length_fields if n not in req.fields]
        if unknown or len(set(req.length_fields)) != len(req.length_fields):
            raise InvalidRequest(f"length_fields {req.length_fields} must name distinct fields of the put {names}")
        if len(flat) != req.num_rows * len(req.length_fields):
            raise InvalidRequest(
                f"lengths has {len(flat)} entries; {req.num_rows} rows x {len(req.length_fields)} length_fields "
                f"need {req.num_rows * len(req.length_fields)}"
            )
        cells[:, [names.index(n) for n in req.length_fields]] = flat.reshape(req.num_rows, len(req.length_fields))
        return cells

    def _open_and_reserve(self, job: tuple[p.Reserve, np.ndarray | None, np.ndarray | None]) -> Any:
        req, group_ids, lengths = job
        if req.target_uid is not None:
            return self._reserve_write(req, req.partition, lengths)
        key = req.partition
        if self.bytes_held + req.nbytes > self._byte_budget:
            return WAIT
        part = self._live(key, reopen=True)
        opened = part is None
        part = part or self._open(key, req.keys is not None)
        if part is None:
            return WAIT
        try:
            reservation = self._reserve_rows(part, req, group_ids, lengths)
        except TransferQueueError:
            if opened:  # refused before it took a row: leave no empty partition (or ring slot) behind
                del self.partitions[key]
            raise
        if isinstance(key, str):
            self.cleared_names.pop(key, None)
        return reservation

    def _reserve_rows(
        self, part: PartitionState, req: p.Reserve, group_ids: np.ndarray | None, lengths: np.ndarray | None
    ) -> p.Reservation:
        """A put without metadata: new rows (or, by key, new and existing rows) for its fields."""
        keyed = req.keys is not None
        self._check_use(part, keyed)
        part.check_schema(req.fields)
        if keyed:
            assert req.keys is not None
            rows = np.asarray([part.keys.get(k, -1) for k in req.keys], dtype=np.int64)
            new_rows = rows < 0
            old = rows[~new_rows]
            if np.any(part.state[old] != COMMITTED):
                raise FieldAlreadyProduced(f"another put is creating some of these keys in {part.name} right now")
            part.check_write(old, list(req.fields), upsert=True)  # before any row is taken for the new keys
            if new_rows.any():
                rows[new_rows] = part.allocate(int(new_rows.sum()), None)
                for k, row in zip(np.asarray(req.keys)[new_rows].tolist(), rows[new_rows].tolist(), strict=True):
                    part.keys[k] = row  # claimed now, so a concurrent put of the same new key is refused
                    part.row_keys[row] = k
        else:
            rows = part.allocate(req.num_rows, group_ids)
            new_rows = np.ones(len(rows), dtype=bool)
        part.add_fields(req.fields)
        mask = part.begin_write(rows, list(req.fields), upsert=part.keyed)
        return self._reserve(part, req, rows, mask, new_rows, lengths)

    @staticmethod
    def _check_use(part: PartitionState, keyed: bool) -> None:
        if part.keyed != keyed:
            how = "by key (kv_*)" if part.keyed else "by row (put)"
            raise InvalidRequest(f"{part.name} is used {how}; use one way per partition")

    def _reserve_write(self, req: p.Reserve, key: PartitionKey, lengths: np.ndarray | None) -> Any:
        """A put with metadata: write new fields into existing rows."""
        part = self._live(key)
        if part is None or part.uid != req.target_uid:
            raise StaleBatchMeta(f"the metadata of this put is from before a clear of {describe_partition(key)}")
        indexes = p.unpack_indexes(req.target_indexes)
        if len(indexes) != req.num_rows:
            raise InvalidRequest(f"the metadata names {len(indexes)} rows; the data has {req.num_rows}")
        rows = part.rows_of(indexes, req.target_uid)
        part.check_schema(req.fields)
        part.check_write(rows, list(req.fields), upsert=part.keyed)
        if self.bytes_held + req.nbytes > self._byte_budget:
            return WAIT
        part.add_fields(req.fields)
        mask = part.begin_write(rows, list(req.fields), upsert=part.keyed)
        return self._reserve(part, req, rows, mask, np.zeros(len(rows), dtype=bool), lengths)

    def _reserve(
        self,
        part: PartitionState,
        req: p.Reserve,
        rows: np.ndarray,
        mask: int,
        new_rows: np.ndarray,
        lengths: np.ndarray | None,
    ) -> p.Reservation:
        units = self.config.num_storage_units
        placements, blocks, offsets = [], np.empty(len(rows), np.int64), np.empty(len(rows), np.int64)
        for unit, start, stop in place_rows(len(rows), req.nbytes, units, self._next_put % units, down=self.down_units):
            block_id = self._next_block * units + unit
            self._next_block += 1
            placements.append(p.Placement(unit, block_id, start, stop))
            blocks[start:stop] = block_id
            offsets[start:stop] = np.arange(stop - start)
        put = OpenPut(
            self._next_put,
            part.key,
            part.uid,
            rows,
            list(req.fields),
            mask,
            new_rows,
            blocks,
            offsets,
            lengths,
            req.nbytes,
            self.clock() + min(req.timeout, self.config.max_reservation_s) + self.config.put_grace,
            req.keys,
        )
        self._next_put += 1
        self.open_puts[put.put_id] = put
        self.next_deadline = min(self.next_deadline, put.deadline)
        self.bytes_held += req.nbytes
        part.nbytes += req.nbytes
        return p.Reservation(
            put.put_id,
            part.uid,
            p.pack_indexes(rows + part.base_index),
            p.pack_indexes(part.group[rows]),
            placements,
        )

    def _on_commit(self, req: p.Commit) -> p.MetaWire:
        put = self.open_puts.pop(req.put_id, None)
        if put is None:
            done = self.committed.get(req.put_id)
            if done is not None and self._by_uid(done.uid) is not None:
                # a retry of a commit whose reply was lost: the same rows, not new ones
                return done.wire
            raise PutExpired(
                f"put {req.put_id} expired, was aborted, or its partition was cleared before the commit; "
                "none of its rows are visible"
            )
        part = self.partitions[put.key]  # a clear drops its partition's open puts, so this one is live
        part.end_write(put.rows, put.mask)
        dead = part.commit(put.rows, put.names, put.blocks, put.offsets, put.lengths, put.new_rows)
        rows_before = bytes_before = 0  # split the put's bytes over its blocks by rows, summing to nbytes exactly
        for b, c in zip(*np.unique(put.blocks, return_counts=True), strict=True):
            rows_before += int(c)
            upto = put.nbytes * rows_before // len(put.rows)
            part.block_nbytes[int(b)] = upto - bytes_before
            bytes_before = upto
        self._drop_blocks(part, dead)
        extra = {"keys": put.keys} if put.keys is not None else {}
        wire = part.meta_wire(put.rows, put.names, None, extra)
        self._remember_commit(put, wire)
        self._retry_getters(put.key)
        return wire

    def _remember_commit(self, put: OpenPut, wire: p.MetaWire) -> None:
        """Keep the commit's meta until the put's reservation would have expired (a retry comes before that)."""
        self.committed[put.put_id] = Committed(wire, put.uid, put.deadline)
        while len(self.committed) > COMMITS_REMEMBERED:
            del self.committed[next(iter(self.committed))]

    def _on_abort(self, req: p.Abort) -> None:
        put = self.open_puts.pop(req.put_id, None)
        if put is not None:
            self._abort(put, popped=True)

    def _abort(self, put: OpenPut, popped: bool = False) -> None:
        if not popped:
            self.open_puts.pop(put.put_id, None)
        self.bytes_held -= put.nbytes
        part = self.partitions.get(put.key)
        if part is not None and part.uid == put.uid:
            part.nbytes -= put.nbytes
            part.end_write(put.rows, put.mask)
            fresh = put.rows[put.new_rows]
            for row in fresh.tolist():
                key = part.row_keys.pop(row, None)
                if key is not None:
                    part.keys.pop(key, None)
            part.free(fresh)
            self._drop_blocks(part, np.unique(put.blocks).tolist())
            self._retry_getters(put.key)
        self._retry_putters()

    def _block_floor(self) -> int:
        """Every block id below this belongs to a put that committed or was aborted (storage units refuse late
        writes of those and forget their tombstones)."""
        floor = self._next_block * self.config.num_storage_units
        for put in self.open_puts.values():
            if len(put.blocks):
                floor = min(floor, int(put.blocks.min()))
        return floor

    def _drop_blocks(self, part: PartitionState, blocks: list[int]) -> None:
        units = self.config.num_storage_units
        by_unit: dict[int, list[int]] = {}
        freed = 0
        for b in blocks:
            by_unit.setdefault(b % units, []).append(b)
            freed += part.block_nbytes.pop(b, 0)
        part.nbytes -= freed
        self.bytes_held -= freed
        for unit, ids in by_unit.items():
            self.outbox.append((unit, p.DropBlocks(part.uid, ids, self._block_floor())))
        if freed:
            self._retry_putters()

    # ---- get_meta ------------------------------------------------------------------------------------------
    def _on_get_meta(self, req: p.GetMeta) -> Any:
        key = self._check_key(req.partition)
        if not isinstance(req.batch_size, int) or req.batch_size < 1:
            raise InvalidRequest(f"batch_size must be an int >= 1, got {req.batch_size!r}")
        if not req.fields or not all(isinstance(f, str) and f for f in req.fields):
            raise InvalidRequest(f"data_fields must be a non-empty list of field names, got {req.fields!r}")
        if len(set(req.fields)) != len(req.fields):
            raise InvalidRequest(f"data_fields names a field twice: {req.fields}")
        if not isinstance(req.task_name, str) or not req.task_name:
            raise InvalidRequest(f"task_name must be a non-empty str, got {req.task_name!r}")
        if not 0 < req.timeout < float("inf"):
            raise InvalidRequest(f"timeout must be a finite number of seconds > 0, got {req.timeout}")
        check_lease_s(req.lease_s)
        sampler = self.sampler_for(req.task_name)
        params = {**sampler.default_sampler_params(), **(req.sampler_params or {})}
        dp_size, dp_rank, dp_group_id = params.get("dp_size", 1), params.get("dp_rank", 0), params.get("dp_group_id")
        for name, value in (("dp_size", dp_size), ("dp_rank", dp_rank)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequest(f"sampler_params[{name!r}] must be an int, got {value!r}")
        if not 1 <= dp_size <= MAX_DP_SIZE:
            raise InvalidRequest(f"dp_size must lie in [1, {MAX_DP_SIZE}], got {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise InvalidRequest(f"dp_rank must lie in [0, dp_size={dp_size}), got dp_rank={dp_rank}")
        if dp_group_id is not None and not isinstance(dp_group_id, (str, int)):
            raise InvalidRequest(f"dp_group_id must be a str or int, got {dp_group_id!r}")
        if req.peek and (dp_group_id is not None or dp_size > 1):
            raise InvalidRequest("a non-consuming get_meta (peek) cannot take part in a DP round")
        whole = req.get_n_samples or sampler.serves_whole_groups
        n = self.config.num_n_samples
        if whole and req.batch_size % n:
            raise IncompleteGroups(
                f"batch_size={req.batch_size} is not divisible by num_n_samples={n}; whole groups are served"
            )
        part = self._live(key)  # raises now if the partition was cleared
        if part is not None:
            part.check_new_task(req.task_name)
        auto_round = None
        if dp_group_id is None and dp_size > 1:
            caller = params.get("world_rank")
            if caller is not None and (not isinstance(caller, int) or isinstance(caller, bool)):
                raise InvalidRequest(f"sampler_params['world_rank'] must be an int, got {caller!r}")
            counter = (key, req.task_name, dp_rank, self.caller if caller is None else caller)
            number = self.auto_rounds.get(counter, 0)
            dp_group_id, auto_round = f"auto-{number}", (counter, number)
            self.auto_rounds[counter] = number + 1
        job = GetMetaJob(
            req,
            sampler,
            params,
            whole,
            dp_size,
            dp_rank,
            None if dp_group_id is None else str(dp_group_id),
            auto_round,
        )
        try:
            result = self._try_get_meta(job)
        except BaseException:
            self._forget_auto_round(job)  # a call that failed took no round: the rank stays in step with its peers
            raise
        return Wait(job) if result is WAIT else result

    def _try_get_meta(self, job: GetMetaJob) -> Any:
        req = job.request
        part = self._live(req.partition)
        if part is None:
            return WAIT
        if job.dp_group_id is None:
            rows = self._select(part, job, req.batch_size)
            if rows is None:
                return WAIT
            if len(rows) and not req.peek:  # a peek leases nothing: the rows stay ready for the task
                self._lease(part, req.task_name, rows, req.owner, self._lease_s(req), req.call_id)
            return part.meta_wire(rows, req.fields, req.task_name, {})
        round_key = (req.task_name, job.dp_group_id)
        dp_round = part.rounds.get(round_key)
        if dp_round is None:
            dp_round = part.rounds[round_key] = DPRound(job.dp_size, req.batch_size, tuple(req.fields))
            while len(part.rounds) > MAX_ROUNDS_PER_PARTITION:  # the oldest rounds go first
                del part.rounds[next(iter(part.rounds))]
        elif (dp_round.dp_size, dp_round.batch_size, dp_round.fields) != (
            job.dp_size,
            req.batch_size,
            tuple(req.fields),
        ):
            raise InvalidRequest(
                f"dp_group_id {job.dp_group_id!r} was opened with dp_size={dp_round.dp_size}, "
                f"batch_size={dp_round.batch_size}, fields={list(dp_round.fields)}; this call has dp_size="
                f"{job.dp_size}, batch_size={req.batch_size}, fields={req.fields}"
            )
        if dp_round.shares is None:
            rows = self._select(part, job, job.dp_size * req.batch_size)
            if rows is None:
                return WAIT
            group = part.group_size if job.whole_groups else 1
            try:
                shares = job.sampler.split(rows, job.dp_size, part.length[rows], group)
                group_of = part.group if job.whole_groups else None
                dp_round.shares = checked_shares(shares, rows, job.dp_size, group_of, type(job.sampler).__name__)
            except Exception as exc:
                # no row was leased yet and the round is forgotten: only this call fails
                del part.rounds[round_key]
                self._forget_auto_round(job)
                if isinstance(exc, TransferQueueError):
                    raise
                raise SamplerError(
                    f"{type(job.sampler).__name__}.split raised {type(exc).__name__}: {exc}; "
                    f"the {len(rows)} rows it was given are ready again"
                ) from exc
            if len(rows):  # the round holds the shares until every rank acknowledged its own, or its lease expires
                lease_s = self._lease_s(req)
                lease = self._lease(part, req.task_name, rows, ROUND_OWNER, lease_s, 0, round_key)
                dp_round.lease_id, dp_round.lease_s = lease.lease_id, lease_s
        if dp_round.expired:
            raise InvalidRequest(
                f"the lease of dp_group_id {job.dp_group_id!r} expired ({dp_round.lease_s:g} s) before every rank "
                "acknowledged its share; its unacknowledged rows are ready again: ask again with a new dp_group_id"
            )
        if job.dp_rank in dp_round.released:
            raise InvalidRequest(
                f"the share of dp_rank={job.dp_rank} in dp_group_id {job.dp_group_id!r} was released; "
                "ask again with a new dp_group_id"
            )
        shares = dp_round.shares
        extra = {
            "dp_rank": job.dp_rank,
            "dp_size": job.dp_size,
            "dp_group_id": job.dp_group_id,
            # what every rank of the round needs to yield the same number of batches (a short last round)
            "round_rows": int(sum(len(share) for share in shares)),
            "round_max_share": int(max(len(share) for share in shares)),
        }
        return part.meta_wire(dp_round.shares[job.dp_rank], req.fields, req.task_name, extra)

    def _select(self, part: PartitionState, job: GetMetaJob, count: int) -> np.ndarray | None:
        """Rows to hand out (the caller leases them), or ``None`` to wait. Short only when no more can come."""
        req = job.request
        index = part.ready_index(req.task_name, req.fields)
        in_flight = any(put.uid == part.uid for put in self.open_puts.values())
        finished = part.sealed and not in_flight and (index.produced if index else 0) == part.num_committed
        if job.sampler.uses_fast_path:
            if index is None:
                return np.zeros(0, np.int64) if finished else None
            view = ReadyView(part, index)
            group = part.group_size if job.whole_groups else 1
            available = view.num_groups() * group if job.whole_groups else view.num_rows()
            if available < count and not finished:
                return None
            rows = job.sampler.select(view, min(count, available - available % group), job.whole_groups)
        else:
            rows = select_with_user_sampler(
                part, job.sampler, job.params, req.task_name, req.fields, job.whole_groups, count
            )
            if len(rows) < count and not finished:
                return None
        return rows

    # ---- delivery: leases, acknowledgements, dead letters ---------------------------------------------------
    def options(self, task_name: str) -> TaskOptions:
        return self.task_options.get(task_name) or TaskOptions()

    def _lease_s(self, req: p.GetMeta) -> float:
        if req.lease_s is not None:
            return float(req.lease_s)
        task_lease = self.options(req.task_name).lease_s
        return float(task_lease) if task_lease is not None else self.config.lease_s

    def _max_deliveries(self, task_name: str) -> int:
        task_max = self.options(task_name).max_deliveries
        return task_max if task_max is not None else self.config.max_deliveries

    def _lease(
        self,
        part: PartitionState,
        task_name: str,
        rows: np.ndarray,
        owner: str,
        lease_s: float,
        call_id: int,
        round_key: tuple[str, str] | None = None,
    ) -> Lease:
        deadline = self.clock() + lease_s
        lease = self.leases.open(owner, part.key, part.uid, task_name, rows, deadline, call_id)
        lease.round_key = round_key
        again = int(np.count_nonzero(part.task(task_name).deliveries[rows]))
        if again:
            self.events.redelivered(task_name, again)
        part.lease(task_name, rows, lease.lease_id, self.leases.owner_id(owner))
        self.next_deadline = min(self.next_deadline, deadline)
        return lease

    def _give_back(self, lease: Lease, reason: str) -> None:
        """The rows ``lease`` still holds go back to ready for its task, first in line (or to the dead letters)."""
        self.leases.close(lease)
        part = self.partitions.get(lease.key)
        if part is None or part.uid != lease.uid:
            return
        task = part.tasks.get(lease.task_name)
        if task is None:  # its consumption was reset since
            return
        rows = lease.rows[(task.lease[lease.rows] == lease.lease_id) & (task.consumption[lease.rows] == LEASED)]
        if lease.round_key is not None:
            dp_round = part.rounds.get(lease.round_key)
            if dp_round is not None and dp_round.lease_id == lease.lease_id:
                dp_round.expired = True
        if not len(rows):
            return
        if reason in ("lease expired", "client disconnected"):
            self.events.lease_expired(lease.task_name, len(rows))
        dead = part.give_back(lease.task_name, rows, reason, self._max_deliveries(lease.task_name))
        if len(dead):
            logger.warning(
                "%d rows of task %r in %s were delivered %d times; dead-lettered (%s)",
                len(dead),
                lease.task_name,
                part.name,
                self._max_deliveries(lease.task_name),
                reason,
            )
        self._retry_getters(part.key)

    def _held_rows(self, req: p.Ack | p.Release) -> tuple[PartitionState, np.ndarray, np.ndarray, np.ndarray]:
        """The partition, the distinct rows named, and per row: held by the caller (or by a DP round), and the
        caller's id."""
        part = self._by_uid(req.partition_uid)
        if part is None:
            what = "ack" if isinstance(req, p.Ack) else "release"
            raise StaleBatchMeta(
                f"{what} of a BatchMeta whose partition (uid {req.partition_uid}) was cleared: its rows no longer "
                "exist; get a fresh BatchMeta"
            )
        rows = p.unpack_indexes(req.global_indexes) - part.base_index
        rows = unique_in_order(rows[(rows >= 0) & (rows < part.num_rows)])
        task = part.task(req.task_name)
        holder = task.holder[rows]
        return part, rows, holder == self.leases.owner_id(req.owner), holder == self.leases.round_holder

    def _on_ack(self, req: p.Ack) -> dict[str, int] | None:
        if not req.explicit and (
            self.options(req.task_name).ack == "explicit" or self._by_uid(req.partition_uid) is None
        ):
            return None  # a get_data's acknowledgement: the task acknowledges by itself / the meta is stale
        part, rows, mine, rounds = self._held_rows(req)
        task = part.task(req.task_name)
        state = task.consumption[rows]
        take = (state == LEASED) & (mine | rounds)
        if req.explicit:
            again = (state == CONSUMED) & rounds  # TP peers of a DP rank acknowledge the same share: once counts
            bad = ~(take | again)
            if bad.any():
                raise NotLeased(self._not_leased_message(part, req.task_name, rows[bad], state[bad], mine[bad]))
        acked = rows[take]
        if len(acked):
            self.leases.settled(task.lease[acked])
            part.acknowledge(req.task_name, acked)
        return {"acknowledged": len(acked)}

    def _not_leased_message(
        self, part: PartitionState, task_name: str, rows: np.ndarray, state: np.ndarray, mine: np.ndarray
    ) -> str:
        index = rows + part.base_index
        why = {
            "leased to another client": index[(state == LEASED) & ~mine],
            "already acknowledged": index[state == CONSUMED],
            "not leased (never handed out, or handed back: lease expired, client gone, released)": index[
                state == AVAILABLE
            ],
            "dead-lettered": index[state == DEAD],
        }
        detail = "; ".join(f"{what}: {idx[:20].tolist()}" for what, idx in why.items() if len(idx))
        return (
            f"ack of {len(rows)} rows of task {task_name!r} in {part.name} that this client does not hold "
            f"(global indexes {index[:20].tolist()}): {detail}"
        )

    def _on_cancel_get_meta(self, req: p.CancelGetMeta) -> None:
        """The client gave up a get_meta: drop it if it still waits, else hand back what it was served."""
        if not req.owner or not req.call_id or req.owner == ROUND_OWNER:
            return
        for key in list(self.getters):
            keep = []
            for parked in self.getters[key]:
                r = parked.job.request
                if r.owner == req.owner and r.call_id == req.call_id:
                    self._forget_auto_round(parked.job)  # never answered: the client stopped listening
                else:
                    keep.append(parked)
            if keep:
                self.getters[key] = keep
            else:
                del self.getters[key]
        for lease in self.leases.of_owner(req.owner):
            if lease.call_id == req.call_id and req.call_id:
                self._give_back(lease, "cancelled")

    def on_disconnect(self, peer: Any) -> None:
        """Connection ``peer`` closed (its process died, or it closed its client): its parked requests are dropped
        (nobody reads their answer) and its automatic DP round counters forgotten; its open puts are aborted after
        ``disconnect_grace`` (it may still commit over a new connection), and if it was its client's last
        connection, the client's leases go back after the same grace."""
        deadline = self.clock() + self.config.disconnect_grace
        for put in self.open_puts.values():
            if put.owner == peer and put.deadline > deadline:
                put.deadline = deadline
                self.next_deadline = min(self.next_deadline, deadline)
        self.putters = [parked for parked in self.putters if parked.peer != peer]
        for counter in [c for c in self.auto_rounds if c[3] == peer]:
            del self.auto_rounds[counter]
        for key in list(self.getters):
            keep = [parked for parked in self.getters[key] if parked.peer != peer]
            for parked in self.getters[key]:
                if parked.peer == peer:
                    self._forget_auto_round(parked.job)
            if keep:
                self.getters[key] = keep
            else:
                del self.getters[key]
        if self.leases.disconnected(peer, deadline) is not None:
            self.next_deadline = min(self.next_deadline, deadline)

    def _on_set_task_options(self, req: p.SetTaskOptions) -> None:
        if not isinstance(req.task_name, str) or not req.task_name:
            raise InvalidRequest(f"task_name must be a non-empty str, got {req.task_name!r}")
        self.task_options[req.task_name] = TaskOptions(req.ack, req.lease_s, req.max_deliveries)

    def _on_dead_letters(self, req: p.DeadLetters) -> list[dict[str, Any]]:
        return self._known(req.partition).dead_letters(req.task_name)

    def _get_meta_timeout(self, parked: Parked) -> GetMetaTimeout:
        req = parked.job.request
        waited = parked.deadline - parked.started
        ask = (
            f"get_meta timed out after {waited:.1f} s: task {req.task_name!r} asked {describe_partition(req.partition)}"
            f" for {req.batch_size} rows of fields {req.fields}"
        )
        part = self.partitions.get(req.partition)
        if part is None:
            return GetMetaTimeout(f"{ask}; the partition was never opened (no put reached it yet)")
        task = part.task(req.task_name)
        rows = part.committed_rows()
        rows = rows[task.consumption[rows] == AVAILABLE]
        missing = {}
        for f in req.fields:
            col = part.field_col.get(f)
            lacking = len(rows) if col is None else int(np.count_nonzero(part.block[rows, col] < 0))
            if lacking:
                missing[f] = lacking
        index = part.ready_index(req.task_name, req.fields)
        ready = 0 if index is None else index.num_rows
        detail = ", ".join(f"{f!r} missing on {c} rows" for f, c in missing.items()) or "no field missing"
        return GetMetaTimeout(
            f"{ask}; {ready} rows are ready, {len(rows)} unconsumed rows exist ({detail}); "
            f"{part.num_committed} of {part.capacity or 'unbounded'} rows are committed"
        )

    def _put_timeout(self, parked: Parked) -> QueueFull:
        req = parked.job[0]
        waited = parked.deadline - parked.started
        fits = self.bytes_held + req.nbytes <= self._byte_budget
        if fits and isinstance(req.partition, int) and req.partition not in self.partitions:
            steps = sorted(k for k in self.partitions if isinstance(k, int))
            return QueueFull(
                f"put to global_step={req.partition} waited {waited:.1f} s for a free slot in the step ring: "
                f"num_global_batch={self.config.num_global_batch} steps are live ({steps}); clear one first"
            )
        limit = self._byte_budget
        return QueueFull(
            f"put to {describe_partition(req.partition)} waited {waited:.1f} s for storage space: "
            f"{self.bytes_held} of {limit} bytes are held and the put needs {req.nbytes}"
        )

    # ---- release, clear, reset -----------------------------------------------------------------------------
    def _on_release(self, req: p.Release) -> None:
        """Hand back rows the caller holds (leased or acknowledged by it, or held by a DP round), behind the rows
        ready now; rows it does not hold, or names twice, are ignored. A row delivered ``max_deliveries`` times is
        dead-lettered instead."""
        part, rows, mine, rounds = self._held_rows(req)
        task = part.task(req.task_name)
        state = task.consumption[rows]
        rows = rows[((state == LEASED) | (state == CONSUMED)) & (mine | rounds)]
        leased = rows[task.consumption[rows] == LEASED]
        self.leases.settled(task.lease[leased])
        worn = rows[task.deliveries[rows] >= self._max_deliveries(req.task_name)]
        if len(worn):
            part.give_back(req.task_name, worn, "released", self._max_deliveries(req.task_name))
        part.release(req.task_name, rows)
        released = set(rows.tolist())
        for (task_name, _), dp_round in part.rounds.items():
            if task_name == req.task_name and dp_round.shares is not None:
                for rank, share in enumerate(dp_round.shares):
                    if not released.isdisjoint(share.tolist()):
                        dp_round.released.add(rank)
        self._retry_getters(part.key)

    def _on_clear(self, req: p.Clear) -> None:
        key = self._check_key(req.partition)
        part = self.partitions.pop(key, None)
        if part is None:
            return  # never opened, or already cleared: a no-op (it must not mark steps up to ``key`` as cleared)
        if isinstance(key, int):
            self.max_cleared_step = max(self.max_cleared_step, key)
        else:
            self.cleared_names[key] = None
            while len(self.cleared_names) > CLEARED_NAMES_REMEMBERED:
                del self.cleared_names[next(iter(self.cleared_names))]
        for waiting in [k for k in self.getters if k != key]:
            if waiting not in self.partitions:  # waits for a partition to open: fails if it now never can
                self._retry_getters(waiting)
        self.leases.drop_partition(part.uid)
        for put in [put for put in self.open_puts.values() if put.uid == part.uid]:
            del self.open_puts[put.put_id]  # its bytes are counted in part.nbytes
        self.bytes_held -= part.nbytes
        live, floor = sorted(other.uid for other in self.partitions.values()), self._block_floor()
        for unit in range(self.config.num_storage_units):
            self.outbox.append((unit, p.DropPartition(part.uid, live, self._next_uid - 1, floor)))
        for counter in [c for c in self.auto_rounds if c[0] == key]:
            del self.auto_rounds[counter]
        for parked in self.getters.pop(key, []):
            parked.respond(None, PartitionCleared(f"{part.name} was cleared while get_meta waited for it"))
        self._retry_putters()

    def _on_reset_consumption(self, req: p.ResetConsumption) -> None:
        parts = list(self.partitions.values()) if req.partition is None else [self._known(req.partition)]
        for part in parts:
            part.reset_consumption(req.task_name)
            for counter in [c for c in self.auto_rounds if c[0] == part.key and req.task_name in (None, c[1])]:
                del self.auto_rounds[counter]
            self._retry_getters(part.key)

    def _on_close_partition(self, req: p.ClosePartition) -> None:
        part = self._known(req.partition)
        part.closed = True
        self._retry_getters(part.key)

    # ---- status --------------------------------------------------------------------------------------------
    def _on_production_status(self, req: p.ProductionStatus) -> dict[str, Any]:
        return self._known(req.partition).production_status()

    def _on_consumption_status(self, req: p.ConsumptionStatus) -> dict[str, Any]:
        return self._known(req.partition).consumption_status(req.task_name)

    def _on_list_partitions(self, req: p.ListPartitions) -> list[PartitionKey]:
        return list(self.partitions)

    # ---- kv ------------------------------------------------------------------------------------------------
    def _keyed(self, key: str) -> PartitionState:
        part = self._known(key)
        if not part.keyed:
            raise InvalidRequest(f"{part.name} is used by row (put), not by key")
        return part

    def _on_kv_lookup(self, req: p.KvLookup) -> p.MetaWire:
        part = self._keyed(req.partition)
        missing = [k for k in req.keys if k not in part.keys or part.state[part.keys[k]] != COMMITTED]
        if missing:
            raise UnknownKey(f"keys {missing[:10]} are not in {part.name}")
        rows = np.asarray([part.keys[k] for k in req.keys], dtype=np.int64)
        names = req.fields
        if names is None:
            names = [n for n, c in part.field_col.items() if np.all(part.block[rows, c] >= 0)]
        for n in names:
            col = part.field_col.get(n)
            if col is None or np.any(part.block[rows, col] < 0):
                lacking = [
                    k for k, r in zip(req.keys, rows.tolist(), strict=True) if col is None or part.block[r, col] < 0
                ]
                raise UnknownField(f"field {n!r} is not set for keys {lacking[:10]} in {part.name}")
        return part.meta_wire(rows, list(names), None, {"keys": list(req.keys)})

    def _on_kv_list(self, req: p.KvList) -> Any:
        if req.partition is None:
            keyed = [part for part in self.partitions.values() if part.keyed]
            return {part.key: self._keys_of(part, req.with_tags) for part in keyed}
        part = self.partitions.get(self._check_key(req.partition))
        if part is None:  # never opened, or cleared: no keys
            return {} if req.with_tags else []
        if not part.keyed:
            raise InvalidRequest(f"{part.name} is used by row (put), not by key")
        return self._keys_of(part, req.with_tags)

    @staticmethod
    def _keys_of(part: PartitionState, with_tags: bool) -> Any:
        keys = [(k, row) for k, row in part.keys.items() if part.state[row] == COMMITTED]
        if with_tags:
            return {k: part.custom_meta.get(row, {}) for k, row in keys}
        return [k for k, _ in keys]

    def _on_kv_tag(self, req: p.KvTag) -> p.MetaWire:
        key = self._check_key(req.partition)
        if not isinstance(key, str) or len(req.keys) != len(req.values) or len(set(req.keys)) != len(req.keys):
            raise InvalidRequest(f"kv tags need a str partition and one tag per distinct key, got {len(req.keys)} keys")
        check_custom_meta(list(req.values), [f"key {k!r}" for k in req.keys])  # before anything changes
        part = self._live(key, reopen=True)
        if part is not None:
            self._check_use(part, keyed=True)
        part = part or self._open(key, keyed=True)
        assert part is not None  # a str partition always opens
        self.cleared_names.pop(key, None)
        if any(k in part.keys and part.state[part.keys[k]] != COMMITTED for k in req.keys):
            raise FieldAlreadyProduced(f"another put is creating some of these keys in {part.name} right now")
        new = [k for k in req.keys if k not in part.keys]
        if new:  # a tag of a new key creates it, with no fields yet (as upstream does)
            rows = part.allocate(len(new), None)
            for k, row in zip(new, rows.tolist(), strict=True):
                part.keys[k], part.row_keys[row] = row, k
            none = np.zeros(0, dtype=np.int64)
            part.commit(rows, [], none, none, None, np.ones(len(rows), dtype=bool))
        rows = np.asarray([part.keys[k] for k in req.keys], dtype=np.int64)
        part.set_custom_meta(rows, list(req.values))
        return part.meta_wire(rows, [], None, {"keys": list(req.keys)})

    def _on_set_custom_meta(self, req: p.SetCustomMeta) -> None:
        part = self._by_uid(req.partition_uid)
        if part is None:
            raise StaleBatchMeta(f"set_custom_meta of a meta whose partition (uid {req.partition_uid}) was cleared")
        rows = part.committed_rows_of(p.unpack_indexes(req.global_indexes), "set_custom_meta")
        part.set_custom_meta(rows, list(req.values))

    def _on_get_custom_meta(self, req: p.GetCustomMeta) -> list[dict[str, Any]]:
        part = self._by_uid(req.partition_uid)
        if part is None:
            raise StaleBatchMeta(f"get_custom_meta of a meta whose partition (uid {req.partition_uid}) was cleared")
        rows = p.unpack_indexes(req.global_indexes) - part.base_index
        return [part.custom_meta.get(row, {}) for row in rows.tolist()]

    def _on_clear_samples(self, req: p.ClearSamples) -> None:
        part = self._by_uid(req.partition_uid)
        if part is None:
            return  # its partition was cleared: the rows are gone already
        indexes = p.unpack_indexes(req.global_indexes)
        rows = indexes - part.base_index
        rows = rows[(rows >= 0) & (rows < part.num_rows)]
        rows = np.unique(rows[part.state[rows] == COMMITTED])  # rows cleared before are skipped (idempotent)
        if np.any(part.inflight_mask[rows]):
            raise FieldAlreadyProduced(f"some rows of {part.name} are being written by an open put; clear them after")
        for row in rows.tolist():
            key = part.row_keys.pop(row, None)
            if key is not None:
                part.keys.pop(key, None)
        self._drop_blocks(part, part.remove_rows(rows))
        self._retry_getters(part.key)  # a closed partition may now have served everything that is left
        self._retry_putters()

    def _on_kv_clear(self, req: p.KvClear) -> None:
        if req.keys is None:
            self._on_clear(p.Clear(req.partition))
            return
        part = self.partitions.get(self._check_key(req.partition))
        if part is None:
            return
        found = list(dict.fromkeys(k for k in req.keys if k in part.keys))
        busy = [k for k in found if part.state[part.keys[k]] != COMMITTED or part.inflight_mask[part.keys[k]]]
        if busy:
            raise FieldAlreadyProduced(
                f"keys {busy[:10]} of {part.name} are being written by an open put; clear them after it commits"
            )
        rows = [part.keys.pop(k) for k in found]
        if not rows:
            return
        for row in rows:
            part.row_keys.pop(row, None)
        dead = part.remove_rows(np.asarray(rows, dtype=np.int64))
        self._drop_blocks(part, dead)


def meta_from_wire(wire: p.MetaWire) -> BatchMeta:
    return wire.to_meta()
