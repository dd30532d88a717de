"""A queue that survives a restart (issue 8 section 4): ``client.save_checkpoint(dir)`` then a new queue started from
it, on another number of storage units, serves what was not consumed, with the same bytes."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import ray
import torch

from transfer_queue import TransferQueueClient, TransferQueueController
from transfer_queue.storage.checkpoint import current_checkpoint


def jagged(lengths: Any) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.arange(n, dtype=torch.int64) for n in lengths], layout=torch.jagged)


def stop(controller: Any) -> None:
    ray.get(controller.shutdown.remote(), timeout=60)
    ray.kill(controller)


def test_save_then_restore_onto_another_number_of_units_serves_what_was_not_consumed(ray_session, tmp_path) -> None:
    controller = TransferQueueController.remote(4, num_global_batch=2, num_n_samples=2, num_storage_units=1)
    client = TransferQueueClient("before", ray.get(controller.get_info.remote()))
    responses = jagged(range(1, 9))
    client.put({"x": torch.arange(8.0).reshape(8, 1), "responses": responses}, global_step=0)
    taken = client.get_meta(["x"], 4, global_step=0, task_name="train")
    client.get_data(taken)  # acknowledged: a restore keeps it consumed (a lease alone would come back as ready)
    client.kv_put("a", "kv", {"v": torch.full((3,), 5.0)})
    client.kv_put("a", "kv", {"v": torch.full((3,), 6.0)})  # the old value's block is dropped, not saved
    saved = client.save_checkpoint(str(tmp_path))
    assert os.path.isdir(saved) and current_checkpoint(str(tmp_path)) == saved
    before = client.get_production_status(global_step=0)
    client.put({"x": torch.zeros(2, 1), "responses": jagged([1, 2])}, global_step=1)  # after the save: not restored
    client.close()
    stop(controller)

    restored = TransferQueueController.remote(
        4, num_global_batch=2, num_n_samples=2, num_storage_units=2, restore_from=str(tmp_path)
    )
    client = TransferQueueClient("after", ray.get(restored.get_info.remote()))
    try:
        assert client.get_production_status(global_step=0) == before
        assert client.list_partitions() == [0, "kv"]
        rest = client.get_meta(["x", "responses"], 4, global_step=0, task_name="train")
        assert sorted(rest.global_indexes.tolist()) == sorted(set(range(8)) - set(taken.global_indexes.tolist()))
        data = client.get_data(rest)
        rows = rest.global_indexes.tolist()
        assert np.array_equal(data["x"].numpy().reshape(-1), np.asarray(rows, dtype=np.float32))
        for row, got in zip(rows, data["responses"].unbind(), strict=True):
            assert torch.equal(got, torch.arange(row + 1, dtype=torch.int64))
        assert torch.equal(client.kv_batch_get(["a"], "kv")["v"][0], torch.full((3,), 6.0))
        # another task sees every row; new puts go on with fresh ids
        assert len(client.get_meta(["x"], 8, global_step=0, task_name="other")) == 8
        client.put({"x": torch.zeros(2, 1), "responses": jagged([1, 2])}, global_step=1)
        stats = ray.get(restored.storage_stats.remote())
        assert len(stats) == 2 and sum(s["blocks"] for s in stats) >= 2
    finally:
        client.close()
        stop(restored)


def test_restoring_from_a_directory_without_a_checkpoint_fails_with_checkpoint_error(ray_session, tmp_path) -> None:
    with pytest.raises(ray.exceptions.RayActorError, match="CheckpointError: no committed queue checkpoint under"):
        ray.get(TransferQueueController.remote(4, restore_from=str(tmp_path)).get_info.remote())
