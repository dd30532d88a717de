"""``replicas=2`` without Ray: a ControllerServer and three StorageServers in this process, wired by hand (as the
controller actor does: each unit holds the second copy of its partner's blocks). Every block is written to two units,
a read falls back to the other copy at once when a unit is down (stopped) or came back empty (restarted), nothing is
reported lost while one copy lives, a restarted unit gets its copies back from the other ones (refill), a row is lost
(typed) only when both copies are gone, and a checkpoint saves each block once and restores both copies."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import transfer_queue
from transfer_queue.client import TransferQueueClient
from transfer_queue.config import QueueConfig
from transfer_queue.controller.server import ControllerServer
from transfer_queue.errors import CheckpointError, InvalidRequest, RowsLost, StorageUnitDown
from transfer_queue.state.placement import replica_units
from transfer_queue.state.queue_state import QueueState
from transfer_queue.state.snapshot import block_map, read_snapshot, restore_state, unit_restores
from transfer_queue.storage.checkpoint import (
    current_checkpoint,
    load_unit,
    read_controller,
    read_manifest,
    restore_into,
)
from transfer_queue.storage.unit import BlockStore, StorageServer
from transfer_queue.wire import protocol as p

SESSION = "f" * 32
SECRET = b"q" * 32
UNITS = 3


def store(unit: int, replica_of: list[int]) -> BlockStore:
    block_store = BlockStore(unit, UNITS, SECRET)
    block_store.holds = frozenset(u for u, partner in enumerate(replica_of) if partner == unit)
    return block_store


@dataclass
class LocalQueue:
    controller: ControllerServer
    units: list[StorageServer]
    client: TransferQueueClient
    info: p.ControllerInfo

    @property
    def replica_of(self) -> list[int]:
        replica_of = self.controller.state.ledger.replica_of
        assert replica_of is not None
        return replica_of

    def restart(self, unit: int) -> dict[str, Any]:
        self.units[unit].stop()
        self.units[unit] = StorageServer(store(unit, self.replica_of), "127.0.0.1", SESSION, SECRET)
        return self.controller.restart_unit(unit, self.units[unit].endpoint)


def start_queue(state: QueueState, stores: list[BlockStore]) -> LocalQueue:
    """A controller serving ``state`` over storage servers of ``stores`` (their blocks already in them)."""
    units = [StorageServer(s, "127.0.0.1", SESSION, SECRET) for s in stores]
    controller = ControllerServer(state, SESSION, [u.endpoint for u in units], "127.0.0.1", SECRET)
    info = p.ControllerInfo(
        p.PROTOCOL_VERSION,
        SESSION,
        controller.endpoint,
        [u.endpoint for u in units],
        state.config.to_dict(),
        SECRET,
        controller.state.ledger.replica_of,
    )
    return LocalQueue(controller, units, TransferQueueClient("c", info, force_tcp=True), info)


def stop_queue(local: LocalQueue) -> None:
    local.client.close()
    local.controller.stop()
    for unit in local.units:
        unit.stop()


@pytest.fixture
def queue() -> Iterator[LocalQueue]:
    config = QueueConfig(global_batch_size=4, num_storage_units=UNITS, default_timeout=3.0, replicas=2)
    replica_of = replica_units([""] * UNITS, 2)
    assert replica_of == [1, 2, 0]
    local = start_queue(QueueState(config, None), [store(u, replica_of) for u in range(UNITS)])
    yield local
    stop_queue(local)


def put_on_each_unit(client: TransferQueueClient, first: float = 1.0) -> dict[int, Any]:
    """Three small puts, one per unit (round robin). Returns primary unit -> meta; values ``first + unit order``."""
    metas = {}
    for i in range(UNITS):
        meta = client.put({"x": torch.full((2, 4), first + i)}, partition_id="p")
        metas[int(meta.blocks[0, 0]) % UNITS] = meta
    assert sorted(metas) == list(range(UNITS))
    return metas


def values(client: TransferQueueClient, metas: dict[int, Any]) -> dict[int, list[float]]:
    return {u: client.get_data(m, timeout=5.0)["x"][:, 0].tolist() for u, m in metas.items()}


def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_every_block_is_on_two_units_and_a_clear_drops_both(queue: LocalQueue) -> None:
    metas = put_on_each_unit(queue.client)
    for unit, meta in metas.items():
        block = int(meta.blocks[0, 0])
        holders = [u for u, server in enumerate(queue.units) if block in server.store.blocks]
        assert holders == sorted([unit, queue.replica_of[unit]])
    summary = queue.client.status()["storage"]
    assert summary["replicas"] == 2 and summary["blocks_single_copy"] == 0
    assert summary["budget"] == 3 * (8 << 30) // 2
    assert [u["bytes"] for u in summary["units"]] == [2 * 2 * 4 * 4] * UNITS  # two blocks of 2 x 4 floats each
    queue.client.clear(partition_id="p")
    wait_for(lambda: all(not server.store.blocks for server in queue.units))


def test_a_stopped_unit_is_read_from_its_replica_at_once_and_puts_skip_it_and_its_partner(queue: LocalQueue) -> None:
    client = queue.client
    metas = put_on_each_unit(client)
    before = values(client, metas)
    queue.units[0].stop()
    wait_for(lambda: 0 in queue.controller.down_reasons)
    client.ping()  # the controller's view: unit 0 is down
    assert values(client, metas) == before  # unit 0's blocks from unit 1, unit 2's from unit 2
    assert client.lost_rows(partition_id="p") == []
    assert client.status()["storage"]["blocks_single_copy"] == 2  # unit 0's own and unit 2's copy on it
    meta = client.put({"x": torch.ones(2, 4)}, partition_id="p")  # not on 0 nor on 2 (its copy would go to 0)
    assert set((meta.blocks[:, 0] % UNITS).tolist()) == {1}


def test_a_read_that_finds_a_unit_gone_reads_the_replica_in_the_same_call(queue: LocalQueue) -> None:
    client = queue.client
    metas = put_on_each_unit(client)
    before = values(client, metas)
    queue.controller.stop()  # nobody tells the client: it learns from its own failed read
    queue.units[0].stop()
    assert values(client, metas) == before


def storage(client: TransferQueueClient) -> dict[str, Any]:
    return client.status()["storage"]


def refilled(client: TransferQueueClient) -> bool:
    return storage(client)["refilling"] == []


def test_a_restarted_unit_loses_nothing_while_the_other_copy_lives(queue: LocalQueue) -> None:
    client = queue.client
    metas = put_on_each_unit(client)
    before = values(client, metas)
    queue.controller.mark_unit(1, "held down by the test")  # the other copy of unit 0's own block: no refill yet
    result = queue.restart(0)
    assert result["rows"] == 0 and result["partitions"] == {}
    queue.controller.mark_unit(1, None)
    wait_for(lambda: refilled(client))
    queue.controller.mark_unit(2, "held down by the test")  # unit 2's block is read from its copy refilled on 0
    assert values(client, metas) == before
    assert client.lost_rows(partition_id="p") == []
    summary = client.status()
    assert summary["rows_lost"] == 0 and summary["storage"]["blocks_single_copy"] == 2  # the two on unit 2
    assert summary["storage"]["rows_single_copy"] == 4
    queue.controller.mark_unit(2, None)
    fresh = put_on_each_unit(client, first=10.0)  # the restarted unit takes both copies of new puts again
    assert sorted(v for read in values(client, fresh).values() for v in read) == [10, 10, 11, 11, 12, 12]
    meta = client.get_meta(["x"], 12, partition_id="p", timeout=2.0)
    assert len(meta) == 12 and client.get_data(meta)["x"].shape == (12, 4)


def test_rows_are_lost_once_both_copies_are_gone(queue: LocalQueue) -> None:
    client = queue.client
    metas = put_on_each_unit(client)
    queue.controller.mark_unit(1, "held down by the test")  # unit 0's block is not copied back from unit 1
    queue.restart(0)
    result = queue.restart(1)  # unit 0's blocks had their last copy on unit 1
    assert result["rows"] == 2 and result["partitions"] == {"p": 2}
    wait_for(lambda: refilled(client))  # both refills went past the lost block: still lost, typed
    assert storage(client)["blocks_single_copy"] == 0
    lost = metas[0].global_indexes.tolist()
    with pytest.raises(RowsLost, match=re.escape(f"rows {lost} (2 of 2) of partition_id='p' were lost: storage unit")):
        client.get_data(metas[0])
    assert client.get_data(metas[1])["x"].shape == (2, 4)  # its copy on unit 2
    assert client.get_data(metas[2])["x"].shape == (2, 4)  # on unit 2 itself
    assert [r["global_index"] for r in client.lost_rows(partition_id="p")] == lost


def test_a_row_whose_both_units_are_down_is_reported_down_typed(queue: LocalQueue) -> None:
    client = queue.client
    metas = put_on_each_unit(client)
    queue.units[0].stop()
    queue.units[1].stop()
    wait_for(lambda: {0, 1} <= set(queue.controller.down_reasons))
    client.ping()
    with pytest.raises(StorageUnitDown, match=r"storage unit 0 is down \(the controller lost its connection to it\)"):
        client.get_data(metas[0])
    assert client.get_data(metas[2])["x"].shape == (2, 4)  # unit 2 holds it itself


def test_a_restarted_unit_is_refilled_and_then_outlives_the_restart_of_its_partner(queue: LocalQueue) -> None:
    client = queue.client
    metas = put_on_each_unit(client)
    before = values(client, metas)
    blocks = {u: int(m.blocks[0, 0]) for u, m in metas.items()}
    queue.restart(0)
    wait_for(lambda: refilled(client))
    assert sorted(queue.units[0].store.blocks) == sorted([blocks[0], blocks[2]])  # its own and unit 2's copy
    summary = storage(client)
    assert summary["blocks_single_copy"] == 0 and summary["rows_single_copy"] == 0
    assert summary["blocks_refilled"] == 2 and summary["refill_waiting"] == {}
    result = queue.restart(1)  # the other copy of unit 0's block is gone now: the refilled one remains
    assert result["rows"] == 0
    assert values(client, metas) == before
    assert client.lost_rows(partition_id="p") == []
    wait_for(lambda: refilled(client))
    assert sorted(queue.units[1].store.blocks) == sorted([blocks[0], blocks[1]])
    assert storage(client)["blocks_refilled"] == 4


def test_a_refill_of_many_batches_is_planned_once_and_copies_every_block_back_whole(
    queue: LocalQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More blocks than one batch takes, a field written into the rows later (another block): the refill plans once
    per restart (it was planned again for every batch: quadratic in the queue's blocks) and every block comes back."""
    from transfer_queue.controller import server as controller_server

    client = queue.client
    metas = [client.put({"x": torch.full((3, 2), float(i))}, partition_id="p") for i in range(40)]
    ys = {i: client.put({"y": torch.full((3,), 100.0 + i)}, metadata=metas[i]) for i in range(0, 40, 4)}
    plans: list[int] = []
    real = controller_server.plan_refill
    monkeypatch.setattr(controller_server, "plan_refill", lambda state, unit: plans.append(unit) or real(state, unit))
    queue.restart(0)
    wait_for(lambda: refilled(client))
    assert plans == [0]
    refilled_blocks = storage(client)["blocks_refilled"]
    assert refilled_blocks > 2 * controller_server.REFILL_BLOCKS  # three batches at least
    assert refilled_blocks == len(queue.units[0].store.blocks)
    for unit in (1, 2):  # every copy is read from unit 0 now
        queue.controller.mark_unit(unit, "held down by the test")
    held = queue.units[0].store.blocks
    x_on_0 = [i for i, m in enumerate(metas) if int(m.blocks[0, 0]) in held]
    y_on_0 = [i for i, m in ys.items() if int(m.blocks[0, 0]) in held]
    assert len(x_on_0) > 20 and y_on_0
    assert [client.get_data(metas[i])["x"][:, 0].tolist() for i in x_on_0] == [[float(i)] * 3 for i in x_on_0]
    assert [client.get_data(ys[i])["y"].tolist() for i in y_on_0] == [[100.0 + i] * 3 for i in y_on_0]


