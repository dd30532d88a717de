"""The controller's serving loop runs on the shared server base (transfer_queue.wire.server): a failure in its periodic
work, in a disconnect or in a request is logged, counted in ``stats()`` and the loop keeps serving. No Ray: a
ControllerServer in this process with a client over TCP."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from transfer_queue.client import TransferQueueClient
from transfer_queue.config import QueueConfig
from transfer_queue.controller.server import ControllerServer
from transfer_queue.errors import TransferQueueError
from transfer_queue.state.queue_state import QueueState
from transfer_queue.wire import protocol as p

SESSION = "e" * 32
SECRET = b"s" * 32


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture
def served() -> Iterator[tuple[ControllerServer, TransferQueueClient]]:
    config = QueueConfig(global_batch_size=4, num_storage_units=1, default_timeout=5.0)
    server = ControllerServer(QueueState(config, None), SESSION, [], "127.0.0.1", SECRET)
    info = p.ControllerInfo(p.PROTOCOL_VERSION, SESSION, server.endpoint, [], config.to_dict(), SECRET)
    client = TransferQueueClient("c", info, force_tcp=True)
    yield server, client
    client.close()
    server.stop()


def test_a_failing_timer_is_counted_and_the_controller_keeps_serving(served, monkeypatch) -> None:
    server, client = served

    def broken_tick() -> Any:
        raise RuntimeError("tick broke")

    with server.lock:
        monkeypatch.setattr(server.state, "tick", broken_tick)
        server.state.next_deadline = 0.0  # due at every wake-up
    wait_for(lambda: server.stats().get("failures.tick", 0) >= 2)
    assert client.list_partitions() == []
    assert server.serving


def test_a_failing_request_is_answered_counted_and_the_next_one_served(served, monkeypatch) -> None:
    server, client = served
    handle = server.requests.handle

    def once_broken(request: Any, respond: Any, peer: Any = None) -> None:
        monkeypatch.setattr(server.requests, "handle", handle)
        raise RuntimeError("a bug in the bookkeeping")

    assert client.list_partitions() == []  # connected (its hello is served before the bug is planted)
    with server.lock:
        monkeypatch.setattr(server.requests, "handle", once_broken)
    with pytest.raises(TransferQueueError, match="RuntimeError: a bug in the bookkeeping"):
        client.list_partitions()
    assert server.stats()["failures.request"] == 1
    assert client.list_partitions() == []


def test_a_failing_disconnect_is_counted_and_other_clients_are_served(served, monkeypatch) -> None:
    server, client = served
    assert client.list_partitions() == []

    def broken(peer: Any) -> None:
        raise RuntimeError("disconnect broke")

    with server.lock:
        monkeypatch.setattr(server.state, "on_disconnect", broken)
    other = TransferQueueClient(
        "d",
        p.ControllerInfo(p.PROTOCOL_VERSION, SESSION, server.endpoint, [], server.state.config.to_dict(), SECRET),
        force_tcp=True,
    )
    assert other.list_partitions() == []
    other.close()
    wait_for(lambda: server.stats().get("failures.on_disconnect", 0) == 1)
    assert client.list_partitions() == []
