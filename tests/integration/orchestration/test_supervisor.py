"""The run's supervisor (orchestration/supervisor.py) on real Ray actors: a worker whose process is killed mid-call is
restarted by Ray, its call is made again on the restarted actor and the restart counted once; a worker Ray does not
restart ends the run with WorkerLost."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from orchestration.supervisor import Supervisor, WorkerLost


@ray.remote
class Worker:
    def pid(self) -> int:
        return os.getpid()

    def step(self, step: int, seconds: float) -> dict[str, float]:
        time.sleep(seconds)
        return {"step": float(step), "pid": float(os.getpid())}


def supervised(worker: Any, budget: int) -> tuple[Supervisor, list[tuple[str, int, int]]]:
    made_again: list[tuple[str, int, int]] = []
    restarted: list[tuple[str, int]] = []

    def call(kind: str, index: int, step: int) -> Any:
        made_again.append((kind, index, step))
        return worker.step.remote(step, 0.0)

    client = SimpleNamespace(config=SimpleNamespace(disconnect_grace=0.0))
    supervisor = Supervisor(
        {"rollout": [], "reward": [worker]}, call, lambda kind, i: restarted.append((kind, i)), client, budget
    )
    supervisor.restarted_log = restarted  # type: ignore[attr-defined]
    return supervisor, made_again


def wait_for(refs: list[Any]) -> None:
    ray.wait(refs, num_returns=len(refs), timeout=60)


def test_a_call_that_died_with_its_worker_is_made_again_on_the_restarted_worker_and_the_restart_counted_once(
    ray_session,
) -> None:
    worker = Worker.options(max_restarts=1).remote()
    supervisor, made_again = supervised(worker, budget=1)
    old_pid = ray.get(worker.pid.remote())
    pending = {
        s: ([], [supervisor.track("reward", 0, s, worker.step.remote(s, 30.0 if s == 4 else 0.0))]) for s in (4, 5)
    }  # step 5's call waits behind step 4's: both die with the worker
    time.sleep(0.5)
    os.kill(old_pid, signal.SIGKILL)
    wait_for([pending[4][1][0], pending[5][1][0]])

    supervisor.check(pending)

    assert made_again == [("reward", 0, 4), ("reward", 0, 5)]  # in step order
    assert supervisor.restarts == {"rollout": 0, "reward": 1}  # one death, two calls
    assert supervisor.restarted_log == [("reward", 0)]  # type: ignore[attr-defined]
    results = [supervisor.gather(s, pending[s][1]) for s in (4, 5)]
    assert [[r["step"] for r in rs] for rs in results] == [[4.0], [5.0]]
    assert {r["pid"] for rs in results for r in rs} == {float(ray.get(worker.pid.remote()))} != {float(old_pid)}
    assert supervisor.take_restarts() == {"restarts_rollout": 0, "restarts_reward": 1}
    assert supervisor.take_restarts() == {"restarts_rollout": 0, "restarts_reward": 0}  # counted in one step's row


def test_a_worker_whose_restarts_are_spent_ends_the_run_with_worker_lost(ray_session) -> None:
    worker = Worker.options(max_restarts=0).remote()
    supervisor, made_again = supervised(worker, budget=0)
    pid = ray.get(worker.pid.remote())
    pending = {0: ([], [supervisor.track("reward", 0, 0, worker.step.remote(0, 30.0))])}
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    wait_for(pending[0][1])

    with pytest.raises(WorkerLost, match=r"reward worker 0 died and was not restarted: .*max_worker_restarts=0"):
        supervisor.check(pending)
    assert made_again == []


def test_a_call_that_failed_otherwise_fails_the_run(ray_session) -> None:
    worker = Worker.options(max_restarts=1).remote()
    supervisor, _ = supervised(worker, budget=1)
    pending = {0: ([], [supervisor.track("reward", 0, 0, worker.step.remote(0, "not seconds"))])}
    wait_for(pending[0][1])
    with pytest.raises(ray.exceptions.RayTaskError, match="TypeError"):
        supervisor.check(pending)
