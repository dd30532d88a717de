"""A storage unit restarted empty on new ports, without Ray: a ControllerServer and StorageServers in this process,
wired by hand (as the controller actor does after Ray restarted a unit: ``restart_unit`` with the new endpoint).
Reads of the rows it held fail at once with RowsLost naming partition, rows and unit; the other unit's rows read;
new puts go to both units again; the client learns the new address from any controller reply."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from transfer_queue.client import TransferQueueClient
from transfer_queue.config import QueueConfig
from transfer_queue.controller.server import ControllerServer
from transfer_queue.errors import RowsLost, StorageUnitDown
from transfer_queue.state.queue_state import QueueState
from transfer_queue.storage.unit import BlockStore, StorageServer
from transfer_queue.wire import protocol as p

SESSION = "e" * 32
SECRET = b"r" * 32


@dataclass
class LocalQueue:
    controller: ControllerServer
    units: list[StorageServer]
    client: TransferQueueClient
    info: p.ControllerInfo

    def restart(self, unit: int) -> dict[str, Any]:
        self.units[unit].stop()
        self.units[unit] = StorageServer(BlockStore(unit, 2, SECRET), "127.0.0.1", SESSION, SECRET)
        return self.controller.restart_unit(unit, self.units[unit].endpoint)


@pytest.fixture
def queue() -> Iterator[LocalQueue]:
    config = QueueConfig(global_batch_size=4, num_storage_units=2, default_timeout=3.0)
    units = [StorageServer(BlockStore(u, 2, SECRET), "127.0.0.1", SESSION, SECRET) for u in range(2)]
    controller = ControllerServer(QueueState(config, None), SESSION, [u.endpoint for u in units], "127.0.0.1", SECRET)
    info = p.ControllerInfo(
        p.PROTOCOL_VERSION, SESSION, controller.endpoint, [u.endpoint for u in units], config.to_dict(), SECRET
    )
    local = LocalQueue(controller, units, TransferQueueClient("c", info, force_tcp=True), info)
    yield local
    local.client.close()
    controller.stop()
    for unit in local.units:
        unit.stop()


def put_on_each_unit(client: TransferQueueClient, partition: str = "p") -> dict[int, Any]:
    metas = {}
    for value in (1.0, 2.0):
        meta = client.put({"x": torch.full((2, 4), value)}, partition_id=partition)
        metas[int(meta.blocks[0, 0]) % 2] = meta
    assert sorted(metas) == [0, 1]
    return metas


def test_rows_of_a_restarted_unit_raise_rows_lost_others_read_and_new_puts_use_both_units(queue: LocalQueue) -> None:
    client = queue.client
    metas = put_on_each_unit(client)
    lost_rows = metas[0].global_indexes.tolist()
    result = queue.restart(0)
    assert result["rows"] == 2 and result["partitions"] == {"p": 2}
    message = (
        f"rows {lost_rows} (2 of 2) of partition_id='p' were lost: storage unit 0 died and was restarted empty "
        "(restart 1), taking fields ['x'] of them; put them again as new rows (client.lost_rows lists them)"
    )
    with pytest.raises(RowsLost, match=re.escape(message)):  # learnt from the reply: no socket to the unit tried
        client.get_data(metas[0])
    assert isinstance(RowsLost("x"), StorageUnitDown)  # callers that handle a dead unit handle this too
    assert client.get_data(metas[1])["x"][:, 0].tolist() in ([1.0, 1.0], [2.0, 2.0])
    report = client.lost_rows(partition_id="p")
    assert [(r["global_index"], r["unit"], r["fields"]) for r in report] == [(i, 0, ["x"]) for i in lost_rows]
    assert client.get_production_status(partition_id="p")["rows_lost"] == 2
    summary = client.status()
    assert summary["rows_lost"] == 2 and summary["lost_rows"]["unit_restarts"] == {0: 1}
    assert [u["restarts"] for u in summary["storage"]["units"]] == [1, 0]
    fresh = put_on_each_unit(client)  # the restarted unit takes puts again, at its new address
    assert client.get_data(fresh[0])["x"].shape == (2, 4)
    meta = client.get_meta(["x"], 6, partition_id="p", timeout=2.0)
    assert sorted(meta.global_indexes.tolist()) == sorted(
        metas[1].global_indexes.tolist() + fresh[0].global_indexes.tolist() + fresh[1].global_indexes.tolist()
    )  # never a lost row
    assert client.get_data(meta)["x"].shape == (6, 4)


def test_a_client_that_missed_the_restart_learns_it_on_its_first_failed_read(queue: LocalQueue) -> None:
    metas = put_on_each_unit(queue.client)
    late = TransferQueueClient("late", queue.info, force_tcp=True)
    try:
        late.ping()  # before the restart: it knows the old address only
        queue.restart(0)
        with pytest.raises(RowsLost, match=r"storage unit 0 died and was restarted empty \(restart 1\)"):
            late.get_data(metas[0], timeout=2.0)  # the old address does not answer; the controller's reply says why
        late.put({"x": torch.ones(2, 4)}, partition_id="p")
        late.put({"x": torch.ones(2, 4)}, partition_id="p")
    finally:
        late.close()


def test_a_second_restart_loses_the_rows_written_since_the_first(queue: LocalQueue) -> None:
    client = queue.client
    put_on_each_unit(client)
    queue.restart(0)
    metas = put_on_each_unit(client)
    queue.restart(0)
    with pytest.raises(RowsLost, match=r"\(restart 2\)"):
        client.get_data(metas[0])
    assert len(client.lost_rows(partition_id="p")) == 4