def test_a_refill_waits_for_the_unit_holding_the_other_copy_and_the_status_says_so(queue: LocalQueue) -> None:
    client = queue.client
    metas = put_on_each_unit(client)
    blocks = {u: int(m.blocks[0, 0]) for u, m in metas.items()}
    queue.controller.mark_unit(1, "held down by the test")
    queue.restart(0)
    first = blocks[2] < blocks[0]  # unit 2's copy goes back first if it is older (block id order)
    wait_for(lambda: (s := storage(client))["refill_waiting"] == {0: 1} and s["blocks_refilled"] == first)
    summary = storage(client)
    assert summary["refilling"] == [0] and blocks[0] not in queue.units[0].store.blocks
    assert summary["blocks_single_copy"] == 3 - first  # unit 0's (its units 0 and 1), unit 1's (down), unit 2's?
    queue.controller.mark_unit(1, None)  # back: the refill goes on
    wait_for(lambda: refilled(client))
    summary = storage(client)
    assert summary["blocks_single_copy"] == 0 and summary["refill_waiting"] == {} and summary["blocks_refilled"] == 2
    assert sorted(queue.units[0].store.blocks) == sorted([blocks[0], blocks[2]])


def hold_refill_reads(controller: ControllerServer, block: int) -> tuple[threading.Event, threading.Event]:
    """Hold the other copy of ``block`` once it arrived at the controller (before it is written back) until the
    returned ``release`` is set; ``held`` is set once it is held. The batch waits for it meanwhile."""
    held, release = threading.Event(), threading.Event()
    real_read, real_periodic = controller._refill_read, controller.periodic
    kept: list[Any] = []

    def read(batch: Any, step: Any, header: Any, frames: Any) -> None:
        if step.block == block and not release.is_set():
            batch.reads[-1] = step  # the batch is not done while this block is held
            kept.append((batch, step, header, frames))
            held.set()
            return
        real_read(batch, step, header, frames)

    def periodic(events: Any) -> None:
        if release.is_set() and kept:
            batch, step, header, frames = kept.pop()
            batch.reads.pop(-1, None)
            real_read(batch, step, header, frames)
        real_periodic(events)

    controller._refill_read = read  # type: ignore[method-assign]
    controller.periodic = periodic  # type: ignore[method-assign]
    return held, release


