"""In-flight checkpoints on a live queue (``rollout.checkpoint_inflight``): a rollout worker resumes the partial
responses a dead call of its step left in the queue (their tokens, log-probs and versions kept), generates again
those older than ``max_staleness`` versions of the policy that trains the step, and clears the checkpoints once
the rows are written; a worker SIGKILLed mid-generation resumes, after Ray restarted it, from what it had
checkpointed."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch
from tensordict import TensorDict

import transfer_queue as tq
from rl_contracts.inflight import InflightCheckpoints, Partial, inflight_partition
from rl_contracts.rows import float_rows_of, jagged, rows_of
from workers.engines.base import SamplingParams
from workers.engines.host import EngineSpec
from workers.rollout import RolloutWorker, start_engine
from workers.tasks.addition import AdditionTask

N, PROMPTS = 2, 4  # a step: PROMPTS groups of N rows
FIELDS = ["response_ids", "response_logprobs", "response_versions"]


@pytest.fixture(scope="module")
def queue(ray_session):
    controller = tq.TransferQueueController.remote(
        global_batch_size=PROMPTS, num_n_samples=N, sampler=tq.GRPOSampler(N), num_storage_units=1
    )
    info = ray.get(controller.get_info.remote())
    yield controller, info, tq.TransferQueueClient("inflight-test", info)
    ray.get(controller.shutdown.remote())
    ray.kill(controller)


def put_prompts(client, step: int) -> list[int]:
    """The step's prompts, ``N`` rows each; returns the rows' group ids."""
    problems = AdditionTask().prompts("train", PROMPTS, seed=step)
    rows = [p for p in problems for _ in range(N)]
    data = TensorDict({"prompt_ids": jagged([p["prompt_ids"] for p in rows], torch.int64)}, batch_size=[len(rows)])
    client.put(data, global_step=step)
    meta = client.get_meta(["prompt_ids"], len(rows), global_step=step, task_name="peek", peek=True, timeout=30)
    return meta.group_ids.tolist()


def responses(client, step: int, rows: int) -> list[tuple[int, list[int], list[float], list[int]]]:
    """``(group id, response ids, log-probs, versions)`` of each row of ``step``."""
    meta = client.get_meta(FIELDS, rows, global_step=step, task_name="check", timeout=30)
    data = client.get_data(meta)
    return list(zip(meta.group_ids.tolist(), rows_of(data["response_ids"]), float_rows_of(data["response_logprobs"]),
                    rows_of(data["response_versions"]), strict=True))  # fmt: skip


def kill_mid_generation(worker, controller, client, step: int) -> None:
    """SIGKILL ``worker`` once its call of ``step`` checkpointed its first chunk, wait for Ray's restart of it, and
    hand the rows it held back (as the run's supervisor does)."""
    pid, owner = ray.get(worker.pid.remote()), ray.get(worker.queue_owner.remote())
    call = worker.generate_step.remote(step, None, None, 0)
    while not client.kv_list(inflight_partition(step)):  # the first chunk is checkpointed: mid-generation
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(call)
    while True:
        try:
            if ray.get(worker.pid.remote()) != pid:
                break
        except ray.exceptions.RayActorError:
            time.sleep(0.1)
    ray.get(controller.clients_gone.remote([owner]))


@pytest.mark.slow  # ~45 s on a loaded 2-core machine (make test's 10-minute budget); the unit tier covers the pieces
def test_a_worker_resumes_fresh_partials_regenerates_stale_ones_and_clears_them(queue):
    _, info, client = queue
    step = 0
    groups = put_prompts(client, step)
    fresh_group, stale_group = groups[0], groups[-1]
    store = InflightCheckpoints(client, inflight_partition(step))
    fresh = Partial([3, 4], [-1.5, -2.5], [2, 3])  # within max_staleness=1 of version 3
    stale = Partial([5, 6, 7], [-0.5, -0.5, -0.5], [1, 3, 3])  # its first token 2 versions before 3
    store.save([f"{fresh_group}/0", f"{stale_group}/1"], [fresh, stale])
    worker = RolloutWorker.remote(
        0, info, EngineSpec(partial_rollout=True, chunk_tokens=2), SamplingParams(max_new_tokens=6), N, 2,
        timeout=30.0, checkpoint_inflight=True, max_staleness=1,
    )  # fmt: skip
    weights = AdditionTask(model_seed=7).build_policy().state_dict()
    ray.get(worker.update_weights.remote(3, [ray.put(weights)]))

    stats = ray.get(worker.generate_step.remote(step, None, None, 3))  # version 3 trains the step

    assert stats["rows"] == PROMPTS * N
    assert (stats["resumed_tokens"], stats["stale_partials"], stats["stale_partial_tokens"]) == (2, 1, 3)
    rows = responses(client, step, PROMPTS * N)
    resumed = [r for r in rows if r[0] == fresh_group and r[1][:2] == [3, 4]]
    assert len(resumed) == 1, rows
    _, ids, logprobs, versions = resumed[0]
    assert logprobs[:2] == [-1.5, -2.5] and versions[:2] == [2, 3]  # kept as checkpointed
    assert versions[2:] == [3] * (len(ids) - 2)
    others = [r for r in rows if r is not resumed[0]]
    assert all(v == [3] * len(ids) for _, ids, _, v in others), others  # the stale one started over on version 3
    assert client.kv_list(inflight_partition(step)) == []  # cleared once the rows were written
    client.clear(global_step=step)
    ray.kill(worker)


@pytest.mark.slow  # a real SIGKILL and Ray's restart of the worker: ~20 s
def test_a_worker_killed_mid_generation_resumes_from_its_checkpoints_after_its_restart(queue):
    controller, info, client = queue
    step = 1
    put_prompts(client, step)
    worker = RolloutWorker.options(max_restarts=1).remote(
        1, info, EngineSpec(partial_rollout=True, chunk_tokens=1), SamplingParams(max_new_tokens=20), N, PROMPTS,
        timeout=30.0, checkpoint_inflight=True, max_staleness=1,
    )  # fmt: skip
    partition = inflight_partition(step)
    kill_mid_generation(worker, controller, client, step)  # its engine dies with it
    store = InflightCheckpoints(client, partition)
    keys = client.kv_list(partition)
    left = store.load(keys)
    checkpointed = sum(len(p.token_ids) for p in left.values())
    assert checkpointed > 0

    stats = ray.get(worker.generate_step.remote(step, None, None, 0))

    assert stats["rows"] == PROMPTS * N  # the whole step, in one batch, was the dead call's
    assert stats["resumed_tokens"] == checkpointed and stats["stale_partials"] == 0
    rows = responses(client, step, PROMPTS * N)
    for key, partial in left.items():  # each partial went on in a row of its group, its tokens and versions kept
        group = int(key.split("/")[0])
        kept = len(partial.token_ids)
        assert any(g == group and ids[:kept] == partial.token_ids and v[:kept] == partial.versions
                   for g, ids, _, v in rows), (key, partial)  # fmt: skip
    assert client.kv_list(partition) == []
    client.clear(global_step=step)
    ray.kill(worker)


@pytest.mark.slow  # a real SIGKILL and Ray's restart of the worker: ~20 s
def test_a_worker_killed_mid_generation_with_the_runs_engine_generates_nothing_again_after_its_restart(queue):
    """As a run starts them: the engine is the driver's (``start_engine``), not the worker's. Killed mid-generation,
    the worker leaves its engine going on with the dead call, checkpointing every chunk; after Ray restarted the
    worker, its call of the step reaches the same engine, waits for the dead call, and resumes every response
    whole: not one token is generated again (before: the engine died with the worker, and every token after the
    last checkpoint the restarted worker read was generated again)."""
    controller, info, client = queue
    step = 2
    put_prompts(client, step)
    spec = EngineSpec(partial_rollout=True, chunk_tokens=1)
    engine = start_engine(spec, None, 0)
    worker = RolloutWorker.options(max_restarts=1).remote(
        2, info, spec, SamplingParams(max_new_tokens=20), N, PROMPTS, timeout=30.0, checkpoint_inflight=True,
        max_staleness=1, engine=engine,
    )  # fmt: skip
    engine_pid = ray.get(engine.pid.remote())
    partition = inflight_partition(step)
    kill_mid_generation(worker, controller, client, step)
    assert ray.get(worker.engine_pid.remote()) == engine_pid  # the engine lived on

    stats = ray.get(worker.generate_step.remote(step, None, None, 0))

    assert stats["rows"] == PROMPTS * N and stats["stale_partials"] == 0
    assert stats["tokens"] > 0 and stats["resumed_tokens"] == stats["tokens"]  # every token: the dead call's
    rows = responses(client, step, PROMPTS * N)
    assert all(len(ids) == len(versions) > 0 for _, ids, _, versions in rows)
    assert client.kv_list(partition) == []
    client.clear(global_step=step)
    ray.kill(worker)
    ray.kill(engine)
