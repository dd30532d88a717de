"""The supervisor (orchestration/supervisor.py) with fake workers and a fake ``ray``: a call is made again only when its
worker's process is new (Ray restarted it); a call that failed with ``ActorUnavailableError`` while the same process
lived on (unreachable for a while, not dead) is not made twice."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from orchestration import supervisor as supervisor_module
from orchestration.supervisor import Supervisor


class FakeWorker:
    def __init__(self, pid: int):
        self.process = pid
        self.pid = SimpleNamespace(remote=lambda: ("pid", self))


class FakeRay:
    """``ray.get`` / ``ray.wait`` over the refs of ``results`` (a value, or the error the call failed with)."""

    def __init__(self) -> None:
        self.results: dict[Any, Any] = {}

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        if isinstance(ref, list):
            return [self.get(r) for r in ref]
        if isinstance(ref, tuple) and ref[0] == "pid":
            return ref[1].process
        result = self.results[ref]
        if isinstance(result, BaseException):
            raise result
        return result

    def wait(self, refs: list[Any], **_: Any) -> tuple[list[Any], list[Any]]:
        return [r for r in refs if r in self.results], [r for r in refs if r not in self.results]


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> FakeRay:
    fake = FakeRay()
    monkeypatch.setattr(supervisor_module, "ray", fake)
    return fake


def supervised(worker: FakeWorker) -> tuple[Supervisor, list[tuple[str, int, int]]]:
    made_again: list[tuple[str, int, int]] = []

    def call(kind: str, index: int, step: int) -> Any:
        made_again.append((kind, index, step))
        return f"again {step}"

    client = SimpleNamespace(config=SimpleNamespace(disconnect_grace=0.0))
    return Supervisor({"rollout": [worker], "reward": []}, call, lambda kind, i: None, client, 1), made_again


def test_a_call_that_failed_while_its_worker_lived_on_is_not_made_again(fake_ray: FakeRay) -> None:
    worker = FakeWorker(pid=100)
    supervisor, made_again = supervised(worker)
    pending: dict[int, tuple[list[Any], list[Any]]] = {3: ([supervisor.track("rollout", 0, 3, "call 3")], [])}
    fake_ray.results["call 3"] = ActorUnavailableError("unreachable for a while", None)

    supervisor.check(pending)
    supervisor.check(pending)  # looked at once

    assert made_again == []
    assert pending[3][0] == ["call 3"]
    assert supervisor.restarts["rollout"] == 0
    assert supervisor.gather(3, pending[3][0]) == []  # its figures left out


@pytest.mark.parametrize(
    "error", [ActorUnavailableError("being restarted", None), ActorDiedError()], ids=["unavailable", "died"]
)
def test_a_call_whose_worker_has_a_new_process_is_made_again_once(fake_ray: FakeRay, error: Exception) -> None:
    worker = FakeWorker(pid=100)
    supervisor, made_again = supervised(worker)
    pending: dict[int, tuple[list[Any], list[Any]]] = {
        s: ([supervisor.track("rollout", 0, s, f"call {s}")], []) for s in (3, 4)
    }
    fake_ray.results["call 3"] = error
    worker.process = 101  # Ray restarted it

    supervisor.check(pending)
    assert made_again == [("rollout", 0, 3)]
    fake_ray.results["call 4"] = ActorDiedError()  # the same death, seen later: made again too
    supervisor.check(pending)

    assert made_again == [("rollout", 0, 3), ("rollout", 0, 4)]
    assert pending == {3: (["again 3"], []), 4: (["again 4"], [])}
    assert supervisor.restarts["rollout"] == 1


def test_a_worker_restarted_while_it_had_no_call_in_flight_is_seen_by_its_new_pid(
    fake_ray: FakeRay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between two steps, a worker fails no call: the supervisor's periodic look at the workers' process ids
    counts its restart and calls ``on_restart`` (a restarted rollout worker gets the weights last published; before,
    it went on sampling from the task's initial weights)."""
    monkeypatch.setattr(supervisor_module, "PID_LOOK_S", 0.0)  # a look at every check
    worker = FakeWorker(pid=100)
    restarted: list[tuple[str, int]] = []
    client = SimpleNamespace(config=SimpleNamespace(disconnect_grace=0.0))
    supervisor = Supervisor(
        {"rollout": [worker], "reward": []}, lambda *a: None, lambda *a: restarted.append(a), client, 1
    )

    supervisor.check({})
    assert supervisor.restarts["rollout"] == 0 and restarted == []

    worker.process = 101  # Ray restarted it; no call of it was in flight
    supervisor.check({})
    supervisor.check({})  # seen once

    assert supervisor.restarts["rollout"] == 1 and restarted == [("rollout", 0)]
    assert supervisor.take_restarts() == {"restarts_rollout": 1, "restarts_reward": 0}
