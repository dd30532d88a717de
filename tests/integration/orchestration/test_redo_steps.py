"""The driver's relaunch of a step (its rows died with a storage unit and were put again) runs while the workers are
busy with the step launched ahead of it, which waits for the trainer to finish the relaunched step first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import torch
from tensordict import TensorDict

import transfer_queue as tq
from orchestration.grpo_run import GRPORun
from rl_contracts.rows import jagged
from workers.engines.base import SamplingParams
from workers.engines.host import EngineSpec
from workers.reward import RewardWorker
from workers.rollout import RolloutWorker
from workers.tasks.addition import AdditionTask

N = 2
WORKER_TIMEOUT_S = 60.0  # how long the workers' blocked calls wait for rows of the step ahead


@pytest.fixture(scope="module")
def queue(ray_session):
    controller = tq.TransferQueueController.remote(
        global_batch_size=2, num_n_samples=N, sampler=tq.GRPOSampler(N), num_global_batch=2
    )
    info = ray.get(controller.get_info.remote())
    yield info, tq.TransferQueueClient("redo-steps-test", info)
    ray.get(controller.shutdown.remote())
    ray.kill(controller)


def put_prompts(client: tq.TransferQueueClient, step: int) -> None:
    rows = [p for p in AdditionTask().prompts("train", 2, seed=step) for _ in range(N)]
    data = TensorDict(
        {"prompt_ids": jagged([p["prompt_ids"] for p in rows], torch.int64), "answer": [p["answer"] for p in rows]},
        batch_size=[len(rows)],
    )
    client.put(data, global_step=step)


@pytest.mark.slow  # ~30 s with its workers' start; the slow tier runs the unit-death run it guards
def test_a_relaunched_step_runs_while_the_step_ahead_waits_for_it(queue):
    info, client = queue
    rollout = RolloutWorker.remote(
        0, info, EngineSpec(), SamplingParams(max_new_tokens=4), N, 2, timeout=WORKER_TIMEOUT_S
    )
    reward = RewardWorker.remote(0, info, "workers.tasks.addition:AdditionTask", {}, None, N, 2, WORKER_TIMEOUT_S)
    ahead, redo = 1, 0
    # the step launched ahead: its rows come only after the trainer finished step 0 (here: after the redo is done)
    blocked = [rollout.generate_step.remote(ahead), reward.score_step.remote(ahead)]
    put_prompts(client, redo)
    driver = SimpleNamespace(
        rollout=[rollout],
        reward=[reward],
        prompt_fields=lambda: None,
        _tracked=lambda step, refs: refs,
        _train_version=lambda step: 0,
    )

    rollout_refs, reward_refs = GRPORun.relaunch(driver, redo, True, True)  # type: ignore[arg-type]

    # queued behind the blocked calls, the redo would wait WORKER_TIMEOUT_S and then fail with them
    done, _ = ray.wait(rollout_refs + reward_refs, num_returns=2, timeout=WORKER_TIMEOUT_S / 2)
    assert len(done) == 2
    assert [s["rows"] for s in ray.get(rollout_refs + reward_refs)] == [4.0, 4.0]
    assert ray.wait(blocked, num_returns=2, timeout=0)[0] == []  # the step ahead still waits
    put_prompts(client, ahead)
    assert [s["rows"] for s in ray.get(blocked, timeout=WORKER_TIMEOUT_S)] == [4.0, 4.0]
    for step in (redo, ahead):
        client.clear(global_step=step)
    ray.kill(rollout)
    ray.kill(reward)
