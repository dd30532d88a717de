"""The colocated cycle both runs share (rl_contracts/colocate.py): a ``RequestGate`` that holds new requests and waits
for those in flight, and ``ColocatedServers``: drain, release, then resume, sync, let the requests go on."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from rl_contracts.colocate import ColocatedServers, RequestGate


def test_drain_waits_for_the_request_in_flight_and_holds_new_ones_until_resume():
    gate = RequestGate()
    inside, finish = threading.Event(), threading.Event()
    order: list[str] = []

    def request(name: str, started: threading.Event | None = None) -> None:
        if started is not None:
            started.set()
        with gate.passing():
            order.append(name)
            inside.set()
            finish.wait(30)

    first = threading.Thread(target=request, args=("first",))
    first.start()
    assert inside.wait(30)
    assert gate.drain(0) is False and gate.active == 1  # in flight: not drained
    finish.set()
    first.join(30)
    assert gate.drain(30) is True and gate.active == 0

    started = threading.Event()
    held = threading.Thread(target=request, args=("held", started))
    held.start()
    assert started.wait(30)
    order.append("resume")  # the held request passes only after this
    gate.resume()
    held.join(30)
    assert order == ["first", "resume", "held"]


def test_an_event_loops_requests_are_counted_and_held_as_well():
    gate = RequestGate()

    async def main() -> list[str]:
        order: list[str] = []
        async with gate.passing_async():
            assert gate.active == 1
        gate.drain(0)

        async def held() -> None:
            async with gate.passing_async(poll_s=0.001):
                order.append("held")

        task = asyncio.create_task(held())
        await asyncio.sleep(0.01)  # the task polls the closed gate meanwhile
        order.append("resume")
        gate.resume()
        await task
        return order

    assert asyncio.run(main()) == ["resume", "held"]
    assert gate.active == 0


class Servers:
    def __init__(self, calls: list[str]):
        self.calls = calls

    def release_memory(self) -> list[str]:
        self.calls.append("release")
        return ["engine"]

    def resume_memory(self) -> list[str]:
        self.calls.append("resume")
        return ["http://127.0.0.1:1"]


class Requests:
    def __init__(self, calls: list[str], left: int = 0):
        self.calls, self.left, self.active = calls, left, 0

    def drain(self, timeout_s: float) -> bool:
        self.calls.append(f"drain {timeout_s:g}")
        self.active = self.left
        return self.left == 0

    def resume(self) -> None:
        self.calls.append("requests go on")


def test_the_cycle_drains_releases_then_resumes_syncs_and_lets_the_requests_go_on():
    calls: list[str] = []
    colocation = ColocatedServers(Servers(calls), Requests(calls), drain_s=5)

    def sync() -> float:
        calls.append("sync")
        return 1.5

    colocation.release()
    assert colocation.resume(sync) == 1.5
    assert calls == ["drain 5", "release", "resume", "sync", "requests go on"]


def test_requests_go_on_when_the_sync_fails():
    calls: list[str] = []
    colocation = ColocatedServers(Servers(calls), Requests(calls))

    def sync() -> None:
        raise RuntimeError("the weights did not load")

    with pytest.raises(RuntimeError, match=r"^the weights did not load$"):
        colocation.resume(sync)
    assert calls == ["resume", "requests go on"]


def test_requests_still_in_flight_after_the_drain_are_named_in_a_warning(caplog):
    calls: list[str] = []
    colocation = ColocatedServers(Servers(calls), Requests(calls, left=3), drain_s=2)
    with caplog.at_level(logging.WARNING, logger="rl_contracts.colocate"):
        colocation.release()
    assert calls == ["drain 2", "release"]
    assert caplog.messages == ["3 requests still in flight after 2 s: the servers are released under them"]
