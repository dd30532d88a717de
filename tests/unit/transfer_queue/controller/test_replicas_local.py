"""``replicas=2`` without Ray: a ControllerServer and three StorageServers in this process, wired by hand (as the
controller actor does: each unit holds the second copy of its partner's blocks). Every block is written to two units,
a read falls back to the other copy at once when a unit is down (stopped) or came back empty (restarted), nothing is
reported lost while one copy lives, and a row is lost (typed) only when both copies are gone."""

from __future__ import annotations

import re
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


@pytest.fixture
def queue() -> Iterator[LocalQueue]:
    config = QueueConfig(global_batch_size=4, num_storage_units=UNITS, default_timeout=3.0, replicas=2)
    replica_of = replica_units([""] * UNITS, 2)
    assert replica_of == [1, 2, 0]
    units = [StorageServer(store(u, replica_of), "127.0.0.1", SESSION, SECRET) for u in range(UNITS)]
    controller = ControllerServer(QueueState(config, None), SESSION, [u.endpoint for u in units], "127.0.0.1", SECRET)
    info = p.ControllerInfo(
        p.PROTOCOL_VERSION,
        SESSION,
        controller.endpoint,
        [u.endpoint for u in units],
        config.to_dict(),
        SECRET,
        controller.state.ledger.replica_of,
    )
    local = LocalQueue(controller, units, TransferQueueClient("c", info, force_tcp=True), info)
    yield local
    local.client.close()
    controller.stop()
    for unit in local.units:
        unit.stop()


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


def test_a_restarted_unit_loses_nothing_while_the_other_copy_lives(queue: LocalQueue) -> None:
    client = queue.client
    metas = put_on_each_unit(client)
    before = values(client, metas)
    result = queue.restart(0)
    assert result["rows"] == 0 and result["partitions"] == {}
    assert values(client, metas) == before
    assert client.lost_rows(partition_id="p") == []
    summary = client.status()
    assert summary["rows_lost"] == 0 and summary["storage"]["blocks_single_copy"] == 2
    assert summary["storage"]["rows_single_copy"] == 4
    fresh = put_on_each_unit(client, first=10.0)  # the restarted unit takes both copies of new puts again
    assert sorted(v for read in values(client, fresh).values() for v in read) == [10, 10, 11, 11, 12, 12]
    meta = client.get_meta(["x"], 12, partition_id="p", timeout=2.0)
    assert len(meta) == 12 and client.get_data(meta)["x"].shape == (12, 4)


def test_rows_are_lost_once_both_copies_are_gone(queue: LocalQueue) -> None:
    client = queue.client
    metas = put_on_each_unit(client)
    queue.restart(0)
    result = queue.restart(1)  # unit 0's blocks had their last copy on unit 1
    assert result["rows"] == 2 and result["partitions"] == {"p": 2}
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


def test_a_checkpoint_of_a_replicated_queue_is_refused_typed(queue: LocalQueue, tmp_path: Any) -> None:
    put_on_each_unit(queue.client)
    with pytest.raises(CheckpointError, match=r"checkpoints of a queue with replicas=2 are not supported yet"):
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


def test_restoring_a_replicated_queue_is_refused_typed_before_anything_starts(tmp_path: Any) -> None:
    from transfer_queue.controller.actor import ControllerActor

    with pytest.raises(CheckpointError, match=r"restoring a queue with replicas=2 is not supported yet"):
        ControllerActor(4, storage_units=[object(), object()], replicas=2, restore_from=str(tmp_path))
