"""QueueState driven through ``handle`` with protocol structs, on a fake clock: the semantics in docs/architecture.md
("One GRPO step, row by row", "Delivery").

Every test builds a queue with the ``make_queue`` fixture (tests/unit/conftest.py). Default shape:
global_batch_size=4, num_global_batch=2, num_n_samples=1, so a step holds 4 rows and two steps are live at once.
"""

from __future__ import annotations

import re

import msgspec
import pytest

from transfer_queue.errors import (
    FieldAlreadyProduced,
    GetMetaTimeout,
    IncompleteGroups,
    InvalidRequest,
    PartitionCleared,
    PartitionOverfilled,
    PutExpired,
    QueueFull,
    SamplerError,
    SchemaMismatch,
    StaleBatchMeta,
    UnknownField,
    UnknownKey,
    UnknownPartition,
)
from transfer_queue.metadata import BatchMeta, FieldSchema
from transfer_queue.samplers import DPSampler, GRPOSampler
from transfer_queue.wire import protocol as p

F32 = FieldSchema("dense", "float32", ())
I64 = FieldSchema("dense", "int64", ())
X = {"x": F32}
Y = {"y": F32}
XY = {"x": F32, "y": F32}


def indexes(meta) -> list[int]:
    return meta.global_indexes.tolist()


def drops(q) -> list:
    """The outbox without the tombstone bounds drops carry (live uids, block floor:
    tests/unit/transfer_queue/state/test_bounds.py)."""
    bare = {"live_uids": None, "max_uid": None, "block_floor": None}
    return [
        (unit, msgspec.structs.replace(m, **{k: v for k, v in bare.items() if hasattr(m, k)}))
        for unit, m in q.table.outbox
    ]


def consumed(q, partition, task="train") -> int:
    return q.ok(p.ConsumptionStatus(partition, task))["tasks"][task]["consumed"]


# ---- readiness -----------------------------------------------------------------------------------------------
def test_ready_means_every_field_produced_and_not_consumed_by_the_task(make_queue):
    q = make_queue()
    put = q.put(0, 4, X)
    q.put(0, 2, Y, metadata=put.select_samples([0, 1]))
    assert indexes(q.get(0, ["x"], 4, "a")) == [0, 1, 2, 3]
    assert indexes(q.get(0, ["x", "y"], 2, "b")) == [0, 1]
    # consumption is per task, not per field set: b consumed rows 0, 1 whatever fields it asked for
    assert indexes(q.get(0, ["x"], 2, "b")) == [2, 3]
    waiting = q.get_async(0, ["x", "y"], 4, "c")
    assert not waiting.done  # only 2 rows have y; 2 more can still get it
    q.put(0, 2, Y, metadata=put.select_samples([2, 3]))
    assert indexes(waiting.result().to_meta()) == [0, 1, 2, 3]
    assert indexes(q.get(0, ["x", "y"], 4, "a")) == []  # a consumed them all: end of stream for a


def test_ready_index_follows_commits_consumption_release_and_reset(make_queue):
    q = make_queue()
    q.put(0, 2, X)
    first = q.get(0, "x", 1)
    assert indexes(first) == [0]
    q.put(0, 2, X)
    assert indexes(q.get(0, "x", 2)) == [1, 2]
    q.release(first)
    assert consumed(q, 0) == 2
    # a released row is ready again, after the rows that were ready before it
    assert indexes(q.get(0, "x", 2)) == [3, 0]
    assert consumed(q, 0) == 4
    q.ok(p.ResetConsumption(0, "train"))
    assert consumed(q, 0) == 0
    assert indexes(q.get(0, "x", 4)) == [0, 1, 2, 3]
    # a second field set of the same task shares its consumption
    q.ok(p.ResetConsumption(None, None))
    assert indexes(q.get(0, "x", 3)) == [0, 1, 2]
    assert indexes(q.get(0, ["x"], 1, "other")) == [0]


# ---- the step ring -------------------------------------------------------------------------------------------
def test_a_put_opening_one_step_too_many_waits_for_a_clear(make_queue):
    q = make_queue(num_global_batch=2)
    q.put(0, 4, X)
    q.put(1, 4, X)
    waiting = q.send(q.reserve_request(2, 4, X))
    assert not waiting.done
    q.clear(0)
    reservation = waiting.result()
    assert p.unpack_indexes(reservation.global_indexes).tolist() == [8, 9, 10, 11]
    q.commit(reservation)
    assert q.ok(p.ListPartitions()) == [1, 2]


def test_a_put_waiting_for_the_step_ring_times_out_with_queue_full_naming_live_steps(make_queue):
    q = make_queue(num_global_batch=2)
    q.put(0, 4, X)
    q.put(1, 4, X)
    waiting = q.send(q.reserve_request(2, 4, X, timeout=5.0))
    q.advance(4.9)
    assert not waiting.done
    q.advance(0.2)
    with pytest.raises(
        QueueFull,
        match=r"put to global_step=2 waited 5\.0 s for a free slot in the step ring: num_global_batch=2 steps "
        r"are live \(\[0, 1\]\); clear one first",
    ):
        waiting.result()
    assert q.ok(p.ListPartitions()) == [0, 1]


def test_get_meta_on_a_cleared_step_or_one_behind_the_window_fails_before_waiting(make_queue):
    q = make_queue(num_global_batch=2)
    q.put(0, 4, X)
    q.put(2, 4, X)
    q.clear(2)
    with pytest.raises(PartitionCleared, match=r"global_step=2 was cleared or lies behind the live window"):
        q.get(2, "x", 1)
    # step 1 was never opened and lies behind the cleared step 2: it can never come
    with pytest.raises(PartitionCleared, match=r"global_step=1 was cleared .* live steps: \[0\]"):
        q.get(1, "x", 1)
    assert indexes(q.get(0, "x", 4)) == [0, 1, 2, 3]  # a live step below the cleared one still serves
    with pytest.raises(PartitionCleared, match="global_step=1 was cleared"):
        q.put(1, 4, X)


def test_get_meta_on_a_step_not_opened_yet_waits_for_its_first_put(make_queue):
    q = make_queue()
    waiting = q.get_async(1, "x", 2)
    assert not waiting.done
    q.put(1, 4, X)
    assert indexes(waiting.result().to_meta()) == [4, 5]