@pytest.mark.parametrize("how", ["kv_put overwrites it", "clear"])
def test_a_block_dropped_while_it_is_refilled_is_not_written_back(queue: LocalQueue, how: str) -> None:
    client = queue.client
    meta = client.kv_put("a", "kv", {"v": torch.full((3,), 5.0)})
    block = int(meta.blocks[0, 0])
    unit = block % UNITS
    held, release = hold_refill_reads(queue.controller, block)
    queue.restart(unit)
    assert held.wait(10), "the refill never read the block's other copy"
    if how == "clear":
        client.clear(partition_id="kv")
    else:
        client.kv_put("a", "kv", {"v": torch.full((3,), 6.0)})  # the old value's block is dropped
    wait_for(lambda: queue.units[unit].store.block_floor > block)  # the drop reached the unit before any copy
    release.set()
    wait_for(lambda: refilled(client))
    assert block not in queue.units[unit].store.blocks  # not resurrected by the refill
    assert storage(client)["blocks_refilled"] == 0
    if how != "clear":
        assert torch.equal(client.kv_batch_get(["a"], "kv")["v"][0], torch.full((3,), 6.0))
        assert storage(client)["blocks_single_copy"] == 0


def saved_blocks(checkpoint: str) -> list[int]:
    """Every block id in the checkpoint's unit files (a block saved twice is listed twice)."""
    out = []
    for u in range(UNITS):
        try:
            out += [b.block_id for b in read_manifest(checkpoint, u)[1].blocks]
        except CheckpointError:  # this unit saved nothing
            pass
    return sorted(out)


def restore_locally(root: str, units: int, replicas: int) -> LocalQueue:
    """What ``init(restore_from=root)`` does, without Ray: the snapshot's state, and each unit's blocks loaded from
    the files the restore plan names."""
    checkpoint = current_checkpoint(root)
    snapshot = read_snapshot(read_controller(checkpoint))
    config = QueueConfig(global_batch_size=4, num_storage_units=units, default_timeout=3.0, replicas=replicas)
    replica_of = replica_units([""] * units, replicas)
    mapping, next_block = block_map(snapshot, units)
    stores = []
    for u, (files, block_ids) in enumerate(unit_restores(snapshot, mapping, units, replica_of)):
        unit_store = store(u, replica_of) if replica_of is not None else BlockStore(u, units, SECRET)
        unit_store.secret = b""  # the restore writes without a reservation, as StorageUnit.restore_checkpoint does
        for f in files:
            restore_into(unit_store, [b for b in load_unit(checkpoint, f) if b.block_id in block_ids], block_ids)
        unit_store.secret = SECRET
        stores.append(unit_store)
    return start_queue(restore_state(snapshot, config, None, mapping, next_block), stores)


