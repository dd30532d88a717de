"""Rows lost with a storage unit that restarted empty (transfer_queue.state.lost_rows), driven without Ray through
``RequestTable.handle`` on a fake clock (see tests/unit/conftest.py). Two units; a small put goes whole to one unit, the
units taken in turn."""

from __future__ import annotations

import numpy as np
import pytest

from transfer_queue.errors import PutExpired, RowsLost, UnknownKey
from transfer_queue.metadata import FieldSchema
from transfer_queue.wire import protocol as p

F32 = FieldSchema("dense", "float32", ())
X = {"x": F32}
Y = {"y": F32}


def unit_of(meta) -> int:
    units = np.unique(meta.blocks % 2)
    assert len(units) == 1
    return int(units[0])


def lost(q, partition) -> list[dict]:
    return q.ok(p.LostRows(partition))


def test_a_restarted_unit_loses_its_rows_which_are_reported_never_served_and_can_be_put_again(make_queue):
    q = make_queue(global_batch_size=4, num_n_samples=2, num_storage_units=2)
    first = q.put(0, 4)
    dead = unit_of(first)
    waiting = q.get_async(0, "x", 8, get_n_samples=True)  # the whole step, in one call: it waits for the rest
    result = q.state.unit_restarted(dead)
    assert result["rows"] == 4 and result["partitions"] == {0: 4}
    assert result["lost_below"] == q.state._next_block * 2 and result["restarts"] == 1
    q.put(0, 4)
    status = q.ok(p.ProductionStatus(0))
    assert (status["rows"], status["rows_lost"], status["closed"]) == (4, 4, False)
    assert status["fields"]["x"]["produced"] == 4
    assert q.ok(p.ConsumptionStatus(0, "train"))["rows_lost"] == 4
    report = lost(q, 0)
    assert [r["global_index"] for r in report] == first.global_indexes.tolist()
    assert [r["group_id"] for r in report] == [0, 0, 1, 1]
    assert {(r["unit"], tuple(r["fields"])) for r in report} == {(dead, ("x",))}
    assert [r["tasks"] for r in report] == [{"train": "ready"}] * 4
    assert not waiting.done  # the step cannot complete with the lost rows: it waits for them to be put again
    again = q.put(0, 4, group_ids=[0, 0, 1, 1])  # the producer puts the lost prompts again: after the capacity
    assert again.global_indexes.tolist() == [8, 9, 10, 11]
    served = waiting.result().to_meta()  # only live rows are ever handed out
    assert sorted(served.global_indexes.tolist()) == [4, 5, 6, 7, 8, 9, 10, 11]
    status = q.ok(p.ProductionStatus(0))
    assert (status["rows"], status["rows_lost"], status["closed"]) == (8, 4, True)
    assert q.state.bytes_held == 32  # the lost blocks' bytes are gone: 8 live rows of 4 bytes
    with pytest.raises(RowsLost, match=r"rows \[0, 1, 2, 3\] of global_step=0 were lost \(their storage unit died"):
        q.put(0, 4, Y, metadata=first)  # e.g. a rollout worker's responses to a prompt it read before the loss


def test_a_group_split_over_two_units_is_lost_whole(make_queue):
    q = make_queue(global_batch_size=2, num_n_samples=2, num_storage_units=2)
    a = q.put(0, 1, group_ids=[0])
    b = q.put(0, 1, group_ids=[0])
    c = q.put(0, 2, group_ids=[1, 1])
    assert unit_of(a) == unit_of(c) != unit_of(b)
    q.state.unit_restarted(unit_of(b))
    report = {r["global_index"]: r["fields"] for r in lost(q, 0)}
    assert report == {int(b.global_indexes[0]): ["x"], int(a.global_indexes[0]): []}  # a: lost with its group
    assert q.get(0, "x", 2, get_n_samples=True).group_ids.tolist() == [1, 1]


def test_a_consumer_that_read_a_row_before_it_was_lost_can_still_ack_it(make_queue):
    q = make_queue(global_batch_size=2, num_storage_units=2)
    q.ok(p.SetTaskOptions("train", ack="explicit"))
    put = q.put(0, 2)
    meta = q.ok(p.GetMeta(0, ["x"], 2, "train", owner="trainer")).to_meta()
    q.state.unit_restarted(unit_of(put))
    assert {r["tasks"]["train"] for r in lost(q, 0)} == {"leased"}
    q.ok(p.Ack(meta.partition_uid, "train", p.pack_indexes(meta.global_indexes), "trainer", explicit=True))
    assert {r["tasks"]["train"] for r in lost(q, 0)} == {"acknowledged"}  # the producer need not put it again


