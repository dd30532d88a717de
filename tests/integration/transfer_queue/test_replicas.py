"""``replicas=2`` on a live Ray queue: a storage unit killed (its process SIGKILLed and restarted empty by Ray, or its
actor killed for good) loses nothing: every committed row reads back equal from the other copy, nothing is reported
lost, and the status shows the blocks left with one copy. (Without Ray: tests/unit/.../test_replicas_local.py.)"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import pytest
import ray
import torch

import transfer_queue
from transfer_queue import TransferQueueClient, TransferQueueController


def put_rows(client: TransferQueueClient, count: int) -> list[tuple[Any, float]]:
    """``count`` puts of 2 rows each (round robin over the units), each put's rows holding its own value."""
    return [
        (client.put({"x": torch.full((2, 8), float(v)), "y": torch.arange(2) + v}, partition_id="p"), float(v))
        for v in range(count)
    ]


def check_all_read_back(client: TransferQueueClient, metas: list[tuple[Any, float]]) -> None:
    for meta, value in metas:
        td = client.get_data(meta, timeout=30.0)
        assert td["x"][:, 0].tolist() == [value] * 2 and td["y"].tolist() == [int(value), int(value) + 1]
    assert client.lost_rows(partition_id="p") == []
    assert client.get_production_status(partition_id="p")["rows_lost"] == 0


@pytest.mark.slow  # ~15-50 s: a unit's restart by Ray
def test_a_killed_unit_restarted_empty_loses_no_row_with_two_replicas(
    ray_session: Any, wait_until: Callable[..., Any]
) -> None:
    controller = TransferQueueController.remote(4, num_storage_units=2, default_timeout=5.0, replicas=2)
    client = TransferQueueClient("replicas", ray.get(controller.get_info.remote()))
    try:
        metas = put_rows(client, 6)
        assert {int(m.blocks[0, 0]) % 2 for m, _ in metas} == {0, 1}
        pids = [stats["pid"] for stats in ray.get(controller.storage_stats.remote())]
        assert [s["blocks"] for s in ray.get(controller.storage_stats.remote())] == [6, 6]  # both hold every block
        os.kill(pids[0], signal.SIGKILL)
        wait_until(
            lambda: ray.get(controller.server_stats.remote())["storage_units_restarted"] == {0: 1},
            90,
            what="storage unit 0 to be restarted and attached",
        )
        check_all_read_back(client, metas)  # unit 0's blocks from unit 1
        storage = client.status()["storage"]
        assert storage["blocks_single_copy"] == 6 and storage["rows_single_copy"] == 12
        fresh = put_rows(TransferQueueClient("fresh", ray.get(controller.get_info.remote())), 2)
        check_all_read_back(client, fresh)
        assert client.status()["storage"]["blocks_single_copy"] == 6  # the new puts hold two copies again
    finally:
        ray.get(controller.shutdown.remote(), timeout=60)
        ray.kill(controller)
        client.close()


@pytest.mark.timeout(120)
def test_init_with_two_replicas_reads_a_unit_killed_for_good_from_its_replica_at_once(
    ray_session: Any, wait_until: Callable[..., Any]
) -> None:
    client = transfer_queue.init(
        global_batch_size=4, num_storage_units=3, default_timeout=5.0, replicas=2, storage_unit_max_restarts=0
    )
    controller = transfer_queue.get_controller()
    try:
        assert client.config.replicas == 2
        metas = put_rows(client, 6)
        units = ray.get(controller.storage_stats.remote())
        assert sum(u["blocks"] for u in units) == 12  # two copies of each of the 6 blocks
        os.kill(units[0]["pid"], signal.SIGKILL)  # max_restarts=0: it stays dead
        check_all_read_back(client, metas)  # before the controller noticed: the failed read falls back itself
        wait_until(lambda: 0 in ray.get(controller.server_stats.remote())["storage_units_down"], 30, what="unit 0 down")
        check_all_read_back(client, metas)  # known down: read from the replica without trying unit 0
        assert client.status()["storage"]["blocks_single_copy"] == 4  # unit 0's own 2 blocks and 2 copies on it
        meta = client.put({"x": torch.ones(2, 8), "y": torch.zeros(2, dtype=torch.int64)}, partition_id="p")
        assert client.get_data(meta)["x"].shape == (2, 8)
    finally:
        client.close()
        transfer_queue.shutdown()