@pytest.mark.parametrize(("units", "replicas"), [(3, 2), (2, 1)])
def test_a_checkpoint_saves_each_block_once_and_restores_into_another_replica_count(
    queue: LocalQueue, tmp_path: Any, units: int, replicas: int
) -> None:
    client = queue.client
    metas = put_on_each_unit(client)
    before = values(client, metas)
    queue.restart(0)  # restarted and refilled: the save takes unit 0's blocks from whichever holder is whole
    wait_for(lambda: refilled(client))
    queue.units[1].stop()  # a unit down: each block still has a holder that is up
    wait_for(lambda: 1 in queue.controller.down_reasons)
    saved = client.save_checkpoint(str(tmp_path))
    assert saved_blocks(saved) == sorted(int(m.blocks[0, 0]) for m in metas.values())  # each block once
    restored = restore_locally(str(tmp_path), units, replicas)
    try:
        again = {u: restored.client.get_meta(["x"], 2, partition_id="p", task_name="t") for u in range(UNITS)}
        got = sorted(v for m in again.values() for v in restored.client.get_data(m)["x"][:, 0].tolist())
        assert got == sorted(v for read in before.values() for v in read)
        held = sorted(b for unit in restored.units for b in unit.store.blocks)
        assert len(held) == replicas * len(metas)  # restored with as many copies as the new queue keeps
        if replicas == 2:
            assert storage(restored.client)["blocks_single_copy"] == 0
            restored.units[0].stop()  # either copy serves
            again_read = sorted(v for m in again.values() for v in restored.client.get_data(m)["x"][:, 0].tolist())
            assert again_read == got
    finally:
        stop_queue(restored)


def test_a_checkpoint_needs_a_whole_copy_of_each_unit_s_blocks(queue: LocalQueue, tmp_path: Any) -> None:
    put_on_each_unit(queue.client)
    queue.units[0].stop()
    queue.units[1].stop()  # unit 0's blocks: both holders down
    wait_for(lambda: {0, 1} <= set(queue.controller.down_reasons))
    with pytest.raises(
        CheckpointError,
        match=r"no storage unit holding the blocks placed on storage unit 0 holds all of them now \(storage unit 0 is "
        r"down \(the controller lost its connection to it\); storage unit 1 is down",
    ):
        queue.client.save_checkpoint(str(tmp_path / "ckpt"))


def test_replicas_config_is_checked() -> None:
    with pytest.raises(InvalidRequest, match=r"replicas must be 1 or 2 \(copies of each row on distinct storage units"):
        QueueConfig(global_batch_size=1, num_storage_units=4, replicas=3)
    with pytest.raises(InvalidRequest, match=r"replicas=2 needs as many storage units.*num_storage_units=1"):
        QueueConfig(global_batch_size=1, num_storage_units=1, replicas=2)
    with pytest.raises(InvalidRequest, match=r"replicas=2 needs as many storage units.*num_storage_units=1"):
        transfer_queue.init(global_batch_size=1, num_storage_units=1, replicas=2)  # refused before Ray is touched
    assert QueueConfig(global_batch_size=1).replicas == 1
    assert QueueConfig.from_dict({"global_batch_size": 1}).byte_budget == 2 * (8 << 30)


def test_a_client_without_the_replica_map_of_a_replicated_queue_is_refused(queue: LocalQueue) -> None:
    import msgspec

    info = msgspec.structs.replace(queue.info, replica_units=None)
    with pytest.raises(
        InvalidRequest, match=r"replicas=2 copies of each row, but controller_info names the replica of 0"
    ):
        TransferQueueClient("bad", info, force_tcp=True)


def test_replicas_go_to_other_nodes_spread_over_them() -> None:
    assert replica_units(["a", "a", "b", "b"], 2) == [2, 3, 0, 1]
    assert replica_units(["a", "b", "a", "b"], 2) == [1, 2, 3, 0]
    assert replica_units(["a", "a", "a", "b"], 2) == [3, 3, 3, 0]
    assert replica_units(["a", "b", "c"], 2) == [1, 2, 0]
    assert replica_units(["", ""], 2) == [1, 0]
    assert replica_units(["a", "b"], 1) is None


def test_a_large_put_spread_over_units_writes_each_unit_once_and_reads_back_over_unix_sockets(
    queue: LocalQueue,
) -> None:
    client = TransferQueueClient("unix", queue.info)  # Unix sockets: one request per unit and call on each
    try:
        x = torch.arange(64 * 32768, dtype=torch.float32).reshape(64, 32768)  # 8 MiB: worth several units
        meta = client.put({"x": x}, partition_id="big")
        primaries = sorted(set((meta.blocks[:, 0] % UNITS).tolist()))
        holders = primaries + [queue.replica_of[u] for u in primaries]
        assert len(holders) == len(set(holders))  # no unit holds two blocks of one put: each gets one write
        assert torch.equal(client.get_data(meta)["x"], x)
        queue.units[primaries[0]].stop()
        assert torch.equal(client.get_data(meta)["x"], x)
    finally:
        client.close()


def test_a_checkpoint_of_one_copy_restores_into_two(tmp_path: Any) -> None:
    config = QueueConfig(global_batch_size=4, num_storage_units=2, default_timeout=3.0)
    single = start_queue(QueueState(config, None), [BlockStore(u, 2, SECRET) for u in range(2)])
    try:
        metas = [single.client.put({"x": torch.full((2, 4), float(v))}, partition_id="p") for v in range(4)]
        assert {int(m.blocks[0, 0]) % 2 for m in metas} == {0, 1}
        single.client.save_checkpoint(str(tmp_path))
    finally:
        stop_queue(single)
    restored = restore_locally(str(tmp_path), UNITS, 2)
    try:
        assert sum(len(unit.store.blocks) for unit in restored.units) == 8  # 4 blocks, 2 copies each
        assert storage(restored.client)["blocks_single_copy"] == 0
        meta = restored.client.get_meta(["x"], 8, partition_id="p", task_name="t")
        restored.units[int(meta.blocks[0, 0]) % UNITS].stop()  # the other copy serves
        got = restored.client.get_data(meta)["x"][:, 0].tolist()
        assert sorted(got) == sorted(float(v) for v in range(4) for _ in range(2))
    finally:
        stop_queue(restored)