def test_an_open_put_placed_on_the_restarted_unit_is_aborted(make_queue):
    q = make_queue(global_batch_size=4, num_storage_units=2)
    reservation = q.reserve(0, 2)
    unit = reservation.placements[0].unit
    q.state.unit_restarted(unit)
    assert q.state.bytes_held == 0 and not q.state.open_puts
    with pytest.raises(PutExpired):
        q.commit(reservation)
    assert q.put(0, 2).global_indexes.tolist() == [0, 1]  # its rows are free again (they never were committed)


def test_a_lost_key_is_forgotten_and_a_new_kv_put_of_it_makes_a_new_row(make_queue):
    q = make_queue(global_batch_size=1, num_storage_units=2)
    meta = q.kv_put("kv", ["a", "b"])
    q.state.unit_restarted(unit_of(meta))
    assert [(r["key"], r["global_index"]) for r in lost(q, "kv")] == [("a", 0), ("b", 1)]
    with pytest.raises(UnknownKey, match=r"keys \['a'\] are not in partition_id='kv'"):
        q.ok(p.KvLookup("kv", ["a"]))
    assert q.kv_put("kv", ["a"]).global_indexes.tolist() == [2]


def test_lost_rows_of_a_cleared_partition_are_forgotten(make_queue):
    q = make_queue(global_batch_size=2, num_storage_units=2, num_global_batch=2)
    meta = q.put(0, 2)
    q.state.unit_restarted(unit_of(meta))
    assert q.state.lost.count(meta.partition_uid) == 2
    q.clear(0)
    q.put(1, 2)
    q.state.unit_restarted(0)
    assert meta.partition_uid not in q.state.lost.by_uid
    assert q.state.lost.total >= 2 and q.state.lost.restarts[unit_of(meta)] >= 1


def test_a_retired_unit_s_copies_are_planned_onto_a_unit_of_another_node_than_the_surviving_copy(make_queue):
    """Four units on nodes a, a, b, b (partners 0-2, 1-3): unit 0 retired, the blocks that had a copy on it (its own
    and unit 2's) have their other copy on unit 2 (node b): they go to unit 1 (node a), read from 2, in block id
    order; blocks handed out later are not in the move; with unit 1 down too they go to 3 (node b: the only one)."""
    from transfer_queue.state.lost_rows import holders_now, plan_move, start_move
    from transfer_queue.state.placement import replica_units

    nodes = ["a", "a", "b", "b"]
    q = make_queue(global_batch_size=8, num_storage_units=4, replicas=2)
    q.state.ledger.replica_of = replica_units(nodes, 2)
    assert q.state.ledger.replica_of == [2, 3, 0, 1]
    metas = [q.put(0, 1) for _ in range(8)]
    blocks = sorted(int(m.blocks[0, 0]) for m in metas)
    q.state.down_units.add(0)
    move = start_move(q.state, 0, nodes, {0})
    assert not isinstance(move, str)
    assert (move.unit, move.to, move.below, move.upto) == (0, {2: 1}, 0, q.state._next_block * 4)
    plan = plan_move(q.state, move)
    moved = [b for b in blocks if b % 4 in (0, 2)]
    assert plan.blocks == moved and len(moved) == 4
    assert {(s.source, s.target, tuple(s.fields), s.num_rows) for s in plan.steps} == {(2, 1, ("x",), 1)}
    later = q.put(1, 1)  # after the retirement: on units 1 and 3 (0 and 2 cannot take a put: 0 is down)
    assert int(later.blocks[0, 0]) >= move.upto and plan_move(q.state, move).blocks == moved
    ids = np.asarray(moved)
    assert [h.tolist() for h in holders_now(q.state, ids)] == [[b % 4 for b in moved], [(b % 4 + 2) % 4 for b in moved]]
    move.below = move.upto  # done: the copies on 0 are on 1 now
    first, second = holders_now(q.state, ids)
    assert sorted(zip(first.tolist(), second.tolist(), strict=True)) == [(1, 2)] * 2 + [(2, 1)] * 2
    assert plan_move(q.state, move).steps == []
    q.state.lost.moves.clear()
    q.state.down_units.add(1)
    assert start_move(q.state, 0, nodes, {0}).to == {2: 3}  # node a has no unit up: the same node as the copy
    q.state.lost.moves.clear()
    q.state.down_units.add(2)
    assert start_move(q.state, 0, nodes, {0}) == (
        "the copies of retired storage unit 0 cannot be re-replicated: a second copy needs a unit other than the one "
        "holding the first, and only 1 unit [3] is up; its blocks stay single-copy"
    )
    q.state.down_units.discard(1)
    assert start_move(q.state, 0, nodes, {0}) == "storage unit 2, which holds the other copies, is down"
    assert q.state.lost.cannot_rereplicate == {0: "storage unit 2, which holds the other copies, is down"}