def test_a_waiting_get_meta_fails_when_its_partition_is_cleared(make_queue):
    q = make_queue()
    q.put(0, 2, X)
    on_open = q.get_async(0, "x", 4)
    not_opened = q.get_async(1, "x", 4)
    named = q.get_async("val", "x", 4)
    q.clear(0)
    with pytest.raises(PartitionCleared, match="global_step=0 was cleared while get_meta waited for it"):
        on_open.result()
    # clearing a partition never opened is a no-op (issue 8, defect 5): its waiters go on waiting for its first put
    q.clear(1)
    q.clear("val")
    assert not not_opened.done and not named.done
    q.put(1, 4, X)
    q.put("val", 4, X)
    assert indexes(not_opened.result().to_meta()) == [4, 5, 6, 7]
    assert indexes(named.result().to_meta()) == [0, 1, 2, 3]
    assert q.state.getters == {}


def test_clearing_a_later_step_fails_waiters_of_steps_now_behind_the_window(make_queue):
    q = make_queue()
    q.put(3, 4, X)
    waiting = q.get_async(2, "x", 1)
    q.clear(3)
    with pytest.raises(PartitionCleared, match="global_step=2 was cleared or lies behind the live window"):
        waiting.result()


def test_string_partitions_live_outside_the_step_ring(make_queue):
    q = make_queue(num_global_batch=1)
    q.put(0, 4, X)
    meta = q.put("val", 6, X)  # no capacity: more rows than a step holds
    assert meta.partition_id == "val" and indexes(meta) == [0, 1, 2, 3, 4, 5]
    q.put("val", 3, X)
    assert q.ok(p.ProductionStatus("val"))["capacity"] is None
    assert indexes(q.get("val", "x", 9)) == list(range(9))
    assert sorted(map(str, q.ok(p.ListPartitions()))) == ["0", "val"]
    with pytest.raises(InvalidRequest, match="partition_id must be a non-empty str"):
        q.put("", 1, X)
    with pytest.raises(InvalidRequest, match="global_step must be >= 0, got -1"):
        q.get(-1, "x", 1)


# ---- what a put appends --------------------------------------------------------------------------------------
def test_a_put_appends_one_contiguous_block_of_rows(make_queue):
    q = make_queue()
    assert indexes(q.put(0, 2, X)) == [0, 1]
    assert indexes(q.put(0, 2, X)) == [2, 3]
    assert indexes(q.put(1, 3, X)) == [4, 5, 6]  # step 1 starts at 1 * rows_per_step


def test_default_group_ids_are_row_div_num_n_samples(make_queue):
    q = make_queue(global_batch_size=4, num_n_samples=2)
    assert q.put(0, 4, X).group_ids.tolist() == [0, 0, 1, 1]
    assert q.put(0, 2, X).group_ids.tolist() == [2, 2]
    assert q.put(1, 2, X).group_ids.tolist() == [0, 0]  # scoped to the step


def test_explicit_group_ids_let_a_group_arrive_over_several_puts(make_queue):
    q = make_queue(global_batch_size=4, num_n_samples=2, sampler=GRPOSampler(2))
    q.put(0, 1, X, group_ids=[7])
    q.put(0, 2, X, group_ids=[5, 5])
    waiting = q.get_async(0, "x", 4)
    assert not waiting.done  # group 7 has one member of two
    q.put(0, 1, X, group_ids=[7])
    meta = waiting.result().to_meta()
    assert sorted(zip(meta.group_ids.tolist(), indexes(meta), strict=True)) == [(5, 1), (5, 2), (7, 0), (7, 3)]
    with pytest.raises(IncompleteGroups, match=r"group 7 would have 3 members in global_step=0; num_n_samples=2"):
        q.put(0, 1, X, group_ids=[7])
    with pytest.raises(IncompleteGroups, match=r"group_ids has 1 entries; the put has 2 rows"):
        q.put(0, 2, X, group_ids=[1])


def test_a_put_without_group_ids_must_hold_whole_groups(make_queue):
    q = make_queue(num_n_samples=4)
    with pytest.raises(
        IncompleteGroups,
        match=r"a put of 6 rows without group_ids must hold whole groups of num_n_samples=4 \(got 2 rows too many\)",
    ):
        q.put(0, 6, X)
    assert q.ok(p.ListPartitions()) == []  # refused before opening anything


def test_batch_size_must_be_a_multiple_of_the_group_size_when_whole_groups_are_served(make_queue):
    q = make_queue(num_n_samples=2)
    message = r"batch_size=3 is not divisible by num_n_samples=2; whole groups are served"
    with pytest.raises(IncompleteGroups, match=message):
        q.get(0, "x", 3, get_n_samples=True)  # before waiting on a step nobody opened
    q.state.register_sampler("grpo", GRPOSampler(2))
    with pytest.raises(IncompleteGroups, match=message):
        q.get(0, "x", 3, "grpo")
    assert q.state.getters == {}


def test_overfilling_a_step_is_refused(make_queue):
    q = make_queue()
    with pytest.raises(
        PartitionOverfilled,
        match=r"a put of 6 rows can never fit global_step=0: a step holds at most 4 rows \(global_batch_size=4 x "
        r"num_n_samples=1\)",
    ):
        q.put(0, 6, X)
    q.put(0, 3, X)
    with pytest.raises(
        PartitionOverfilled,
        match=r"a put of 2 rows overfills global_step=0: it holds 4 rows \(global_batch_size x num_n_samples\) "
        r"and 3 are already taken",
    ):
        q.put(0, 2, X)
    q.ok(p.Clear(0))
    q.put(1, 2, X)
    q.reserve(1, 1, X)  # reserved rows count as taken
    with pytest.raises(PartitionOverfilled, match="and 3 are already taken"):
        q.put(1, 2, X)


@pytest.mark.parametrize(
    ("stored", "put", "described"),
    [
        (F32, I64, "dense int64[]"),
        (FieldSchema("dense", "float32", (3,)), FieldSchema("dense", "float32", (4,)), "dense float32[4]"),
        (F32, FieldSchema("jagged", "float32", ()), "jagged float32[*]"),
        (F32, FieldSchema("object", "object", ()), "object"),
    ],
    ids=["dtype", "shape", "kind-jagged", "kind-object"],
)
def test_a_schema_clash_is_refused(make_queue, stored, put, described):
    q = make_queue()
    q.put(0, 2, {"x": stored})
    assert put.describe() == described
    message = f"field 'x' is stored as {stored.describe()} in global_step=0; the put has {described}"
    with pytest.raises(SchemaMismatch, match=re.escape(message)):
        q.put(0, 2, {"x": put})
    assert q.ok(p.ProductionStatus(0))["rows"] == 2


