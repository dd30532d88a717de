"""PartitionState and ReadyIndex on their own: row allocation, commits, consumption, and the incremental ready
indexes checked against a brute-force recomputation after every step of seeded random histories."""

from __future__ import annotations

import random
from itertools import count

import numpy as np
import pytest

from transfer_queue.errors import (
    FieldAlreadyProduced,
    IncompleteGroups,
    InvalidRequest,
    PartitionOverfilled,
    SchemaMismatch,
)
from transfer_queue.metadata import FieldSchema
from transfer_queue.state.partition import (
    AVAILABLE,
    COMMITTED,
    FREE,
    MAX_FIELDS,
    RESERVED,
    PartitionState,
    ReadyIndex,
    describe_partition,
)
from transfer_queue.state.partition_status import consumption_status, row_state_counts

F32 = FieldSchema("dense", "float32", ())
_blocks = count()


def step(capacity: int = 8, group_size: int = 1, key: int = 0) -> PartitionState:
    return PartitionState(key, 1, capacity, group_size, key * capacity)


def put(part: PartitionState, num_rows: int, names=("x",), group_ids=None) -> np.ndarray:
    rows = part.allocate(num_rows, None if group_ids is None else np.asarray(group_ids, dtype=np.int64))
    commit(part, rows, names, new=True)
    return rows


def commit(part: PartitionState, rows: np.ndarray, names=("x",), new: bool = False, upsert: bool = False) -> list:
    names = list(names)
    part.add_fields(dict.fromkeys(names, F32))
    mask = part.begin_write(rows, names, upsert=upsert)
    part.end_write(rows, mask)
    block = next(_blocks)
    return part.commit(
        rows, names, np.full(len(rows), block), np.arange(len(rows)), None, np.full(len(rows), new, dtype=bool)
    )


def check_invariants(part: PartitionState) -> None:
    """Everything PartitionState keeps incrementally equals what a scan of its arrays says."""
    state = part.state[: part.num_rows]
    assert not np.any(part.state[part.num_rows :])  # nothing above the high-water mark
    assert part.num_committed == np.count_nonzero(state == COMMITTED)
    assert part.num_reserved == np.count_nonzero(state == RESERVED)
    if part.capacity is not None:
        assert part.num_rows <= part.capacity
    committed = np.flatnonzero(state == COMMITTED)
    members: dict[int, int] = {}
    for row in np.flatnonzero(state != FREE).tolist():
        members[int(part.group[row])] = members.get(int(part.group[row]), 0) + 1
    assert members == part.group_members
    assert all(c <= part.group_size for c in members.values())
    by_group: dict[int, list[int]] = {}
    for row in committed.tolist():
        by_group.setdefault(int(part.group[row]), []).append(row)
    assert {g: sorted(r) for g, r in part.group_rows.items()} == by_group
    for task in part.tasks.values():
        for mask, index in task.ready.items():
            m = np.uint64(mask)
            produced = committed[(part.produced_mask[committed] & m) == m]
            assert index.produced == len(produced)
            ready = produced[task.consumption[produced] == AVAILABLE]
            assert set(index.rows) == set(ready.tolist())
            counts: dict[int, int] = {}
            for row in ready.tolist():
                counts[int(part.group[row])] = counts.get(int(part.group[row]), 0) + 1
            if part.group_size > 1:  # with groups of one row, the rows are the groups and no counts are kept
                assert index.group_count == counts
                assert set(index.groups) == {g for g, c in counts.items() if c == part.group_size}


# ---- ReadyIndex --------------------------------------------------------------------------------------------
def test_ready_index_keeps_rows_in_order_and_complete_groups():
    group_of = np.array([0, 0, 1, 1, 2, 2])
    index = ReadyIndex(mask=1, group_size=2)
    index.add([2, 0, 3], group_of)
    assert list(index.rows) == [2, 0, 3] and list(index.groups) == [1]
    index.add([3, 1], group_of)  # adding a row twice is a no-op
    assert list(index.rows) == [2, 0, 3, 1] and list(index.groups) == [1, 0]
    index.remove([2, 5], group_of)  # removing a row that is not there is a no-op
    assert list(index.groups) == [0] and index.group_count == {0: 2, 1: 1}
    index.remove([3, 0, 1], group_of)
    assert index.rows == [] and index.group_count == {} and index.groups == {}


def test_describe_partition():
    assert describe_partition(3) == "global_step=3"
    assert describe_partition("val") == "partition_id='val'"


