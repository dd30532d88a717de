"""RolloutWorker: takes prompt rows from the queue as they become ready, generates, writes responses back.

For a global step it loops: ``get_meta(["prompt_ids", ...], whole groups)`` -> generate ``n`` responses per prompt
-> ``put`` ``response_ids``, ``response_logprobs``, ``response_mask``-ready lengths, ``policy_version`` and
``finish_reason`` into those same rows -> until the step's rows are all taken (end of stream).

With ``checkpoint_inflight`` (``rollout.checkpoint_inflight``, partial rollouts), the engine writes each chunk's
partial responses into the queue as it generates (rl_contracts/inflight.py): a call of the step made again after
this worker was killed reads them and resumes each response where it stopped, its tokens and their versions kept,
unless its oldest token is more than ``max_staleness`` versions older than the policy that trains the step (then
it is generated again, counted in ``stale_partials``). The checkpoints of a batch are cleared once its rows are
written.

The engine lives in its own actor. If it dies mid-call, the worker hands the rows back to the queue (``release``),
starts a new engine with the latest weights, and carries on: no prompt is lost. The run starts each worker's engine
itself (``engine``, :func:`start_engine`), so the engine outlives a worker killed mid-generation: it goes on with the
dead call (checkpointing its chunks), and the call made again after Ray restarted the worker reaches the same engine,
waits for the dead call and resumes from everything it generated (workers/engines/host.py); a worker given no engine
starts its own, which dies with it. Restarts and weight updates go
through one :class:`EngineSlot`, so a weight update that arrives while an engine restarts lands in the new engine:
a restarted engine never serves older weights than the last published version.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from rl_contracts.actors import actor_class
from rl_contracts.colocate import RequestGate
from rl_contracts.images import IMAGE_REFS, image_refs_of
from rl_contracts.inflight import InflightCall, InflightCheckpoints, Partial, fresh_enough, inflight_partition, row_keys
from rl_contracts.lost_rows import (
    WORKER_TASK_OPTIONS,
    BatchesInFlight,
    release_quietly,
    served_batches,
    write_or_release,
)
from rl_contracts.queue_clock import QueueClock
from rl_contracts.rows import jagged, rows_of
from rl_contracts.stages import REDO_CONCURRENCY, REDO_GROUP, ROLLOUT_TASK
from transfer_queue import BatchMeta, ControllerInfo, TransferQueueClient
from workers.engines.base import SamplingParams
from workers.engines.host import EngineActor, EngineSpec

logger = logging.getLogger(__name__)
ENGINE_FAILURES = (RayActorError, ActorDiedError, ActorUnavailableError)


WeightsUpdate = tuple[int, Any, str | None]  # (version, weights, path), as EngineActor.update_weights takes them


def start_engine(spec: EngineSpec, options: dict[str, Any] | None, seed: int) -> Any:
    """A rollout worker's EngineActor with Ray ``options`` (e.g. ``num_gpus``): a partial-rollout engine takes a
    weight update while it generates (``max_concurrency`` 2). Owned by its caller: made by the run's driver, it
    outlives the worker it serves."""
    options = dict(options or {})
    if spec.partial_rollout:  # update_weights must reach the engine while it generates
        options.setdefault("max_concurrency", 2)
    return actor_class(EngineActor).options(**options).remote(spec, seed)


class EngineSlot:
    """The rollout worker's current engine and the newest weights a replacement must start with.

    Plain bookkeeping, no Ray: ``start(restart_count) -> engine`` builds an engine and ``load(engine, update)``
    loads weights into it (raising one of ``failures`` if the engine is dead). Weight updates (the control thread)
    and restarts (the generation thread) are serialised by one lock, so an update either reaches the engine that
    serves next or is loaded into its replacement: never an engine with old weights after a newer publish.
    """

    def __init__(
        self,
        start: Callable[[int], Any],
        load: Callable[[Any, WeightsUpdate], int],
        failures: tuple[type[BaseException], ...],
    ):
        self._start, self._load, self._failures = start, load, failures
        self._lock = threading.Lock()
        self.latest: WeightsUpdate | None = None
        self.restarts = 0
        self.engine = self._new_engine()

    def update_weights(self, version: int, weights: Any = None, path: str | None = None) -> int:
        """Remember ``version`` for restarts and load it into the engine (a new one if it died); returns it."""
        with self._lock:
            self.latest = (version, weights, path)
            try:
                return self._load(self.engine, self.latest)
            except self._failures:
                self._replace()
                return version

    def restart(self, dead: Any) -> bool:
        """Replace ``dead`` with a new engine holding the latest weights; False if it was already replaced."""
        with self._lock:
            if self.engine is not dead:
                return False
            self._replace()
            return True

    def _replace(self) -> None:
        self.restarts += 1
        self.engine = self._new_engine()

    def _new_engine(self) -> Any:
        engine = self._start(self.restarts)
        if self.latest is not None:
            self._load(engine, self.latest)
        return engine


@ray.remote(concurrency_groups={"rollout": 1, REDO_GROUP: REDO_CONCURRENCY, "control": 1})  # type: ignore[call-overload]  # Ray's overloads omit it
class RolloutWorker:
    """Generates responses for the prompt rows of global steps.

    Args:
        worker_id: a name for logs and metrics.
        controller_info: the queue.
        engine_spec: how to (re)build the engine.
        sampling: sampling parameters for every request.
        n_samples: responses per prompt (the queue's group size).
        groups_per_request: GRPO groups taken from the queue at a time.
        timeout: seconds one wait for rows may take.
        engine_options: Ray options of the engine actor (e.g. ``num_gpus``).
        checkpoint_inflight: write partial responses into the queue chunk by chunk and resume from them (needs
            ``engine_spec.partial_rollout``).
        max_staleness: the versions a resumed partial's oldest token may lag the policy that trains its step.
        engine: the EngineActor the run started for this worker (:func:`start_engine` from the driver: it outlives
            the worker, and a restarted worker takes it again); None: the worker starts its own. A replacement for
            a dead engine is the worker's own.
    """

    def __init__(
        self,
        worker_id: int,
        controller_info: ControllerInfo,
        engine_spec: EngineSpec,
        sampling: SamplingParams,
        n_samples: int,
        groups_per_request: int,
        timeout: float = 300.0,
        engine_options: dict[str, Any] | None = None,
        seed: int = 0,
        checkpoint_inflight: bool = False,
        max_staleness: int = 0,
        engine: Any = None,
    ):
        if checkpoint_inflight and not engine_spec.partial_rollout:
            raise ValueError(
                "checkpoint_inflight needs a partial-rollout engine (EngineSpec.partial_rollout=True, "
                "rollout.partial_rollout=true): its chunks are what is checkpointed"
            )
        self.checkpoint_inflight = checkpoint_inflight
        self.max_staleness = max_staleness
        self.worker_id = worker_id
        self.client = TransferQueueClient(f"rollout-{worker_id}", controller_info)
        # rows are done once their responses are written: a worker killed mid-batch hands them back (lost_rows.py)
        self.client.set_task_options(ROLLOUT_TASK, **WORKER_TASK_OPTIONS)
        self.spec = engine_spec
        self.sampling = sampling
        self.n = n_samples
        self.batch_rows = groups_per_request * n_samples
        self.timeout = timeout
        self.engine_options = dict(engine_options or {})
        self.seed = seed
        self.gate = RequestGate()  # each step's generations pass it (drain_requests holds them: colocated servers)
        # each batch from its generation to its write (finish_writes: a trainer-group restart keeps them)
        self.in_flight = BatchesInFlight()
        # (engine, its resumed_tokens_on_retry when last read): the run's engine may have counted some before this
        # worker (its previous process) began, which that process reported; asked now, read at the first look
        self._retry_seen: tuple[Any, Any] = (None, 0)
        if engine is not None and checkpoint_inflight:
            self._retry_seen = (engine, engine.resumed_tokens_on_retry.remote())
        self.slot = EngineSlot(
            lambda restarts: (
                engine
                if restarts == 0 and engine is not None
                else start_engine(self.spec, self.engine_options, self.seed + 1000 * restarts)
            ),
            lambda engine, update: ray.get(engine.update_weights.remote(*update)),
            ENGINE_FAILURES,
        )

    @property
    def engine(self) -> Any:
        return self.slot.engine

    @property
    def restarts(self) -> int:
        return self.slot.restarts

    @ray.method(concurrency_group="control")
    def update_weights(self, version: int, weights: Any = None, path: str | None = None) -> int:
        """Queue new weights for the engine (they land between two generations) and remember them for restarts."""
        return self.slot.update_weights(version, weights, path)

    @ray.method(concurrency_group="control")
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, n: int = 1, image_refs: list[list[str]] | None = None
    ) -> list[list[Any]]:
        """``n`` responses per prompt from the current weights, outside the queue (evaluation); ``image_refs``: a
        vision task's prompts' image blob keys, one list per prompt."""
        return ray.get(self.engine.generate.remote(prompts, n, params, None, image_refs))[1]

    @ray.method(concurrency_group="control")
    def drain_requests(self, timeout_s: float) -> int:
        """Hold ``generate_step``'s next generations back and wait up to ``timeout_s`` for the one in flight (a
        colocated run releases its servers then); returns how many are still in flight (0: drained)."""
        self.gate.drain(timeout_s)
        return self.gate.active

    @ray.method(concurrency_group="control")
    def resume_requests(self) -> None:
        """Let the generations ``drain_requests`` held back go on."""
        self.gate.resume()

    @ray.method(concurrency_group="control")
    def finish_writes(self, timeout_s: float) -> int:
        """Start no new generation and wait up to ``timeout_s`` for the batches generating now to be written into the
        queue; returns how many are still in flight (0: every one written). For a worker about to be stopped while
        its queue goes on (a trainer-group restart that keeps the queue, orchestration/trainer_restarts.py): its
        generations in flight are kept instead of generated again; the rows it takes meanwhile wait, unstarted, and
        go back to the queue when it is stopped."""
        return self.in_flight.finish(timeout_s)

    @ray.method(concurrency_group="control")
    def rows_generating(self) -> int:
        """Rows of the batches this worker is generating or writing now (taken rows that wait for weights or for the
        gate are not counted: nothing was generated for them yet). What its death would make generate again."""
        return self.in_flight.rows()

    @ray.method(concurrency_group="control")
    def queue_owner(self) -> str:
        """Its queue client's owner (the supervisor tells the controller when this worker died)."""
        return str(self.client.owner)

    def pid(self) -> int:
        """This worker's process id (a restarted worker has a new one: the run's supervisor counts restarts by it)."""
        return os.getpid()

    @ray.method(concurrency_group="control")
    def engine_pid(self) -> int:
        return ray.get(self.engine.pid.remote())

    @ray.method(concurrency_group="control")
    def health(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "restarts": self.restarts, **ray.get(self.engine.health.remote())}

    @ray.method(concurrency_group="rollout")
    def generate_step(
        self,
        step: int,
        fields: list[str] | None = None,
        min_version: int | None = None,
        train_version: int | None = None,
    ) -> dict[str, float]:
        """Generate responses for every prompt row of ``step`` this worker gets; returns timings and counts.

        ``min_version``: with a weight channel, every generation waits for weights at least this new (the engine
        pulls them itself), so the driver can launch a step before the training step it depends on has ended.

        ``fields`` holding ``image_refs`` (``rl_contracts.images.IMAGE_REFS``, a vision task's rows): each prompt's
        image blob keys go to the engine with it (a group's n rows carry the same keys; the first row's are read).

        ``train_version``: the policy version that will train ``step``; with ``checkpoint_inflight``, a checkpointed
        partial whose oldest token is more than ``max_staleness`` versions older is generated again (None: every
        partial is resumed).
        """
        fields = fields or ["prompt_ids"]
        read = ["prompt_ids", *([IMAGE_REFS] if IMAGE_REFS in fields else [])]
        stats = {"rows": 0.0, "generate_s": 0.0, "weights_wait_s": 0.0, "tokens": 0.0, "engine_restarts": 0.0}
        if self.checkpoint_inflight:
            stats.update(resumed_tokens=0.0, stale_partials=0.0, stale_partial_tokens=0.0)
        store = InflightCheckpoints(self.client, inflight_partition(step)) if self.checkpoint_inflight else None
        clock = QueueClock()
        batches = served_batches(
            self.client, clock, fields, self.batch_rows, step=step, task_name=ROLLOUT_TASK, timeout=self.timeout,
            read=read,
        )  # fmt: skip
        for meta, data in batches:
            stats.setdefault("started_at", time.time())  # wall clock: the run's trace (orchestration) draws the span
            check_groups(meta, self.n)
            prompts = rows_of(data["prompt_ids"])[:: self.n]  # rows come group by group, n rows per prompt
            images = image_refs_of(data[IMAGE_REFS])[:: self.n] if IMAGE_REFS in read else None
            inflight = None
            if store is not None:
                inflight = clock.call(self._inflight_call, store, meta, train_version, stats)
            t1 = time.perf_counter()
            engine = self.engine
            try:
                if min_version is not None:  # timed apart: waiting for the trainer is not generating
                    # the wait runs beside the engine: a redo of the step before this one generates meanwhile
                    ray.get(engine.wait_for_weights.remote(min_version))
            except ENGINE_FAILURES as exc:
                self._engine_died(engine, exc, meta, stats)
                continue
            with contextlib.ExitStack() as in_flight:  # from its generation to its write (finish_writes)
                try:
                    # held while a colocated run's servers are released for training (drain_requests): waiting too
                    with self.gate.passing():
                        # past the colocated gate; generating from after the weights' load (rows_generating)
                        in_flight.enter_context(self.in_flight.batch(meta, generating=False))
                        if min_version is not None:
                            ray.get(engine.pull_weights.remote(min_version))
                        stats["weights_wait_s"] += time.perf_counter() - t1
                        t1 = time.perf_counter()
                        self.in_flight.generating(meta)
                        version, generations = ray.get(
                            engine.generate.remote(prompts, self.n, self.sampling, min_version, images, inflight)
                        )
                except ENGINE_FAILURES as exc:
                    in_flight.close()  # nothing to write: finish_writes does not wait for the engine's restart
                    self._engine_died(engine, exc, meta, stats)
                    continue
                stats["generate_s"] += time.perf_counter() - t1
                responses = self._responses(generations, version)
                written = clock.call(write_or_release, self.client, responses, meta, self.n)
            if not written:  # lost meanwhile (a storage unit died: they come back as new rows), or written already
                continue
            stats["rows"] += written
            stats["tokens"] += sum(len(g.token_ids) for group in generations for g in group)
            if store is not None and inflight is not None:  # written: its checkpoints are done with
                stats["resumed_tokens"] += sum(len(p.token_ids) for p in inflight.resume if p is not None)
                clock.call(store.clear, inflight.keys)
        if store is not None:  # and what the engine resumed after its server died under a generation
            stats["resumed_tokens"] += self._resumed_on_retry()
        return {**stats, **clock.stats(), "ended_at": time.time()}

    def _resumed_on_retry(self) -> float:
        """Tokens the engine took from partials it had checkpointed itself since the last look: a generation asked
        again after its server died, or the dead call of this worker's previous process that the engine went on with
        (``EngineActor.resumed_tokens_on_retry``); 0 if it cannot say (dead)."""
        engine = self.engine
        try:
            now = int(ray.get(engine.resumed_tokens_on_retry.remote(), timeout=30))
        except (ray.exceptions.RayError, TimeoutError):
            return 0.0
        seen = self._retry_seen[1] if self._retry_seen[0] is engine else 0  # a new engine counts from 0
        if isinstance(seen, ray.ObjectRef):  # the run's engine's count when this worker began
            try:
                seen = int(ray.get(seen, timeout=30))
            except (ray.exceptions.RayError, TimeoutError):
                seen = 0
        self._retry_seen = (engine, now)
        return float(max(0, now - seen))

    def _engine_died(self, engine: Any, exc: BaseException, meta: BatchMeta, stats: dict[str, float]) -> None:
        """The engine died under a batch: its rows go back to the queue and the engine is restarted."""
        logger.warning("rollout %d: engine died (%s); releasing %d rows", self.worker_id, exc, len(meta))
        release_quietly(self.client, meta)  # a step cleared meanwhile has nothing left to generate
        self.slot.restart(engine)
        stats["engine_restarts"] += 1

    def _inflight_call(
        self, store: InflightCheckpoints, meta: BatchMeta, train_version: int | None, stats: dict[str, float]
    ) -> InflightCall:
        """The batch's checkpoint keys and the partials it resumes from (those fresh enough; the others counted)."""
        keys = row_keys(meta.group_ids, self.n)
        found = store.load(keys)
        resume: list[Partial | None] = []
        for key in keys:
            partial = found.get(key)
            if partial is not None and not fresh_enough(partial, train_version, self.max_staleness):
                logger.info("rollout %d: partial %s is too stale to resume; generating it again", self.worker_id, key)
                stats["stale_partials"] += 1
                stats["stale_partial_tokens"] += len(partial.token_ids)
                partial = None
            resume.append(partial)
        return InflightCall(
            self.client.controller_info, store.partition, keys, resume, train_version, self.max_staleness
        )

    def _responses(self, generations: list[list[Any]], version: int) -> dict[str, Any]:
        """The fields to write into the prompt rows (a plain dict: a put takes one, and it skips building a
        TensorDict of nested tensors, which costs milliseconds per batch)."""
        flat = [g for group in generations for g in group]
        fields = {
            "response_ids": jagged([g.token_ids for g in flat], torch.int64),
            "response_logprobs": jagged([g.logprobs for g in flat], torch.float32),
            "policy_version": torch.full((len(flat),), version, dtype=torch.int64),
            "finish_reason": [g.finish_reason for g in flat],
        }
        if self.spec.partial_rollout:
            # per token, the version that sampled it; the row's policy_version is its newest token's (the one it
            # finished on), the trainer masks older tokens with train.mask_offpolicy_in_partial_rollout
            per_token = [g.versions if g.versions is not None else [version] * len(g.token_ids) for g in flat]
            fields["response_versions"] = jagged(per_token, torch.int64)
            fields["policy_version"] = torch.tensor([max(v, default=version) for v in per_token], dtype=torch.int64)
        return fields


def check_groups(meta: BatchMeta, n: int) -> None:
    """Rows of a whole-groups meta come group by group; say so loudly if that ever breaks."""
    groups = meta.group_ids.reshape(-1, n)
    if not np.all(groups == groups[:, :1]):
        raise RuntimeError("rows of a whole-groups BatchMeta are not laid out group by group")