def retire(queue: LocalQueue, unit: int) -> None:
    """Unit ``unit`` is lost for good: stopped, and marked down for good (as the unit watch does when Ray will not
    restart it)."""
    queue.units[unit].stop()
    queue.controller.mark_unit(unit, "its Ray actor died (held by the test)", final=True)


def rereplicated(client: TransferQueueClient, unit: int) -> bool:
    summary = storage(client)
    return summary["rereplicating"] == [] and unit in summary["rereplicated"]


def test_a_retired_unit_s_copies_are_moved_so_a_second_unit_lost_for_good_loses_nothing(
    queue: LocalQueue, tmp_path: Any
) -> None:
    client = queue.client
    metas = [client.put({"x": torch.full((2, 4), float(v))}, partition_id="p") for v in range(30)]
    ys = {i: client.put({"y": torch.full((2,), 100.0 + i)}, metadata=metas[i]) for i in range(0, 30, 5)}
    before = [client.get_data(m)["x"][:, 0].tolist() for m in metas]
    retire(queue, 0)
    wait_for(lambda: rereplicated(client, 0))
    summary = storage(client)
    assert summary["rereplicated"] == {0: {1: 2, 2: 1}}  # unit 0's own blocks (other copy on 1) go to 2, 2's to 1
    assert (
        summary["blocks_single_copy"] == 0 and summary["rows_single_copy"] == 0 and summary["cannot_rereplicate"] == {}
    )
    ids = [int(m.blocks[0, 0]) for m in [*metas, *ys.values()]]
    with_copy_on_0 = [b for b in ids if b % UNITS in (0, 2)]
    assert summary["blocks_rereplicated"] == len(with_copy_on_0)
    for unit in (1, 2):  # every block is on both live units now
        assert sorted(queue.units[unit].store.blocks) == sorted(ids)
    retire(queue, 1)  # the second unit lost for good: every block still has its copy on unit 2
    wait_for(lambda: 1 in queue.controller.state.lost.cannot_rereplicate)
    assert [client.get_data(m)["x"][:, 0].tolist() for m in metas] == before
    assert [client.get_data(m)["y"].tolist() for m in ys.values()] == [[100.0 + i] * 2 for i in ys]
    assert client.lost_rows(partition_id="p") == []
    summary = storage(client)
    assert summary["cannot_rereplicate"] == {
        1: "the copies of retired storage unit 1 cannot be re-replicated: a second copy needs a unit other than the "
        "one holding the first, and only 1 unit [2] is up; its blocks stay single-copy"
    }
    assert summary["blocks_single_copy"] == len(ids)  # degraded again, and says why
    saved = client.save_checkpoint(str(tmp_path))  # unit 0's and 1's blocks by unit 2, which holds moved copies
    assert saved_blocks(saved) == sorted(ids)


def test_a_unit_restarted_after_a_move_gets_back_the_moved_copies_from_where_they_are_now(queue: LocalQueue) -> None:
    """Unit 0 retired, its copies moved (unit 0's own blocks onto 2, unit 2's onto 1): every block is on 1 and 2. Unit 2
    restarted empty is the target of the first and the survivor of the second: its refill copies back all of them
    from unit 1 (none from retired 0), and then unit 1 lost for good takes no row with it."""
    client = queue.client
    metas = [client.put({"x": torch.full((2, 4), float(v))}, partition_id="p") for v in range(6)]
    before = [client.get_data(m)["x"][:, 0].tolist() for m in metas]
    ids = sorted(int(m.blocks[0, 0]) for m in metas)
    retire(queue, 0)
    wait_for(lambda: rereplicated(client, 0))
    assert storage(client)["rereplicated"] == {0: {1: 2, 2: 1}}
    assert queue.restart(2)["rows"] == 0
    wait_for(lambda: refilled(client))
    assert sorted(queue.units[2].store.blocks) == ids
    summary = storage(client)
    assert summary["blocks_refilled"] == len(ids) and summary["refill_waiting"] == {}
    assert summary["blocks_single_copy"] == 0
    retire(queue, 1)
    assert [client.get_data(m)["x"][:, 0].tolist() for m in metas] == before
    assert client.lost_rows(partition_id="p") == []
    assert storage(client)["blocks_single_copy"] == len(ids)


def test_without_the_move_a_second_unit_lost_for_good_takes_rows_with_it(queue: LocalQueue) -> None:
    """What the move prevents (the same run with it held off): unit 0's own blocks had their other copy on unit 1."""
    client = queue.client
    metas = put_on_each_unit(client)
    queue.controller._moves_due = lambda: False  # type: ignore[method-assign]
    retire(queue, 0)
    retire(queue, 1)
    client.ping()
    with pytest.raises(StorageUnitDown, match=r"storage unit 0 is down \(its Ray actor died"):
        client.get_data(metas[0])


def test_a_block_cleared_or_put_while_a_retired_unit_s_copies_move_is_safe(queue: LocalQueue) -> None:
    client = queue.client
    kept = [client.put({"x": torch.full((2, 4), float(v))}, partition_id="p") for v in range(6)]
    cleared = [int(client.put({"x": torch.ones(2, 4)}, partition_id="q").blocks[0, 0]) for _ in range(UNITS)]
    block = max(int(m.blocks[0, 0]) for m in kept if int(m.blocks[0, 0]) % UNITS in (0, 2))  # has a copy on 0
    held, release = hold_refill_reads(queue.controller, block)
    retire(queue, 0)
    assert held.wait(10), "the move never read the block's other copy"
    client.clear(partition_id="q")  # cleared meanwhile: not moved
    fresh = client.put({"x": torch.full((2, 4), 50.0)}, partition_id="p")  # a put racing it: on 1 and 2 only
    assert int(fresh.blocks[0, 0]) % UNITS == 1
    release.set()
    wait_for(lambda: rereplicated(client, 0))
    assert not {b for unit in queue.units[1:] for b in unit.store.blocks} & set(cleared)  # none moved or left
    assert int(fresh.blocks[0, 0]) >= queue.controller.state.lost.moves[0].upto  # not one of the moved
    assert storage(client)["blocks_single_copy"] == 0
    retire(queue, 1)
    got = [client.get_data(m)["x"][:, 0].tolist() for m in [*kept, fresh]]
    assert got == [[float(v)] * 2 for v in range(6)] + [[50.0, 50.0]]
    assert storage(client)["blocks_single_copy"] == 7


