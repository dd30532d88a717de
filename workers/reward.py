"""Reward workers: score responses as they land in the queue and write ``reward`` back into their rows.

A reward function is pure: ``fn(response_text, **fields) -> float`` where ``fields`` are the task's reward fields
of the row (e.g. ``answer``). The task's own ``reward`` is the default; ``reward_fn="module:function"`` replaces it.
A function that raises marks that sample failed (``reward_failed``, reward 0) and logs why; the run goes on, and
the trainer leaves failed samples out of advantages and loss. A reward that is NaN or +-inf is rejected here, at the
reward worker, as a :class:`NonFiniteReward` naming the sample: it is marked failed and counted (``non_finite``),
never written into the queue where it would turn a whole group's advantages into NaN.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from rl_contracts.lost_rows import WORKER_TASK_OPTIONS, served_batches, write_or_release
from rl_contracts.queue_clock import QueueClock
from rl_contracts.rows import rows_of
from rl_contracts.stages import REDO_CONCURRENCY, REDO_GROUP, REWARD_TASK
from rl_contracts.task import Task, load_reward_fn, load_task
from transfer_queue import ControllerInfo, TransferQueueClient

logger = logging.getLogger(__name__)


class NonFiniteReward(ValueError):
    """A reward function returned NaN or +-inf for a sample; the message names the sample and the value."""


@dataclass
class Scores:
    """What :func:`score_responses` found: one reward and failure flag per response, and why samples failed."""

    rewards: list[float] = field(default_factory=list)
    failed: list[bool] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    non_finite: int = 0  # how many of the failures were NaN / inf rewards


def score_responses(
    reward_fn: Callable[..., float],
    texts: Sequence[str],
    fields: dict[str, Sequence[Any]],
    sample_ids: Sequence[int] | None = None,
) -> Scores:
    """Rewards, failure flags and failure messages for decoded responses (pure).

    Args:
        reward_fn: ``fn(text, **fields) -> float``.
        texts: the decoded responses.
        fields: the task's reward fields, one column per name.
        sample_ids: the samples' ids for messages (the queue's ``global_index``); positions when None.

    A function that raises, or returns NaN / +-inf (:class:`NonFiniteReward`), fails that sample only.
    """
    outcomes: list[Any] = []
    for i, text in enumerate(texts):
        try:
            outcomes.append(reward_fn(text, **{name: column[i] for name, column in fields.items()}))
        except Exception as exc:  # a user function's bug must not stop the run: mark the sample, log it
            outcomes.append(exc)
    return scores_of(outcomes, sample_ids)


def score_task(
    task: Task, texts: Sequence[str], fields: dict[str, Sequence[Any]], sample_ids: Sequence[int] | None = None
) -> Scores:
    """:func:`score_responses` with the task's own batch scoring (:meth:`~rl_contracts.task.Task.rewards`): a task
    may score a batch in one call. A ``rewards`` that raises, or returns another number of scores than responses,
    fails the whole batch."""
    try:
        outcomes: list[Any] = list(task.rewards(list(texts), **{name: list(column) for name, column in fields.items()}))
        if len(outcomes) != len(texts):
            raise ValueError(
                f"{type(task).__name__}.rewards returned {len(outcomes)} scores for {len(texts)} responses"
            )
    except Exception as exc:
        outcomes = [exc] * len(texts)
    return scores_of(outcomes, sample_ids)


def scores_of(outcomes: Sequence[Any], sample_ids: Sequence[int] | None = None) -> Scores:
    """Scores from each response's reward or the exception its reward raised: an exception, or a value that is not a
    finite number, fails its sample."""
    ids = list(range(len(outcomes))) if sample_ids is None else list(sample_ids)
    out = Scores()
    for i, outcome in enumerate(outcomes):
        try:
            if isinstance(outcome, Exception):
                raise outcome
            value = float(outcome)
            if not math.isfinite(value):
                out.non_finite += 1
                raise NonFiniteReward(f"sample global_index={ids[i]}: the reward function returned {value}")
            out.rewards.append(value)
            out.failed.append(False)
        except Exception as exc:
            out.rewards.append(0.0)
            out.failed.append(True)
            out.errors.append(f"{type(exc).__name__}: {exc}")
    return out


@ray.remote(concurrency_groups={"score": 1, REDO_GROUP: REDO_CONCURRENCY, "control": 1})  # type: ignore[call-overload]  # Ray's overloads omit it
class RewardWorker:
    """Scores the responses of global steps.

    Args:
        worker_id: a name for logs.
        controller_info: the queue.
        task_name, task_kwargs: the task (its tokenizer decodes responses; its ``reward`` is the default).
        reward_fn: ``"module:function"`` replacing the task's reward.
        n_samples: the queue's group size (whole groups are scored together).
        groups_per_request: groups taken from the queue at a time.
    """

    def __init__(
        self,
        worker_id: int,
        controller_info: ControllerInfo,
        task_name: str,
        task_kwargs: dict[str, Any],
        reward_fn: str | None,
        n_samples: int,
        groups_per_request: int,
        timeout: float = 300.0,
    ):
        self.worker_id = worker_id
        self.client = TransferQueueClient(f"reward-{worker_id}", controller_info)
        # rows are done once their rewards are written: a worker killed mid-batch hands them back (lost_rows.py)
        self.client.set_task_options(REWARD_TASK, **WORKER_TASK_OPTIONS)
        self.n = n_samples
        self.task: Task = load_task(task_name, task_kwargs)
        self.reward_fn = load_reward_fn(reward_fn) if reward_fn else None  # None: the task's own rewards
        self.batch_rows = groups_per_request * n_samples
        self.timeout = timeout

    @ray.method(concurrency_group="control")
    def queue_owner(self) -> str:
        """Its queue client's owner (the supervisor tells the controller when this worker died)."""
        return str(self.client.owner)

    def pid(self) -> int:
        """This worker's process id (a restarted worker has a new one: the run's supervisor counts restarts by it)."""
        return os.getpid()

    @ray.method(concurrency_group="score")
    def score_step(self, step: int) -> dict[str, float]:
        fields = ["response_ids", *self.task.reward_fields]
        stats = {"rows": 0.0, "reward_s": 0.0, "failed": 0.0, "non_finite": 0.0}
        clock = QueueClock()
        batches = served_batches(
            self.client, clock, fields, self.batch_rows, step=step, task_name=REWARD_TASK, timeout=self.timeout
        )
        for meta, data in batches:
            stats.setdefault("started_at", time.time())  # wall clock: the run's trace (orchestration) draws the span
            t1 = time.perf_counter()
            texts = [self.task.decode(ids) for ids in rows_of(data["response_ids"])]
            columns = {name: data.get(name).tolist() for name in self.task.reward_fields}
            ids = meta.global_indexes.tolist()
            if self.reward_fn is not None:
                scores = score_responses(self.reward_fn, texts, columns, sample_ids=ids)
            else:
                scores = score_task(self.task, texts, columns, sample_ids=ids)
            for message in scores.errors[:3]:
                logger.warning("reward worker %d: a reward function failed: %s", self.worker_id, message)
            stats["reward_s"] += time.perf_counter() - t1
            scored = {
                "reward": torch.tensor(scores.rewards, dtype=torch.float32),
                "reward_failed": torch.tensor(scores.failed, dtype=torch.bool),
            }
            written = clock.call(write_or_release, self.client, scored, meta, self.n)
            if not written:  # lost meanwhile, or scored already by a worker that died before its ack
                continue
            stats["rows"] += written
            stats["failed"] += sum(scores.failed)
            stats["non_finite"] += scores.non_finite
        return {**stats, **clock.stats(), "ended_at": time.time()}
