"""Extending leases on a live queue (docs/api.md "Delivery"): ``client.extend_lease`` keeps a meta's rows past
their ``lease_s``, and ``client.keep_leased`` does it in the background for a consumer whose work outlasts it (a long
trainer step). Each test leases witness rows with the same ``lease_s`` and does not extend them: once they came
back, the extended rows would have too."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from transfer_queue import AsyncTransferQueueClient
from transfer_queue.errors import InvalidRequest, NotLeased


def leased_rows(client: Any, partition: str, task: str) -> int:
    return client.get_consumption_status(partition_id=partition, task_name=task)["tasks"][task]["leased"]


def test_extend_lease_keeps_rows_past_their_lease_s(queue: Any, wait_until: Callable[..., Any]) -> None:
    client, partition, task = queue.new_client("long-step"), queue.partition(), "extend"
    client.set_task_options(task, ack="explicit")
    client.put(TensorDict({"x": torch.arange(4)}, batch_size=[4]), partition_id=partition)
    meta = client.get_meta(["x"], 2, partition_id=partition, task_name=task, lease_s=1.0)
    witness = client.get_meta(["x"], 2, partition_id=partition, task_name=task, lease_s=1.0)
    assert client.extend_lease(meta, 60.0) == {"extended": 2}
    wait_until(lambda: leased_rows(client, partition, task) == 2, 30, what="the witness rows' lease to expire")
    other = queue.new_client("other")
    assert other.get_meta(["x"], 2, partition_id=partition, task_name=task).global_indexes.tolist() == [2, 3]
    client.ack(meta)
    with pytest.raises(NotLeased, match=r"extend_lease of 2 rows of task 'extend' .*leased to another client"):
        client.extend_lease(witness, 60.0)
    with pytest.raises(InvalidRequest, match=r"extend_lease: seconds must be a number in \(0, 3600\.0\] .*got 0"):
        client.extend_lease(meta, 0)


def test_keep_leased_keeps_a_long_consumers_rows_until_the_block_exits(
    queue: Any, wait_until: Callable[..., Any]
) -> None:
    client, partition, task = queue.new_client("trainer"), queue.partition(), "heartbeat"
    client.set_task_options(task, ack="explicit")
    client.put(TensorDict({"x": torch.arange(4)}, batch_size=[4]), partition_id=partition)
    meta = client.get_meta(["x"], 2, partition_id=partition, task_name=task, lease_s=1.0)
    client.get_meta(["x"], 2, partition_id=partition, task_name=task, lease_s=1.0)  # the witness
    with client.keep_leased(meta, every=0.2, seconds=3.0) as heartbeat:
        wait_until(lambda: leased_rows(client, partition, task) == 2, 30, what="the witness rows' lease to expire")
        wait_until(lambda: heartbeat.beats >= 8, 30, what="8 beats (past the lease_s of 1 s)")
        assert leased_rows(client, partition, task) == 2
    assert heartbeat.error is None
    client.ack(meta)
    assert client.get_consumption_status(partition_id=partition, task_name=task)["tasks"][task]["acknowledged"] == 2


def test_the_async_clients_heartbeat_extends_too(queue: Any, wait_until: Callable[..., Any]) -> None:
    partition, task = queue.partition(), "async-heartbeat"
    queue.client.set_task_options(task, ack="explicit")
    queue.client.put(TensorDict({"x": torch.arange(2)}, batch_size=[2]), partition_id=partition)
    client = AsyncTransferQueueClient("async-trainer", queue.info)

    async def train() -> int:
        meta = await client.get_meta(["x"], 2, partition_id=partition, task_name=task, lease_s=1.0)
        async with client.keep_leased(meta, every=0.2, seconds=3.0) as heartbeat:
            while heartbeat.beats < 8:  # past the lease_s of 1 s
                await asyncio.sleep(0.05)
        await client.ack(meta)
        return heartbeat.beats

    assert asyncio.run(asyncio.wait_for(train(), 60)) >= 8
    status = queue.client.get_consumption_status(partition_id=partition, task_name=task)["tasks"][task]
    assert status["acknowledged"] == 2
    client.close()
