"""PutLedger: puts between reserve and commit, and the storage blocks and bytes they hold.

Plain Python (no Ray, no sockets, no wire format). A put is two steps (docs/architecture.md, "Puts: reserve, write,
commit; abandoned puts are freed"):

1. **reserve**: validate it, make room (a slot in the step ring, storage bytes), take its rows and place them on
   storage units as blocks; the rows stay invisible. A put that cannot get room yet waits (the caller parks it).
2. **commit**: the client wrote its blocks; the rows become visible together. A commit is idempotent by put id: a
   retried commit (its reply was lost) gets the same meta again, never new rows.

A put that never commits (its client died, its connection closed, its deadline passed) is **aborted**: its rows
and bytes are freed and its blocks dropped. Reservations are capped (``max_reservation_s``), so a dead producer with
a huge timeout cannot hold rows for long.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer_queue.config import QueueConfig
from transfer_queue.errors import (
    FieldAlreadyProduced,
    IncompleteGroups,
    InvalidRequest,
    PartitionOverfilled,
    PutExpired,
    QueueFull,
    RequestTimeout,
    StaleBatchMeta,
    TransferQueueError,
)
from transfer_queue.metadata import BatchMeta, FieldSchema, PartitionKey, describe_partition
from transfer_queue.state.partition import COMMITTED, PartitionState, value_counts
from transfer_queue.state.partition_table import PartitionTable
from transfer_queue.state.placement import place_rows, replica_units

logger = logging.getLogger(__name__)

MAX_ROWS_PER_PUT = 1 << 24  # bounds the bookkeeping one request can make the controller allocate
# Recent commits whose meta a retried commit (its reply was lost) gets again; they are forgotten when their put's
# deadline plus put_grace has passed, or beyond this many (then a retry is told its outcome is unknown, never a lie).
COMMITS_REMEMBERED = 4096


@dataclass
class PutRequest:
    """A put to reserve room for (the controller decodes it from the wire)."""

    partition: Any
    num_rows: int
    fields: dict[str, FieldSchema]
    nbytes: int
    group_ids: np.ndarray | None = None
    target_uid: int | None = None  # a put with metadata: write fields into these existing rows
    target_indexes: np.ndarray | None = None
    lengths: np.ndarray | None = None  # flat: one per row, or rows x len(length_fields) row-major
    keys: list[str] | None = None  # a put by key: rows are found or created by key, fields upserted
    timeout: float = 30.0
    length_fields: list[str] | None = None


@dataclass
class Reserved:
    """A reservation: the put's id, its rows and groups, and ``placements`` (unit, block_id, start, stop)."""

    put_id: int
    partition_uid: int
    global_indexes: np.ndarray
    group_ids: np.ndarray
    placements: list[tuple[int, int, int, int]]
    commit_within: float = 0.0  # seconds the controller applies the put's commit (its deadline, from now)


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
class Committed:
    """A commit remembered for a while, so a retried commit (its reply was lost) gets the same meta."""

    meta: BatchMeta
    uid: int
    until: float


PutJob = tuple[PutRequest, np.ndarray | None]  # the request and its cell lengths (rows x fields)


