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

    def get(self, ref: Any) -> Any:
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