# ---- allocation --------------------------------------------------------------------------------------------
def test_puts_take_contiguous_rows_and_default_groups():
    part = step(capacity=8, group_size=2)
    assert put(part, 4).tolist() == [0, 1, 2, 3]
    assert part.group[:4].tolist() == [0, 0, 1, 1]
    assert put(part, 2).tolist() == [4, 5]
    check_invariants(part)


def test_allocation_errors_change_nothing():
    part = step(capacity=4, group_size=2)
    put(part, 2)
    before = (part.num_rows, part.num_reserved, dict(part.group_members))
    with pytest.raises(PartitionOverfilled, match=r"a put of 4 rows overfills global_step=0: it holds 4 rows"):
        part.allocate(4, None)
    with pytest.raises(IncompleteGroups, match="a put of 1 rows without group_ids must hold whole groups"):
        part.allocate(1, None)
    with pytest.raises(IncompleteGroups, match="group_ids has 1 entries; the put has 2 rows"):
        part.allocate(2, np.array([5]))
    with pytest.raises(IncompleteGroups, match=r"group 0 would have 3 members in global_step=0; num_n_samples=2"):
        part.allocate(1, np.array([0]))
    with pytest.raises(InvalidRequest, match="group_ids must be ints >= 0, got -1"):
        part.allocate(1, np.array([-1]))
    assert (part.num_rows, part.num_reserved, part.group_members) == before
    check_invariants(part)


def test_freed_rows_are_taken_again_and_a_step_never_grows_past_its_capacity():
    part = step(capacity=6)
    a = part.allocate(1, None)
    put(part, 2)
    b = part.allocate(2, None)
    put(part, 1)
    part.free(a)
    part.free(b)
    check_invariants(part)
    rows = part.allocate(3, None)  # no run of 3 is free: scattered rows, inside the step
    assert sorted(rows.tolist()) == [0, 3, 4]
    assert part.num_rows == 6
    check_invariants(part)


def test_default_groups_take_aligned_runs_whose_group_is_free():
    part = step(capacity=8, group_size=2)
    put(part, 1, group_ids=[1])  # row 0, explicit group 1: rows 0-1 and 2-3 cannot hold a default group
    assert put(part, 2).tolist() == [4, 5]
    assert part.group[[4, 5]].tolist() == [2, 2]
    with pytest.raises(PartitionOverfilled, match=r"needs 2 free groups of num_n_samples=2 rows in global_step=0; 1"):
        part.allocate(4, None)
    assert put(part, 1, group_ids=[1]).tolist() == [1]  # explicit groups take any free row
    check_invariants(part)


def test_string_partitions_grow_and_keep_task_state_aligned():
    part = PartitionState("replay", 1, None, 1, 0)
    put(part, 10)
    part.consume("t", np.arange(5))
    put(part, 100)  # grows the arrays past their first 64 rows
    assert len(part.tasks["t"].consumption) >= 110
    index = part.ready_index("t", ["x"])
    assert index is not None and len(index.rows) == 105
    check_invariants(part)


# ---- fields ------------------------------------------------------------------------------------------------
def test_schema_checks_and_field_limit():
    part = step()
    part.add_fields({"x": F32})
    part.check_schema({"x": F32, "y": F32})
    with pytest.raises(SchemaMismatch, match=r"field 'x' is stored as dense float32\[\] in global_step=0; the put"):
        part.check_schema({"x": FieldSchema("dense", "float32", (2,))})
    many = {f"f{i}": F32 for i in range(MAX_FIELDS)}
    with pytest.raises(
        InvalidRequest,
        match=rf"a partition holds at most {MAX_FIELDS} fields \(QueueConfig.max_fields, at most 64\); global_step=0",
    ):
        part.check_schema(many)
    part.add_fields({f"f{i}": F32 for i in range(MAX_FIELDS - 1)})  # 64 fields in all: the block table grows
    assert part.block.shape[1] >= MAX_FIELDS and part.field_mask(["f62"]) == 1 << 63
    assert part.field_mask(["nope"]) == -1


def test_write_checks():
    part = step()
    rows = put(part, 2)
    with pytest.raises(FieldAlreadyProduced, match=r"fields \['x'\] of global index 0 in global_step=0"):
        part.check_write(rows, ["x", "new"], upsert=False)
    part.check_write(rows, ["x", "new"], upsert=True)  # an upsert may rewrite a produced field
    part.add_fields({"y": F32})
    mask = part.begin_write(rows[:1], ["y"], upsert=True)
    with pytest.raises(FieldAlreadyProduced, match="another put is writing the same keys and fields"):
        part.check_write(rows, ["y"], upsert=True)
    part.end_write(rows[:1], mask)
    part.check_write(rows, ["y"], upsert=True)