def test_with_two_units_a_retired_unit_s_copies_cannot_move_and_the_status_says_so() -> None:
    config = QueueConfig(global_batch_size=4, num_storage_units=2, default_timeout=3.0, replicas=2)
    stores = []
    for u in range(2):
        unit_store = BlockStore(u, 2, SECRET)
        unit_store.holds = frozenset({1 - u})
        stores.append(unit_store)
    local = start_queue(QueueState(config, None), stores)
    try:
        metas = [local.client.put({"x": torch.full((2, 4), float(v))}, partition_id="p") for v in range(4)]
        local.units[0].stop()
        local.controller.mark_unit(0, "its Ray actor died (held by the test)", final=True)
        wait_for(lambda: storage(local.client)["cannot_rereplicate"] != {})
        summary = storage(local.client)
        assert summary["cannot_rereplicate"] == {
            0: "the copies of retired storage unit 0 cannot be re-replicated: a second copy needs a unit other than "
            "the one holding the first, and only 1 unit [1] is up; its blocks stay single-copy"
        }
        assert summary["blocks_single_copy"] == 4 and summary["rereplicating"] == [] and summary["rereplicated"] == {}
        assert [local.client.get_data(m)["x"][0, 0].item() for m in metas] == [0.0, 1.0, 2.0, 3.0]
    finally:
        stop_queue(local)


def test_after_a_move_both_units_holding_a_moved_copy_restarted_lose_its_rows_typed(queue: LocalQueue) -> None:
    """Unit 0 retired, its copies moved (every block on 1 and 2 now). Units 1 and 2 both restarted empty before a
    refill: every row put before is lost, moved ones included, and a read of them raises RowsLost (as without a move:
    the client tells the pair by where the copies were then); a row put between the two restarts still reads."""
    client = queue.client
    metas = put_on_each_unit(client)
    retire(queue, 0)
    wait_for(lambda: rereplicated(client, 0))
    queue.controller._start_refill = lambda unit, now: False  # type: ignore[method-assign]  # no refill runs
    queue.restart(1)
    fresh = client.put({"x": torch.full((2, 4), 7.0)}, partition_id="p")  # on 1 and 2 after 1 restarted
    assert queue.restart(2)["rows"] == 6
    client.ping()
    for meta in metas.values():
        lost = meta.global_indexes.tolist()
        match = re.escape(f"rows {lost} (2 of 2) of partition_id='p' were lost: storage unit ")
        with pytest.raises(RowsLost, match=match + r"[12] died and was restarted empty \(restart 1\)"):
            client.get_data(meta)
    assert client.get_data(fresh)["x"][:, 0].tolist() == [7.0, 7.0]
    expected = sorted(i for meta in metas.values() for i in meta.global_indexes.tolist())
    assert sorted(r["global_index"] for r in client.lost_rows(partition_id="p")) == expected


def hold_one_read(queue: Any, block: int, start: Any) -> Any:
    """Hold the controller's read of ``block``, ``start()`` a refill or a move (a restart, a retirement), and wait
    until its batch wrote every other block (only that read outstanding); returns what releases the read."""
    held, release = hold_refill_reads(queue.controller, block)
    start()
    assert held.wait(10), "the batch never read the held block"

    def rest_written() -> bool:
        batch = queue.controller._refill
        return batch is not None and not batch.writes and [s.block for s in batch.reads.values()] == [block]

    wait_for(rest_written)
    return release


def only_the_held_block_lost(client: Any, metas: list[Any], before: dict[int, Any], held_block: int) -> None:
    """The held block's rows are listed lost, every other block reads back as it was put."""
    client.ping()
    lost = next(m for m in metas if int(m.blocks[0, 0]) == held_block).global_indexes.tolist()
    assert [r["global_index"] for r in client.lost_rows(partition_id="p")] == lost
    for meta in metas:
        block = int(meta.blocks[0, 0])
        if block != held_block:
            assert client.get_data(meta)["x"][:, 0].tolist() == before[block]


def test_a_survivor_restarted_while_a_move_runs_loses_only_what_both_copies_took_and_never_stalls(
    queue: LocalQueue,
) -> None:
    """Unit 0 retired and its copies' move held at unit 0's first block (the batch's other blocks written): survivor
    2 restarted empty meanwhile. The blocks whose other copy was still on retired 0 (unit 2's own after the held one:
    the move had not got past it) lost both copies: their rows are lost, typed; the refill of 2 does not wait for 0
    (which never comes back), the move finishes, and every other row reads (unit 2's own before the held one too:
    the batch wrote them to 1, and giving it up keeps them)."""
    client = queue.client
    metas = [client.put({"x": torch.full((2, 4), float(v))}, partition_id="p") for v in range(6)]
    before = [client.get_data(m)["x"][0, 0].item() for m in metas]
    first = min(int(m.blocks[0, 0]) for m in metas if int(m.blocks[0, 0]) % UNITS == 0)  # moved first (from 1)
    release = hold_one_read(queue, first, lambda: retire(queue, 0))
    assert queue.controller.state.lost.moves[0].below == 0
    result = queue.restart(2)
    on_2_and_0 = [m for m in metas if int(m.blocks[0, 0]) % UNITS == 2 and int(m.blocks[0, 0]) > first]
    assert result["rows"] == 2 * len(on_2_and_0) > 0
    release.set()
    wait_for(lambda: refilled(client) and rereplicated(client, 0))
    summary = storage(client)
    assert summary["refill_waiting"] == {} and summary["blocks_single_copy"] == 0
    for meta in on_2_and_0:
        lost = meta.global_indexes.tolist()
        match = re.escape(f"rows {lost} (2 of 2) of partition_id='p' were lost: storage unit 2 died and was restarted")
        with pytest.raises(RowsLost, match=match):
            client.get_data(meta)
    kept = [i for i, m in enumerate(metas) if m not in on_2_and_0]
    assert [client.get_data(metas[i])["x"][0, 0].item() for i in kept] == [before[i] for i in kept]
    expected = sorted(i for meta in on_2_and_0 for i in meta.global_indexes.tolist())
    assert sorted(r["global_index"] for r in client.lost_rows(partition_id="p")) == expected


