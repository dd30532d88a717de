"""A lease belongs to the client instance, not to the thread that called ``get_meta``: a thread that ends closes
none of the client's connections, so its leases stay with the client past ``disconnect_grace`` (docs/api.md
"Delivery"); nor to the event loop of an async client's call: a loop that ends leaves its connections to the next.
No Ray: a ControllerServer in this process, its clock shifted by hand to pass the grace."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from tests.unit.conftest import QueueHarness
from transfer_queue.client import AsyncTransferQueueClient, TransferQueueClient
from transfer_queue.config import QueueConfig
from transfer_queue.controller.server import ControllerServer
from transfer_queue.state.partition_status import row_state_counts
from transfer_queue.state.queue_state import QueueState
from transfer_queue.wire import protocol as p

SESSION = "f" * 32
SECRET = b"t" * 32
GRACE = 1.0
T = TypeVar("T")


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Served:
    def __init__(self, force_tcp: bool):
        self.shift = [0.0]  # seconds added to the controller's clock
        config = QueueConfig(4, 2, 1, num_storage_units=1, default_timeout=5.0, disconnect_grace=GRACE)
        state = QueueState(config, None, clock=lambda: time.monotonic() + self.shift[0])
        self.server = ControllerServer(state, SESSION, [], "127.0.0.1", SECRET)
        self.info = p.ControllerInfo(p.PROTOCOL_VERSION, SESSION, self.server.endpoint, [], config.to_dict(), SECRET)
        self.force_tcp = force_tcp
        self.harness = QueueHarness(state)  # puts straight into the state (no storage unit needed for metadata)

    def client(self, name: str) -> TransferQueueClient:
        return TransferQueueClient(name, self.info, force_tcp=self.force_tcp)

    def pass_time(self, seconds: float) -> None:
        with self.server.lock:
            self.shift[0] += seconds
            self.server.state.tick()

    def task_status(self, partition: str, task: str) -> dict[str, int]:
        with self.server.lock:
            return row_state_counts(self.server.state.table.known(partition), task)


@pytest.fixture(params=[False, True], ids=["unix", "tcp"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    served = Served(request.param)
    yield served
    served.server.stop()


def test_a_lease_taken_in_a_thread_that_ended_stays_with_the_client_past_the_grace(served: Served) -> None:
    consumer, other, witness = served.client("consumer"), served.client("other"), served.client("witness")
    with served.server.lock:
        served.harness.put("p", 4)
    consumer.set_task_options("t", ack="explicit")
    taken: list[Any] = []
    worker = threading.Thread(target=lambda: taken.append(consumer.get_meta(["x"], 4, partition_id="p", task_name="t")))
    worker.start()
    worker.join()
    del worker
    gc.collect()  # the thread's thread-local (its sockets, before the fix) is gone now
    (meta,) = taken
    assert meta.global_indexes.tolist() == [0, 1, 2, 3]
    # a connection closed after the thread ended: once the controller saw it close, it saw the thread's close too
    assert witness.list_partitions() == ["p"]
    before = served.server.stats()["disconnects"]
    witness.close()
    wait_for(lambda: served.server.stats()["disconnects"] > before, "the witness's disconnect")
    served.pass_time(GRACE + 1.0)
    assert served.task_status("p", "t")["leased"] == 4
    other.close_partition(partition_id="p")  # a finished partition answers at once, empty when nothing is ready
    assert len(other.get_meta(["x"], 4, partition_id="p", task_name="t", timeout=2)) == 0
    consumer.ack(meta)
    assert served.task_status("p", "t")["acknowledged"] == 4
    consumer.close()
    other.close()


def test_a_closed_clients_leases_go_back_after_the_grace(served: Served) -> None:
    consumer, other = served.client("consumer"), served.client("other")
    with served.server.lock:
        served.harness.put("p", 4)
    meta = consumer.get_meta(["x"], 4, partition_id="p", task_name="t")
    assert len(meta) == 4
    before = served.server.stats()["disconnects"]
    consumer.close()
    wait_for(lambda: served.server.stats()["disconnects"] > before, "the consumer's disconnect")
    served.pass_time(GRACE + 1.0)
    assert served.task_status("p", "t")["leased"] == 0
    assert other.get_meta(["x"], 4, partition_id="p", task_name="t", timeout=2).global_indexes.tolist() == [0, 1, 2, 3]
    other.close()


def run_in_a_loop_closed_with_its_tasks_pending(coro: Coroutine[Any, Any, T]) -> T:
    """As code that drives its own loop does: the client's reader tasks are never cancelled, only dropped."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@pytest.mark.parametrize(
    "run", [asyncio.run, run_in_a_loop_closed_with_its_tasks_pending], ids=["asyncio.run", "closed"]
)
def test_a_lease_taken_in_an_event_loop_that_ended_stays_with_the_async_client_past_the_grace(
    run: Callable[[Coroutine[Any, Any, Any]], Any],
) -> None:
    served = Served(force_tcp=True)  # the async client speaks ZeroMQ over TCP
    consumer = AsyncTransferQueueClient("consumer", served.info)
    other, witness = served.client("other"), served.client("witness")
    try:
        with served.server.lock:
            served.harness.put("p", 4)

        async def lease() -> Any:
            await consumer.set_task_options("t", ack="explicit")
            return await consumer.get_meta(["x"], 4, partition_id="p", task_name="t")

        meta = run(lease())  # the loop that took the lease has ended now
        assert meta.global_indexes.tolist() == [0, 1, 2, 3]
        # another loop uses the client for a call that names no owner: the ended loop's connections must not close
        assert asyncio.run(consumer.list_partitions()) == ["p"]
        assert witness.list_partitions() == ["p"]
        before = served.server.stats()["disconnects"]
        witness.close()  # once the controller saw this close, it saw any close of the consumer's before it
        wait_for(lambda: served.server.stats()["disconnects"] > before, "the witness's disconnect")
        served.pass_time(GRACE + 1.0)
        assert served.task_status("p", "t")["leased"] == 4
        other.close_partition(partition_id="p")  # a finished partition answers at once, empty when nothing is ready
        assert len(other.get_meta(["x"], 4, partition_id="p", task_name="t", timeout=2)) == 0

        async def finish() -> dict:
            extended = await consumer.extend_lease(meta, 30.0)
            await consumer.ack(meta)
            return extended

        assert asyncio.run(finish()) == {"extended": 4}
        assert served.task_status("p", "t")["acknowledged"] == 4
    finally:
        consumer.close()
        other.close()
        served.server.stop()
