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