def test_a_retired_unit_ray_brings_back_after_its_move_is_no_longer_retired(queue: LocalQueue) -> None:
    """Unit 1 retired and its copies moved; then Ray brings it back after all (restarted elsewhere, empty). A block
    put since on 0 has its other copy on 1: when 0 restarts, that copy lives (1 is not retired any more), so nothing
    is lost and every row, moved or new, reads."""
    client = queue.client
    metas = put_on_each_unit(client)
    before = values(client, metas)
    retire(queue, 1)
    wait_for(lambda: rereplicated(client, 1))
    assert queue.restart(1)["rows"] == 0  # every copy it held was moved
    wait_for(lambda: refilled(client))
    fresh = put_on_each_unit(client, first=10.0)  # 0's has its other copy on 1 again
    fresh_before = values(client, fresh)
    assert queue.restart(0)["rows"] == 0
    client.ping()
    assert values(client, metas) == before and values(client, fresh) == fresh_before
    assert client.lost_rows(partition_id="p") == []


def test_a_move_made_after_a_restart_does_not_make_a_block_look_lost_with_that_restart(queue: LocalQueue) -> None:
    """Unit 1 restarted, its refill waiting for unit 2 (down), then unit 2 restarted: unit 1's own block (copies on 1
    and 2) lost both copies. The refills finish, then unit 0 is retired and its copies moved (0's own block to 2, 2's
    to 1): both are on 1 and 2 now, the pair unit 2's restart lost blocks with, but they were not on that pair then
    (the moves as they stood at the restart): they read."""
    client = queue.client
    metas = put_on_each_unit(client)
    before = values(client, metas)
    queue.controller.mark_unit(2, "held down by the test")  # 1's refill waits for 2 (its own block's other copy)
    assert queue.restart(1)["rows"] == 0
    result = queue.restart(2)
    assert result["rows"] == 2 and [partner for partner, _, _ in result["lost_with"]] == [1]
    wait_for(lambda: refilled(client))
    retire(queue, 0)
    wait_for(lambda: rereplicated(client, 0))
    assert storage(client)["rereplicated"] == {0: {1: 2, 2: 1}}
    client.ping()
    assert values(client, {0: metas[0], 2: metas[2]}) == {0: before[0], 2: before[2]}
    lost = metas[1].global_indexes.tolist()
    with pytest.raises(RowsLost, match=re.escape(f"rows {lost} (2 of 2) of partition_id='p' were lost: storage unit ")):
        client.get_data(metas[1])


def test_a_unit_brought_back_after_its_move_does_not_make_the_blocks_moved_off_it_look_lost(queue: LocalQueue) -> None:
    """Unit 0 retired and its copies moved (every block on 1 and 2 now); unit 2 restarted empty, its refill not run:
    1 holds every block. Then Ray brings 0 back: its restart names 2 (not refilled) in ``lost_with``, but the block 0
    and 2 shared is on 1 and 2 since the move (as it stood at that restart): nothing is lost and every row reads."""
    client = queue.client
    metas = put_on_each_unit(client)
    before = values(client, metas)
    retire(queue, 0)
    wait_for(lambda: rereplicated(client, 0))
    queue.controller._start_refill = lambda unit, now: False  # type: ignore[method-assign]  # no refill runs
    assert queue.restart(2)["rows"] == 0
    result = queue.restart(0)
    assert result["rows"] == 0 and [partner for partner, _, _ in result["lost_with"]] == [2]
    client.ping()
    assert values(client, metas) == before
    assert client.lost_rows(partition_id="p") == []


def test_a_unit_brought_back_and_retired_again_has_the_copies_it_took_since_moved(queue: LocalQueue) -> None:
    """Unit 0 retired, its copies moved; Ray brings it back, blocks are put on it again, then it is lost for good a
    second time: those copies are moved too (a move of their own, not the first one, done long ago), so restarts of
    the units holding their other copies lose nothing."""
    client = queue.client
    metas = put_on_each_unit(client)
    retire(queue, 0)
    wait_for(lambda: rereplicated(client, 0))
    moved = storage(client)["blocks_rereplicated"]
    assert queue.restart(0)["rows"] == 0
    wait_for(lambda: refilled(client))
    fresh = put_on_each_unit(client, first=10.0)  # 0's has its other copy on 1, 2's on 0
    every = {**{u: metas[u] for u in metas}, **{UNITS + u: m for u, m in fresh.items()}}
    before = values(client, every)
    retire(queue, 0)
    wait_for(lambda: storage(client)["blocks_rereplicated"] == moved + 2)  # the fresh blocks of 0 and of 2
    wait_for(lambda: rereplicated(client, 0))
    assert storage(client)["blocks_single_copy"] == 0
    assert queue.restart(1)["rows"] == 0  # every block is on 1 and 2 again
    wait_for(lambda: refilled(client))
    assert queue.restart(2)["rows"] == 0
    client.ping()
    assert values(client, every) == before


