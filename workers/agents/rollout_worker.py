"""AgentRolloutWorker: runs a ``rollout.generate_fn`` over the prompt rows of global steps, writes trajectories.

For a global step it loops: ``get_meta(["sample_id"] (or the run's prompt fields), whole groups)`` ->
``collect_groups(generate_fn, ...)`` over the worker's engine -> ``put`` ``tokens``, ``loss_mask``, ``logprobs``,
``reward``, ``num_turns``, ``success``, ``policy_version`` into those same rows. A dropped group (an episode
failed) or a filtered one is written with ``reward_failed`` set and an empty loss mask, so its rows complete the
step but never reach the loss.

The engine lives in this actor, behind a lock: weight updates land between two batched generations.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import ray
import torch

from rl_contracts.lost_rows import WORKER_TASK_OPTIONS, BatchesInFlight, served_batches, write_or_release
from rl_contracts.queue_clock import QueueClock
from rl_contracts.rows import rows_of
from rl_contracts.stages import REDO_CONCURRENCY, REDO_GROUP, ROLLOUT_TASK
from rl_contracts.task import load_task
from transfer_queue import ControllerInfo, TransferQueueClient
from workers.agents.rollout_fns import chat_format, collect_groups, load_rollout_fn
from workers.agents.samplers import BatchingSampler
from workers.agents.trajectory import Sample, samples_to_fields
from workers.engines.base import Generation, SamplingParams
from workers.engines.host import EngineSpec

logger = logging.getLogger(__name__)


def prompt_dicts(data: Any, fields: list[str], n: int) -> list[dict[str, Any]]:
    """One dict per group (rows come group by group, ``n`` per prompt) of the ``fields`` read from the queue: token
    fields (jagged tensors, e.g. ``prompt_ids``) as lists of ids, the others (``sample_id``, reward fields) as
    values."""
    columns = {}
    for name in fields:
        value = data.get(name)
        columns[name] = rows_of(value) if isinstance(value, torch.Tensor) else list(value.tolist())
    rows = len(next(iter(columns.values()))) if columns else 0
    return [{name: column[i] for name, column in columns.items()} for i in range(0, rows, n)]


@ray.remote(concurrency_groups={"rollout": 1, REDO_GROUP: REDO_CONCURRENCY, "control": 1})  # type: ignore[call-overload]  # Ray's overloads omit it
class AgentRolloutWorker:
    """See the module docstring.

    Args:
        worker_id: a name for logs.
        controller_info: the queue.
        engine_spec: how to build the engine (in this actor).
        sampling: sampling parameters of every turn.
        n_samples: episodes per sample id (the queue's group size).
        groups_per_request: GRPO groups taken from the queue at a time.
        generate_fn, generate_fn_kwargs, filter_fn, reward_fn: see ``workers/agents/rollout_fns.py``.
        timeout: seconds one wait for rows may take.
        seed: seeds this process's sampling.
    """

    def __init__(
        self,
        worker_id: int,
        controller_info: ControllerInfo,
        engine_spec: EngineSpec,
        sampling: SamplingParams,
        n_samples: int,
        groups_per_request: int,
        generate_fn: str,
        generate_fn_kwargs: dict[str, Any] | None = None,
        filter_fn: str | None = None,
        reward_fn: str | None = None,
        timeout: float = 300.0,
        seed: int = 0,
    ):
        torch.manual_seed(seed)  # the engine samples from the global generator
        self.worker_id = worker_id
        self.client = TransferQueueClient(f"agent-rollout-{worker_id}", controller_info)
        # rows are done once their samples are written: a worker killed mid-batch hands them back (lost_rows.py)
        self.client.set_task_options(ROLLOUT_TASK, **WORKER_TASK_OPTIONS)
        self.engine = engine_spec.build()
        self.task = load_task(engine_spec.task_name, engine_spec.task_kwargs)
        self.n = n_samples
        self.batch_rows = groups_per_request * n_samples
        self.timeout = timeout
        self._lock = threading.Lock()
        # not ``self.generate``: that would shadow the ``generate`` method (the run's evaluations) inside the actor
        self.generate_fn = load_rollout_fn(
            generate_fn, generate_fn_kwargs, n_samples=n_samples, sampling=sampling, task=self.task
        )
        self.filter_fn = load_rollout_fn(filter_fn) if filter_fn else None
        self.reward_fn = load_rollout_fn(reward_fn) if reward_fn else None
        self.sampler = BatchingSampler(self._generate_batch)
        # each batch from its episodes to its write (finish_writes: a trainer-group restart keeps them)
        self.in_flight = BatchesInFlight()
        self.task_label = engine_spec.task_name.rsplit(":", 1)[-1]

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> tuple[int, list[Generation]]:
        with self._lock:
            return self.engine.version, [g[0] for g in self.engine.generate(prompts, 1, params)]

    @ray.method(concurrency_group="control")
    def finish_writes(self, timeout_s: float) -> int:
        """``RolloutWorker.finish_writes``: start no new batch of episodes and wait up to ``timeout_s`` for those
        running to be written into the queue; returns how many are still in flight."""
        return self.in_flight.finish(timeout_s)

    @ray.method(concurrency_group="control")
    def rows_generating(self) -> int:
        """Rows of the batches whose episodes run now (``RolloutWorker.rows_generating``)."""
        return self.in_flight.rows()

    @ray.method(concurrency_group="control")
    def queue_owner(self) -> str:
        """Its queue client's owner (the supervisor tells the controller when this worker died)."""
        return str(self.client.owner)

    def pid(self) -> int:
        """This worker's process id (a restarted worker has a new one: the run's supervisor counts restarts by it)."""
        return os.getpid()

    @ray.method(concurrency_group="control")
    def update_weights(self, version: int, weights: Any = None, path: str | None = None) -> int:
        """Load new weights between two generations (a state dict, a list holding its ObjectRef, or a directory)."""
        if isinstance(weights, list) and weights and isinstance(weights[0], ray.ObjectRef):
            weights = ray.get(weights[0])
        with self._lock:
            self.engine.update_weights(version, state_dict=weights, path=path)
            return self.engine.version

    @ray.method(concurrency_group="control")
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[list[Generation]]:
        """``n`` responses per prompt from the current weights, outside the queue (``GRPORun.evaluate``, SFT
        probes)."""
        with self._lock:
            return self.engine.generate(prompts, n, params)

    @ray.method(concurrency_group="control")
    def serve_openai(self, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None) -> tuple[str, str]:
        """Serve the OpenAI-compatible endpoint (``workers/agents/openai_api.py``) over this worker's engine, in a
        thread of this actor, until the actor ends; returns its base URL and the key it requires (``api_key``, or a
        fresh one). Its calls share the engine lock with the rollout."""
        import contextlib

        from workers.agents.openai_api import create_app
        from workers.agents.task_server import serve_in_background
        from workers.api_key import new_api_key

        key = api_key or new_api_key()
        app = create_app(
            BatchingSampler(self._generate_batch), chat_format(self.task), model=self.task_label, api_key=key
        )
        self._endpoint = contextlib.ExitStack()
        return self._endpoint.enter_context(serve_in_background(app, host, port)), key

    @ray.method(concurrency_group="rollout")
    def generate_step(
        self,
        step: int,
        fields: list[str] | None = None,
        min_version: int | None = None,
        train_version: int | None = None,
    ) -> dict[str, float]:
        """Episodes for every group of ``step`` this worker gets; returns counts for the step's metrics row.

        ``fields``: the rows' fields each prompt dict is made of (default ``["sample_id"]``, task servers; the
        single-turn ``generate_fn`` takes ``prompt_ids`` and the task's reward fields).

        ``fields`` and ``min_version`` are ``RolloutWorker.generate_step``'s; weights arrive by ``update_weights``
        (``weight_sync`` memory or disk), so a ``min_version`` (the shm weight channel) is refused. ``train_version``
        is for in-flight checkpoints, which agent rollouts do not write: ignored."""
        if min_version is not None:
            raise ValueError(
                f"AgentRolloutWorker takes weights by update_weights; got min_version={min_version} "
                "(weight_sync='shm' is not supported for agent rollouts)"
            )
        stats = dict.fromkeys(
            ("rows", "generate_s", "tokens", "groups", "dropped_groups", "filtered_groups", "episodes",
             "success_sum", "num_turns_sum", "env_reward_sum"), 0.0,
        )  # fmt: skip
        fields = fields or ["sample_id"]
        clock = QueueClock()
        batches = served_batches(
            self.client, clock, fields, self.batch_rows, step=step, task_name=ROLLOUT_TASK, timeout=self.timeout
        )
        for meta, data in batches:
            with self.in_flight.batch(meta):  # from its episodes to its write (finish_writes waits for it)
                t0 = time.perf_counter()
                groups, group_stats = asyncio.run(
                    collect_groups(
                        self.generate_fn, prompt_dicts(data, fields, self.n), self.sampler, self.n, self.reward_fn,
                        self.filter_fn,
                    )
                )  # fmt: skip
                stats["generate_s"] += time.perf_counter() - t0
                samples = [s for group in groups for s in (group or self._placeholders())]
                written = clock.call(write_or_release, self.client, self._fields(samples, groups), meta, self.n)
            if not written:  # lost meanwhile (a storage unit died: they come back as new rows), or written already
                continue
            kept = [s for group in groups if group for s in group]
            stats["rows"] += written
            stats["groups"] += group_stats.groups
            stats["dropped_groups"] += group_stats.dropped_groups
            stats["filtered_groups"] += group_stats.filtered_groups
            stats["episodes"] += len(kept)
            stats["success_sum"] += sum(bool(s.metadata.get("success")) for s in kept)
            stats["num_turns_sum"] += sum(int(s.metadata.get("num_turns", 1)) for s in kept)
            stats["env_reward_sum"] += sum(s.reward for s in kept)
            stats["tokens"] += sum(sum(1 for m in s.loss_mask if m) for s in kept)
        return {**stats, **clock.stats()}

    def _placeholders(self) -> list[Sample]:
        pad = self.task.tokenizer.pad_token_id
        return [Sample("", "", [pad], [0.0], 0.0, {"policy_version": self.engine.version}) for _ in range(self.n)]

    def _fields(self, samples: list[Sample], groups: list[list[Sample] | None]) -> dict[str, Any]:
        fields = samples_to_fields(samples)
        failed = [group is None for group in groups for _ in range(self.n)]
        fields["reward_failed"] = fields["reward_failed"] | torch.tensor(failed)
        return fields