def unit_0_down_of_four(make_queue):
    """Four units on nodes a, a, b, b (partners 0-2, 1-3), 8 blocks of one row put, unit 0 down: the queue, the
    nodes, the puts' metas, the blocks, and those with a copy on 0 (its own and 2's)."""
    from transfer_queue.state.placement import replica_units

    nodes = ["a", "a", "b", "b"]
    q = make_queue(global_batch_size=8, num_storage_units=4, replicas=2)
    q.state.ledger.replica_of = replica_units(nodes, 2)
    metas = [q.put(0, 1) for _ in range(8)]
    blocks = sorted(int(m.blocks[0, 0]) for m in metas)
    q.state.down_units.add(0)
    return q, nodes, metas, blocks, [b for b in blocks if b % 4 in (0, 2)]


def test_after_a_move_a_restarted_target_and_a_restarted_survivor_refill_from_the_copies_held_now(make_queue):
    """Four units on nodes a, a, b, b (partners 0-2, 1-3): unit 0 retired and its copies moved to 1 (read from 2).
    Target 1 restarted empty: its refill copies the moved blocks back too, read from 2. Survivor 2 restarted empty
    then: its refill reads the moved blocks from 1, not from retired 0. Both restarted before either got them back:
    the moved blocks' rows are lost (both units holding them now lost them)."""
    from transfer_queue.state.lost_rows import all_gone, plan_refill, start_move

    q, nodes, _, blocks, moved = unit_0_down_of_four(make_queue)
    move = start_move(q.state, 0, nodes, {0})
    assert not isinstance(move, str) and move.to == {2: 1}
    move.below = move.upto  # done: the copies on 0 are on 1 now
    book = q.state.lost

    assert q.state.unit_restarted(1)["rows"] == 0
    plan = plan_refill(q.state, 1)
    assert plan.blocks == blocks  # its own blocks (from 3) and the moved ones (from 2)
    assert {s.block: s.source for s in plan.steps} == {b: 2 if b in moved else 3 for b in blocks}
    assert not all_gone(q.state, moved).any()
    book.refilled_below[1] = book.lost_below[1]  # refilled

    assert q.state.unit_restarted(2)["rows"] == 0
    plan = plan_refill(q.state, 2)
    assert plan.blocks == moved and {s.source for s in plan.steps} == {1}  # not retired 0

    assert q.state.unit_restarted(1)["rows"] == 4  # 2 not refilled yet: both copies of the moved blocks are gone
    assert all_gone(q.state, moved).all()
    assert sorted(r["unit"] for r in lost(q, 0)) == [1] * 4


def test_a_survivor_restarted_while_a_move_runs_loses_the_blocks_the_move_has_not_reached(make_queue):
    """Four units on nodes a, a, b, b (partners 0-2, 1-3): unit 0 retired, its copies being moved to 1 (read from 2),
    the move halfway. Survivor 2 restarted empty: the blocks the move has not reached had their other copy on retired
    0, gone for good too: their rows are lost (not refilled from 0, which never comes back); those it reached are
    refilled from 1, and the restart's ``lost_with`` names the range lost with 0."""
    from transfer_queue.state.lost_rows import all_gone, plan_refill, start_move

    q, nodes, metas, _, moved = unit_0_down_of_four(make_queue)
    q.state.lost.retired.add(0)
    move = start_move(q.state, 0, nodes, {0})
    assert not isinstance(move, str) and move.to == {2: 1}
    move.below = moved[2]  # the first two moved: on 1 now
    reached, left = moved[:2], moved[2:]

    result = q.state.unit_restarted(2)
    assert result["rows"] == 2 and (0, moved[2], move.upto) in result["lost_with"]
    assert all_gone(q.state, left).all() and not all_gone(q.state, reached).any()
    plan = plan_refill(q.state, 2)
    assert 0 not in {s.source for s in plan.steps}  # nothing waits for retired 0
    assert {s.block: s.source for s in plan.steps} == {b: 1 for b in reached}
    lost_blocks = {int(m.blocks[0, 0]): m.global_indexes.tolist() for m in metas}
    assert sorted(r["global_index"] for r in lost(q, 0)) == sorted(i for b in left for i in lost_blocks[b])


