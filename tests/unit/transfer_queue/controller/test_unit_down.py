"""A queue without Ray (a ControllerServer and StorageServers in this process, wired by hand, as a client on another
host sees them: over TCP): a storage unit that stops is marked down, new puts go to the live unit, reads of the rows it
held fail at once with StorageUnitDown naming the unit and the rows, a clear does not wait for it, and ``get_data``
takes a timeout."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from transfer_queue.client import TransferQueueClient
from transfer_queue.config import QueueConfig
from transfer_queue.controller.server import ControllerServer
from transfer_queue.controller.unit_watch import units_on_dead_nodes
from transfer_queue.errors import StorageUnavailable, StorageUnitDown
from transfer_queue.state.queue_state import QueueState
from transfer_queue.storage.unit import BlockStore, StorageServer
from transfer_queue.wire import protocol as p

SESSION = "d" * 32
SECRET = b"k" * 32


@dataclass
class LocalQueue:
    controller: ControllerServer
    units: list[StorageServer]
    client: TransferQueueClient


def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def queue() -> Iterator[LocalQueue]:
    config = QueueConfig(global_batch_size=4, num_storage_units=2, default_timeout=2.0)
    units = [StorageServer(BlockStore(u, 2, SECRET), "127.0.0.1", SESSION, SECRET) for u in range(2)]
    controller = ControllerServer(QueueState(config, None), SESSION, [u.endpoint for u in units], "127.0.0.1", SECRET)
    info = p.ControllerInfo(
        p.PROTOCOL_VERSION, SESSION, controller.endpoint, [u.endpoint for u in units], config.to_dict(), SECRET
    )
    client = TransferQueueClient("c", info, force_tcp=True)
    yield LocalQueue(controller, units, client)
    client.close()
    controller.stop()
    for unit in units:
        unit.stop()


def put_on_each_unit(client: TransferQueueClient) -> dict[int, Any]:
    """Two small puts: the units take them in turn. Returns unit -> meta."""
    metas = {}
    for value in (1.0, 2.0):
        meta = client.put({"x": torch.full((2, 4), value)}, partition_id="p")
        metas[int(meta.blocks[0, 0]) % 2] = meta
    assert sorted(metas) == [0, 1]
    return metas


def test_a_stopped_unit_is_down_reads_of_its_rows_fail_at_once_and_puts_go_elsewhere(queue: LocalQueue) -> None:
    client = queue.client
    metas = put_on_each_unit(client)
    rows_on_0 = metas[0].global_indexes.tolist()
    queue.units[0].stop()
    wait_for(lambda: 0 in queue.controller.down_reasons)
    client.ping()  # any controller reply brings its view of the units
    with pytest.raises(
        StorageUnitDown,
        match=re.escape(
            f"storage unit 0 is down (the controller lost its connection to it): it held rows {rows_on_0} of partition "
            "'p', which cannot be read; new puts go to the live units"
        ),
    ):
        client.get_data(metas[0], timeout=60.0)  # at once: no socket is tried
    on_1 = client.get_data(metas[1])["x"][:, 0].tolist()  # the live unit serves
    assert on_1 in ([1.0, 1.0], [2.0, 2.0])
    for value in (3.0, 4.0):
        meta = client.put({"x": torch.full((2, 4), value)}, partition_id="p")
        assert set((meta.blocks[:, 0] % 2).tolist()) == {1}
    queue.controller._drop_ack_wait = 3600.0  # a clear that waited for unit 0 would outlive the client's timeout
    client.clear(partition_id="p")
    assert "p" not in client.list_partitions()


def test_a_read_that_finds_a_unit_gone_marks_it_down_for_the_next_read(queue: LocalQueue) -> None:
    client = queue.client
    metas = put_on_each_unit(client)
    queue.controller.stop()  # nobody else tells the client: it learns from its own failed read
    queue.units[0].stop()
    with pytest.raises(StorageUnitDown, match=r"storage units \[0\] did not answer.*storage unit 0 is down"):
        client.get_data(metas[0], timeout=5.0)
    with pytest.raises(StorageUnitDown, match=r"storage unit 0 is down \(tcp://127\.0\.0\.1:\d+ (is gone|did not)"):
        client.get_data(metas[0], timeout=5.0)


def test_get_data_takes_a_timeout(queue: LocalQueue) -> None:
    client = queue.client
    metas = put_on_each_unit(client)
    stuck = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with queue.units[1].lock:  # the unit's serving thread waits for this lock: it answers nothing
            stuck.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        stuck.wait(10)
        with pytest.raises(StorageUnavailable, match=r"no reply within 0\.3 s"):
            client.get_data(metas[1], timeout=0.3)
    finally:
        release.set()
        holder.join()
    with pytest.raises(ValueError, match=r"timeout must be a finite number of seconds > 0"):
        client.get_data(metas[1], timeout=-1)


def test_units_on_dead_ray_nodes_are_named() -> None:
    assert units_on_dead_nodes(["n1", "n2", ""], {"n1"}) == {1: "its Ray node n2 died"}
    assert units_on_dead_nodes(["n1", "n2"], {"n1", "n2"}) == {}


def test_a_unit_ray_reports_dead_stays_down_and_others_come_back(queue: LocalQueue) -> None:
    controller = queue.controller
    controller.mark_unit(0, "its Ray actor died (ActorDiedError)", final=True)
    controller.mark_unit(0, None)  # a reconnect does not revive what Ray calls dead
    controller.mark_unit(0, "the controller lost its connection to it")  # nor does a weaker reason replace it
    controller.mark_unit(1, "the controller lost its connection to it")
    assert controller.down_reasons == {
        0: "its Ray actor died (ActorDiedError)",
        1: "the controller lost its connection to it",
    }
    assert controller.state.down_units == {0, 1}
    controller.mark_unit(1, None)  # the connection is back
    assert controller.down_reasons == {0: "its Ray actor died (ActorDiedError)"}
    assert controller.state.down_units == {0}
    queue.client.ping()
    assert queue.client._client._down_units == {0: "its Ray actor died (ActorDiedError)"}  # told with every reply
