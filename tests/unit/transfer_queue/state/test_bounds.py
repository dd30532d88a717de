"""What a long run leaves behind stays bounded (issue 8 defect 8): cleared names, DP rounds, storage tombstones,
per-task state, parked requests, remembered commits and automatic round counters. Each bound is lowered here so
a test crosses it in a few steps; tests/unit/transfer_queue/state/test_soak.py runs 16,000 cycles at the real bounds
(slow tier)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from transfer_queue.errors import (
    GetMetaTimeout,
    InvalidRequest,
    PartitionCleared,
    PutExpired,
    QueueBusy,
    RequestTimeout,
)
from transfer_queue.metadata import FieldSchema
from transfer_queue.state import dp_rounds, partition_table, put_ledger
from transfer_queue.state import partition as partition_module
from transfer_queue.storage.unit import BlockStore
from transfer_queue.wire import protocol as p
from transfer_queue.wire.columns import columns_from_tensordict

X = {"x": FieldSchema("dense", "float32", ())}


def test_only_the_latest_cleared_names_are_remembered(make_queue, monkeypatch):
    monkeypatch.setattr(partition_table, "CLEARED_NAMES_REMEMBERED", 3)
    q = make_queue()
    for i in range(10):
        q.put(f"s{i}", 1, X)
        q.clear(f"s{i}")
    assert list(q.state.cleared_names) == ["s7", "s8", "s9"]
    with pytest.raises(PartitionCleared, match="partition_id='s9' was cleared"):
        q.get("s9", "x", 1)
    # a forgotten name is one never seen: get_meta waits for a put (here: times out) instead of failing at once
    waiting = q.get_async("s0", "x", 1, timeout=1.0)
    q.advance(1.5)
    with pytest.raises(GetMetaTimeout, match="the partition was never opened"):
        waiting.result()


def test_a_partition_keeps_only_its_latest_dp_rounds(make_queue, monkeypatch):
    monkeypatch.setattr(dp_rounds, "MAX_ROUNDS_PER_PARTITION", 2)
    q = make_queue()
    q.put("s", 8, X)
    for r in range(4):
        q.get("s", "x", 1, sampler_params={"dp_rank": 0, "dp_size": 2, "dp_group_id": f"g{r}"})
    assert list(q.state.partitions["s"].rounds) == [("train", "g2"), ("train", "g3")]
    peer = q.get("s", "x", 1, sampler_params={"dp_rank": 1, "dp_size": 2, "dp_group_id": "g3"})
    assert peer.global_indexes.tolist() == [7]


def test_idle_tasks_are_forgotten_and_one_task_too_many_is_refused(make_queue, monkeypatch):
    monkeypatch.setattr(partition_module, "MAX_TASKS_PER_PARTITION", 3)
    q = make_queue()
    q.put("s", 4, X)
    q.ok(p.ConsumptionStatus("s", None))
    for i in range(3):
        meta = q.get("s", "x", 1, task=f"t{i}")
    q.release(meta)  # t2 holds nothing any more: it is forgotten when a new task comes
    t3 = q.get("s", "x", 1, task="t3")
    assert t3.global_indexes.tolist() == [0]
    assert sorted(q.state.partitions["s"].tasks) == ["t0", "t1", "t3"]
    with pytest.raises(InvalidRequest, match=r"partition_id='s' already follows 3 tasks that hold rows \(at most 3\)"):
        q.get("s", "x", 1, task="t4")
    q.release(t3)
    assert q.get("s", "x", 1, task="t2").global_indexes.tolist() == [0]  # rebuilt: it had taken nothing


def test_parked_requests_are_capped_with_queue_busy(make_queue):
    q = make_queue(max_waiting_requests=2)
    first, second = q.get_async(0, "x", 1), q.get_async(0, "x", 1, "other")
    assert not first.done and not second.done
    with pytest.raises(
        QueueBusy, match=r"2 requests are waiting in the controller \(max_waiting_requests=2\); this GetMeta was"
    ):
        q.get_async(0, "x", 1, "third").result()
    q.put(0, 4, X)
    assert first.result().to_meta().global_indexes.tolist() == [0]
    assert q.get(0, "x", 1, "third").global_indexes.tolist() == [0]


def test_remembered_commits_are_capped(make_queue, monkeypatch):
    monkeypatch.setattr(put_ledger, "COMMITS_REMEMBERED", 2)
    q = make_queue()
    reservations = [q.reserve("s", 1, X) for _ in range(3)]
    for r in reservations:
        q.commit(r)
    assert list(q.state.committed) == [r.put_id for r in reservations[1:]]
    with pytest.raises(RequestTimeout, match="no longer remembered"):  # it was applied: not a PutExpired
        q.commit(reservations[0])


def test_automatic_round_counters_die_with_their_connection(make_queue):
    q = make_queue(global_batch_size=8)
    q.put(0, 8, X)
    replies: list[Any] = []
    for peer in ("a", "b"):
        request = q.get_request(0, "x", 1, sampler_params={"dp_rank": 0, "dp_size": 2})
        q.table.handle(request, lambda value, error: replies.append((value, error)), peer)
    assert len(q.state.auto_rounds) == 2
    q.state.on_disconnect("a")
    assert [c[3] for c in q.state.auto_rounds] == ["b"]


# ---- storage tombstones ---------------------------------------------------------------------------------------
def write(store: BlockStore, uid: int, block_id: int) -> None:
    _, columns = columns_from_tensordict(TensorDict({"x": torch.zeros(2)}, batch_size=[2]))
    column = columns["x"]
    spec = p.ColumnSpec("x", column.schema, 2, len(column.buffers()))
    frames = [np.frombuffer(bytearray(bytes(memoryview(b))), dtype=np.uint8) for b in column.buffers()]
    store.write(p.Write(uid, block_id, 2, [spec]), frames)


def test_drops_carry_the_live_partitions_and_the_block_floor(make_queue):
    q = make_queue(num_storage_units=1)
    q.put("keep", 1, X)
    open_put = q.reserve("open", 1, X)
    q.put("gone", 1, X)
    q.clear("gone")
    _, drop = q.table.outbox[-1]
    assert drop.live_uids == [1, 2] and drop.max_uid == 3
    assert drop.block_floor == int(p.unpack_indexes(p.pack_indexes(np.array([open_put.placements[0].block_id])))[0])
    q.commit(open_put)
    q.state.outbox.clear()
    q.kv_put("kv", ["k"], X)
    q.kv_put("kv", ["k"], X)  # the old value's block is dropped; no put is open: the floor is the next block
    _, drop = q.table.outbox[-1]
    assert isinstance(drop, p.DropBlocks) and drop.block_floor == q.state._next_block


def test_a_storage_unit_keeps_tombstones_only_for_what_the_controller_has_not_covered():
    store = BlockStore(0, 1)
    for uid in range(1, 101):
        write(store, uid, uid)
        store.drop_partition(uid)  # an old controller's message: one tombstone each
    assert len(store.dead_partitions) == 100
    write(store, 200, 300)
    store.drop_partition(100, live_uids=[200], max_uid=201, block_floor=301)
    assert not store.dead_partitions and not store.dead_blocks
    with pytest.raises(Exception, match="partition uid 50 was cleared"):
        write(store, 50, 400)
    with pytest.raises(Exception, match="partition uid 201 was cleared"):
        write(store, 201, 400)
    write(store, 202, 400)  # opened after the message: alive
    with pytest.raises(PutExpired, match="block 299 belongs to a put that was aborted or already finished"):
        write(store, 200, 299)
    store.drop_blocks(200, [350, 500], block_floor=360)
    assert store.dead_blocks == {200: {500}}
    store.drop_blocks(200, [], block_floor=600)
    assert not store.dead_blocks
    assert store.stats()["blocks"] == 2  # blocks 300 and 400 (of live partitions) stay
