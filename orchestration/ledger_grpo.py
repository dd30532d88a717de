"""GRPO from the ledger: a trainer step reads whole groups of trajectories from the queue (put there by samplers
through ``QueueSink``), keeps the rows whose ledger records it may still train on (rows with ``record_id < 0`` have
no record: a run taking its prompts from a ``PromptSource`` puts those) (``Ledger.mark_trained`` with
``max_trained_count`` / ``retrained_interval``, atomically, so no record is trained twice), and takes a step of the
configured policy loss (``LedgerTrainingConfig.loss``: GRPO's PPO-clip by default) on group-normalised advantages.
After the step it frees the rows it read (``clear_samples``), as the GRPO run clears its steps: the partition holds
only what is not yet trained.

    trainer = LedgerGRPOTrainer(policy, optimizer, client, ledger, partition_id="agentrl", batch_rows=128)
    metrics = trainer.step(step)           # then push the policy's weights to the engines
    metrics = trainer.step_on(step, rows)  # or a step on LedgerRows rebuilt from records (no queue)

``check_producers`` (a callable that raises when what fills the queue has failed, e.g. a ``SamplingScheduler``'s
``fatal_error``): the step's wait for rows checks it every ``check_every_s``, so that a failed producer ends the step
with its error rather than after the whole ``queue_timeout``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rl_contracts.rows import float_rows_of, rows_of
from trainers.advantages import group_advantages_by_id
from trainers.fsdp import token_logprobs
from trainers.losses import loss_named, policy_loss
from transfer_queue.errors import GetMetaTimeout
from workers.ledger.queue_sink import FIELDS
from workers.ledger.store import Ledger


@dataclass
class LedgerTrainingConfig:
    """The seed's filtering arguments that apply to records, and the step's shape."""

    batch_rows: int = 128  # rows per step: prompts per step x num_generations
    max_trained_count: int = 1  # a record is trained at most this often
    retrained_interval: int = 0  # and, when more than once, at least this many steps apart
    temperature: float = 1.0  # the sampling temperature (the old log-probs were taken at it)
    grad_clip: float = 1.0
    queue_timeout: float = 120.0
    check_every_s: float = 1.0  # how often a step's wait for rows calls the trainer's check_producers
    loss: str = "grpo"  # the policy loss: a key of trainers.losses.LOSSES, in any case (token-mean aggregated)

    def __post_init__(self) -> None:
        self.loss = loss_named(self.loss)  # ValueError naming the losses and the closest


@dataclass
class LedgerRows:
    """A step's rows: each row's ledger record (-1: none), GRPO group, reward, policy version and tokens; ``logprobs``
    (the sampler's, per response token) None when the rows were rebuilt from ledger records, which keep none, and a
    row's empty when it has none (a ``convert_record_to_data_func`` changed its tokens): the policy's own log-probs are
    then the old ones."""

    record_ids: list[int]
    group_ids: list[int]
    rewards: torch.Tensor
    policy_versions: torch.Tensor
    prompts: list[list[int]]
    responses: list[list[int]]
    logprobs: list[list[float]] | None = None


class LedgerGRPOTrainer:
    """One GRPO step at a time over the queue's partition ``partition_id`` (see the module docstring)."""

    def __init__(
        self,
        policy: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        client: Any,
        ledger: Ledger,
        partition_id: str,
        config: LedgerTrainingConfig,
        pad_token_id: int = 0,
        check_producers: Callable[[], None] | None = None,
    ):
        self.policy, self.optimizer, self.client, self.ledger = policy, optimizer, client, ledger
        self.partition_id, self.cfg, self.pad_token_id = partition_id, config, pad_token_id
        self.check_producers = check_producers
        self.rows_consumed = 0
        self.rows_cleared = 0  # rows this trainer freed from the queue after their step

    def step(self, step: int, before_train: Callable[[], Any] | None = None) -> dict[str, float]:
        """One step on the next ``batch_rows`` rows of the queue; ``before_train`` is called once they are read,
        before the step's forward (a colocated run frees its inference servers' memory there: the rows it waits for
        are sampled by then)."""
        t0 = time.perf_counter()
        meta = self._wait_for_rows()
        data = self.client.get_data(meta)
        self.rows_consumed += len(meta)
        wait_s = time.perf_counter() - t0
        rows = LedgerRows(
            record_ids=data["record_id"].tolist(),
            group_ids=[int(g) for g in meta.group_ids],
            rewards=data["reward"].float(),
            policy_versions=data["policy_version"].float(),
            prompts=rows_of(data["prompt_ids"]),
            responses=rows_of(data["response_ids"]),
            logprobs=float_rows_of(data["response_logprobs"]),
        )
        if before_train is not None:
            before_train()
        metrics = self._train(step, rows, wait_s)
        # the rows are trained (or not trainable any more): free them, or the partition grows until QueueFull
        self.client.clear_samples(meta)
        self.rows_cleared += len(meta)
        metrics["step_s"] = time.perf_counter() - t0
        return metrics

    def _wait_for_rows(self) -> Any:
        """The meta of a step's ``batch_rows`` rows, waited for up to ``queue_timeout``; with ``check_producers``, in
        waits of ``check_every_s``, each after a check (which raises what the producer failed with).

        Raises:
            GetMetaTimeout: no full batch within ``queue_timeout``.
        """
        cfg = self.cfg
        deadline = time.monotonic() + cfg.queue_timeout
        while True:
            wait = cfg.queue_timeout
            if self.check_producers is not None:
                self.check_producers()
                wait = max(min(cfg.check_every_s, deadline - time.monotonic()), 0.01)
            try:
                return self.client.get_meta(
                    list(FIELDS), cfg.batch_rows, partition_id=self.partition_id, task_name="grpo", timeout=wait
                )
            except GetMetaTimeout as exc:
                if self.check_producers is None:
                    raise
                if time.monotonic() >= deadline:
                    raise GetMetaTimeout(
                        f"the trainer waited queue_timeout={cfg.queue_timeout} s for {cfg.batch_rows} rows of "
                        f"partition {self.partition_id!r}: {exc}"
                    ) from exc

    def step_on(self, step: int, rows: LedgerRows) -> dict[str, float]:
        """A step on ``rows`` rebuilt from ledger records rather than read from the queue (a run that samples
        nothing trains the records a ledger already holds); rows without ``logprobs`` take the policy's own log-probs
        as the old ones (the ledger keeps none), so the step's ratio starts at 1."""
        t0 = time.perf_counter()
        metrics = self._train(step, rows, 0.0)
        metrics["step_s"] = time.perf_counter() - t0
        return metrics

    def _train(self, step: int, data: LedgerRows, wait_s: float) -> dict[str, float]:
        """Mark the rows' records trained at ``step`` (those still trainable) and take a step on those rows."""
        cfg = self.cfg
        record_ids = data.record_ids
        # rows without a ledger record (record_id < 0: prompts from a PromptSource) are trained as they come
        in_ledger = [rid for rid in record_ids if rid >= 0]
        kept = set(self.ledger.mark_trained(in_ledger, step, cfg.max_trained_count, cfg.retrained_interval))
        rows = [i for i, rid in enumerate(record_ids) if rid < 0 or rid in kept]
        metrics: dict[str, float] = {
            "step": step,
            "rows": len(record_ids),
            "rows_trained": len(rows),
            "reward": data.rewards.mean().item(),
            "staleness": float(step - data.policy_versions.mean().item()),
            "wait_s": wait_s,
        }
        if rows:
            group_ids = torch.tensor(data.group_ids, dtype=torch.int64)[rows]
            advantages = group_advantages_by_id(data.rewards[rows], group_ids)
            prompts, responses = [data.prompts[i] for i in rows], [data.responses[i] for i in rows]
            sampled = [None] * len(rows) if data.logprobs is None else [data.logprobs[i] or None for i in rows]
            logprobs = [lp if lp is not None else [0.0] * len(r) for lp, r in zip(sampled, responses, strict=True)]
            batch = self._batch(prompts, responses, logprobs)
            missing = [j for j, lp in enumerate(sampled) if lp is None]
            if missing:  # rows without the sampler's log-probs: the policy's own are the old ones (ratio 1)
                part = {key: value[missing] for key, value in batch.items()}
                with torch.no_grad():
                    batch["old_logprobs"][missing] = self._logprobs(part) * part["response_mask"]
            loss = self._loss(batch, advantages)
            self.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.grad_clip)
            self.optimizer.step()
            metrics["loss"] = loss.item()
        return metrics

    def _batch(self, prompts: list[list[int]], responses: list[list[int]], logprobs: list[list[float]]) -> dict:
        """Right-padded prompt+response rows, old log-probs aligned with ``input_ids``."""
        length = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
        ids, attention, mask, old = [], [], [], []
        for p, r, lp in zip(prompts, responses, logprobs, strict=True):
            pad = length - len(p) - len(r)
            ids.append(p + r + [self.pad_token_id] * pad)
            attention.append([1] * (length - pad) + [0] * pad)
            mask.append([0.0] * len(p) + [1.0] * len(r) + [0.0] * pad)
            old.append([0.0] * len(p) + lp + [0.0] * pad)
        return {
            "input_ids": torch.tensor(ids),
            "attention_mask": torch.tensor(attention),
            "response_mask": torch.tensor(mask),
            "old_logprobs": torch.tensor(old),
        }

    def _logprobs(self, batch: dict) -> torch.Tensor:
        """The policy's log-probs of ``input_ids`` at the sampling temperature, aligned with them (position 0: 0)."""
        logits = self.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return token_logprobs(logits, batch["input_ids"], batch["attention_mask"], self.cfg.temperature)

    def _loss(self, batch: dict, advantages: torch.Tensor) -> torch.Tensor:
        logprobs, old, mask = self._logprobs(batch), batch["old_logprobs"], batch["response_mask"]
        loss, _ = policy_loss(self.cfg.loss, logprobs, old, advantages, mask, loss_agg="token-mean")
        return loss
