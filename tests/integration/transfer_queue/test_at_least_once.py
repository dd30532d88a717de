"""At-least-once delivery on a live queue: a consumer killed while holding a lease, explicit acks, lease expiry,
a get_meta that its caller abandons (docs/api.md "Delivery")."""

from __future__ import annotations

import asyncio
import json
import pickle
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from transfer_queue import AsyncTransferQueueClient
from transfer_queue.errors import NotLeased


def ids(meta: Any) -> list[int]:
    return (meta.global_indexes % 16).tolist()


# A consumer that leases rows, says which, and is killed before it acknowledges them.
LEASE_AND_DIE = r"""
import os, pickle, signal, sys
from transfer_queue import TransferQueueClient
info, partition = pickle.loads(sys.stdin.buffer.read())
client = TransferQueueClient("doomed", info)
meta = client.get_meta(["x"], 3, partition_id=partition, task_name="t")
print(meta.global_indexes.tolist(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(180)
def test_a_consumer_killed_while_holding_a_lease_hands_its_rows_to_another(
    queue: Any, wait_until: Callable[..., Any]
) -> None:
    client, partition = queue.client, queue.partition()
    client.put(TensorDict({"x": torch.arange(5)}, batch_size=[5]), partition_id=partition)
    child = subprocess.run(
        [sys.executable, "-c", LEASE_AND_DIE],
        input=pickle.dumps((queue.info, partition)),
        capture_output=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-3000:]
    leased = json.loads(child.stdout.decode().strip().splitlines()[-1])  # the rows the dead consumer held
    assert leased == [0, 1, 2]
    # Its socket closed with it: after disconnect_grace its leases come back, first in line.
    status = lambda: client.get_consumption_status(partition_id=partition, task_name="t")["tasks"]["t"]  # noqa: E731
    wait_until(lambda: status()["leased"] == 0, 30, what="the dead consumer's leases to come back")
    other = queue.new_client("survivor")
    meta = other.get_meta(["x"], 5, partition_id=partition, task_name="t", timeout=10)
    assert meta.global_indexes.tolist() == [0, 1, 2, 3, 4]
    assert other.get_data(meta)["x"].tolist() == [0, 1, 2, 3, 4]
    # get_data's acknowledgement is not waited for over a Unix socket: another client sees it a moment later
    wait_until(lambda: status()["acknowledged"] == 5, 10, what="get_data's acknowledgement")
    assert status() == {"consumed": 5, "rows": 5, "ready": 0, "leased": 0, "acknowledged": 5, "dead_lettered": 0}


def test_explicit_acks_and_lease_expiry(queue: Any, wait_until: Callable[..., Any]) -> None:
    client, step = queue.client, queue.step()
    task = f"explicit-{step}"
    client.set_task_options(task, ack="explicit", max_deliveries=2)
    client.put(TensorDict({"x": torch.arange(4)}, batch_size=[4]), global_step=step)
    meta = client.get_meta(["x"], 4, global_step=step, task_name=task)
    assert client.get_data(meta)["x"].tolist() == [0, 1, 2, 3]

    def status() -> dict:
        return client.get_consumption_status(global_step=step, task_name=task)["tasks"][task]

    assert status()["leased"] == 4  # get_data does not acknowledge an explicit task
    client.ack(meta.select_samples([0, 1]))
    assert status()["acknowledged"] == 2
    with pytest.raises(NotLeased, match=r"ack of 2 rows of task .* does not hold .*: already acknowledged"):
        client.ack(meta.select_samples([0, 1]))
    other = queue.new_client("other")
    with pytest.raises(NotLeased, match="leased to another client"):
        other.ack(meta.select_samples([2]))
    # rows 2, 3: released once, then leased for 0.5 s and never acknowledged: they come back, then die
    client.release(meta.select_samples([2, 3, 3]))
    again = other.get_meta(["x"], 2, global_step=step, task_name=task, lease_s=0.5)
    assert ids(again) == [2, 3]
    wait_until(lambda: status()["dead_lettered"] == 2, 30, what="rows 2, 3 to be dead-lettered")
    letters = client.dead_letters(global_step=step, task_name=task)
    assert [(d["global_index"] % 16, d["deliveries"], d["reason"]) for d in letters] == [
        (2, 2, "lease expired"),
        (3, 2, "lease expired"),
    ]


@pytest.mark.parametrize("force_tcp", [False, True], ids=["unix", "tcp"])
def test_get_data_acknowledges_over_either_transport(queue: Any, force_tcp: bool) -> None:
    from transfer_queue import TransferQueueClient

    consumer = TransferQueueClient("consumer", queue.info, force_tcp=force_tcp)
    partition = queue.partition()
    queue.client.put(TensorDict({"x": torch.arange(3)}, batch_size=[3]), partition_id=partition)
    meta = consumer.get_meta(["x"], 3, partition_id=partition, task_name="t")
    consumer.get_data(meta)
    # the same client asks next: its acknowledgement went first on the same connection
    status = consumer.get_consumption_status(partition_id=partition, task_name="t")["tasks"]["t"]
    assert (status["acknowledged"], status["leased"]) == (3, 0)
    consumer.close()


def test_a_cancelled_get_meta_is_never_served(queue: Any) -> None:
    client, partition = queue.client, queue.partition()

    waiter = AsyncTransferQueueClient("waiter", queue.info)

    async def cancel_a_wait() -> None:
        task = asyncio.ensure_future(waiter.get_meta(["x"], 4, partition_id=partition, task_name="t", timeout=30))
        await asyncio.sleep(0.5)  # it is parked in the controller now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_a_wait())  # the waiter's connection stays open: only its cancel withdraws the wait
    client.put(TensorDict({"x": torch.arange(4)}, batch_size=[4]), partition_id=partition)
    meta = queue.new_client("second").get_meta(["x"], 4, partition_id=partition, task_name="t", timeout=10)
    assert meta.global_indexes.tolist() == [0, 1, 2, 3]
    waiter.close()


def test_an_async_clients_leases_outlive_the_event_loop_that_took_them(
    queue: Any, wait_until: Callable[..., Any]
) -> None:
    """Leases belong to the client instance, not to an event loop: the loop that took them ends, another loop uses
    the client for calls that name no owner, and past ``disconnect_grace`` the rows are still the client's."""
    partition = queue.partition()
    task = f"loops-{partition}"  # task options are the queue's: a name of this test's own
    queue.client.put(TensorDict({"x": torch.arange(8)}, batch_size=[8]), partition_id=partition)
    consumer = AsyncTransferQueueClient("loops", queue.info)

    async def lease() -> Any:
        await consumer.set_task_options(task, ack="explicit")
        return await consumer.get_meta(["x"], 4, partition_id=partition, task_name=task)

    meta = asyncio.run(lease())  # that loop has ended
    assert partition in asyncio.run(consumer.list_partitions())  # another loop, a call that names no owner
    # A client that closes after that: once its leases came back, the grace has passed for any close before it.
    probe = queue.new_client("probe")
    assert ids(probe.get_meta(["x"], 4, partition_id=partition, task_name=task)) == [4, 5, 6, 7]
    probe.close()
    status = lambda: queue.client.get_consumption_status(partition_id=partition, task_name=task)["tasks"][task]  # noqa: E731
    wait_until(lambda: status()["ready"] == 4, 30, what="the closed probe's leases to come back")
    assert status()["leased"] == 4
    queue.client.close_partition(partition_id=partition)  # a short batch of what is ready, at once
    assert ids(queue.new_client("other").get_meta(["x"], 8, partition_id=partition, task_name=task)) == [4, 5, 6, 7]

    async def finish() -> None:
        assert await consumer.extend_lease(meta, 30.0) == {"extended": 4}
        await consumer.ack(meta)

    asyncio.run(finish())  # a third loop
    assert status()["acknowledged"] == 4
    consumer.close()