def test_a_unit_retired_while_a_restarted_unit_waits_for_it_takes_the_rows_they_shared_lost_typed(
    queue: LocalQueue,
) -> None:
    """Unit 0 down (not for good yet); unit 2 restarted empty, its refill held: its own block's other copy is on 0.
    Then 0 is lost for good: that block has no copy left. Its rows are lost (listed, put on 2's restart) and a client
    that knew of 2's restart before is told (RowsLost, though 2's refill has not moved); the refill then goes on
    without the block (never claiming 2 holds it), 0's other copies are moved, and every other row reads."""
    client = queue.client
    metas = put_on_each_unit(client)
    before = values(client, metas)
    start_refill = queue.controller._start_refill
    hold = threading.Event()
    hold.set()
    queue.controller._start_refill = (  # type: ignore[method-assign]
        lambda unit, now: False if hold.is_set() else start_refill(unit, now)
    )
    queue.units[0].stop()
    wait_for(lambda: 0 in queue.controller.down_reasons)
    assert queue.restart(2)["rows"] == 0  # 0 holds the other copy of 2's own block
    client.ping()  # this client knows of 2's restart, nothing refilled
    queue.controller.mark_unit(0, "its Ray actor died (held by the test)", final=True)
    lost = metas[2].global_indexes.tolist()
    wait_for(lambda: [r["global_index"] for r in client.lost_rows(partition_id="p")] == lost)
    assert {r["unit"] for r in client.lost_rows(partition_id="p")} == {2}
    match = re.escape(f"rows {lost} (2 of 2) of partition_id='p' were lost: storage unit 2 died and was restarted")
    with pytest.raises(RowsLost, match=match):
        client.get_data(metas[2])
    hold.clear()
    wait_for(lambda: refilled(client) and rereplicated(client, 0))
    with pytest.raises(RowsLost, match=match):
        client.get_data(metas[2])
    assert values(client, {0: metas[0], 1: metas[1]}) == {0: before[0], 1: before[1]}
    assert storage(client)["blocks_single_copy"] == 0


def test_a_move_onto_a_unit_being_refilled_waits_for_its_refill_so_no_row_it_holds_is_called_lost(
    queue: LocalQueue,
) -> None:
    """Unit 2 restarted empty, its refill held; then unit 0 is retired: its own block's copy (other copy on 1) can only
    go to 2 (the one other unit). A copy written onto 2 below where its refill stands would count as missing there,
    so a restart of 1 would call its rows lost while 2 holds them: the move waits for 2's refill (the status says so)
    and goes on once the refill passed the block. Every row the queue calls lost is held by no unit."""
    client = queue.client
    metas = put_on_each_unit(client)
    start_refill = queue.controller._start_refill
    hold = threading.Event()
    hold.set()
    queue.controller._start_refill = (  # type: ignore[method-assign]
        lambda unit, now: False if hold.is_set() else start_refill(unit, now)
    )
    assert queue.restart(2)["rows"] == 0
    retire(queue, 0)
    wait_for(lambda: rereplicated(client, 0) or "refilled" in storage(client)["cannot_rereplicate"].get(0, ""))
    assert len(client.lost_rows(partition_id="p")) == 2  # 2's own block: its other copy was on 0
    assert queue.restart(1)["rows"] == 4  # 0's and 1's: 2 got no copy back of either (its refill is held)
    client.ping()
    for row in client.lost_rows(partition_id="p"):
        meta = next(m for m in metas.values() if row["global_index"] in m.global_indexes.tolist())
        block = int(meta.blocks[0, 0])
        assert [u for u in (1, 2) if block in queue.units[u].store.blocks] == [], f"block {block} is held"
    hold.clear()
    wait_for(lambda: refilled(client) and rereplicated(client, 0))
    assert len(client.lost_rows(partition_id="p")) == 6
    for meta in metas.values():
        with pytest.raises(RowsLost, match=r"\(2 of 2\) of partition_id='p' were lost: storage unit [12] died"):
            client.get_data(meta)


def test_a_move_batch_given_up_keeps_the_copies_it_wrote_so_a_restart_of_its_source_loses_only_the_rest(
    queue: LocalQueue,
) -> None:
    """Unit 0 retired: its copies' move reads from 1 and 2 in one batch; the last block's read (from 2) is held, every
    other copy is written. Unit 2 then dies (the batch is given up) and is restarted empty: the copies the batch wrote
    stay counted where they were written (unit 2's first block is on 2 and 1 now, 1 holds it), so only the held
    block, whose other copy was on retired 0 alone, is lost."""
    client = queue.client
    metas = [client.put({"x": torch.full((2, 4), float(v))}, partition_id="p") for v in range(6)]
    before = {int(m.blocks[0, 0]): client.get_data(m)["x"][:, 0].tolist() for m in metas}
    held_block = max(b for b in before if b % UNITS == 2)
    hold_one_read(queue, held_block, lambda: retire(queue, 0))
    queue.units[2].stop()
    wait_for(lambda: queue.controller._refill is None)  # given up: its unit 2 went down
    assert queue.restart(2)["rows"] == 2  # the held block's rows only
    only_the_held_block_lost(client, metas, before, held_block)


def test_a_refill_batch_given_up_keeps_the_copies_it_wrote_so_a_restart_of_its_source_loses_only_the_rest(
    queue: LocalQueue,
) -> None:
    """The same for a refill: unit 1 restarted, its refill's last block held (its other blocks written back onto 1),
    then the unit the held block is read from is restarted empty (the batch is given up): only the held block is
    lost, not its sibling the batch wrote back (1 holds it, and giving the batch up keeps it)."""
    client = queue.client
    metas = [client.put({"x": torch.full((2, 4), float(v))}, partition_id="p") for v in range(6)]
    before = {int(m.blocks[0, 0]): client.get_data(m)["x"][:, 0].tolist() for m in metas}
    held_block = max(b for b in before if b % UNITS in (0, 1))  # a copy on 1
    source = 2 if held_block % UNITS == 1 else 0  # where the other copy is
    restarted: list[dict[str, Any]] = []
    hold_one_read(queue, held_block, lambda: restarted.append(queue.restart(1)))
    assert restarted[0]["rows"] == 0
    assert queue.restart(source)["rows"] == 2  # the batch is given up; the held block's rows only are lost
    only_the_held_block_lost(client, metas, before, held_block)