def test_rewriting_a_produced_field_is_refused(make_queue):
    q = make_queue()
    meta = q.put(0, 2, X)
    with pytest.raises(
        FieldAlreadyProduced,
        match=r"fields \['x'\] of global index 1 in global_step=0 are already produced \(or being written\)",
    ):
        q.put(0, 1, X, metadata=meta.select_samples([1]))
    reservation = q.reserve(0, 1, Y, metadata=meta.select_samples([0]))
    with pytest.raises(FieldAlreadyProduced, match=r"fields \['y'\] of global index 0"):
        q.put(0, 1, Y, metadata=meta.select_samples([0]))  # being written by the open put
    q.commit(reservation)


def test_a_put_with_metadata_writes_fields_into_existing_rows(make_queue):
    q = make_queue()
    meta = q.put(0, 4, X, lengths=[1, 2, 3, 4])
    written = q.put(0, 2, {"y": I64}, metadata=meta.select_samples([3, 1]), lengths=[10, 10])
    assert indexes(written) == [3, 1] and written.field_names == ["y"]
    status = q.ok(p.ProductionStatus(0))
    assert status["fields"]["y"] == {"schema": "dense int64[]", "produced": 2}
    assert status["rows"] == 4
    got = q.get(0, ["x", "y"], 2)
    assert indexes(got) == [1, 3]
    part = q.state.partitions[0]
    assert part.length[:4].tolist() == [1, 12, 3, 14]  # lengths add up over the fields a row gets
    bogus = BatchMeta(0, meta.partition_uid, [99], [0], {}, [], [])
    with pytest.raises(InvalidRequest, match="the metadata names rows that are not committed in global_step=0"):
        q.put(0, 1, Y, metadata=bogus)


def test_a_put_with_metadata_from_before_a_clear_is_stale(make_queue):
    q = make_queue()
    meta = q.put("val", 2, X)
    q.clear("val")
    q.put("val", 2, X)
    with pytest.raises(StaleBatchMeta, match="the metadata of this put is from before a clear of partition_id='val'"):
        q.put("val", 2, Y, metadata=meta)


def test_a_closed_partition_takes_no_more_rows(make_queue):
    q = make_queue()
    q.put("val", 2, X)
    q.ok(p.ClosePartition("val"))
    with pytest.raises(InvalidRequest, match="partition_id='val' is closed; no more rows can be put into it"):
        q.put("val", 1, X)


# ---- atomic visibility ---------------------------------------------------------------------------------------
def test_rows_are_invisible_until_their_put_commits(make_queue):
    q = make_queue()
    reservation = q.reserve(0, 4, X)
    status = q.ok(p.ProductionStatus(0))
    assert (status["rows"], status["rows_in_flight"]) == (0, 4)
    waiting = q.get_async(0, "x", 1)
    assert not waiting.done
    q.commit(reservation)
    assert indexes(waiting.result().to_meta()) == [0]


def test_an_aborted_put_frees_its_rows_for_the_next_put(make_queue):
    q = make_queue()
    aborted = q.reserve(0, 2, X)
    q.put(0, 2, X)
    q.ok(p.Abort(aborted.put_id))
    (place,) = aborted.placements
    assert drops(q)[-1] == (place.unit, p.DropBlocks(aborted.partition_uid, [place.block_id]))
    assert q.ok(p.ProductionStatus(0))["rows_in_flight"] == 0
    assert indexes(q.put(0, 2, X)) == [0, 1]  # the hole is reused; the step is full now
    assert sorted(indexes(q.get(0, "x", 4))) == [0, 1, 2, 3]
    with pytest.raises(PutExpired, match=f"put {aborted.put_id} expired, was aborted"):
        q.commit(aborted)


def test_scattered_holes_are_reused_without_leaving_the_step(make_queue):
    q = make_queue()
    first = q.reserve(0, 1, X)
    q.put(0, 2, X)
    last = q.reserve(0, 1, X)
    q.ok(p.Abort(first.put_id))
    q.ok(p.Abort(last.put_id))
    meta = q.put(0, 2, X)  # two free rows, not adjacent: still inside the step's 4 rows
    assert sorted(indexes(meta)) == [0, 3]
    assert q.put(1, 1, X).global_indexes.tolist() == [4]


def test_adjacent_holes_merge(make_queue):
    q = make_queue()
    a, b = q.reserve(0, 1, X), q.reserve(0, 1, X)
    q.put(0, 2, X)
    q.ok(p.Abort(a.put_id))
    q.ok(p.Abort(b.put_id))
    assert indexes(q.put(0, 2, X)) == [0, 1]


