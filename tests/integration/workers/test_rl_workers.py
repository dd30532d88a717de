"""Rollout and reward workers on a live queue: responses land in the prompt rows, a dead engine loses no prompt,
a failing reward function marks samples and the run goes on."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch
from tensordict import TensorDict

import transfer_queue as tq
from rl_contracts.rows import jagged, rows_of
from rl_contracts.stages import REDO_GROUP
from rl_contracts.weight_channel import WeightChannel
from workers.engines.base import SamplingParams
from workers.engines.host import EngineSpec
from workers.reward import RewardWorker
from workers.rollout import RolloutWorker
from workers.tasks.addition import AdditionTask

N = 2


@pytest.fixture(scope="module")
def queue(ray_session):
    controller = tq.TransferQueueController.remote(
        global_batch_size=4, num_n_samples=N, sampler=tq.GRPOSampler(N), num_storage_units=1
    )
    info = ray.get(controller.get_info.remote())
    yield controller, info, tq.TransferQueueClient("rl-workers-test", info)
    ray.get(controller.shutdown.remote())
    ray.kill(controller)


@pytest.fixture(scope="module")
def rollout_worker(queue):
    _, info, _ = queue
    return RolloutWorker.remote(0, info, EngineSpec(), SamplingParams(max_new_tokens=4), N, 2, timeout=30.0)


def put_prompts(client, step: int, num: int = 4) -> list[dict]:
    problems = AdditionTask().prompts("train", num, seed=step)
    rows = [p for p in problems for _ in range(N)]
    data = TensorDict(
        {"prompt_ids": jagged([p["prompt_ids"] for p in rows], torch.int64), "answer": [p["answer"] for p in rows]},
        batch_size=[len(rows)],
    )
    client.put(data, global_step=step)
    return rows


@pytest.mark.slow  # ~15-50 s each: the slow tier keeps make test under 10 minutes
def test_a_dead_engine_is_restarted_and_its_prompts_are_generated_again(queue, rollout_worker):
    _, _, client = queue
    worker = rollout_worker
    put_prompts(client, step=0)
    os.kill(ray.get(worker.engine_pid.remote()), signal.SIGKILL)  # the engine dies before its first call

    stats = ray.get(worker.generate_step.remote(0))

    assert stats["engine_restarts"] == 1.0
    assert stats["rows"] == 8.0  # every prompt row got its response, none lost with the dead engine
    produced = client.get_production_status(global_step=0)["fields"]
    assert produced["response_ids"]["produced"] == produced["policy_version"]["produced"] == 8
    meta = client.get_meta(["response_ids", "response_logprobs", "finish_reason"], 8, global_step=0, task_name="check")
    data = client.get_data(meta)
    assert [len(r) for r in rows_of(data["response_ids"])] == [len(r) for r in rows_of(data["response_logprobs"])]
    assert set(data["finish_reason"].tolist()) <= {"stop", "length"}
    assert ray.get(worker.health.remote())["restarts"] == 1
    client.clear(global_step=0)


def test_weights_reach_the_engine_with_their_version(queue, rollout_worker):
    _, _, client = queue
    worker = rollout_worker
    weights = AdditionTask(model_seed=7).build_policy().state_dict()
    assert ray.get(worker.update_weights.remote(3, [ray.put(weights)])) == 3
    put_prompts(client, step=1)
    ray.get(worker.generate_step.remote(1))
    meta = client.get_meta(["policy_version"], 8, global_step=1, task_name="check")
    assert client.get_data(meta)["policy_version"].tolist() == [3] * 8
    client.clear(global_step=1)


@pytest.mark.slow  # ~15-50 s each: the slow tier keeps make test under 10 minutes
def test_reward_failures_are_marked_and_the_rest_is_scored(queue):
    step = 2
    _, info, client = queue
    rows = put_prompts(client, step=step)
    meta = client.get_meta(["prompt_ids"], 8, global_step=step, task_name="fake-rollout")
    # half the responses are the right answer, the other half a string the reward function chokes on ("99") or
    # scores +inf ("98")
    texts = [row["answer"] if i % 2 == 0 else ["99", "98"][i // 2 % 2] for i, row in enumerate(rows)]
    responses = [AdditionTask().tokenizer.encode(text) for text in texts]
    client.put(TensorDict({"response_ids": jagged(responses, torch.int64)}, batch_size=[8]), metadata=meta)
    worker = RewardWorker.remote(
        0, info, "workers.tasks.addition:AdditionTask", {}, "tests.integration.workers.rewards:picky_reward", N, 2, 30.0
    )

    stats = ray.get(worker.score_step.remote(step))

    # a raising function and a non-finite reward both fail the sample; the non-finite ones are counted apart
    assert (stats["rows"], stats["failed"], stats["non_finite"]) == (8.0, 4.0, 2.0)
    scored = client.get_data(client.get_meta(["reward", "reward_failed"], 8, global_step=step, task_name="check"))
    assert scored["reward"].tolist() == [1.0, 0.0] * 4
    assert scored["reward_failed"].tolist() == [False, True] * 4
    client.clear(global_step=step)


@pytest.mark.slow  # ~15-50 s each: the slow tier keeps make test under 10 minutes
def test_with_a_weight_channel_the_engine_waits_for_the_version_it_needs(queue, tmp_path):
    _, info, client = queue
    channel = WeightChannel(tmp_path / "weights")
    channel.write(4, AdditionTask(model_seed=4).build_policy().state_dict())
    spec = EngineSpec(weights_channel=str(channel.path), weights_timeout=60.0)
    worker = RolloutWorker.remote(1, info, spec, SamplingParams(max_new_tokens=4), N, 2, timeout=30.0)
    put_prompts(client, step=5)

    pending = worker.generate_step.remote(5, None, 5)  # launched before version 5 exists: it must wait for it
    time.sleep(0.5)
    channel.write(5, AdditionTask(model_seed=5).build_policy().state_dict())
    stats = ray.get(pending)

    assert stats["rows"] == 8.0
    meta = client.get_meta(["policy_version"], 8, global_step=5, task_name="check")
    assert client.get_data(meta)["policy_version"].tolist() == [5] * 8
    client.clear(global_step=5)
    # a restarted engine starts from the channel's newest weights, not the task's initial ones
    os.kill(ray.get(worker.engine_pid.remote()), signal.SIGKILL)
    put_prompts(client, step=6)
    stats = ray.get(worker.generate_step.remote(6))
    assert stats["engine_restarts"] == 1.0
    meta = client.get_meta(["policy_version"], 8, global_step=6, task_name="check")
    assert client.get_data(meta)["policy_version"].tolist() == [5] * 8
    client.clear(global_step=6)
    ray.kill(worker)


@pytest.mark.slow  # ~15-50 s each: the slow tier keeps make test under 10 minutes
def test_a_redo_generates_while_the_next_step_waits_for_weights(ray_session, tmp_path):
    """A step's redo (its prompts put again after a storage unit died) needs the engine while the next step's rollout
    waits for weights that only the redo's training step can publish: the wait must not hold the engine."""
    controller = tq.TransferQueueController.remote(
        global_batch_size=4, num_n_samples=N, sampler=tq.GRPOSampler(N), num_storage_units=1, num_global_batch=2
    )
    info = ray.get(controller.get_info.remote())
    client = tq.TransferQueueClient("rl-workers-redo-test", info)
    channel = WeightChannel(tmp_path / "weights")
    channel.write(7, AdditionTask(model_seed=7).build_policy().state_dict())
    spec = EngineSpec(weights_channel=str(channel.path), weights_timeout=60.0)
    worker = RolloutWorker.remote(2, info, spec, SamplingParams(max_new_tokens=4), N, 2, timeout=30.0)
    put_prompts(client, step=7)
    put_prompts(client, step=8)

    waiting = worker.generate_step.remote(8, None, 8)  # needs version 8: the training step of step 7 publishes it
    time.sleep(0.5)
    redo = worker.generate_step.options(concurrency_group=REDO_GROUP).remote(7)
    done, _ = ray.wait([redo], timeout=30)  # before the fix: stuck behind the wait until its 60 s timeout
    assert done, "the redo of step 7 waited for the weights step 8 needs"
    assert ray.get(redo)["rows"] == 8.0
    channel.write(8, AdditionTask(model_seed=8).build_policy().state_dict())
    assert ray.get(waiting)["rows"] == 8.0
    for step in (7, 8):
        meta = client.get_meta(["policy_version"], 8, global_step=step, task_name="check")
        assert client.get_data(meta)["policy_version"].tolist() == [step] * 8
        client.clear(global_step=step)
    ray.kill(worker)
    ray.get(controller.shutdown.remote())
    ray.kill(controller)


