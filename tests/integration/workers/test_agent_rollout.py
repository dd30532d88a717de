"""The agent rollout worker on a live queue and a live task server: trajectories land in the step's rows, a group
whose episodes cannot start is dropped whole (its rows complete the step, marked ``reward_failed``, nothing to
train on), and the OpenAI-compatible endpoint serves the worker's engine."""

from __future__ import annotations

import time

import openai
import pytest
import ray

import transfer_queue as tq
from rl_contracts.rows import rows_of
from workers.agents.environment import environment_class
from workers.agents.rollout_worker import AgentRolloutWorker
from workers.agents.task_server import create_app, serve_in_background
from workers.engines.base import SamplingParams
from workers.engines.host import EngineSpec

# ~15 s on a loaded 2-core machine (an actor that builds a model, a queue, a task server): the slow tier, to keep the
# default tier's budget; the workflow itself is tested against live servers in
# tests/unit/workers/agents/test_agent_workflow.py.
pytestmark = pytest.mark.slow
N = 2
TASK = "workers.tasks.guess_number:GuessNumberTask"


@pytest.fixture(scope="module")
def setup(ray_session):
    controller = tq.TransferQueueController.remote(global_batch_size=3, num_n_samples=N, sampler=tq.GRPOSampler(N))
    info = ray.get(controller.get_info.remote())
    with serve_in_background(create_app(environment_class("guess-number"))) as url:
        worker = AgentRolloutWorker.remote(
            0, info, EngineSpec(task_name=TASK), SamplingParams(max_new_tokens=1), N, 3,
            "workers.agents.rollout_fns:task_server_generate", {"task_server_url": url, "max_turns": 3}, timeout=30.0,
        )  # fmt: skip
        yield worker, tq.TransferQueueClient("agent-rollout-test", info)
        ray.kill(worker)
    ray.get(controller.shutdown.remote())
    ray.kill(controller)


def test_trajectories_land_in_the_rows_and_a_failed_group_is_dropped_whole(setup):
    worker, client = setup
    client.put({"sample_id": [s for s in ("game-01", "game-99", "game-07") for _ in range(N)]}, global_step=0)
    stats = ray.get(worker.generate_step.remote(0))
    assert (stats["rows"], stats["groups"], stats["dropped_groups"], stats["episodes"]) == (6, 2, 1, 4)
    fields = ["tokens", "loss_mask", "logprobs", "reward", "reward_failed", "num_turns", "success", "policy_version"]
    data = client.get_data(client.get_meta(fields, 6, global_step=0, task_name="check"))
    tokens, masks, lps = rows_of(data["tokens"]), rows_of(data["loss_mask"]), rows_of(data["logprobs"])
    failed = data["reward_failed"].tolist()
    assert failed.count(True) == 2  # the game-99 group (unknown sample: 404 at start), both rows
    for ids, mask, lp, bad, turns in zip(tokens, masks, lps, failed, data["num_turns"].tolist(), strict=True):
        assert len(ids) == len(mask) == len(lp)
        if bad:
            assert sum(mask) == 0  # nothing of a dropped group is trained on
        else:
            assert sum(mask) == turns and 1 <= turns <= 3  # one sampled token per turn, mask 1 exactly there
            assert all((m == 0) == (x == 0.0) for m, x in zip(mask, lp, strict=True))
    client.clear(global_step=0)


def test_the_openai_endpoint_serves_the_workers_engine(setup):
    worker, _ = setup
    url, key = ray.get(worker.serve_openai.remote())
    unauthenticated = openai.OpenAI(base_url=url + "/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="missing or wrong API key"):
        unauthenticated.models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    out = client.chat.completions.create(
        model="GuessNumberTask",
        messages=[{"role": "user", "content": "guess a number from 1 to 16"}],
        max_tokens=1,
        n=2,
    )
    assert out.model_extra["prompt_token_ids"] == [11, 2, 3, 4, 5, 13, 6, 28, 12]
    assert [len(c.model_extra["token_ids"]) for c in out.choices] == [1, 1]


def test_finish_writes_writes_the_episodes_in_flight_and_starts_no_other(setup, ray_session):
    """As ``RolloutWorker.finish_writes``: a trainer-group restart keeps the batch of episodes running."""
    _, client = setup
    info = client.controller_info
    with serve_in_background(create_app(environment_class("guess-number"))) as url:
        worker = AgentRolloutWorker.remote(
            1, info, EngineSpec(task_name=TASK), SamplingParams(max_new_tokens=1), N, 1,
            "tests.integration.workers.slow_tasks:slow_task_server_generate",
            {"task_server_url": url, "max_turns": 3, "delay_s": 2.0}, timeout=30.0,
        )  # fmt: skip
        try:
            client.put({"sample_id": [s for s in ("game-01", "game-07") for _ in range(N)]}, global_step=1)
            pending = worker.generate_step.remote(1)  # two batches of one group each
            deadline = time.monotonic() + 60
            while ray.get(worker.rows_generating.remote()) < N:
                assert time.monotonic() < deadline, "the worker never started its first batch"
                time.sleep(0.05)

            assert ray.get(worker.finish_writes.remote(60.0)) == 0

            produced = client.get_production_status(global_step=1)["fields"]["tokens"]["produced"]
            assert produced == N and ray.get(worker.rows_generating.remote()) == 0
            time.sleep(1.5)  # the second group's episodes never start
            assert client.get_production_status(global_step=1)["fields"]["tokens"]["produced"] == N
            assert not ray.wait([pending], timeout=0)[0]
        finally:
            ray.kill(worker)
            client.clear(global_step=1)