def test_default_groups_stay_aligned_after_puts_with_explicit_group_ids(make_queue):
    q = make_queue(global_batch_size=4, num_n_samples=2, sampler=GRPOSampler(2))
    q.put(0, 1, X, group_ids=[9])
    meta = q.put(0, 2, X)  # whole group without group_ids: must not straddle two default groups
    assert len(set(meta.group_ids.tolist())) == 1
    assert meta.group_ids.tolist() == (meta.global_indexes // 2).tolist()
    assert sorted(indexes(q.get(0, "x", 2))) == indexes(meta)


def test_default_groups_skip_group_ids_taken_by_explicit_puts(make_queue):
    q = make_queue(global_batch_size=4, num_n_samples=2)
    q.put(0, 1, X, group_ids=[1])  # rows 2, 3 would default to group 1, which is taken
    assert q.put(0, 2, X).group_ids.tolist() == [2, 2]
    with pytest.raises(
        PartitionOverfilled,
        match=r"a put of 4 rows without group_ids needs 2 free groups of num_n_samples=2 rows in global_step=0; "
        r"1 are free",
    ):
        q.put(0, 4, X)
    assert q.ok(p.ProductionStatus(0))["rows_in_flight"] == 0
    assert q.state.partitions[0].num_rows <= 8


def test_an_expired_open_put_is_aborted_and_its_blocks_dropped(make_queue):
    q = make_queue(put_grace=2.0)
    reservation = q.reserve(0, 4, X, timeout=1.0)
    waiting = q.get_async(0, "x", 4, timeout=100.0)
    q.advance(2.9)
    assert q.state.open_puts
    q.advance(0.2)  # past timeout + put_grace
    assert not q.state.open_puts
    (place,) = reservation.placements
    assert (place.unit, p.DropBlocks(reservation.partition_uid, [place.block_id])) in drops(q)
    assert q.state.bytes_held == 0
    with pytest.raises(PutExpired, match=r"put 1 expired, was aborted, or its partition was cleared before the commit"):
        q.commit(reservation)
    assert not waiting.done
    q.put(0, 4, X)  # the rows are free again
    assert indexes(waiting.result().to_meta()) == [0, 1, 2, 3]


def test_a_commit_after_a_clear_is_refused(make_queue):
    q = make_queue()
    reservation = q.reserve(0, 4, X)
    q.clear(0)
    with pytest.raises(PutExpired, match="none of its rows are visible"):
        q.commit(reservation)
    assert q.state.bytes_held == 0


# ---- GRPO groups ---------------------------------------------------------------------------------------------
def assert_whole_groups(meta, n: int) -> None:
    groups = meta.group_ids.tolist()
    for i in range(0, len(groups), n):
        assert len(set(groups[i : i + n])) == 1, f"group split or mixed: {groups}"
    assert len(set(groups)) == len(groups) // n


def test_grpo_groups_are_never_split_or_mixed_with_out_of_order_group_ids(make_queue):
    q = make_queue(global_batch_size=4, num_n_samples=4, sampler=GRPOSampler(4))
    order = [3, 1, 3, 0, 2, 1, 1, 3, 0, 2, 2, 0, 1, 3, 0, 2]
    served = []
    for k in range(0, 16, 2):
        q.put(0, 2, X, group_ids=order[k : k + 2])
        while True:
            reply = q.get_async(0, "x", 4, timeout=1.0)
            if not reply.done:
                q.advance(1.1)
                assert isinstance(reply.error, GetMetaTimeout)
                break
            meta = reply.result().to_meta()
            if not len(meta):
                break  # the step is full and everything was served: end of stream
            assert_whole_groups(meta, 4)
            served.append(meta.group_ids[0])
    assert sorted(served) == [0, 1, 2, 3]
    assert served == [1, 3, 0, 2]  # in the order groups became complete


def test_grpo_groups_stay_whole_across_clears(make_queue):
    q = make_queue(global_batch_size=2, num_global_batch=1, num_n_samples=2)
    for step in range(3):
        q.put(step, 1, X, group_ids=[0])
        q.put(step, 2, X, group_ids=[1, 1])
        q.put(step, 1, X, group_ids=[0])
        meta = q.get(step, "x", 4, get_n_samples=True)
        assert_whole_groups(meta, 2)
        assert meta.global_indexes.min() >= 4 * step
        q.clear(step)


def test_get_n_samples_makes_the_sequential_sampler_serve_whole_groups(make_queue):
    q = make_queue(global_batch_size=4, num_n_samples=2)
    q.put(0, 2, X, group_ids=[0, 1])
    q.put(0, 1, X, group_ids=[1])
    meta = q.get(0, "x", 2, get_n_samples=True)
    assert meta.group_ids.tolist() == [1, 1] and indexes(meta) == [1, 2]
    assert indexes(q.get(0, "x", 1, "rows")) == [0]  # without get_n_samples: rows in ready order


# ---- DP rounds -----------------------------------------------------------------------------------------------
def dp(rank: int, size: int = 2, group: str = "g0") -> dict:
    return {"dp_rank": rank, "dp_size": size, "dp_group_id": group}


def test_a_dp_round_serves_every_rank_its_share_however_often_it_asks(make_queue):
    q = make_queue(global_batch_size=8)
    q.put(0, 8, X)
    r0 = q.get(0, "x", 2, sampler_params=dp(0))
    assert consumed(q, 0) == 4  # the first call takes dp_size * batch_size rows for the round
    r1 = q.get(0, "x", 2, sampler_params=dp(1))
    assert indexes(r0) == [0, 1] and indexes(r1) == [2, 3]
    for _ in range(3):  # TP/PP peers of a rank ask again
        assert indexes(q.get(0, "x", 2, sampler_params=dp(1))) == [2, 3]
        assert indexes(q.get(0, "x", 2, sampler_params=dp(0))) == [0, 1]
    assert r1.extra == {"dp_rank": 1, "dp_size": 2, "dp_group_id": "g0", "round_rows": 4, "round_max_share": 2}
    n0 = q.get(0, "x", 2, sampler_params=dp(0, group="g1"))
    n1 = q.get(0, "x", 2, sampler_params=dp(1, group="g1"))
    assert sorted(indexes(n0) + indexes(n1)) == [4, 5, 6, 7]  # a new round never overlaps an old one
    assert consumed(q, 0) == 8


def test_a_dp_round_waits_until_its_whole_share_is_ready(make_queue):
    q = make_queue(global_batch_size=8)
    q.put(0, 2, X)
    waiting = q.get_async(0, "x", 2, sampler_params=dp(1))
    peer = q.get_async(0, "x", 2, sampler_params=dp(0))
    assert not waiting.done and not peer.done
    q.put(0, 2, X)
    assert indexes(waiting.result().to_meta()) == [2, 3]
    assert indexes(peer.result().to_meta()) == [0, 1]


def test_a_dp_round_refuses_a_different_shape(make_queue):
    q = make_queue(global_batch_size=8)
    q.put(0, 8, X)
    q.get(0, "x", 2, sampler_params=dp(0))
    with pytest.raises(
        InvalidRequest,
        match=r"dp_group_id 'g0' was opened with dp_size=2, batch_size=2, fields=\['x'\]; this call has "
        r"dp_size=4, batch_size=2",
    ):
        q.get(0, "x", 2, sampler_params=dp(1, size=4))
    with pytest.raises(InvalidRequest, match="this call has dp_size=2, batch_size=3"):
        q.get(0, "x", 3, sampler_params=dp(1))


def test_dp_rank_out_of_range_fails_before_waiting(make_queue):
    q = make_queue()
    with pytest.raises(InvalidRequest, match=r"dp_rank must lie in \[0, dp_size=2\), got dp_rank=2"):
        q.get(5, "x", 2, sampler_params=dp(2))
    with pytest.raises(InvalidRequest, match=r"dp_size must lie in \[1, 65536\], got 0"):
        q.get(5, "x", 2, sampler_params=dp(0, size=0))
    with pytest.raises(InvalidRequest, match=r"sampler_params\['dp_rank'\] must be an int, got '1'"):
        q.get(5, "x", 2, sampler_params={"dp_rank": "1", "dp_size": 2})
    assert q.state.getters == {}


def test_dp_rounds_with_whole_groups_give_each_rank_whole_groups(make_queue):
    q = make_queue(global_batch_size=4, num_n_samples=2, sampler=GRPOSampler(2))
    q.put(0, 8, X)
    r0 = q.get(0, "x", 4, sampler_params=dp(0))
    r1 = q.get(0, "x", 4, sampler_params=dp(1))
    assert_whole_groups(r0, 2)
    assert_whole_groups(r1, 2)
    assert not set(indexes(r0)) & set(indexes(r1))


def test_dp_sampler_defaults_make_automatic_rounds(make_queue):
    q = make_queue(global_batch_size=8)
    q.state.register_sampler("train", DPSampler(dp_rank=0, dp_size=2))
    q.put(0, 8, X)
    a0 = q.get(0, "x", 1)  # round auto-0 as rank 0
    a1 = q.get(0, "x", 1, sampler_params={"dp_rank": 1})  # the same round as rank 1
    b0 = q.get(0, "x", 1)  # round auto-1
    b1 = q.get(0, "x", 1, sampler_params={"dp_rank": 1})
    assert [indexes(m) for m in (a0, a1, b0, b1)] == [[0], [1], [2], [3]]
    assert a0.extra["dp_group_id"] == "auto-0" and b1.extra["dp_group_id"] == "auto-1"


def test_an_automatic_round_that_times_out_is_taken_again_by_the_next_call(make_queue):
    q = make_queue(global_batch_size=8)
    q.state.register_sampler("train", DPSampler(dp_rank=0, dp_size=2))
    late = q.get_async(0, "x", 1, timeout=1.0)  # round auto-0 waits: nothing is put yet
    q.advance(2.0)
    with pytest.raises(GetMetaTimeout):
        late.result()
    q.put(0, 8, X)
    again = q.get(0, "x", 1)  # still auto-0, so rank 0 stays in step with rank 1
    peer = q.get(0, "x", 1, sampler_params={"dp_rank": 1})
    assert again.extra["dp_group_id"] == peer.extra["dp_group_id"] == "auto-0"


def test_a_get_meta_that_waited_says_how_long(make_queue):
    q = make_queue()
    waiting = q.get_async(0, "x", 2)
    q.advance(1.5)
    q.put(0, 2, X)
    assert waiting.result().extra["wait_s"] == pytest.approx(1.5)
    assert "wait_s" not in q.get(0, "x", 2, task="other").extra  # served at once: no wait to report


def test_a_released_dp_share_goes_back_to_the_task_and_not_to_its_round(make_queue):
    q = make_queue(global_batch_size=4)
    q.put(0, 4, X)
    r0 = q.get(0, "x", 2, sampler_params=dp(0))
    q.release(r0)
    with pytest.raises(InvalidRequest, match=r"the share of dp_rank=0 in dp_group_id 'g0' was released"):
        q.get(0, "x", 2, sampler_params=dp(0))
    assert indexes(q.get(0, "x", 2, sampler_params=dp(1))) == [2, 3]  # rank 1's share is untouched
    assert indexes(q.get(0, "x", 2)) == [0, 1]  # nothing is lost: the rows are served again


def test_a_partly_released_dp_share_is_not_served_twice(make_queue):
    q = make_queue(global_batch_size=4)
    q.put(0, 4, X)
    r0 = q.get(0, "x", 2, sampler_params=dp(0))
    q.release(r0.select_samples([1]))
    again = q.get(0, "x", 2)  # row 1 goes back to the task
    assert indexes(again) == [1]  # (rows 0, 2, 3 are consumed by round g0)
    with pytest.raises(InvalidRequest, match="was released"):
        q.get(0, "x", 2, sampler_params=dp(0))  # a peer of rank 0 would get row 1 a second time


# ---- release, clear, reset, close ----------------------------------------------------------------------------
def test_released_rows_are_served_again(make_queue):
    q = make_queue()
    q.put(0, 4, X)
    meta = q.get(0, "x", 4)
    q.release(meta.select_samples([2, 0]))
    assert indexes(q.get(0, "x", 2)) == [2, 0]


def test_a_release_naming_a_row_twice_releases_it_once(make_queue):
    q = make_queue(global_batch_size=2, num_n_samples=2, sampler=GRPOSampler(2))
    q.put(0, 4, X)
    meta = q.get(0, "x", 4)
    q.release(meta.select_samples([0, 0]))  # row 0 named twice: it must not count as its whole group of 2
    assert consumed(q, 0) == 3
    # row 1 of group 0 is still held, so no group is complete: nothing is served (was [0, 1]: row 1 twice)
    assert indexes(q.get(0, "x", 2)) == []
    q.release(meta.select_samples([1]))
    assert indexes(q.get(0, "x", 2)) == [0, 1]


def test_a_release_after_its_partition_was_cleared_is_stale(make_queue):
    q = make_queue()
    q.put(0, 4, X)
    meta = q.get(0, "x", 4)
    q.clear(0)
    with pytest.raises(StaleBatchMeta, match=r"release of a BatchMeta whose partition \(uid 1\) was cleared"):
        q.release(meta)


def test_clears_are_idempotent(make_queue):
    q = make_queue()
    q.put(0, 4, X)
    uid = q.state.partitions[0].uid
    q.clear(0)
    assert drops(q) == [(0, p.DropPartition(uid)), (1, p.DropPartition(uid))]
    q.clear(0)
    q.clear("never")
    assert len(q.state.outbox) == 2
    with pytest.raises(UnknownPartition, match=r"global_step=0 not found; live partitions: \[\]"):
        q.ok(p.ProductionStatus(0))


def test_clearing_a_step_never_opened_is_a_no_op(make_queue):
    q = make_queue()
    q.clear(1)  # before step 1 exists: it must not mark steps 0 and 1 as cleared
    q.put(0, 4, X)
    q.put(1, 4, X)
    assert indexes(q.get(1, "x", 4)) == [4, 5, 6, 7]
    assert q.state.outbox == []  # nothing to drop anywhere


def test_clearing_a_string_partition_before_its_first_put_is_a_no_op(make_queue):
    q = make_queue()
    q.clear("later")
    waiting = q.get_async("later", "x", 2)
    assert not waiting.done  # it waits for the partition to open, as for any partition not opened yet
    q.put("later", 2, X)
    assert indexes(waiting.result().to_meta()) == [0, 1]


def test_reset_consumption_serves_the_data_again(make_queue):
    q = make_queue()
    q.put(0, 4, X)
    q.get(0, "x", 4)
    q.get(0, "x", 4, "other")
    q.ok(p.ResetConsumption(0, "train"))
    assert indexes(q.get(0, "x", 4)) == [0, 1, 2, 3]
    assert consumed(q, 0, "other") == 4
    with pytest.raises(UnknownPartition, match="global_step=3 not found"):
        q.ok(p.ResetConsumption(3, None))


def test_close_partition_gives_the_short_final_batch_then_end_of_stream(make_queue):
    q = make_queue()
    q.put("val", 3, X)
    assert indexes(q.get("val", "x", 2)) == [0, 1]
    waiting = q.get_async("val", "x", 2)
    assert not waiting.done
    q.ok(p.ClosePartition("val"))
    assert indexes(waiting.result().to_meta()) == [2]
    end = q.get("val", "x", 2)
    assert len(end) == 0 and end.partition_id == "val"
    with pytest.raises(UnknownPartition, match="partition_id='nope' not found"):
        q.ok(p.ClosePartition("nope"))


def test_a_full_step_gives_a_short_batch_then_end_of_stream(make_queue):
    q = make_queue(global_batch_size=4)
    q.put(0, 4, X)
    assert len(q.get(0, "x", 3)) == 3
    assert indexes(q.get(0, "x", 3)) == [3]
    assert len(q.get(0, "x", 3)) == 0


def test_a_full_step_waits_while_a_field_can_still_arrive(make_queue):
    q = make_queue(global_batch_size=4)
    meta = q.put(0, 4, X)
    waiting = q.get_async(0, ["x", "y"], 3)
    assert not waiting.done
    q.put(0, 4, Y, metadata=meta)
    assert len(waiting.result().to_meta()) == 3
    reservation = q.reserve(0, 1, {"z": F32}, metadata=meta.select_samples([3]))
    short = q.get_async(0, ["x", "y"], 3)
    assert not short.done  # a put into the step is still open
    q.commit(reservation)
    assert indexes(short.result().to_meta()) == [3]


def test_waiting_get_meta_is_served_when_rows_commit(make_queue):
    q = make_queue()
    waiters = [q.get_async(0, "x", 2, f"t{i}") for i in range(3)]
    q.put(0, 1, X)
    assert not any(w.done for w in waiters)
    q.put(0, 1, X)
    assert [indexes(w.result().to_meta()) for w in waiters] == [[0, 1]] * 3


def test_get_meta_timeout_names_missing_fields_and_counts(make_queue):
    q = make_queue()
    meta = q.put(0, 4, X)
    q.put(0, 1, Y, metadata=meta.select_samples([0]))
    q.get(0, "x", 1)
    waiting = q.get_async(0, ["x", "y", "z"], 2, timeout=3.0)
    q.advance(3.0)
    with pytest.raises(
        GetMetaTimeout,
        match=r"get_meta timed out after 3\.0 s: task 'train' asked global_step=0 for 2 rows of fields "
        r"\['x', 'y', 'z'\]; 0 rows are ready, 3 unconsumed rows exist \('y' missing on 3 rows, 'z' missing on "
        r"3 rows\); 4 of 4 rows are committed",
    ):
        waiting.result()
    never = q.get_async(1, "x", 1, timeout=1.0)
    q.advance(1.0)
    with pytest.raises(GetMetaTimeout, match=r"global_step=1 .*; the partition was never opened"):
        never.result()
    assert q.state.getters == {} and q.state.tick() == q.config.lease_s  # only the lease of the row taken is due


def test_status_queries(make_queue):
    q = make_queue()
    q.put(0, 4, X, nbytes=100)
    q.get(0, "x", 3, "a")
    status = q.ok(p.ProductionStatus(0))
    assert status == {
        "partition_id": 0,
        "partition_uid": status["partition_uid"],
        "capacity": 4,
        "rows": 4,
        "rows_in_flight": 0,
        "rows_lost": 0,
        "closed": True,
        "bytes": 100,
        "fields": {"x": {"schema": "dense float32[]", "produced": 4}},
    }
    a = {"consumed": 3, "rows": 4, "ready": 1, "leased": 3, "acknowledged": 0, "dead_lettered": 0}
    assert q.ok(p.ConsumptionStatus(0, None)) == {"partition_id": 0, "tasks": {"a": a}, "rows_lost": 0}
    b = {"consumed": 0, "rows": 4, "ready": 4, "leased": 0, "acknowledged": 0, "dead_lettered": 0}
    assert q.ok(p.ConsumptionStatus(0, "b"))["tasks"] == {"b": b}
    with pytest.raises(UnknownPartition, match=r"partition_id='x' not found; live partitions: \[0\]"):
        q.ok(p.ConsumptionStatus("x", None))


# ---- kv ------------------------------------------------------------------------------------------------------
def kv_blocks(q, keys: list[str], field: str = "x") -> list[int]:
    meta = q.ok(p.KvLookup("kv", keys, [field])).to_meta()
    return meta.blocks[:, 0].tolist()


def test_kv_puts_insert_upsert_and_mix(make_queue):
    q = make_queue()
    first = q.kv_put("kv", ["a", "b"])
    assert first.keys == ["a", "b"]
    (old,) = set(kv_blocks(q, ["a", "b"]))
    q.kv_put("kv", ["a"])  # upsert: a new block for a; the old one is still referenced by b
    new_a, b = kv_blocks(q, ["a", "b"])
    assert b == old and new_a != old
    assert not any(isinstance(m, p.DropBlocks) for _, m in q.table.outbox)
    mixed = q.kv_put("kv", ["b", "c"])
    assert sorted(indexes(mixed)) == [1, 2]  # b keeps its row, c gets a new one
    assert (old % 2, p.DropBlocks(first.partition_uid, [old])) in drops(q)  # nothing references it now
    assert q.ok(p.KvList("kv")) == ["a", "b", "c"]
    meta = q.ok(p.KvLookup("kv", ["c", "a"], None)).to_meta()
    assert meta.keys == ["c", "a"] and meta.field_names == ["x"]


def test_kv_clear_frees_blocks_and_keys(make_queue):
    q = make_queue()
    meta = q.kv_put("kv", ["a", "b"])
    block = int(meta.blocks[0, 0])
    q.ok(p.KvClear("kv", ["a", "zz"]))  # unknown keys are ignored
    assert q.ok(p.KvList("kv")) == ["b"]
    assert not any(isinstance(m, p.DropBlocks) for _, m in q.table.outbox)
    q.ok(p.KvClear("kv", ["b"]))
    assert (block % 2, p.DropBlocks(meta.partition_uid, [block])) in drops(q)
    assert q.state.bytes_held == 0
    with pytest.raises(UnknownKey, match=r"keys \['a'\] are not in partition_id='kv'"):
        q.ok(p.KvLookup("kv", ["a"], None))
    q.ok(p.KvClear("kv", None))
    assert q.ok(p.KvList("kv")) == []  # a cleared (or unknown) partition has no keys, as upstream's kv_list


def test_kv_lookup_errors(make_queue):
    q = make_queue()
    q.kv_put("kv", ["a"])
    q.kv_put("kv", ["b"], Y)
    with pytest.raises(UnknownKey, match=r"keys \['zz'\] are not in partition_id='kv'"):
        q.ok(p.KvLookup("kv", ["a", "zz"], None))
    with pytest.raises(UnknownField, match=r"field 'y' is not set for keys \['a'\] in partition_id='kv'"):
        q.ok(p.KvLookup("kv", ["a", "b"], ["y"]))
    assert q.ok(p.KvLookup("kv", ["a", "b"], None)).fields == {}  # no field that both have
    q.put("rows", 1, X)
    with pytest.raises(InvalidRequest, match=r"partition_id='rows' is used by row \(put\), not by key"):
        q.ok(p.KvList("rows"))
    with pytest.raises(InvalidRequest, match=r"partition_id='kv' is used by key \(kv_\*\); use one way"):
        q.put("kv", 1, X)


def test_kv_keys_are_invisible_until_their_put_commits(make_queue):
    q = make_queue()
    reservation = q.reserve("kv", 1, X, keys=["a"])
    with pytest.raises(UnknownKey, match=r"keys \['a'\] are not in partition_id='kv'"):
        q.ok(p.KvLookup("kv", ["a"], None))
    assert q.ok(p.KvList("kv")) == []
    q.commit(reservation)
    assert q.ok(p.KvList("kv")) == ["a"]


def test_a_kv_put_refused_for_a_concurrent_upsert_leaves_no_rows_behind(make_queue):
    q = make_queue()
    q.kv_put("kv", ["a"])
    open_upsert = q.reserve("kv", 1, X, keys=["a"])
    with pytest.raises(FieldAlreadyProduced, match="another put is writing the same keys and fields"):
        q.kv_put("kv", ["a", "new"])
    assert q.ok(p.ProductionStatus("kv"))["rows_in_flight"] == 0
    q.commit(open_upsert)
    q.kv_put("kv", ["a", "new"])  # "new" was not left half-created
    assert q.ok(p.KvList("kv")) == ["a", "new"]


def test_kv_clear_of_a_key_being_written_is_refused(make_queue):
    q = make_queue()
    q.kv_put("kv", ["a", "b"])
    upsert = q.reserve("kv", 1, X, keys=["a"])
    create = q.reserve("kv", 1, X, keys=["c"])
    with pytest.raises(FieldAlreadyProduced, match=r"keys \['a'\] of partition_id='kv' are being written"):
        q.ok(p.KvClear("kv", ["b", "a"]))
    with pytest.raises(FieldAlreadyProduced, match=r"keys \['c'\] of partition_id='kv' are being written"):
        q.ok(p.KvClear("kv", ["c"]))
    assert q.ok(p.KvList("kv")) == ["a", "b"]  # nothing was cleared
    q.commit(upsert)
    q.commit(create)
    q.ok(p.KvClear("kv", ["a", "b", "c"]))
    status = q.ok(p.ProductionStatus("kv"))
    assert (status["rows"], status["rows_in_flight"], status["bytes"]) == (0, 0, 0)


def test_kv_rows_are_reused_after_clears(make_queue):
    q = make_queue()
    for i in range(20):
        q.kv_put("kv", [f"a{i}", f"b{i}"])
        q.ok(p.KvClear("kv", [f"a{i}", f"b{i}"]))
    assert q.state.partitions["kv"].num_rows == 2


def test_byte_accounting_is_exact_when_puts_span_several_blocks(make_queue):
    q = make_queue(num_storage_units=2)
    nbytes = (2 << 20) + 2  # placed in two blocks of 1 and 2 rows: 1/3 and 2/3 of it do not divide evenly
    meta = q.kv_put("kv", ["a", "b", "c"], nbytes=nbytes)
    assert len(set(meta.blocks[:, 0].tolist())) == 2
    assert q.state.bytes_held == nbytes
    q.ok(p.KvClear("kv", ["a", "b", "c"]))
    assert q.state.bytes_held == 0 and q.ok(p.ProductionStatus("kv"))["bytes"] == 0


# ---- the storage byte budget ---------------------------------------------------------------------------------
def test_a_put_waits_for_storage_space_then_fails_with_queue_full(make_queue):
    q = make_queue(num_storage_units=1, storage_unit_bytes=100)
    q.put("a", 1, X, nbytes=60)
    waiting = q.send(q.reserve_request("b", 1, X, nbytes=60, timeout=2.0))
    assert not waiting.done
    q.advance(2.0)
    with pytest.raises(
        QueueFull,
        match=r"put to partition_id='b' waited 2\.0 s for storage space: 60 of 100 bytes are held and the put "
        r"needs 60",
    ):
        waiting.result()


def test_a_put_waiting_for_storage_space_is_served_when_space_frees(make_queue):
    q = make_queue(num_storage_units=1, storage_unit_bytes=100)
    q.put("a", 1, X, nbytes=60)
    by_clear = q.send(q.reserve_request("b", 1, X, nbytes=60))
    q.clear("a")
    q.commit(by_clear.result())
    q.kv_put("kv", ["k"], nbytes=30)
    by_kv_clear = q.send(q.reserve_request("c", 1, X, nbytes=30))
    assert not by_kv_clear.done
    q.ok(p.KvClear("kv", ["k"]))
    q.commit(by_kv_clear.result())
    assert q.state.bytes_held == 90


def test_a_put_that_can_never_fit_fails_at_once(make_queue):
    q = make_queue(num_storage_units=2, storage_unit_bytes=100)
    with pytest.raises(QueueFull, match=r"a put of 201 bytes can never fit: the storage units hold 200 bytes in all"):
        q.put(0, 4, X, nbytes=201)
    assert q.ok(p.ListPartitions()) == []  # nothing was opened for it


# ---- regressions ---------------------------------------------------------------------------------------------
def test_a_refused_put_leaves_no_empty_step_in_the_ring(make_queue):
    q = make_queue(num_global_batch=1, num_n_samples=2)
    with pytest.raises(IncompleteGroups, match="group 0 would have 3 members in global_step=0"):
        q.put(0, 3, X, group_ids=[0, 0, 0])
    with pytest.raises(InvalidRequest, match="group_ids must be ints >= 0, got -1"):
        q.put(0, 2, X, group_ids=[-1, -1])
    assert q.ok(p.ListPartitions()) == []
    q.put(1, 2, X)  # the ring's only slot is free


def test_a_cleared_string_partition_opens_again_on_a_put(make_queue):
    q = make_queue()
    q.put("val", 2, X)
    q.clear("val")
    with pytest.raises(PartitionCleared, match="partition_id='val' was cleared"):
        q.get("val", "x", 1)
    assert indexes(q.put("val", 2, X)) == [0, 1]
    assert indexes(q.get("val", "x", 2)) == [0, 1]
    q.kv_put("kv", ["a"])
    q.ok(p.KvClear("kv", None))
    q.kv_put("kv", ["b"])  # a kv partition is used again after a whole clear
    assert q.ok(p.KvList("kv")) == ["b"]


def test_a_put_with_metadata_waits_for_storage_space(make_queue):
    q = make_queue(num_storage_units=1, storage_unit_bytes=100)
    meta = q.put(0, 4, X, nbytes=60)
    q.put("other", 1, X, nbytes=30)
    waiting = q.send(q.reserve_request(0, 4, Y, metadata=meta, nbytes=40))
    assert not waiting.done
    q.clear("other")
    q.commit(waiting.result())
    assert q.state.bytes_held == 100


def test_a_closed_partition_that_never_got_a_row_is_at_its_end(make_queue):
    q = make_queue()
    aborted = q.reserve("val", 2, X)
    q.ok(p.Abort(aborted.put_id))
    q.ok(p.ClosePartition("val"))
    end = q.get("val", ["x", "never"], 2)
    assert len(end) == 0


class _OverlappingSplit(DPSampler):
    def split(self, rows, num_shares, lengths, group_size):
        return [rows, rows]  # every row to both ranks


class _FailingSplit(DPSampler):
    def split(self, rows, num_shares, lengths, group_size):
        raise ValueError("split broke")


def test_a_split_that_serves_a_row_to_two_ranks_fails_that_call_and_keeps_the_rows(make_queue):
    q = make_queue(global_batch_size=8)
    q.state.register_sampler("train", _OverlappingSplit(dp_rank=0, dp_size=2))
    q.put(0, 8, X)
    with pytest.raises(
        SamplerError,
        match=r"_OverlappingSplit.split must split the round's 4 rows into disjoint shares .*\(4 given twice",
    ):
        q.get(0, "x", 2, sampler_params=dp(0))
    assert consumed(q, 0) == 0  # nothing was lost: the rows are ready for the task again
    assert indexes(q.get(0, "x", 4, "other")) == [0, 1, 2, 3]


def test_a_split_that_raises_fails_only_its_waiting_getter_and_the_put_commits(make_queue):
    q = make_queue(global_batch_size=8)
    q.state.register_sampler("train", _FailingSplit(dp_rank=0, dp_size=2))
    broken = q.get_async(0, "x", 2, sampler_params=dp(0))
    other = q.get_async(0, "x", 4, "other")
    assert not broken.done and not other.done
    q.put(0, 4, X)  # the commit retries both waiting getters: it must succeed whatever the sampler does
    with pytest.raises(SamplerError, match=r"_FailingSplit.split raised ValueError: split broke; the 4 rows"):
        broken.result()
    assert indexes(other.result().to_meta()) == [0, 1, 2, 3]
    assert consumed(q, 0) == 0


# ---- requests that can never be served fail at once -----------------------------------------------------------
def test_a_get_meta_for_more_rows_than_a_step_holds_is_served_the_whole_step(make_queue):
    # workers ask for up to groups_per_request x n_samples rows, which may exceed a small step (the SmolLM2 recipe's
    # test: 32 asked of 8-row steps); refusing that request broke the recipe
    q = make_queue(global_batch_size=2, num_n_samples=4)  # steps of 8 rows
    q.put(0, 8, X)
    assert len(q.get(0, "x", 32)) == 8


def test_a_get_meta_of_a_string_partition_is_never_refused_for_its_size(make_queue):
    q = make_queue()
    q.put("open", 4, X)
    assert not q.get_async("open", "x", 10**9).done  # unbounded: more rows may come


def test_a_put_larger_than_its_step_fails_at_once_even_while_the_step_ring_is_full(make_queue):
    q = make_queue()  # steps of 4 rows, two live
    q.put(0, 4, X)
    q.put(1, 4, X)
    with pytest.raises(
        PartitionOverfilled,
        match=r"^a put of 5 rows can never fit global_step=2: a step holds at most 4 rows "
        r"\(global_batch_size=4 x num_n_samples=1\)$",
    ):
        q.ok(q.reserve_request(2, 5, X))