def test_a_retired_unit_ray_brings_back_after_its_move_holds_its_new_copies_again(make_queue):
    """Four units on nodes a, a, b, b (partners 0-2, 1-3): unit 0 retired and its copies moved to 1. Ray brings 0
    back after all (restarted elsewhere): it is no longer retired, and a block put on it since (other copy on 2) is
    not lost when 2 restarts: its copy on 0 lives. The moved blocks stay on 1 (also not lost)."""
    from transfer_queue.state.lost_rows import all_gone, plan_refill, refill_summary, start_move
    from transfer_queue.state.placement import replica_units

    nodes = ["a", "a", "b", "b"]
    q = make_queue(global_batch_size=16, num_storage_units=4, replicas=2)
    q.state.ledger.replica_of = replica_units(nodes, 2)
    metas = [q.put(0, 1) for _ in range(8)]
    moved = sorted(int(m.blocks[0, 0]) for m in metas if int(m.blocks[0, 0]) % 4 in (0, 2))
    q.state.down_units.add(0)
    q.state.lost.retired.add(0)  # as the controller's mark_unit(final=True) does
    move = start_move(q.state, 0, nodes, {0})
    assert not isinstance(move, str)
    move.below = move.upto  # done: the copies on 0 are on 1 now
    book = q.state.lost

    q.state.down_units.discard(0)
    assert q.state.unit_restarted(0)["rows"] == 0  # back after all: held nothing (every copy was moved)
    assert plan_refill(q.state, 0).steps == []  # nothing to refill
    book.refilled_below[0] = book.lost_below[0]
    fresh = [q.put(0, 1) for _ in range(8)]
    on_0 = sorted(int(m.blocks[0, 0]) for m in fresh if int(m.blocks[0, 0]) % 4 == 0)
    assert on_0 and not all_gone(q.state, on_0).any()

    assert q.state.unit_restarted(2)["rows"] == 0  # their copies on 0 and the moved ones on 1 live
    assert not all_gone(q.state, on_0 + moved).any()
    assert (0, 0, book.lost_below[0]) not in q.state.lost.lost_with.get(2, [])
    assert refill_summary(q.state)["rereplicating"] == [] and book.retired == set()


def test_a_retired_unit_s_copies_are_not_moved_onto_a_unit_still_refilling(make_queue):
    """Four units on nodes a, a, b, b (partners 0-2, 1-3). Unit 0 restarted and not refilled yet; unit 1 retires:
    the copies whose other copy is on 3 go to 2, not to 0 (the first unit of another node than 3, taken otherwise):
    a copy written onto a refilling unit counts as missing there until its refill passes it, so a restart of 3
    meanwhile would lose rows that 0 holds."""
    from transfer_queue.state.lost_rows import start_move
    from transfer_queue.state.placement import replica_units

    nodes = ["a", "a", "b", "b"]
    q = make_queue(global_batch_size=8, num_storage_units=4, replicas=2)
    q.state.ledger.replica_of = replica_units(nodes, 2)
    for _ in range(8):
        q.put(0, 1)
    q.state.unit_restarted(0)
    assert q.state.lost.refilling() == [0]
    q.state.down_units.add(1)
    move = start_move(q.state, 1, nodes, {1})
    assert not isinstance(move, str) and move.to == {3: 2}
    q.state.lost.moves.clear()
    q.state.lost.refilled_below[0] = q.state.lost.lost_below[0]  # refilled: 0 is taken again
    move = start_move(q.state, 1, nodes, {1})
    assert not isinstance(move, str) and move.to == {3: 0}