def test_upserts_release_blocks_nothing_references():
    part = PartitionState("kv", 1, None, 1, 0, keyed=True)
    rows = put(part, 2)
    (old,) = set(part.block[rows, 0].tolist())
    assert commit(part, rows[:1], upsert=True) == []  # row 1 still references the old block
    assert commit(part, rows[1:], upsert=True) == [old]
    assert part.field_produced == [2]
    dead = part.remove_rows(rows)
    assert len(dead) == 2 and part.field_produced == [0]
    check_invariants(part)


# ---- consumption ---------------------------------------------------------------------------------------------
def test_consume_release_and_reset():
    part = step(capacity=8, group_size=2)
    put(part, 8)
    index = part.ready_index("t", ["x"])
    assert index is not None and list(index.groups) == [0, 1, 2, 3]
    part.consume("t", np.array([0, 3]))
    assert list(index.groups) == [2, 3]
    part.release("t", np.array([3, 0, 99, -1]))  # rows outside the partition are ignored
    assert list(index.rows)[-2:] == [3, 0] and list(index.groups) == [2, 3, 1, 0]
    part.release("t", np.array([3]))  # releasing an available row is a no-op
    counts = {"ready": 8, "leased": 0, "acknowledged": 0, "dead_lettered": 0}
    assert consumption_status(part, "t")["tasks"]["t"] == {"consumed": 0, "rows": 8, **counts}
    assert row_state_counts(part, "t") == counts
    part.consume("t", np.arange(8))
    part.reset_consumption("t")
    assert "t" not in part.tasks
    check_invariants(part)


def test_first_rows_and_first_groups():
    part = step(capacity=8, group_size=2)
    put(part, 2, group_ids=[5, 6])
    put(part, 2, group_ids=[6, 5])
    index = part.ready_index("t", ["x"])
    assert index is not None
    assert part.first_rows(index, 3).tolist() == [0, 1, 2]
    assert part.first_groups(index, 1).tolist() == [1, 2]  # group 6 completed first
    assert part.first_groups(index, 5).tolist() == [1, 2, 0, 3]
    assert part.first_groups(ReadyIndex(1, 2), 3).tolist() == []


# ---- random histories ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_random_histories_keep_every_index_exact(seed):
    rng = random.Random(seed)
    group_size = rng.choice([1, 2, 4])
    capacity = group_size * rng.choice([4, 8])
    part = step(capacity, group_size) if seed % 2 else PartitionState("p", 1, None, group_size, 0)
    open_puts: list[np.ndarray] = []
    fields = [["x"], ["y"], ["x", "y"]]
    next_group = count(100)
    for _ in range(150):
        op = rng.random()
        try:
            if op < 0.3:
                if rng.random() < 0.5:
                    k = group_size * rng.randint(1, 2)
                    open_puts.append(part.allocate(k, None))
                else:
                    g = next(next_group)
                    k = rng.randint(1, group_size)
                    open_puts.append(part.allocate(k, np.full(k, g)))
            elif op < 0.45 and open_puts:
                rows = open_puts.pop(rng.randrange(len(open_puts)))
                if rng.random() < 0.3:
                    part.free(rows)
                else:
                    commit(part, rows, rng.choice(fields[:2]), new=True)
            elif op < 0.55:
                committed = part.committed_rows()
                lacking = committed[part.block[committed, part.field_col["y"]] < 0] if "y" in part.field_col else []
                if len(lacking):
                    commit(part, np.asarray(rng.sample(list(lacking), rng.randint(1, len(lacking)))), ["y"])
            elif op < 0.75:
                task = rng.choice(["a", "b"])
                index = part.ready_index(task, rng.choice(fields))
                if index is not None and index.rows:
                    part.consume(task, np.asarray(rng.sample(list(index.rows), rng.randint(1, len(index.rows)))))
            elif op < 0.9:
                task = rng.choice(["a", "b"])
                population = range(part.num_rows + 2)
                part.release(task, np.asarray(rng.sample(population, rng.randint(0, 2)), np.int64))
            elif op < 0.95:
                part.reset_consumption(rng.choice(["a", None]))
            else:
                committed = part.committed_rows()
                if len(committed):
                    part.remove_rows(np.asarray(rng.sample(list(committed), 1)))
        except (PartitionOverfilled, IncompleteGroups):
            pass
        check_invariants(part)