@pytest.mark.slow  # ~15-50 s each: the slow tier keeps make test under 10 minutes
def test_finish_writes_writes_the_batch_in_flight_and_starts_no_other(queue):
    """A trainer-group restart that keeps the queue first lets each rollout worker write the generations it has in
    flight (trainer_restarts.finish_writes): they are kept, not generated again, and nothing new starts."""
    _, info, client = queue
    step = 7
    spec = EngineSpec(task_name="tests.integration.workers.slow_tasks:SlowAdditionTask", task_kwargs={"forward_s": 0.8})
    worker = RolloutWorker.remote(2, info, spec, SamplingParams(max_new_tokens=4), N, 2, timeout=30.0)
    try:
        put_prompts(client, step=step)  # 8 rows: two batches of 2 groups
        pending = worker.generate_step.remote(step)
        deadline = time.monotonic() + 120
        # what a death now would make generate again: the first batch, generating (4 tokens at 0.8 s a forward pass)
        while ray.get(worker.rows_generating.remote()) < 4:
            assert time.monotonic() < deadline, "the worker never started generating its first batch"
            time.sleep(0.05)

        assert ray.get(worker.finish_writes.remote(60.0)) == 0  # the batch in flight is written
        assert ray.get(worker.rows_generating.remote()) == 0

        assert client.get_production_status(global_step=step)["fields"]["response_ids"]["produced"] == 4
        time.sleep(1.5)  # the second batch is not generated: nothing new is written
        assert client.get_production_status(global_step=step)["fields"]["response_ids"]["produced"] == 4
        assert not ray.wait([pending], timeout=0)[0]  # the step's call waits, to be stopped with the worker
    finally:
        ray.kill(worker)
        client.clear(global_step=step)
