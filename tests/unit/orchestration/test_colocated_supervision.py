"""A colocated run (``rollout.inference_colocate``) waits for each step's rollout before it releases the servers: a
rollout worker that dies during that wait, or during the drain of the generations, is restarted and its call made
again (the supervisor), instead of ending the run; a restarted worker's gate is held while the servers are released."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import ray

from orchestration.grpo_run import GRPORun
from orchestration.inference import RolloutRequests
from orchestration.regenerate import LostPrompts


@ray.remote(num_cpus=0)
class _Gate:
    """A rollout worker's gate calls (``drain_requests`` / ``resume_requests``), its state kept for the test."""

    def __init__(self) -> None:
        self.paused = False

    def drain_requests(self, timeout_s: float) -> int:
        self.paused = True
        return 0

    def resume_requests(self) -> None:
        self.paused = False

    def is_paused(self) -> bool:
        return self.paused


@ray.remote
def _dies() -> None:
    raise ray.exceptions.RayActorError()


def test_the_wait_for_a_rollout_has_a_call_that_died_with_its_worker_made_again_by_the_watch(ray_session):
    lost = LostPrompts(None, "train", lambda *_: None, lambda *_: ([], []))
    rollout: list[Any] = [ray.put({"worker": 0}), _dies.remote()]
    pending = {0: (rollout, [])}
    watched: list[int] = []

    def watch(pending: dict[int, tuple[list[Any], list[Any]]]) -> None:  # the supervisor: makes the call again
        refs = pending[0][0]
        for position, ref in enumerate(refs):
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                watched.append(position)
                refs[position] = ray.put({"worker": position, "again": True})

    assert lost.wait(rollout, pending, watch) == [{"worker": 0}, {"worker": 1, "again": True}]
    assert watched == [1]


def test_a_colocated_step_waits_for_its_rollout_with_the_supervisors_watch():
    waits: list[tuple[Any, ...]] = []
    supervisor = SimpleNamespace(check=lambda pending: None)
    run = SimpleNamespace(
        colocation=SimpleNamespace(release=lambda: waits.append(("release",))),
        lost_prompts=SimpleNamespace(wait=lambda *args: waits.append(args) or [{"policy_version": 1}]),
        pending={0: ([], [])},
        supervisor=supervisor,
        trainer=[],
        channel=None,
    )
    GRPORun.train(run, 0)  # type: ignore[arg-type]
    rollout_wait = waits[0]
    assert rollout_wait[0] is run.pending[0][0]
    assert len(rollout_wait) == 3 and rollout_wait[2] == supervisor.check
    assert waits[1] == ("release",)


def test_the_drain_skips_a_dead_worker_and_a_restarted_one_is_held_until_resume(ray_session):
    alive, dead = _Gate.remote(), _Gate.remote()
    ray.get(dead.is_paused.remote())
    ray.kill(dead, no_restart=True)
    requests = RolloutRequests([alive, dead])

    assert requests.drain(1.0) is True
    assert ray.get(alive.is_paused.remote()) is True
    restarted = _Gate.remote()  # Ray's restart: a new process, its gate open
    requests.workers[1] = restarted
    requests.restarted(1)
    assert ray.get(restarted.is_paused.remote()) is True  # no generation against the released servers

    requests.workers[1] = dead
    requests.resume()  # the dead one skipped
    assert ray.get(alive.is_paused.remote()) is False
    requests.workers[1] = restarted
    requests.resume()
    requests.restarted(1)  # not held: its gate stays open
    assert ray.get(restarted.is_paused.remote()) is False
