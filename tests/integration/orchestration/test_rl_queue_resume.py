"""An RL run's queue restored from its checkpoint (orchestration/queue_resume.py): rows whose output was written before
the crash are kept for every worker task, rows a worker had taken but not written yet are handed out again, and rows
that were only leased come back ready. The calls below are the rollout and reward workers' own protocol. A queue a
trainer-group restart kept running (orchestration/trainer_restarts.py) is resumed the same way, the trainer served
again the steps it had trained since the checkpoint."""

from __future__ import annotations

from typing import Any

import pytest
import ray
import torch

from orchestration.queue_resume import reconcile_step, resume_steps
from rl_contracts.stages import REWARD_TASK, ROLLOUT_TASK, TRAIN_TASK
from transfer_queue import GRPOSampler, TransferQueueClient, TransferQueueController

N = 2  # samples per prompt
PROMPTS = 4  # prompts per step: 8 rows
OUTPUTS = {ROLLOUT_TASK: "response_ids", REWARD_TASK: "reward"}


def jagged(rows: list[list[int]]) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.tensor(r, dtype=torch.int64) for r in rows], layout=torch.jagged)


def start(**kwargs: Any) -> tuple[Any, TransferQueueClient]:
    controller = TransferQueueController.remote(
        PROMPTS, num_global_batch=3, num_n_samples=N, sampler=GRPOSampler(N), num_storage_units=2, **kwargs
    )
    return controller, TransferQueueClient("driver", ray.get(controller.get_info.remote()))


def stop(controller: Any, client: TransferQueueClient) -> None:
    client.close()
    ray.get(controller.shutdown.remote(), timeout=60)
    ray.kill(controller)


def put_prompts(client: TransferQueueClient, step: int) -> None:
    rows = [[step, p] for p in range(PROMPTS) for _ in range(N)]
    client.put({"prompt_ids": jagged(rows)}, global_step=step)


def generate(client: TransferQueueClient, step: int, rows: int, write: bool = True) -> list[int]:
    """A rollout worker's round: take whole groups, read them (acknowledged), write responses (unless in flight)."""
    meta = client.get_meta(["prompt_ids"], rows, global_step=step, task_name=ROLLOUT_TASK, get_n_samples=True)
    data = client.get_data(meta.select_fields(["prompt_ids"]))
    if write:
        responses = [[*p.tolist(), 99] for p in data["prompt_ids"].unbind()]
        client.put({"response_ids": jagged(responses)}, metadata=meta)
    return sorted(meta.global_indexes.tolist())


def score(client: TransferQueueClient, step: int, rows: int, write: bool = True) -> list[int]:
    meta = client.get_meta(["response_ids"], rows, global_step=step, task_name=REWARD_TASK, get_n_samples=True)
    client.get_data(meta)
    if write:
        client.put({"reward": torch.ones(len(meta), dtype=torch.float32)}, metadata=meta)
    return sorted(meta.global_indexes.tolist())