class PutLedger:
    """Open puts, recent commits, block ids and the bytes held by the queue.

    Args:
        config: the queue's config (byte budget, storage units, reservation caps).
        table: the live partitions.
        clock: the queue's clock.
        wake: called with a new deadline (the owner's timer must fire by then).
        rows_changed: called with a partition key whose rows changed (its waiting getters retry), and for a commit
            its rows and fields (None for an abort: anything may have changed).
        space_freed: called when rows, bytes or a ring slot were freed (waiting putters retry).
        drop_blocks: ``(unit, partition_uid, block_ids, block_floor)``: tell a storage unit to drop blocks.
    """

    def __init__(
        self,
        config: QueueConfig,
        table: PartitionTable,
        clock: Callable[[], float],
        wake: Callable[[float], None],
        rows_changed: Callable[[PartitionKey, np.ndarray | None, list[str] | None], None],
        space_freed: Callable[[], None],
        drop_blocks: Callable[[int, int, list[int], int], None],
    ):
        self.config = config
        self.table = table
        self.clock = clock
        self.wake = wake
        self.rows_changed = rows_changed
        self.space_freed = space_freed
        self.send_drop = drop_blocks
        self.open_puts: dict[int, OpenPut] = {}
        self.committed: dict[int, Committed] = {}  # put id -> its commit, oldest first
        self.forgotten_upto = 0  # the newest put id whose commit was forgotten for want of room
        self.down_units: set[int] = set()  # storage units the controller lost its connection to: placement skips them
        # replicas=2: the unit holding the second copy of each unit's blocks (the controller sets it from its units'
        # nodes: transfer_queue.state.placement.replica_units); None: one copy
        self.replica_of: list[int] | None = replica_units([""] * config.num_storage_units, config.replicas)
        self.moved_to: set[int] = set()  # replicas=2: units holding copies moved off retired units
        self.bytes_held = 0
        self.next_put = 1
        self.next_block = 0

    @property
    def byte_budget(self) -> int:
        return self.config.byte_budget

    def holders(self, unit: int) -> list[int]:
        """The units holding a copy of the blocks placed on ``unit``: itself, and its replica's unit (replicas=2)."""
        return [unit] if self.replica_of is None else [unit, self.replica_of[unit]]

    def unplaceable(self) -> set[int]:
        """Units a put cannot be placed on now: down ones, and (replicas=2) those whose replica's unit is down."""
        if self.replica_of is None:
            return self.down_units
        return {u for u in range(self.config.num_storage_units) if set(self.holders(u)) & self.down_units}

    # ---- reserve ------------------------------------------------------------------------------------------
    def validate(self, req: PutRequest) -> PutJob:
        """Check a put before it takes anything or waits; raises what is wrong with it."""
        key = self.table.check_key(req.partition)
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
        if req.nbytes > self.byte_budget:
            raise QueueFull(
                f"a put of {req.nbytes} bytes can never fit: the storage units hold {self.byte_budget} bytes in all"
            )
        lengths = cell_lengths(req)
        if req.keys is not None and (len(req.keys) != req.num_rows or len(set(req.keys)) != len(req.keys)):
            raise InvalidRequest(f"a put by key needs {req.num_rows} distinct keys, got {len(req.keys)}")
        n = self.config.num_n_samples
        if req.target_uid is None and req.keys is None and req.group_ids is None and req.num_rows % n:
            raise IncompleteGroups(
                f"a put of {req.num_rows} rows without group_ids must hold whole groups of num_n_samples={n} "
                f"(got {req.num_rows % n} rows too many); pass group_ids to spread a group over several puts"
            )
        c = self.config
        if isinstance(key, int) and req.target_uid is None and req.keys is None and req.num_rows > c.rows_per_step:
            raise PartitionOverfilled(  # at once, even while the step ring is full: it never fits a step
                f"a put of {req.num_rows} rows can never fit {describe_partition(key)}: a step holds at most "
                f"{c.rows_per_step} rows (global_batch_size={c.global_batch_size} x num_n_samples={c.num_n_samples})"
            )
        part = self.table.live(key, reopen=req.target_uid is None)
        if part is not None and req.target_uid is None:  # validate against what the partition holds before waiting
            self.table.check_use(part, req.keys is not None)
            part.check_schema(req.fields)
            part.check_room(req.num_rows)
        return req, lengths

    def try_reserve(self, job: PutJob) -> Reserved | None:
        """Reserve the put's rows; ``None`` when there is no room yet (the put waits)."""
        req, lengths = job
        if req.target_uid is not None:
            return self._reserve_write(req, lengths)
        key = req.partition
        if self.bytes_held + req.nbytes > self.byte_budget:
            return None
        part = self.table.live(key, reopen=True)
        opened = part is None
        part = part or self.table.open(key, req.keys is not None)
        if part is None:
            return None
        try:
            reservation = self._reserve_rows(part, req, lengths)
        except TransferQueueError:
            if opened:  # refused before it took a row: leave no empty partition (or ring slot) behind
                del self.table.partitions[key]
            raise
        self.table.reopened(key)
        return reservation

    def _reserve_rows(self, part: PartitionState, req: PutRequest, lengths: np.ndarray | None) -> Reserved:
        """A put without metadata: new rows (or, by key, new and existing rows) for its fields."""
        keyed = req.keys is not None
        self.table.check_use(part, keyed)
        part.check_schema(req.fields)
        chunks = self._place(req)  # before a row is taken: a put that cannot be placed leaves nothing behind
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
            rows = part.allocate(req.num_rows, req.group_ids)
            new_rows = np.ones(len(rows), dtype=bool)
        part.add_fields(req.fields)
        mask = part.begin_write(rows, list(req.fields), upsert=part.keyed)
        return self._reserve(part, req, rows, mask, new_rows, lengths, chunks)

    def _reserve_write(self, req: PutRequest, lengths: np.ndarray | None) -> Reserved | None:
        """A put with metadata: write new fields into existing rows."""
        key = req.partition
        part = self.table.live(key)
        if part is None or part.uid != req.target_uid:
            raise StaleBatchMeta(f"the metadata of this put is from before a clear of {describe_partition(key)}")
        indexes = req.target_indexes if req.target_indexes is not None else np.zeros(0, dtype=np.int64)
        if len(indexes) != req.num_rows:
            raise InvalidRequest(f"the metadata names {len(indexes)} rows; the data has {req.num_rows}")
        rows = part.rows_of(indexes, req.target_uid)
        part.check_schema(req.fields)
        part.check_write(rows, list(req.fields), upsert=part.keyed)
        if self.bytes_held + req.nbytes > self.byte_budget:
            return None
        chunks = self._place(req)  # before the rows' fields are marked as being written
        part.add_fields(req.fields)
        mask = part.begin_write(rows, list(req.fields), upsert=part.keyed)
        return self._reserve(part, req, rows, mask, np.zeros(len(rows), dtype=bool), lengths, chunks)

    def _place(self, req: PutRequest) -> list[tuple[int, int, int]]:
        """The put's chunks, ``(unit, start, stop)``, on the units it can be placed on now; StorageUnavailable when
        none can take it. Changes nothing, so a put refused here leaves no row taken nor field marked."""
        units = self.config.num_storage_units
        return place_rows(
            req.num_rows, req.nbytes, units, self.next_put % units, down=self.unplaceable(), replica_of=self.replica_of
        )

    def _reserve(
        self,
        part: PartitionState,
        req: PutRequest,
        rows: np.ndarray,
        mask: int,
        new_rows: np.ndarray,
        lengths: np.ndarray | None,
        chunks: list[tuple[int, int, int]],
    ) -> Reserved:
        units = self.config.num_storage_units
        placements, blocks, offsets = [], np.empty(len(rows), np.int64), np.empty(len(rows), np.int64)
        for unit, start, stop in chunks:
            block_id = self.next_block * units + unit
            self.next_block += 1
            placements.append((unit, block_id, start, stop))
            blocks[start:stop] = block_id
            offsets[start:stop] = np.arange(stop - start)
        put = OpenPut(
            self.next_put,
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
        self.next_put += 1
        self.open_puts[put.put_id] = put
        self.wake(put.deadline)
        self.bytes_held += req.nbytes
        part.nbytes += req.nbytes
        return Reserved(
            put.put_id, part.uid, rows + part.base_index, part.group[rows], placements, put.deadline - self.clock()
        )

    def timeout_error(self, req: PutRequest, waited: float) -> QueueFull:
        """What a put that waited ``waited`` seconds for room is told at its deadline."""
        fits = self.bytes_held + req.nbytes <= self.byte_budget
        if fits and isinstance(req.partition, int) and req.partition not in self.table.partitions:
            steps = sorted(k for k in self.table.partitions if isinstance(k, int))
            return QueueFull(
                f"put to global_step={req.partition} waited {waited:.1f} s for a free slot in the step ring: "
                f"num_global_batch={self.config.num_global_batch} steps are live ({steps}); clear one first"
            )
        return QueueFull(
            f"put to {describe_partition(req.partition)} waited {waited:.1f} s for storage space: "
            f"{self.bytes_held} of {self.byte_budget} bytes are held and the put needs {req.nbytes}"
        )

    # ---- commit / abort ------------------------------------------------------------------------------------
    def commit(self, put_id: int) -> BatchMeta:
        """Make the put's rows visible; a retried commit gets the same meta again."""
        put = self.open_puts.pop(put_id, None)
        if put is not None and self.clock() > put.deadline:
            # past the deadline the client gives up (it knows it from the reservation's commit_within), so applying
            # a late commit (the serving thread was busy, the request sat in a socket) would show rows of a put
            # that reported failure: refuse it, and free the put now rather than at the next tick
            self._abort(put)
            raise PutExpired(
                f"put {put_id} was not committed within its deadline (its reservation expired); none of its rows "
                "are visible"
            )
        if put is None:
            done = self.committed.get(put_id)
            if done is not None and self.table.by_uid(done.uid) is not None:
                # a retry of a commit whose reply was lost: the same rows, not new ones
                return done.meta
            if done is None and put_id <= self.forgotten_upto:
                raise RequestTimeout(
                    f"put {put_id}: its commit is no longer remembered (more than {COMMITS_REMEMBERED} commits "
                    "since, or the controller restarted since); whether its rows were made visible is unknown"
                )
            raise PutExpired(
                f"put {put_id} expired, was aborted, or its partition was cleared before the commit; "
                "none of its rows are visible"
            )
        part = self.table.partitions[put.key]  # a clear drops its partition's open puts, so this one is live
        part.end_write(put.rows, put.mask)
        dead = part.commit(put.rows, put.names, put.blocks, put.offsets, put.lengths, put.new_rows)
        rows_before = bytes_before = 0  # split the put's bytes over its blocks by rows, summing to nbytes exactly
        for b, c in value_counts(put.blocks):
            rows_before += c
            upto = put.nbytes * rows_before // len(put.rows)
            part.block_nbytes[b] = upto - bytes_before
            bytes_before = upto
        self.drop_blocks(part, dead)
        extra = {"keys": put.keys} if put.keys is not None else {}
        meta = part.meta(put.rows, put.names, None, extra)
        # keep the commit's meta a while past the put's deadline: a client that got no answer asks once more then
        self.committed[put.put_id] = Committed(meta, put.uid, put.deadline + self.config.put_grace)
        while len(self.committed) > COMMITS_REMEMBERED:
            oldest = next(iter(self.committed))
            self.forgotten_upto = max(self.forgotten_upto, oldest)
            del self.committed[oldest]
        self.rows_changed(put.key, put.rows, put.names)  # the getters these rows and fields can serve retry
        return meta

    def abort(self, put_id: int) -> None:
        put = self.open_puts.get(put_id)
        if put is not None:
            self._abort(put)

    def _abort(self, put: OpenPut) -> None:
        self.open_puts.pop(put.put_id, None)
        self.bytes_held -= put.nbytes
        part = self.table.partitions.get(put.key)
        if part is not None and part.uid == put.uid:
            part.nbytes -= put.nbytes
            part.end_write(put.rows, put.mask)
            fresh = put.rows[put.new_rows]
            for row in fresh.tolist():
                key = part.row_keys.pop(row, None)
                if key is not None:
                    part.keys.pop(key, None)
            part.free(fresh)
            self.drop_blocks(part, np.unique(put.blocks).tolist())
            self.rows_changed(put.key, None, None)
        self.space_freed()

    def expire(self, now: float) -> None:
        """Abort the puts whose client did not commit in time; forget commits too old to be retried."""
        for put in [put for put in self.open_puts.values() if put.deadline <= now]:
            logger.warning("aborting put %d to %s: its client did not commit in time", put.put_id, put.key)
            self._abort(put)
        while self.committed:
            put_id, done = next(iter(self.committed.items()))
            if done.until > now:
                break
            del self.committed[put_id]

    def peer_closed(self, peer: Any, deadline: float) -> None:
        """Connection ``peer`` closed: its open puts are aborted at ``deadline`` unless committed before."""
        for put in self.open_puts.values():
            if put.owner == peer and put.deadline > deadline:
                put.deadline = deadline
                self.wake(deadline)

    def deadlines(self) -> list[float]:
        return [put.deadline for put in self.open_puts.values()]

    def in_flight(self, uid: int) -> bool:
        """Whether a put into partition ``uid`` is open."""
        return any(put.uid == uid for put in self.open_puts.values())

    # ---- blocks and bytes -----------------------------------------------------------------------------------
    def block_floor(self) -> int:
        """Every block id below this belongs to a put that committed or was aborted (storage units refuse late
        writes of those and forget their tombstones)."""
        floor = self.next_block * self.config.num_storage_units
        for put in self.open_puts.values():
            if len(put.blocks):
                floor = min(floor, int(put.blocks.min()))
        return floor

    def drop_blocks(self, part: PartitionState, blocks: list[int]) -> None:
        """Free ``blocks`` of ``part``: their bytes are no longer held, their storage units drop them."""
        units = self.config.num_storage_units
        by_unit: dict[int, list[int]] = {}
        freed = 0
        part.mark_blocks(blocks)
        for b in blocks:
            by_unit.setdefault(b % units, []).append(b)
            freed += part.block_nbytes.pop(b, 0)
        part.nbytes -= freed
        self.bytes_held -= freed
        for unit, ids in by_unit.items():  # also to the units a retired unit's copies were moved to (lost_rows)
            for holder in sorted({*self.holders(unit), *self.moved_to}):
                self.send_drop(holder, part.uid, ids, self.block_floor())
        if freed:
            self.space_freed()

    def drop_partition(self, part: PartitionState) -> None:
        """``part`` was cleared: its open puts are forgotten and its bytes freed (the caller drops its blocks)."""
        for put in [put for put in self.open_puts.values() if put.uid == part.uid]:
            del self.open_puts[put.put_id]  # its bytes are counted in part.nbytes
        self.bytes_held -= part.nbytes


def cell_lengths(req: PutRequest) -> np.ndarray | None:
    """The put's lengths as a (rows x fields) matrix in the order of ``req.fields``: what each cell it writes
    adds to its row's length (a per-row sum is put on the put's first field)."""
    if req.lengths is None:
        return None
    flat = req.lengths
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
