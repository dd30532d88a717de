"""QueueConfig.restart_retry_s: a client asks the controller again, with backoff, a call that failed with ServerGone
(the controller restarting from its journal), for at most that many seconds; never a put's commit (its outcome is
unknown) nor an abort. Over a scripted transport and a fake clock: no Ray, no sockets, no waiting."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from transfer_queue.client import channel
from transfer_queue.client.async_client import AsyncTransferQueueClient
from transfer_queue.config import QueueConfig
from transfer_queue.errors import InvalidRequest, ServerGone
from transfer_queue.wire import protocol as p
from transfer_queue.wire.transport import BlockingTransport, run_sync


class FakeClock:
    """time.monotonic and time.sleep for the channel: a sleep moves the clock on and is recorded."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.pauses: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(round(seconds, 6))
        self.now += seconds


class ScriptedTransport(BlockingTransport):
    """Fails the first ``gone`` calls with ServerGone, then answers every request with ``reply``."""

    def __init__(self, gone: int, reply: Any) -> None:
        super().__init__()
        self.gone, self.reply = gone, reply
        self.requests: list[Any] = []

    async def call_many(self, calls: Sequence[tuple[p.Endpoint, Any, int]], timeout: float, into: Any = None) -> Any:
        ((_, frames, request_id),) = calls
        self.requests.append(p.decode_controller_request(frames[1]))
        if len(self.requests) <= self.gone:
            raise ServerGone("tcp://127.0.0.1:5555 closed the connection before replying (the server is gone)")
        return [[p.encode(p.ReplyHeader(request_id, down_units={})), p.encode(self.reply)]]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(channel, "time", fake)
    return fake


def client(transport: ScriptedTransport, restart_retry_s: float) -> AsyncTransferQueueClient:
    config = QueueConfig(2, num_storage_units=1, restart_retry_s=restart_retry_s)
    endpoint = p.Endpoint("tcp://127.0.0.1:5555", None)
    info = p.ControllerInfo(p.PROTOCOL_VERSION, "a" * 32, endpoint, [endpoint], config.to_dict(), b"s" * 32)
    return AsyncTransferQueueClient("retrying", info, transport=transport)


def test_a_call_that_found_the_controller_gone_is_asked_again_with_backoff_until_it_answers(clock: FakeClock) -> None:
    transport = ScriptedTransport(gone=4, reply=["p"])
    assert run_sync(client(transport, 60.0).list_partitions()) == ["p"]
    assert len(transport.requests) == 5
    assert all(isinstance(r, p.ListPartitions) for r in transport.requests)
    assert clock.pauses == [0.1, 0.2, 0.4, 0.8]


def test_the_pauses_double_up_to_a_ceiling(clock: FakeClock) -> None:
    transport = ScriptedTransport(gone=8, reply=[])
    run_sync(client(transport, 60.0).list_partitions())
    assert clock.pauses == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]


def test_the_last_server_gone_is_raised_once_restart_retry_s_passed(clock: FakeClock) -> None:
    transport = ScriptedTransport(gone=1000, reply=[])
    with pytest.raises(ServerGone, match=r"the controller at tcp://127\.0\.0\.1:5555 did not answer.*server is gone"):
        run_sync(client(transport, 1.0).list_partitions())
    assert clock.pauses == [0.1, 0.2, 0.4, 0.3]  # the last pause ends at the deadline: one more try, then it gives up
    assert len(transport.requests) == 5


def test_without_restart_retry_s_server_gone_is_raised_at_once(clock: FakeClock) -> None:
    transport = ScriptedTransport(gone=1, reply=[])
    with pytest.raises(ServerGone, match="server is gone"):
        run_sync(client(transport, 0.0).list_partitions())
    assert len(transport.requests) == 1 and clock.pauses == []


def test_a_reserve_is_asked_again_but_a_commit_never(clock: FakeClock) -> None:
    """A reserve that found the controller gone committed nothing: asked again (the put goes on). A commit may have
    been applied before the controller died: it raises, the put with it (its rows may or may not be visible)."""
    transport = ScriptedTransport(gone=1, reply=None)
    retrying = client(transport, 60.0)
    reserve = p.Reserve("p", 2, {}, 0, None, None, None, None, None, 5.0, None)
    run_sync(retrying._control(reserve, Any, 5.0))
    assert [type(r) for r in transport.requests] == [p.Reserve, p.Reserve]
    transport.requests.clear()
    with pytest.raises(ServerGone, match="server is gone"):
        run_sync(retrying._commit(7, clock.now + 30.0))
    assert transport.requests == [p.Commit(7)] and clock.pauses == [0.1]


@pytest.mark.parametrize("value", [-1.0, float("inf"), True, "60"])
def test_restart_retry_s_takes_a_finite_number_of_seconds(value: Any) -> None:
    with pytest.raises(InvalidRequest, match=r"restart_retry_s must be a finite number of seconds >= 0, got"):
        QueueConfig(2, restart_retry_s=value)


def test_a_client_asked_again_sets_its_task_options_again_first(clock: FakeClock) -> None:
    """A controller restarted from its journal forgot the task options: the retry sets this client's again."""
    transport = ScriptedTransport(gone=0, reply=None)
    retrying = client(transport, 60.0)
    run_sync(retrying.set_task_options("train", ack="explicit"))
    transport.gone, transport.requests = 2, []
    run_sync(retrying.list_partitions())
    kinds = [type(r).__name__ for r in transport.requests]
    assert kinds == ["ListPartitions", "SetTaskOptions", "SetTaskOptions", "ListPartitions"]
    assert transport.requests[-2] == p.SetTaskOptions("train", "explicit", None, None)


def test_an_ack_asked_again_says_so_so_that_rows_it_acknowledged_already_are_no_error(clock: FakeClock) -> None:
    """The first ack may have reached the restarted controller and its reply been lost: the one asked again carries
    ``again`` (the controller then takes rows this client acknowledged already as done, not NotLeased)."""
    transport = ScriptedTransport(gone=2, reply=None)
    ack = p.Ack(3, "train", b"", "retrying", True)
    run_sync(client(transport, 60.0)._control(ack, Any, 5.0))
    assert [r.again for r in transport.requests] == [False, True, True]
