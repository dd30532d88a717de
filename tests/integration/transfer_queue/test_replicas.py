"""``replicas=2`` on a live Ray queue: a storage unit killed (its process SIGKILLed and restarted empty by Ray, or its
actor killed for good) loses nothing: every committed row reads back equal from the other copy, nothing is reported
lost, the status shows the blocks left with one copy, and a restarted unit gets its copies back (so its partner can
die next); a checkpoint restores into one or two copies. (Without Ray: tests/unit/.../test_replicas_local.py.)"""

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
        check_all_read_back(client, metas)  # unit 0's blocks from unit 1 (or from 0 once copied back)
        wait_until(lambda: client.status()["storage"]["refilling"] == [], 60, what="unit 0 to get its copies back")
        storage = client.status()["storage"]
        assert storage["blocks_single_copy"] == 0 and storage["rows_single_copy"] == 0
        assert storage["blocks_refilled"] == 6
        assert [s["blocks"] for s in ray.get(controller.storage_stats.remote())] == [6, 6]
        fresh = put_rows(TransferQueueClient("fresh", ray.get(controller.get_info.remote())), 2)
        check_all_read_back(client, fresh)
        os.kill(ray.get(controller.storage_stats.remote())[1]["pid"], signal.SIGKILL)  # now its partner
        wait_until(
            lambda: ray.get(controller.server_stats.remote())["storage_units_restarted"] == {0: 1, 1: 1},
            90,
            what="storage unit 1 to be restarted and attached",
        )
        check_all_read_back(client, metas + fresh)  # every row from unit 0: nothing was lost
        wait_until(lambda: client.status()["storage"]["refilling"] == [], 60, what="unit 1 to get its copies back")
        assert client.status()["storage"]["blocks_single_copy"] == 0
    finally:
        ray.get(controller.shutdown.remote(), timeout=60)
        ray.kill(controller)
        client.close()


def three_units_none_restarted() -> Any:
    """A queue of three storage units keeping two copies of each row, whose units Ray never restarts."""
    return transfer_queue.init(global_batch_size=4, num_storage_units=3, default_timeout=5.0, replicas=2,
                               storage_unit_max_restarts=0)  # fmt: skip


@pytest.mark.timeout(120)
def test_init_with_two_replicas_reads_a_unit_killed_for_good_from_its_replica_at_once(
    ray_session: Any, wait_until: Callable[..., Any]
) -> None:
    client = three_units_none_restarted()
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
        # unit 0's own 2 blocks and 2 copies on it were single-copy until moved onto the other two units
        wait_until(lambda: 0 in client.status()["storage"]["rereplicated"], 30, what="unit 0's copies moved")
        storage = client.status()["storage"]
        assert storage["blocks_single_copy"] == 0 and storage["blocks_rereplicated"] == 4
        assert storage["refilling"] == [] and storage["blocks_refilled"] == 0  # dead for good: nothing to refill
        meta = client.put({"x": torch.ones(2, 8), "y": torch.zeros(2, dtype=torch.int64)}, partition_id="p")
        assert client.get_data(meta)["x"].shape == (2, 8)
    finally:
        client.close()
        transfer_queue.shutdown()


@pytest.mark.timeout(180)
def test_a_unit_lost_for_good_is_re_replicated_so_a_second_one_lost_for_good_loses_nothing(
    ray_session: Any, wait_until: Callable[..., Any]
) -> None:
    client = three_units_none_restarted()
    controller = transfer_queue.get_controller()
    try:
        metas = put_rows(client, 9)
        pids = [u["pid"] for u in ray.get(controller.storage_stats.remote())]
        os.kill(pids[0], signal.SIGKILL)  # max_restarts=0: retired; its copies are moved onto units 1 and 2
        wait_until(lambda: 0 in client.status()["storage"]["rereplicated"], 60, what="unit 0's copies to be moved")
        storage = client.status()["storage"]
        assert storage["blocks_single_copy"] == 0 and storage["rereplicating"] == []  # healthy again
        assert storage["blocks_rereplicated"] == 6  # the 3 blocks placed on unit 0 and the 3 copies of unit 2's
        assert [u["blocks"] for u in ray.get(controller.storage_stats.remote())[1:]] == [9, 9]
        os.kill(pids[1], signal.SIGKILL)  # a second unit lost for good: unit 2 holds a copy of every block
        wait_until(lambda: 1 in client.status()["storage"]["cannot_rereplicate"], 60, what="unit 1 retired")
        check_all_read_back(client, metas)  # 0 lost
        assert client.status()["storage"]["blocks_single_copy"] == 9  # degraded, and says it cannot re-replicate
    finally:
        client.close()
        transfer_queue.shutdown()


@pytest.mark.parametrize("replicas", [2, pytest.param(1, marks=pytest.mark.slow)])  # 1: slow tier (10-minute budget)
def test_a_checkpoint_of_two_replicas_restores_into_one_or_two(ray_session: Any, tmp_path: Any, replicas: int) -> None:
    controller = TransferQueueController.remote(4, num_storage_units=3, default_timeout=5.0, replicas=2)
    client = TransferQueueClient("save", ray.get(controller.get_info.remote()))
    try:
        metas = put_rows(client, 6)
        client.save_checkpoint(str(tmp_path))
    finally:
        client.close()
        ray.get(controller.shutdown.remote(), timeout=60)
        ray.kill(controller)
    restored = TransferQueueController.remote(
        4, num_storage_units=2, default_timeout=5.0, replicas=replicas, restore_from=str(tmp_path)
    )
    client = TransferQueueClient("restored", ray.get(restored.get_info.remote()))
    try:
        units = ray.get(restored.storage_stats.remote())
        assert sum(u["blocks"] for u in units) == 6 * replicas  # each saved block once, restored with its copies
        meta = client.get_meta(["x", "y"], 12, partition_id="p", task_name="t")
        td = client.get_data(meta)
        got = sorted(zip(td["x"][:, 0].tolist(), td["y"].tolist(), strict=True))
        assert got == sorted((v, int(v) + i) for _, v in metas for i in range(2))
        if replicas == 2:
            assert client.status()["storage"]["blocks_single_copy"] == 0
    finally:
        client.close()
        ray.get(restored.shutdown.remote(), timeout=60)
        ray.kill(restored)
