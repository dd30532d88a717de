"""Which trainer rank died (orchestration/trainer_restarts.py), on real Ray actors: a call on a killed rank names it;
a live rank's failure (its collective with the dead one) leads to the dead rank too; a failure with every rank alive
is not a death."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import ray
from ray.exceptions import RayActorError, RayTaskError

from orchestration.trainer_restarts import TrainerRankDied, raise_if_rank_died, rank_died


@ray.remote
class Rank:
    def pid(self) -> int:
        return os.getpid()

    def fail(self) -> None:
        raise RuntimeError("Connection closed by peer")  # as gloo says when a peer's process died


def killed(rank: Any) -> None:
    os.kill(ray.get(rank.pid.remote()), signal.SIGKILL)


def error_of(ref: Any) -> BaseException:
    with pytest.raises((RayActorError, RayTaskError)) as info:
        ray.get(ref)
    return info.value


def test_a_call_on_a_killed_rank_names_it_and_a_survivors_failure_leads_to_it(ray_session) -> None:
    ranks = [Rank.remote(), Rank.remote()]
    killed(ranks[1])
    death = error_of(ranks[1].pid.remote())
    assert isinstance(death, RayActorError) and rank_died(ranks, death) == 1
    assert rank_died(ranks, error_of(ranks[0].fail.remote())) == 1  # the survivor's failure: rank 1 is dead
    with pytest.raises(TrainerRankDied, match="trainer rank 1 died at step 7"):
        raise_if_rank_died([ranks[0].pid.remote(), ranks[1].pid.remote()], 7, wait_s=30)


def test_a_failure_with_every_rank_alive_or_of_another_actor_is_not_a_death(ray_session) -> None:
    ranks, other = [Rank.remote(), Rank.remote()], Rank.remote()
    assert rank_died(ranks, error_of(ranks[0].fail.remote())) is None
    killed(other)
    assert rank_died(ranks, error_of(other.pid.remote())) is None
    assert rank_died(ranks, ValueError("not Ray's")) is None
    raise_if_rank_died([r.pid.remote() for r in ranks], 0, wait_s=30)  # every call ended well: nothing raised