def test_a_unit_brought_back_and_retired_again_gets_a_move_of_its_own(make_queue):
    """Four units on nodes a, a, b, b (partners 0-2, 1-3): unit 0 retired and its copies moved to 1, then Ray brings
    it back (restarted) and blocks are put on it again. Its first move is not its move any more (the blocks it reached
    stay on 1); retired again, a move of its own takes the copies it holds now, the new blocks included."""
    from transfer_queue.state.lost_rows import plan_move, refill_summary, retire_unit, start_move
    from transfer_queue.state.placement import replica_units

    nodes = ["a", "a", "b", "b"]
    q = make_queue(global_batch_size=32, num_storage_units=4, replicas=2)
    q.state.ledger.replica_of = replica_units(nodes, 2)
    for _ in range(8):
        q.put(0, 1)
    book = q.state.lost
    q.state.down_units.add(0)
    retire_unit(q.state, 0)
    first = start_move(q.state, 0, nodes, {0})
    assert not isinstance(first, str) and book.move_of(0) is first
    first.below = first.upto  # done: the copies on 0 are on 1 now
    assert refill_summary(q.state)["rereplicated"] == {0: {2: 1}}

    q.state.down_units.discard(0)
    assert q.state.unit_restarted(0)["rows"] == 0  # back after all: every copy it held was moved
    assert book.move_of(0) is None and refill_summary(q.state)["rereplicated"] == {}
    book.refilled_below[0] = book.lost_below[0]
    fresh = [q.put(0, 1) for _ in range(8)]
    on_0 = sorted(int(m.blocks[0, 0]) for m in fresh if int(m.blocks[0, 0]) % 4 in (0, 2))
    assert on_0

    q.state.down_units.add(0)
    retire_unit(q.state, 0)
    second = start_move(q.state, 0, nodes, {0})
    assert not isinstance(second, str) and second is not first and book.move_of(0) is second
    assert second.upto == q.state._next_block * 4 and second.restart == 1
    assert plan_move(q.state, second).blocks == on_0  # the blocks it took since it came back, not the moved ones
    assert refill_summary(q.state)["rereplicating"] == [0]


def test_a_unit_retired_while_a_restarted_unit_waits_for_it_takes_the_blocks_they_shared_lost(make_queue):
    """Four units on nodes a, a, b, b (partners 0-2, 1-3): unit 0 down, unit 2 restarted empty (nothing lost: 0 holds
    the other copies; its refill waits for 0). Then 0 is retired: the blocks 0 and 2 share have no copy left. Their
    rows are lost now (put on 2's restart, whose ``lost_with`` names 0 so clients tell them lost) and 2's refill has
    nothing left to copy."""
    from transfer_queue.state.lost_rows import all_gone, plan_refill, retire_unit
    from transfer_queue.state.placement import replica_units

    nodes = ["a", "a", "b", "b"]
    q = make_queue(global_batch_size=8, num_storage_units=4, replicas=2)
    q.state.ledger.replica_of = replica_units(nodes, 2)
    metas = [q.put(0, 1) for _ in range(8)]
    shared = sorted(int(m.blocks[0, 0]) for m in metas if int(m.blocks[0, 0]) % 4 in (0, 2))
    q.state.down_units.add(0)
    assert q.state.unit_restarted(2)["rows"] == 0
    assert {s.source for s in plan_refill(q.state, 2).steps} == {0}
    book = q.state.lost
    lost_below = book.lost_below[2]

    result = retire_unit(q.state, 0)
    assert result == {"units": [2], "rows": 4, "partitions": {0: 4}}
    assert book.lost_with[2] == [(0, 0, lost_below)] and book.lost_with_moved[2] == [()]
    assert all_gone(q.state, shared).all()
    expected = sorted(int(m.global_indexes[0]) for m in metas if int(m.blocks[0, 0]) in shared)
    assert sorted(r["global_index"] for r in lost(q, 0)) == expected
    assert {(r["unit"], tuple(r["fields"])) for r in lost(q, 0)} == {(2, ("x",))}
    assert plan_refill(q.state, 2).steps == []  # nothing to copy back: the refill never claims them
    assert retire_unit(q.state, 0)["rows"] == 0 and book.lost_with[2] == [(0, 0, lost_below)]  # told again: nothing
