"""The controller's half of a checkpoint: QueueState -> bytes -> QueueState, onto the same or another number of
storage units (issue 8 section 4)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from transfer_queue.config import QueueConfig
from transfer_queue.controller.requests import RequestTable
from transfer_queue.errors import InvalidRequest, SnapshotError
from transfer_queue.metadata import FieldSchema
from transfer_queue.samplers import SequentialSampler
from transfer_queue.state.snapshot import block_map, read_snapshot, restore_state, snapshot_state
from transfer_queue.wire import protocol as p

X = {"x": FieldSchema("dense", "float32", ())}


def restored(q, units: int):
    snapshot = read_snapshot(snapshot_state(q.state))
    mapping, blocks = block_map(snapshot, units)
    config = QueueConfig.from_dict({**snapshot["config"], "num_storage_units": units})
    return restore_state(snapshot, config, None, mapping, blocks), mapping


def ask(state, request):
    out = []
    RequestTable(state).handle(request, lambda value, error: out.append((value, error)))
    assert out, "the request waits"
    value, error = out[0]
    if error is not None:
        raise error
    return value


@pytest.mark.parametrize("units", [2, 3, 1])
def test_a_restored_queue_serves_what_was_not_consumed_and_frees_open_puts(make_queue, units):
    q = make_queue()
    q.put(0, 4, X, lengths=[1, 2, 3, 4])
    taken = q.get(0, "x", 2)
    q.ok(p.Ack(taken.partition_uid, "train", p.pack_indexes(taken.global_indexes)))  # acknowledged: survives
    leased = q.get(0, "x", 1)  # leased, never acknowledged: ready again after the restore
    by_round = q.get(0, "x", 1, "dp", sampler_params={"dp_rank": 0, "dp_size": 2, "dp_group_id": "g"})
    q.kv_put("kv", ["a", "b"], X)
    q.reserve(1, 4, X)  # an open put: not in the checkpoint
    before = q.ok(p.ProductionStatus(0))
    state, mapping = restored(q, units)
    after = ask(state, p.ProductionStatus(0))
    assert {k: v for k, v in after.items() if k != "bytes"} == {k: v for k, v in before.items() if k != "bytes"}
    assert after["bytes"] == before["bytes"]
    # the acknowledged rows are not served again; the leased row is, first among the ready ones
    rest = ask(state, p.GetMeta(0, ["x"], 2, "train", timeout=1.0)).to_meta()
    assert taken.global_indexes.tolist() == [0, 1] and leased.global_indexes.tolist() == [2]
    assert rest.global_indexes.tolist() == [2, 3]
    # DP rounds are not restored: the round's unacknowledged share is ready again, for a new round of the task
    assert by_round.global_indexes.tolist() == [0]
    again = ask(state, p.GetMeta(0, ["x"], 2, "dp", {"dp_rank": 1, "dp_size": 2, "dp_group_id": "g2"}, timeout=1.0))
    assert sorted(again.to_meta().global_indexes.tolist()) == [2, 3]
    # blocks are renumbered onto the new units; lengths survive
    part = state.partitions[0]
    assert set(part.block_refs) <= set(mapping.values()) and set(np.unique(part.block[:4, 0])) == set(part.block_refs)
    assert all(new % units == (old % 2) % units for old, new in mapping.items())
    assert part.length[:4].tolist() == [1, 2, 3, 4]
    # the open put's rows are not in the checkpoint: its step is open and empty, a put fills it
    assert ask(state, p.ListPartitions()) == [0, "kv", 1]
    assert ask(state, p.ProductionStatus(1))["rows"] == ask(state, p.ProductionStatus(1))["rows_in_flight"] == 0
    assert ask(state, p.Reserve(1, 4, X, 16)).put_id > 0
    assert ask(state, p.KvList("kv")) == ["a", "b"]
    assert state.bytes_held == sum(pt.nbytes for pt in state.partitions.values())


def test_open_put_rows_of_a_live_partition_are_freed(make_queue):
    q = make_queue()
    q.put("s", 2, X)
    q.reserve("s", 2, X)
    q.kv_put("kv", ["a"], X)
    q.reserve("kv", 1, X, keys=["new"])
    state, _ = restored(q, 2)
    assert ask(state, p.ProductionStatus("s"))["rows_in_flight"] == 0
    assert ask(state, p.KvList("kv")) == ["a"]
    again = ask(state, p.Reserve("kv", 1, X, 4, keys=["new"]))  # the claimed key is free again
    assert again.put_id > 0


def test_sampler_states_are_saved_and_given_back_when_the_task_registers_again(make_queue):
    class Counting(SequentialSampler):
        def __init__(self):
            self.calls = 0

        def state_dict(self):
            return {"calls": self.calls}

        def load_state_dict(self, state):
            self.calls = state["calls"]

    q = make_queue()
    sampler = Counting()
    sampler.calls = 7
    q.state.register_sampler("t", sampler)
    state, _ = restored(q, 2)
    fresh = Counting()
    state.register_sampler("t", fresh)
    assert fresh.calls == 7


def test_a_snapshot_of_another_format_is_refused():
    import msgspec

    with pytest.raises(SnapshotError, match="the controller snapshot is format 99; this build reads 1"):
        read_snapshot(msgspec.msgpack.encode({"version": 99}))
    with pytest.raises(SnapshotError, match="does not decode"):
        read_snapshot(b"\xc1")


def test_a_queue_checkpoint_that_crashed_mid_save_leaves_the_previous_one_current(tmp_path):
    from transfer_queue.storage.checkpoint import (
        begin_save,
        commit_save,
        current_checkpoint,
        read_controller,
        write_controller,
    )

    root = str(tmp_path)
    staging, name = begin_save(root)
    write_controller(staging, b"first")
    first = commit_save(root, staging, name)
    staging, name = begin_save(root)  # the second save crashes after the controller wrote, before the units did
    write_controller(staging, b"second")
    assert current_checkpoint(root) == first and read_controller(first) == b"first"
    staging, name = begin_save(root)  # the next save sweeps the crashed staging directory
    assert [n for n in os.listdir(root) if n.startswith(".staging-")] == [os.path.basename(staging)]
    write_controller(staging, b"third")
    third = commit_save(root, staging, name)
    assert current_checkpoint(root) == third and read_controller(third) == b"third"
    assert sorted(os.listdir(root)) == ["CURRENT", os.path.basename(third)]


def test_rows_lost_with_a_storage_unit_are_still_reported_after_a_restore(make_queue):
    q = make_queue(global_batch_size=4, num_n_samples=2, num_storage_units=2)
    first = q.put(0, 4)
    q.put(1, 4)
    q.put(1, 4)  # the units are taken in turn: on the same unit as the first
    dead = int(np.unique(first.blocks % 2)[0])
    q.state.unit_restarted(dead)
    before = q.ok(p.LostRows(0))
    assert len(before) == 4 and q.ok(p.ProductionStatus(0))["rows_lost"] == 4
    assert len(q.ok(p.LostRows(1))) == 4
    q.ok(p.Clear(1))  # a cleared partition's lost rows are not carried over
    state, _ = restored(q, 3)
    assert ask(state, p.LostRows(0)) == before
    assert ask(state, p.ProductionStatus(0))["rows_lost"] == 4
    assert state.lost.total == q.state.lost.total and set(state.lost.by_uid) == {first.partition_uid}
    assert state.lost.lost_below == {}  # the restored queue's units are fresh: nothing on them is gone


def test_a_restored_partition_keeps_the_queue_config_promote_jagged_and_max_fields(make_queue):
    q = make_queue(promote_jagged=True, max_fields=2)
    short = {"response": FieldSchema("dense", "int64", (3,))}
    q.put("s", 1, short)
    state, _ = restored(q, 2)
    # a longer response after the restore is promoted to jagged, as it would have been before
    longer = {"response": FieldSchema("dense", "int64", (5,))}
    assert ask(state, p.Reserve("s", 1, longer, 40)).put_id > 0
    assert state.partitions["s"].fields["response"] == FieldSchema("jagged", "int64", ())
    # the queue's max_fields still bounds the restored partition
    with pytest.raises(InvalidRequest, match=r"a partition holds at most 2 fields \(QueueConfig.max_fields"):
        ask(state, p.Reserve("s", 1, {"a": X["x"], "b": X["x"]}, 8))


def test_custom_meta_and_kv_tags_are_saved(make_queue):
    q = make_queue(global_batch_size=4, num_storage_units=2)
    meta = q.put("p", 2)
    q.ok(p.SetCustomMeta(meta.partition_uid, p.pack_indexes(meta.global_indexes), [{"score": 3}, None]))
    q.ok(p.KvTag("kv", ["a"], [{"v": 1}]))
    state, _ = restored(q, 2)
    assert ask(state, p.GetCustomMeta(meta.partition_uid, p.pack_indexes(meta.global_indexes))) == [{"score": 3}, {}]
    assert ask(state, p.KvList("kv", True)) == {"a": {"v": 1}}