@pytest.mark.slow  # two runs' worth of actors (~40 s on a loaded 2-core machine): make test's 10-minute budget
def test_a_restored_step_hands_out_again_only_what_was_in_flight(ray_session, tmp_path) -> None:
    controller, client = start()
    put_prompts(client, 1)
    put_prompts(client, 2)
    generated = generate(client, 1, 4)  # two groups with responses
    in_flight = generate(client, 1, 2, write=False)  # taken and acknowledged, responses not written yet
    scored = score(client, 1, 2)
    scoring = score(client, 1, 2, write=False)
    leased = client.get_meta(["prompt_ids"], 2, global_step=2, task_name=ROLLOUT_TASK, get_n_samples=True)
    client.save_checkpoint(str(tmp_path))
    generate(client, 1, 2)  # after the checkpoint: lost with the crash
    stop(controller, client)

    controller, client = start(restore_from=str(tmp_path))
    try:
        assert reconcile_step(client, 1, OUTPUTS, timeout=30) == {ROLLOUT_TASK: 4, REWARD_TASK: 2}
        assert reconcile_step(client, 2, OUTPUTS, timeout=30) == {ROLLOUT_TASK: 0, REWARD_TASK: 0}
        status = client.get_production_status(global_step=1)
        assert status["fields"]["response_ids"]["produced"] == 4 and status["fields"]["reward"]["produced"] == 2

        # step 1: rollout gets the 4 rows without responses (the 2 in flight and the 2 written after the checkpoint),
        # then the end of the stream; never a row whose responses came back from the checkpoint
        again = generate(client, 1, 4)
        assert set(in_flight) <= set(again) and not set(again) & set(generated)
        assert len(client.get_meta(["prompt_ids"], 2, global_step=1, task_name=ROLLOUT_TASK, get_n_samples=True)) == 0
        # reward: the rows it had taken and not scored, then the rows generated now; never the scored ones
        rescored = score(client, 1, 2)
        assert rescored == scoring and not set(rescored) & set(scored)
        assert score(client, 1, 4) == again
        assert len(client.get_meta(["response_ids"], 2, global_step=1, task_name=REWARD_TASK, get_n_samples=True)) == 0
        # the trainer gets all 8 rows of step 1 once, each with its response and reward
        train = client.get_meta(
            ["prompt_ids", "response_ids", "reward"], 8, global_step=1, task_name=TRAIN_TASK, get_n_samples=True
        )
        data = client.get_data(train)
        assert sorted(train.global_indexes.tolist()) == sorted(generated + again)
        for prompt, response in zip(data["prompt_ids"].unbind(), data["response_ids"].unbind(), strict=True):
            assert response.tolist() == [*prompt.tolist(), 99]

        # step 2: the leased rows are ready again; all 8 rows go to rollout, once
        assert set(leased.global_indexes.tolist()) <= set(generate(client, 2, 8))
        assert len(client.get_meta(["prompt_ids"], 2, global_step=2, task_name=ROLLOUT_TASK, get_n_samples=True)) == 0
    finally:
        stop(controller, client)


def train(client: TransferQueueClient, step: int, rows: int) -> list[int]:
    """The trainer's read of ``rows`` scored rows of ``step`` (acknowledged)."""
    fields = ["prompt_ids", "response_ids", "reward"]
    meta = client.get_meta(fields, rows, global_step=step, task_name=TRAIN_TASK, get_n_samples=True, timeout=5)
    client.get_data(meta)
    return sorted(meta.global_indexes.tolist())


def test_a_kept_queue_serves_the_trainer_again_the_steps_it_trained_and_generates_only_the_rows_in_flight(
    ray_session,
) -> None:
    controller, client = start()
    try:
        for step in (1, 2):
            put_prompts(client, step)
        generated = {1: generate(client, 1, 8), 2: generate(client, 2, 4)}
        in_flight = generate(client, 2, 2, write=False)  # the rollout worker died with the run's other actors
        score(client, 1, 8)
        score(client, 2, 4)
        trained = train(client, 1, 8)  # step 1 trained after checkpoint 1; the rank died while step 2 trained:
        train(client, 2, 2)
        record = {"steps": [1, 2], "prompt_source": {}, "prompt_states": []}

        resume = resume_steps(client, 1, record, PROMPTS * N, OUTPUTS, timeout=30, retrain=TRAIN_TASK)

        assert resume.kept == {1: {ROLLOUT_TASK: 8, REWARD_TASK: 8}, 2: {ROLLOUT_TASK: 4, REWARD_TASK: 4}}
        # step 1: nothing generated or scored again; the trainer, back at checkpoint 1, is served all 8 rows again
        assert len(client.get_meta(["prompt_ids"], 2, global_step=1, task_name=ROLLOUT_TASK, get_n_samples=True)) == 0
        assert train(client, 1, 8) == trained == generated[1]
        # step 2: rollout gets the 4 rows without responses (those in flight among them), once; then the trainer
        # all 8, the 2 it had read before the death too
        again = generate(client, 2, 4)
        assert set(in_flight) <= set(again) and not set(again) & set(generated[2])
        assert len(client.get_meta(["prompt_ids"], 2, global_step=2, task_name=ROLLOUT_TASK, get_n_samples=True)) == 0
        score(client, 2, 4)
        assert train(client, 2, 8) == sorted(generated[2] + again)
        assert resume.message(ROLLOUT_TASK) == (
            "resumed from step 1: 12 rows of steps [1, 2] restored from the queue kept, 4 re-launched"
        )
    finally:
        stop(controller, client)
