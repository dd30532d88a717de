"""PartitionState: production and consumption bookkeeping of one partition, in plain numpy (no Ray, no sockets).

Rows are numbered 0.. within a partition (``global_index = base_index + row``). Each row has a state
(free / reserved by an open put / committed), a GRPO group id and a length; each (row, field) cell has the storage
block and offset of its payload (``block = -1``: not produced). A row's produced fields are also kept as a 64-bit
mask, so "ready for these fields" is one integer comparison.

Per task, a delivery state per row (available / leased / acknowledged / dead-lettered, see docs/architecture.md
"Delivery"), who holds it and how often it was delivered, and, per set of requested fields, a :class:`ReadyIndex`:
the rows ready for that task and those fields, kept incrementally as puts commit and rows are leased, acknowledged
or handed back. Built-in samplers read these indexes and never scan the table. Who leased what until when lives in
:mod:`transfer_queue.state.delivery`; this module only keeps the per-row arrays.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transfer_queue.errors import (
    FieldAlreadyProduced,
    IncompleteGroups,
    InvalidRequest,
    PartitionOverfilled,
    RowsLost,
    SchemaMismatch,
    UnknownField,
)
from transfer_queue.metadata import (
    BatchMeta,
    FieldSchema,
    PartitionKey,
    check_custom_meta,
    describe_partition,
    merge_schema,
)
from transfer_queue.state.ready_index import AVAILABLE, CONSUMED, DEAD, LEASED, NO_HOLDER, ReadyIndex, TaskState

# LOST: its payload died with a storage unit (transfer_queue.state.lost_rows)
FREE, RESERVED, COMMITTED, LOST = 0, 1, 2, 3
MAX_FIELDS = 64  # produced fields are bits of one uint64 per row: the most ``QueueConfig.max_fields`` allows
MAX_TASKS_PER_PARTITION = 128  # task names one partition follows at once (idle ones are forgotten first)


SMALL_ARRAY = 64  # at most this many values: Python's Counter beats numpy's unique (~10 us of overhead per call)


def value_counts(values: np.ndarray) -> list[tuple[int, int]]:
    """``(value, count)`` of each distinct value of ``values``, ascending. A small put's commit counts a few blocks
    and groups several times: ``np.unique`` was most of its cost at a handful of rows."""
    if len(values) <= SMALL_ARRAY:
        return sorted(Counter(values.tolist()).items())
    ids, counts = np.unique(values, return_counts=True)
    return list(zip(ids.tolist(), counts.tolist(), strict=True))


def unique_in_order(rows: np.ndarray) -> np.ndarray:
    """``rows`` without repeats, each kept where it first appears."""
    _, first = np.unique(rows, return_index=True)
    return rows[np.sort(first)]


@dataclass
class DPRound:
    """One fetch round shared by the ranks of a data-parallel world (a ``dp_group_id``)."""

    dp_size: int
    batch_size: int
    fields: tuple[str, ...]
    shares: list[np.ndarray] | None = None  # local rows per dp rank, once the round is served
    released: set[int] = field(default_factory=set)
    lease_id: int = 0  # the lease that holds the round's rows until every rank acknowledged its share
    lease_s: float = 0.0
    expired: bool = False  # the lease ran out: unacknowledged rows went back to the task; the round is over


class PartitionState:
    """Bookkeeping of one partition: see the module docstring.

    Args:
        key: the global step (``int``) or the partition id (``str``).
        uid: identity of this incarnation; BatchMetas carry it so metas from before a clear are stale.
        capacity: rows a step holds (``global_batch_size * num_n_samples``); ``None`` for string partitions.
        group_size: rows per GRPO group (``num_n_samples``; 1 for partitions used by key).
        base_index: global index of row 0.
    """

    def __init__(
        self,
        key: PartitionKey,
        uid: int,
        capacity: int | None,
        group_size: int,
        base_index: int,
        keyed: bool = False,
        max_fields: int = MAX_FIELDS,
        promote_jagged: bool = False,
    ):
        self.key = key
        self.max_fields = max_fields
        self.promote_jagged = promote_jagged
        self.uid = uid
        self.capacity = capacity
        self.group_size = 1 if keyed else group_size
        self.base_index = base_index
        self.keyed = keyed
        self.closed = False
        self.fields: dict[str, FieldSchema] = {}
        self.field_col: dict[str, int] = {}
        self.num_rows = 0  # high-water mark of rows ever allocated
        self.num_committed = 0
        self.num_reserved = 0
        self.num_lost = 0  # rows in state LOST: they keep their index (never reused), room is made after them
        self.nbytes = 0
        self.tasks: dict[str, TaskState] = {}
        self.rounds: dict[tuple[str, str], DPRound] = {}
        self.group_members: dict[int, int] = {}  # group -> rows reserved or committed
        self.group_rows: dict[int, list[int]] = {}  # group -> committed rows
        self.keys: dict[str, int] = {}  # kv partitions: key -> row
        self.row_keys: dict[int, str] = {}
        self.custom_meta: dict[int, dict[str, Any]] = {}  # row -> its custom meta (set_custom_meta, kv tags)
        self.block_refs: dict[int, int] = {}  # block -> live cells referencing it
        self.block_nbytes: dict[int, int] = {}  # block -> payload bytes it holds
        self.field_produced: list[int] = []
        cap = capacity or 64
        self.state = np.zeros(cap, dtype=np.int8)
        self.group = np.full(cap, -1, dtype=np.int64)
        self.length = np.zeros(cap, dtype=np.int64)  # a row's length: the sum of its cells' lengths
        self.cell_length = np.zeros((cap, 4), dtype=np.int64)  # what each (row, field) adds to its row's length
        self.produced_mask = np.zeros(cap, dtype=np.uint64)
        self.inflight_mask = np.zeros(cap, dtype=np.uint64)
        self.block = np.full((cap, 4), -1, dtype=np.int64)
        self.offset = np.zeros((cap, 4), dtype=np.int64)
        # what changed since the journal last wrote this partition (transfer_queue.state.journal), marked by every
        # mutation here: rows (of the per-row arrays, the tasks' arrays, dead letters, kv keys and custom meta), the
        # groups and blocks whose dict entries may have changed with them, and tasks dropped. Kept only once a journal
        # took the partition (``journaled``); past twice the partition's rows it is "everything" (``dirty_all``).
        self.journaled = False
        self.dirty_all = False
        self.dirty_rows: list[np.ndarray] = []
        self.dirty_groups: list[np.ndarray] = []
        self.dirty_blocks: list[np.ndarray] = []
        self.dirty_count = 0
        self.dirty_cells = False  # some mark may have changed the per-row arrays (not only the tasks' or custom meta)
        self.dropped_tasks: set[str] = set()

    # ---- what the journal writes next ------------------------------------------------------------------------
    def mark(self, rows: np.ndarray, cells: bool = True) -> None:
        """``rows`` change now (call before changing them); ``cells``: their groups and blocks may too (their dict
        entries are written with them: the entries of the groups and blocks they hold now and then)."""
        if not self.journaled or self.dirty_all or not len(rows):
            return
        rows = np.array(rows, dtype=np.int64).reshape(-1)
        self.dirty_rows.append(rows)
        n = len(rows)
        if cells:
            self.dirty_cells = True
            inside = rows[rows < len(self.state)]
            self.dirty_groups.append(self.group[inside])
            self.dirty_blocks.append(self.block[inside].reshape(-1))
            n += len(inside) * (1 + self.block.shape[1])
        self._marked(n)

    def mark_blocks(self, blocks: Iterable[int]) -> None:
        """The dict entries of ``blocks`` change now (their bytes are freed)."""
        if not self.journaled or self.dirty_all:
            return
        ids = np.fromiter(blocks, dtype=np.int64)
        if len(ids):
            self.dirty_blocks.append(ids)
            self._marked(len(ids))

    def _marked(self, n: int) -> None:
        self.dirty_count += n
        if self.dirty_count > 2 * len(self.state) + 64:  # the next record is whole: forget the marks
            self.dirty_all = True
            self.dirty_rows, self.dirty_groups, self.dirty_blocks = [], [], []

    @property
    def dirty(self) -> bool:
        """Something changed since the journal last wrote this partition."""
        return self.dirty_all or bool(self.dirty_rows or self.dirty_blocks or self.dropped_tasks)

    def clear_marks(self) -> None:
        """The journal wrote what changed (or took the partition whole): marks start again."""
        self.journaled = True
        self.dirty_all = False
        self.dirty_rows, self.dirty_groups, self.dirty_blocks = [], [], []
        self.dirty_count = 0
        self.dirty_cells = False
        self.dropped_tasks = set()

    # ---- shape ---------------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return describe_partition(self.key)

    @property
    def sealed(self) -> bool:
        """No new rows will arrive: closed, or a step whose every row is committed."""
        return self.closed or (self.capacity is not None and self.num_committed == self.capacity)

    def _grow_rows(self, needed: int) -> None:
        cap = len(self.state)
        if needed <= cap:
            return
        new = max(needed, 2 * cap)
        self.state = np.concatenate([self.state, np.zeros(new - cap, dtype=np.int8)])
        self.group = np.concatenate([self.group, np.full(new - cap, -1, dtype=np.int64)])
        self.length = np.concatenate([self.length, np.zeros(new - cap, dtype=np.int64)])
        self.produced_mask = np.concatenate([self.produced_mask, np.zeros(new - cap, dtype=np.uint64)])
        self.inflight_mask = np.concatenate([self.inflight_mask, np.zeros(new - cap, dtype=np.uint64)])
        cols = self.block.shape[1]
        self.block = np.concatenate([self.block, np.full((new - cap, cols), -1, dtype=np.int64)])
        self.offset = np.concatenate([self.offset, np.zeros((new - cap, cols), dtype=np.int64)])
        self.cell_length = np.concatenate([self.cell_length, np.zeros((new - cap, cols), dtype=np.int64)])
        for task in self.tasks.values():
            task.grow(new)

    def field_mask(self, names: Iterable[str]) -> int:
        mask = 0
        for name in names:
            col = self.field_col.get(name)
            if col is None:
                return -1  # a field nobody produced yet: nothing is ready for it
            mask |= 1 << col
        return mask

    # ---- schema --------------------------------------------------------------------------------------------
    def check_schema(self, fields: dict[str, FieldSchema]) -> None:
        """Raise SchemaMismatch if a field clashes with what this partition stores; adds nothing."""
        for name, schema in fields.items():
            stored = self.fields.get(name)
            if stored is not None and merge_schema(stored, schema, self.promote_jagged) is None:
                hint = "" if self.promote_jagged else "; put it with jagged=[...] (or set promote_jagged) to vary it"
                raise SchemaMismatch(
                    f"field {name!r} is stored as {stored.describe()} in {self.name}; the put has {schema.describe()}"
                    + (hint if stored.kind != "object" and schema.kind != "object" else "")
                )
        new = [n for n in fields if n not in self.fields]
        if len(self.fields) + len(new) > self.max_fields:
            raise InvalidRequest(
                f"a partition holds at most {self.max_fields} fields (QueueConfig.max_fields, at most {MAX_FIELDS}); "
                f"{self.name} has {len(self.fields)} and the put adds {len(new)} more: {new[:8]}"
            )

    def add_fields(self, fields: dict[str, FieldSchema]) -> None:
        for name, schema in fields.items():
            if name in self.fields:
                merged = merge_schema(self.fields[name], schema, self.promote_jagged)
                assert merged is not None  # check_schema ran first
                self.fields[name] = merged
                continue
            col = len(self.fields)
            self.fields[name] = schema
            self.field_col[name] = col
            self.field_produced.append(0)
            if col >= self.block.shape[1]:
                extra = self.block.shape[1]
                self.block = np.concatenate([self.block, np.full((len(self.state), extra), -1, np.int64)], axis=1)
                self.offset = np.concatenate([self.offset, np.zeros((len(self.state), extra), np.int64)], axis=1)
                self.cell_length = np.concatenate(
                    [self.cell_length, np.zeros((len(self.state), extra), np.int64)], axis=1
                )

    # ---- rows of a put -------------------------------------------------------------------------------------
    def check_room(self, num_rows: int) -> None:
        """Raise if a put of ``num_rows`` new rows cannot fit (closed, or a step that would overfill)."""
        if self.closed:
            raise InvalidRequest(f"{self.name} is closed; no more rows can be put into it")
        if self.capacity is not None and self.num_committed + self.num_reserved + num_rows > self.capacity:
            taken = self.num_committed + self.num_reserved
            raise PartitionOverfilled(
                f"a put of {num_rows} rows overfills {self.name}: it holds {self.capacity} rows "
                f"(global_batch_size x num_n_samples) and {taken} are already taken"
            )

    def allocate(self, num_rows: int, group_ids: np.ndarray | None) -> np.ndarray:
        """Reserve ``num_rows`` free rows for a put; returns their local rows.

        Without ``group_ids`` the put holds whole groups, each in an aligned run of ``num_n_samples`` rows whose
        default group (``row // num_n_samples``) no explicit group id uses. The rows are one contiguous run (the
        first free one that fits, else appended); a step fragmented by aborted puts hands out scattered free rows
        (whole groups) rather than grow past its capacity.
        """
        n = self.group_size
        self.check_room(num_rows)
        if group_ids is None:
            if num_rows % n:
                raise IncompleteGroups(
                    f"a put of {num_rows} rows without group_ids must hold whole groups of num_n_samples={n} "
                    f"(got {num_rows % n} rows too many); pass group_ids to spread a group over several puts"
                )
        else:
            if len(group_ids) != num_rows:
                raise IncompleteGroups(f"group_ids has {len(group_ids)} entries; the put has {num_rows} rows")
            if len(group_ids) and group_ids.min() < 0:
                raise InvalidRequest(f"group_ids must be ints >= 0, got {int(group_ids.min())}")
            for g, c in value_counts(group_ids):
                have = self.group_members.get(g, 0)
                if have + c > n:
                    raise IncompleteGroups(f"group {g} would have {have + c} members in {self.name}; num_n_samples={n}")
        rows = self._free_rows(num_rows, n if group_ids is None else 1, default_groups=group_ids is None)
        groups = rows // n if group_ids is None else np.asarray(group_ids, dtype=np.int64)
        self._grow_rows(int(rows.max()) + 1)
        self.num_rows = max(self.num_rows, int(rows.max()) + 1)
        self.state[rows] = RESERVED
        self.group[rows] = groups
        self.mark(rows)
        self.num_reserved += num_rows
        for g, c in value_counts(groups):
            self.group_members[g] = self.group_members.get(g, 0) + c
        return rows

    def _free_rows(self, num_rows: int, unit: int, default_groups: bool) -> np.ndarray:
        """Free rows for a put, in runs of ``unit`` aligned rows; changes nothing."""
        k = num_rows // unit
        end = -(-self.num_rows // unit) * unit  # the aligned end of the rows handed out so far
        first_unit = end // unit
        no_holes = self.num_committed + self.num_reserved + self.num_lost == self.num_rows
        room = None if self.capacity is None else self.capacity + self.num_lost  # lost rows keep their indexes
        fits = room is None or end + num_rows <= room
        if no_holes and fits and not (default_groups and any(first_unit + i in self.group_members for i in range(k))):
            return np.arange(end, end + num_rows, dtype=np.int64)
        limit = -(-room // unit) * unit if room is not None else end + num_rows
        free = np.ones(limit, dtype=bool)
        free[: self.num_rows] = self.state[: self.num_rows] == FREE
        units = np.asarray(free.reshape(-1, unit).all(axis=1))
        if default_groups and self.group_members:
            taken = np.fromiter(self.group_members, dtype=np.int64)
            units[taken[(taken >= 0) & (taken < len(units))]] = False
        counts = np.concatenate([[0], np.cumsum(units)])
        runs = np.flatnonzero(counts[k:] - counts[:-k] == k)
        chosen = np.arange(runs[0], runs[0] + k) if len(runs) else np.flatnonzero(units)[:k]
        if len(chosen) < k:
            raise PartitionOverfilled(
                f"a put of {num_rows} rows without group_ids needs {k} free groups of num_n_samples={unit} rows in "
                f"{self.name}; {len(chosen)} are free (pass group_ids to use the scattered free rows)"
            )
        return (chosen[:, None] * unit + np.arange(unit)).reshape(-1)

    def free(self, rows: np.ndarray) -> None:
        """Give back rows reserved by a put that was aborted; a later put takes them."""
        if not len(rows):
            return
        self.mark(rows)
        for g, c in value_counts(self.group[rows]):
            left = self.group_members.get(g, 0) - c
            if left > 0:
                self.group_members[g] = left
            else:
                self.group_members.pop(g, None)
        self.state[rows] = FREE
        self.group[rows] = -1
        self.num_reserved -= len(rows)

    def rows_of(self, global_indexes: np.ndarray, uid: int) -> np.ndarray:
        """Local rows of committed global indexes (for a put with metadata)."""
        rows = global_indexes - self.base_index
        if len(rows) and rows.min() >= 0 and rows.max() < self.num_rows and np.any(self.state[rows] == LOST):
            lost = (rows[self.state[rows] == LOST] + self.base_index)[:20].tolist()
            raise RowsLost(
                f"rows {lost} of {self.name} were lost (their storage unit died and restarted empty): a put cannot "
                "write into them; their prompts are put again as new rows (see client.lost_rows)"
            )
        if len(rows) and (rows.min() < 0 or rows.max() >= self.num_rows or np.any(self.state[rows] != COMMITTED)):
            raise InvalidRequest(f"the metadata names rows that are not committed in {self.name}")
        if len(np.unique(rows)) != len(rows):
            raise InvalidRequest("the metadata names the same row twice; a put writes each row once")
        return rows

    def check_write(self, rows: np.ndarray, names: Iterable[str], upsert: bool) -> None:
        """Raise if an open put may not write fields ``names`` of existing ``rows``; changes nothing.

        Fields the partition does not hold yet cannot clash, so this runs before a put adds them.
        """
        names = [n for n in names if n in self.field_col]
        mask = np.uint64(self.field_mask(names))
        if not upsert:
            clash = (self.produced_mask[rows] | self.inflight_mask[rows]) & mask
            if np.any(clash):
                bad = int(np.flatnonzero(clash)[0])
                cols = [n for n in names if int(clash[bad]) >> self.field_col[n] & 1]
                raise FieldAlreadyProduced(
                    f"fields {cols} of global index {self.base_index + int(rows[bad])} in {self.name} are already "
                    f"produced (or being written); a put never rewrites a field outside a kv partition"
                )
        elif np.any(self.inflight_mask[rows] & mask):
            raise FieldAlreadyProduced(f"another put is writing the same keys and fields of {self.name} right now")

    def begin_write(self, rows: np.ndarray, names: Iterable[str], upsert: bool) -> int:
        """Mark fields of existing rows as being written by an open put; returns the fields' mask."""
        names = list(names)
        self.check_write(rows, names, upsert)
        mask = self.field_mask(names)
        self.inflight_mask[rows] |= np.uint64(mask)
        return mask

    def end_write(self, rows: np.ndarray, mask: int) -> None:
        self.inflight_mask[rows] &= ~np.uint64(mask)

    def commit(
        self,
        rows: np.ndarray,
        names: list[str],
        blocks: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray | None,
        new_rows: np.ndarray,
    ) -> list[int]:
        """Make a put visible: all its rows and fields at once (``new_rows`` marks rows the put created).

        ``lengths``: (rows x names) what each written cell adds to its row's length (None: nothing). A cell written
        again replaces its length, so a row's length never grows by being overwritten.
        Returns the blocks no longer referenced (kv upserts)."""
        self.mark(rows)
        cols = [self.field_col[n] for n in names]
        mask = 0
        for c in cols:
            mask |= 1 << c
        old_mask = self.produced_mask[rows].copy()
        dead_blocks: list[int] = []
        for c in cols:
            old = self.block[rows, c]
            had = old >= 0
            if np.any(had):  # kv upsert: the old payload loses a reference
                dead_blocks += self._unref(old[had])
            self.field_produced[c] += int(np.count_nonzero(~had))
            self.block[rows, c] = blocks
            self.offset[rows, c] = offsets
        for b, c in value_counts(blocks):
            self.block_refs[b] = self.block_refs.get(b, 0) + c * len(cols)
        self.produced_mask[rows] |= np.uint64(mask)
        cells = (rows[:, None], np.asarray(cols, dtype=np.int64))
        new_lengths = np.zeros((len(rows), len(cols)), np.int64) if lengths is None else lengths
        self.length[rows] += (new_lengths - self.cell_length[cells]).sum(axis=1)
        self.cell_length[cells] = new_lengths
        fresh = rows[new_rows]
        if len(fresh):
            self.state[fresh] = COMMITTED
            self.num_reserved -= len(fresh)
            self.num_committed += len(fresh)
            for row, g in zip(fresh.tolist(), self.group[fresh].tolist(), strict=True):
                self.group_rows.setdefault(g, []).append(row)
        new_mask = self.produced_mask[rows]
        for task in self.tasks.values():
            for index in task.ready.values():
                m = np.uint64(index.mask)
                became = rows[((new_mask & m) == m) & ((old_mask & m) != m)]
                index.produced += len(became)
                index.add(became[task.consumption[became] == AVAILABLE], self.group)
        return dead_blocks

    def _unref(self, blocks: np.ndarray) -> list[int]:
        dead = []
        for b, c in value_counts(blocks):
            left = self.block_refs.get(b, 0) - c
            if left > 0:
                self.block_refs[b] = left
            else:
                self.block_refs.pop(b, None)
                dead.append(b)
        return dead

    # ---- consumption ---------------------------------------------------------------------------------------
    def task(self, task_name: str) -> TaskState:
        task = self.tasks.get(task_name)
        if task is None:
            if len(self.tasks) >= MAX_TASKS_PER_PARTITION:
                self._forget_idle_tasks()
            task = self.tasks[task_name] = TaskState.of_size(len(self.state))
        return task

    def _forget_idle_tasks(self) -> None:
        """Bound the per-task state of a long-lived partition: a task that holds no row (nothing leased, acknowledged
        or dead-lettered) is only ready indexes, rebuilt on its next call."""
        n = self.num_rows
        idle = [k for k, t in self.tasks.items() if not np.any(t.consumption[:n] != AVAILABLE)]
        for name in idle:
            del self.tasks[name]
            self.dropped_tasks.add(name)

    def check_new_task(self, task_name: str) -> None:
        """Refuse one task name too many: every task this partition follows holds rows (see ``task``)."""
        if task_name not in self.tasks and len(self.tasks) >= MAX_TASKS_PER_PARTITION:
            self._forget_idle_tasks()
            if len(self.tasks) >= MAX_TASKS_PER_PARTITION:
                raise InvalidRequest(
                    f"{self.name} already follows {len(self.tasks)} tasks that hold rows (at most "
                    f"{MAX_TASKS_PER_PARTITION}); reset_consumption of finished tasks, or use fewer task names"
                )

    def ready_index(self, task_name: str, names: Iterable[str]) -> ReadyIndex | None:
        """The ready index of a task for a set of fields, built on first use (one scan), then kept."""
        mask = self.field_mask(names)
        if mask < 0:
            return None
        task = self.task(task_name)
        index = task.ready.get(mask)
        if index is None:
            index = task.ready[mask] = ReadyIndex(mask, self.group_size)
            committed = np.flatnonzero(self.state[: self.num_rows] == COMMITTED)
            m = np.uint64(mask)
            produced = committed[(self.produced_mask[committed] & m) == m]
            index.produced = len(produced)
            index.add(produced[task.consumption[produced] == AVAILABLE], self.group)
        return index

    def consume(self, task_name: str, rows: np.ndarray) -> None:
        """Mark rows acknowledged for a task at once (no lease)."""
        task = self.task(task_name)
        self.mark(rows, cells=False)
        task.consumption[rows] = CONSUMED
        for index in task.ready.values():
            index.remove(rows, self.group)

    def lease(self, task_name: str, rows: np.ndarray, lease_id: int, holder: int) -> None:
        """Hand ``rows`` (distinct, ready) to lease ``lease_id`` of owner ``holder``: no longer ready, one more
        delivery."""
        task = self.task(task_name)
        self.mark(rows, cells=False)
        task.consumption[rows] = LEASED
        task.lease[rows] = lease_id
        task.holder[rows] = holder
        task.deliveries[rows] += 1
        for index in task.ready.values():
            index.remove(rows, self.group)

    def acknowledge(self, task_name: str, rows: np.ndarray) -> None:
        """Leased rows are done for the task (they keep their lease id and holder, for a later release)."""
        self.mark(rows, cells=False)
        self.task(task_name).consumption[rows] = CONSUMED

    def give_back(self, task_name: str, rows: np.ndarray, reason: str, max_deliveries: int) -> np.ndarray:
        """Rows of a lease that expired, whose client went away or that were released: ready again, first in line,
        unless they were delivered ``max_deliveries`` times already: those are dead-lettered with ``reason``.
        Returns the rows dead-lettered."""
        task = self.task(task_name)
        rows = unique_in_order(rows)
        self.mark(rows, cells=False)
        dead = rows[task.deliveries[rows] >= max_deliveries]
        back = rows[task.deliveries[rows] < max_deliveries]
        task.lease[rows] = 0
        task.holder[rows] = NO_HOLDER
        task.consumption[dead] = DEAD
        for row in dead.tolist():
            task.dead[row] = reason
        task.consumption[back] = AVAILABLE
        for index in task.ready.values():
            m = np.uint64(index.mask)
            index.add_front(back[(self.produced_mask[back] & m) == m], self.group)
        return dead

    def release(self, task_name: str, rows: np.ndarray) -> None:
        """Hand rows back to a task: they are available (and ready, where produced) again, behind the rows ready
        now. Rows already available are ignored (a row named twice, or released twice, is released once)."""
        task = self.task(task_name)
        rows = unique_in_order(rows[(rows >= 0) & (rows < self.num_rows)])
        rows = rows[(task.consumption[rows] == LEASED) | (task.consumption[rows] == CONSUMED)]
        self.mark(rows, cells=False)
        task.consumption[rows] = AVAILABLE
        task.lease[rows] = 0
        task.holder[rows] = NO_HOLDER
        for index in task.ready.values():
            m = np.uint64(index.mask)
            index.add(rows[(self.produced_mask[rows] & m) == m], self.group)

    def reset_consumption(self, task_name: str | None) -> None:
        names = [task_name] if task_name is not None else list(self.tasks)
        for name in names:
            if self.tasks.pop(name, None) is not None:
                self.dropped_tasks.add(name)
            for round_key in [k for k in self.rounds if k[0] == name]:
                del self.rounds[round_key]

    def first_rows(self, index: ReadyIndex, k: int) -> np.ndarray:
        return index.first_rows(k)

    def first_groups(self, index: ReadyIndex, k: int) -> np.ndarray:
        if self.group_size == 1:  # every row is its own group
            return index.first_rows(k)
        groups = index.first_groups(k)
        if not groups:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.asarray(self.group_rows[g], dtype=np.int64) for g in groups])

    # ---- what samplers and metas see -----------------------------------------------------------------------
    def committed_rows(self) -> np.ndarray:
        return np.flatnonzero(self.state[: self.num_rows] == COMMITTED)

    def production_matrix(self, rows: np.ndarray) -> np.ndarray:
        return self.block[rows, : len(self.fields)] >= 0

    def meta(self, rows: np.ndarray, names: list[str], task_name: str | None, extra: dict[str, Any]) -> BatchMeta:
        """The BatchMeta of ``rows`` with fields ``names``, straight from the arrays (the controller encodes it)."""
        if not len(rows):  # the end of a stream: a field nobody produced has no schema to name
            names = [n for n in names if n in self.field_col]
        cols: list[int] = []
        for n in names:
            if n not in self.field_col:
                raise UnknownField(f"field {n!r} is not in {self.name}; it has {list(self.fields)}")
            cols.append(self.field_col[n])
        cells = (rows[:, None], np.asarray(cols, dtype=np.int64))
        if self.custom_meta:
            extra = {**extra, "custom_meta": [self.custom_meta.get(r, {}) for r in rows.tolist()]}
        return BatchMeta.of_arrays(
            self.key,
            self.uid,
            rows + self.base_index,
            self.group[rows],
            {n: self.fields[n] for n in names},
            self.block[cells],
            self.offset[cells],
            task_name,
            extra,
        )

    def remove_rows(self, rows: np.ndarray) -> list[int]:
        """Forget committed rows (kv_clear); returns the blocks no longer referenced."""
        self.mark(rows)
        dead: list[int] = []
        for c in range(len(self.fields)):
            cells = self.block[rows, c]
            live = cells >= 0
            self.field_produced[c] -= int(np.count_nonzero(live))
            dead += self._unref(cells[live])
        for task in self.tasks.values():
            for index in task.ready.values():
                m = np.uint64(index.mask)
                index.produced -= int(np.count_nonzero((self.produced_mask[rows] & m) == m))
                index.remove(rows, self.group)
            task.consumption[rows] = AVAILABLE
            task.lease[rows] = 0
            task.holder[rows] = NO_HOLDER
            task.deliveries[rows] = 0
            for row in rows.tolist():
                task.dead.pop(row, None)
        self._leave_groups(rows)
        for row in rows.tolist():
            self.custom_meta.pop(row, None)
        self.block[rows] = -1
        self.produced_mask[rows] = 0
        self.length[rows] = 0
        self.cell_length[rows] = 0
        self.state[rows] = FREE
        self.group[rows] = -1
        self.num_committed -= len(rows)
        return dead

    def _leave_groups(self, rows: np.ndarray) -> None:
        """Take ``rows`` out of their groups' member lists and counts (a group with none left is forgotten)."""
        for row, g in zip(rows.tolist(), self.group[rows].tolist(), strict=True):
            members = self.group_rows.get(g)
            if members is not None and row in members:
                members.remove(row)
                if not members:
                    del self.group_rows[g]
            left = self.group_members.get(g, 1) - 1
            if left > 0:
                self.group_members[g] = left
            else:
                self.group_members.pop(g, None)

    def lose_rows(self, rows: np.ndarray) -> None:
        """Committed ``rows`` lost their payload (a storage unit restarted empty): they leave every ready index and
        their groups, keep their index and their tasks' delivery state (an ack of a row read before it was lost still
        counts), and are never served or written again. A step makes room for as many new rows after its capacity."""
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return
        self.mark(rows)
        for task in self.tasks.values():
            for index in task.ready.values():
                m = np.uint64(index.mask)
                index.produced -= int(np.count_nonzero((self.produced_mask[rows] & m) == m))
                index.remove(rows, self.group)
        for c in range(len(self.fields)):
            self.field_produced[c] -= int(np.count_nonzero(self.block[rows, c] >= 0))
        self._leave_groups(rows)
        for row in rows.tolist():
            key = self.row_keys.pop(row, None)
            if key is not None:
                self.keys.pop(key, None)
        self.produced_mask[rows] = 0
        self.state[rows] = LOST
        self.num_committed -= len(rows)
        self.num_lost += len(rows)

    def committed_rows_of(self, global_indexes: np.ndarray, what: str) -> np.ndarray:
        """Local rows of ``global_indexes``, each committed and named once; else InvalidRequest."""
        rows = np.asarray(global_indexes, dtype=np.int64) - self.base_index
        inside = (rows >= 0) & (rows < self.num_rows)
        if not inside.all() or np.any(self.state[rows] != COMMITTED):
            bad = (rows[~inside] if not inside.all() else rows[self.state[rows] != COMMITTED]) + self.base_index
            raise InvalidRequest(f"{what}: global indexes {bad[:10].tolist()} are not committed rows of {self.name}")
        if len(np.unique(rows)) != len(rows):
            raise InvalidRequest(f"{what}: a row is named twice")
        return rows

    def set_custom_meta(self, rows: np.ndarray, values: list[Any]) -> None:
        """Give ``rows`` their custom meta: a small msgpack-encodable dict each (``None`` or ``{}`` removes it)."""
        if len(values) != len(rows):
            raise InvalidRequest(f"custom meta needs one value per row: {len(rows)} rows, got {len(values)}")
        check_custom_meta(values, [f"global index {self.base_index + row}" for row in rows.tolist()])
        self.mark(rows, cells=False)
        for row, value in zip(rows.tolist(), values, strict=True):
            if value:
                self.custom_meta[row] = value
            else:
                self.custom_meta.pop(row, None)
