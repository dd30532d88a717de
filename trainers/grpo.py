"""The GRPO trainer: FSDP2 ranks as Ray actors that stream complete groups from the queue and step.

Policy versions count trained global steps: the weights after training step ``s`` are version ``s + 1``, and a
sample's staleness is the trainer's version at the start of the step minus the version that generated it.

Each global step is ``minibatches_per_step`` DP rounds: in round ``k`` every rank asks the queue for its share
(``dp_group_id = f"train/{step}/{k}"``, whole groups only), builds the training batch (:func:`build_train_batch`:
group-normalised advantages, staleness and failed-sample masks, filters), and takes ``ppo_epochs`` optimizer steps
on it together with the other ranks (:func:`train_epochs`). With ``train.tp_size > 1`` the ranks form TP groups of
``tp_size`` consecutive ranks, each group one DP rank (``dp_rank = rank // tp_size`` of ``world_size // tp_size``):
every rank of a group asks for its group's share and gets the same rows. The same code runs with gloo on CPU and
NCCL on GPU.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist
from tensordict import TensorDict

from rl_contracts.images import IMAGE_REFS, ImageSource, image_counts, image_refs_of, rows_pixel_values
from rl_contracts.lost_rows import read_or_none, release_quietly
from rl_contracts.partial import mask_offpolicy_tokens
from rl_contracts.prompts import prompts_checksum, sft_step_batch
from rl_contracts.queue_clock import QueueClock
from rl_contracts.rows import float_rows_of, rows_of
from rl_contracts.stages import TRAIN_TASK
from rl_contracts.task import Task
from rl_contracts.trajectories import TRAJECTORY_FIELDS, split_trajectories
from rl_contracts.weight_channel import WeightChannel
from trainers.advantages import group_advantages_by_id
from trainers.checkpoint import queue_stage
from trainers.config import TrainerConfig
from trainers.filters import apply_filters
from trainers.fsdp import (
    IMAGE_COUNTS,
    PIXEL_VALUES,
    AdamWConfig,
    FSDPPolicy,
    LossFn,
    all_gather_single,
    init_process_group,
)
from trainers.losses import policy_loss
from trainers.rollout_correction import rollout_correction
from transfer_queue import ControllerInfo, TransferQueueClient

TRAIN_FIELDS = ["prompt_ids", "response_ids", "response_logprobs", "policy_version", "reward", "reward_failed"]
PARTIAL_FIELDS = ["response_versions"]  # with rollout.partial_rollout: the version of each response token
IMAGE_FIELDS = [IMAGE_REFS]  # with a vision task (Task.image_source()): each row's image blob keys


@dataclass
class TrainBatch:
    tensors: dict[str, torch.Tensor]
    stats: dict[str, float]


def pad_sequences(prompts: list[list[int]], responses: list[list[int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``response_mask`` ``[B, T]`` for prompt + response, right-padded."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(lengths, default=1)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    response_mask = torch.zeros((len(prompts), width), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.int64)
        attention_mask[i, : len(p) + len(r)] = 1
        response_mask[i, len(p) : len(p) + len(r)] = 1.0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}


def aligned_versions(prompts: list[list[int]], versions: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """Per-token sampling versions ``[B, T]`` aligned with the response mask (partial rollouts)."""
    out = torch.zeros(like.shape, dtype=torch.int64)
    for i, (p, v) in enumerate(zip(prompts, versions, strict=True)):
        out[i, len(p) : len(p) + len(v)] = torch.tensor(v, dtype=torch.int64)
    return out


def build_train_batch(
    data: TensorDict,
    group_ids: np.ndarray,
    *,
    pad_token_id: int,
    trainer_version: int,
    max_staleness: int,
    config: TrainerConfig,
    images: ImageSource | None = None,
) -> TrainBatch:
    """The training tensors of one rank's share (whole groups), aligned as in ``docs/rl-conventions.md``.

    Samples whose reward function failed, or that are staler than ``max_staleness`` policy versions, are left
    out of their group's advantage statistics and of the loss (their ``response_mask`` is zeroed); so are rows
    dropped by the configured filters.

    Rows with ``image_refs`` (``rl_contracts.images``: blob keys, not pixels) get ``pixel_values``
    (``[B, K, 3, H, W]``, ``trainers.fsdp.PIXEL_VALUES``, ``K`` the most images a row holds) and ``image_counts``
    (``[B]``, ``trainers.fsdp.IMAGE_COUNTS``: rows may hold different numbers, 0 included) resolved through
    ``images`` here, each distinct image once; ``ImagesUnavailable`` without a source, ``UnevenImages`` for
    references that are not a list of keys per row.
    """
    config = expect_trainer_config(config)
    response_loss_masks = None
    if "tokens" in data.keys():  # noqa: SIM118 (a TensorDict has no `in`)
        # Multi-turn trajectories (workers/agents): jagged tokens/loss_mask/logprobs. The response mask is built
        # from loss_mask here, in this one place, so environment tokens (mask 0) never reach the loss or the KL.
        prompts, responses, sampled_logprobs, response_loss_masks = split_trajectories(
            rows_of(data["tokens"]), float_rows_of(data["loss_mask"]), float_rows_of(data["logprobs"])
        )
    else:
        prompts, responses = rows_of(data["prompt_ids"]), rows_of(data["response_ids"])
        sampled_logprobs = float_rows_of(data["response_logprobs"])
    tensors = pad_sequences(prompts, responses, pad_token_id)
    for i, (p, m) in enumerate(zip(prompts, response_loss_masks or (), strict=False)):
        tensors["response_mask"][i, len(p) : len(p) + len(m)] = torch.tensor(m, dtype=torch.float32)
    rollout_logprobs = torch.zeros_like(tensors["response_mask"])
    for i, (p, lps) in enumerate(zip(prompts, sampled_logprobs, strict=True)):
        rollout_logprobs[i, len(p) : len(p) + len(lps)] = torch.tensor(lps, dtype=torch.float32)
    # the engine's log-probs; the old (proximal) policy too unless the trainer recomputes it (see train_step)
    tensors["rollout_logprobs"] = rollout_logprobs
    tensors["old_logprobs"] = rollout_logprobs.clone()
    if IMAGE_REFS in data.keys():  # noqa: SIM118
        refs = image_refs_of(data[IMAGE_REFS])
        pixels = rows_pixel_values(refs, images)
        if pixels is not None:
            tensors[PIXEL_VALUES], tensors[IMAGE_COUNTS] = pixels, image_counts(refs)

    rewards = data["reward"].to(torch.float32).reshape(-1)
    # a non-finite reward never passes the reward worker; should one arrive anyway it counts as a failure
    failed = data["reward_failed"].to(torch.bool).reshape(-1) | ~torch.isfinite(rewards)
    rewards = torch.where(failed, torch.zeros_like(rewards), rewards)
    staleness = trainer_version - data["policy_version"].to(torch.int64).reshape(-1)
    valid = ~failed & (staleness <= max_staleness)
    groups = torch.tensor(np.asarray(group_ids), dtype=torch.int64)
    advantages = torch.zeros_like(rewards)
    if valid.any():
        advantages[valid] = group_advantages_by_id(
            rewards[valid], groups[valid], normalize_std=config.train.normalize_advantage_std
        )
    keep = valid & apply_filters(
        config.train.filters, advantages=advantages, rewards=rewards, group_size=config.n_samples, valid=valid
    )
    tensors["advantages"] = advantages
    tensors["response_mask"] = tensors["response_mask"] * keep.to(torch.float32).unsqueeze(1)
    if config.train.mask_offpolicy_in_partial_rollout and "response_versions" in data.keys():  # noqa: SIM118
        tensors["response_mask"] = mask_offpolicy_tokens(
            tensors["response_mask"],
            aligned_versions(prompts, rows_of(data["response_versions"]), tensors["response_mask"]),
            trainer_version,
            max_staleness,
        )
    response_lengths = torch.tensor([len(r) for r in responses], dtype=torch.float32)
    trained_tokens = tensors["response_mask"].sum(dim=1)
    stats = {
        "rows": float(len(rewards)),
        "reward_sum": float(rewards[~failed].sum()),
        "correct_sum": float((rewards[~failed] >= 1.0).sum()),
        "scored_rows": float((~failed).sum()),
        "failed_rows": float(failed.sum()),
        "stale_rows": float((staleness > max_staleness).sum()),
        "trained_rows": float(keep.sum()),
        "staleness_sum": float(staleness.to(torch.float32).sum()),
        "staleness_max": float(staleness.max()) if len(staleness) else 0.0,
        "response_len_sum": float(response_lengths.sum()),
        "trained_tokens": float(trained_tokens.sum()),
        # -log mu of the sampled tokens: an unbiased estimate of the sampling policy's entropy per token
        "neg_logprob_sum": float(-(rollout_logprobs * (tensors["response_mask"] > 0)).sum()),
        "token_staleness_sum": float((trained_tokens * staleness.to(torch.float32)).sum()),
    }
    return TrainBatch(tensors, stats)


def take_groups(tensors: dict[str, torch.Tensor], group_ids: np.ndarray, quota: int) -> tuple[np.ndarray, int]:
    """Rows of the first ``quota`` groups that still have something to train on (a row with a non-zero
    ``response_mask``, i.e. not dropped by the filters, the staleness bound or a failed reward), whole groups only.

    Returns (row positions in order, number of groups taken). Over-sampling with dynamic filtering: the groups
    left out never reach the forward pass.
    """
    trainable = (tensors["response_mask"] > 0).any(dim=1).numpy()
    ids = np.asarray(group_ids)
    groups, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    has_rows = np.bincount(inverse.reshape(-1), weights=trainable, minlength=len(groups)) > 0
    in_order = np.argsort(first)  # groups in the order the batch holds them
    kept = groups[in_order][has_rows[in_order]][:quota]
    return np.flatnonzero(np.isin(ids, kept)), len(kept)


def pad_rows(tensors: dict[str, torch.Tensor], rows: np.ndarray, total: int) -> dict[str, torch.Tensor]:
    """``rows`` of every tensor, then filler rows up to ``total`` (other rows of the batch, masked out of the loss):
    every FSDP rank must run the same number of micro-batches, whatever its filters kept."""
    num_rows = next(iter(tensors.values())).shape[0]
    if total > num_rows:
        raise ValueError(f"cannot fill {total} rows from a batch of {num_rows}")
    fill = np.setdiff1d(np.arange(num_rows), rows)[: total - len(rows)]
    index = torch.from_numpy(np.concatenate([rows, fill]))
    out = {name: value[index] for name, value in tensors.items()}
    out["response_mask"][len(rows) :] = 0.0
    return out


def expect_trainer_config(config: object) -> TrainerConfig:
    """``config`` itself if it is a :class:`TrainerConfig`, else a TypeError naming what the trainer takes and what
    arrived (a run's whole config is not one: ``TrainerConfig.from_run`` takes the trainer's part of it)."""
    if not isinstance(config, TrainerConfig):
        kind = type(config)
        raise TypeError(
            "the trainer takes a trainers.config.TrainerConfig (TrainerConfig.from_run(config) builds one from a "
            f"run's config), got {kind.__module__}.{kind.__qualname__}"
        )
    return config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@ray.remote
class GRPOTrainerRank:
    """One FSDP2 rank of the trainer. Call :meth:`setup` on every rank at once (it joins the process group).

    ``task`` is the run's task object (starting policy, tokenizer, SFT prompts and targets), built by the run's
    orchestration from ``task.name``: the trainer never resolves a task name itself.
    """

    def __init__(self, rank: int, world_size: int, controller_info: ControllerInfo, config: TrainerConfig, task: Task):
        self.rank = rank
        self.world_size = world_size
        self.config = expect_trainer_config(config)
        # train.tp_size consecutive ranks form a TP group that trains on one DP share: they read the same rows (the
        # queue serves a DP round's share to every caller of its dp_rank)
        self.tp_size = self.config.train.tp_size
        self.dp_size = world_size // self.tp_size
        self.dp_rank = rank // self.tp_size
        self.client = TransferQueueClient(f"trainer-{rank}", controller_info)
        # a batch is done once the optimizer stepped on it: a rank that dies mid-step gets its rows redelivered
        self.client.set_task_options(TRAIN_TASK, ack="explicit")
        self.task = task
        # a vision task's rows carry image references; the trainer resolves them to pixels (None: a text task)
        self.images = task.image_source() if task is not None else None
        self.version = 0
        self._channels: dict[tuple[str, bool], WeightChannel] = {}  # publish_weights' channels, by path
        self.policy: FSDPPolicy | None = None
        self.reference: FSDPPolicy | None = None
        self._sft_prompts: list[dict[str, Any]] | None = None

    def pid(self) -> int:
        """This rank's process id (a test kills it: orchestration/trainer_restarts.py)."""
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """Where rank 0 hosts the process group's store: this node's address and a free port."""
        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> int:
        cfg = self.config
        torch.manual_seed(cfg.seed)
        device = init_process_group(self.rank, self.world_size, master_addr, master_port, cfg.train.backend)
        loss_agg = cfg.train.loss_agg or _default_loss_agg(cfg.train.loss)
        self.policy = FSDPPolicy(
            self.task.build_policy(),
            device=device,
            optimizer=rl_adamw(cfg),
            grad_clip=cfg.train.grad_clip,
            micro_batch_size=cfg.train.micro_batch_size,
            loss_weighting="tokens" if loss_agg == "token-mean" else "rows",
            min_layer_params=cfg.train.fsdp_min_layer_params,
            gradient_checkpointing=cfg.train.gradient_checkpointing,
            dynamic_batching=cfg.train.dynamic_batching,
            max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
            loss_seq_chunk_size=cfg.train.loss_seq_chunk_size,
            activation_offloading=cfg.train.activation_offloading,
            tp_size=cfg.train.tp_size,
        )
        return self.rank

    # ---- RL ------------------------------------------------------------------------------------------------
    def init_reference(self, path: str | None = None) -> None:
        """The frozen KL reference policy: the weights of the checkpoint at ``path`` (a resumed run's original
        reference, saved by :meth:`save_reference`), or else a copy of the current weights (after SFT, before
        RL). It has no optimizer and no gradients."""
        assert self.policy is not None
        model = self.task.build_policy()
        if path is None:
            state = self.policy.full_state_dict()
            if self.rank == 0:
                model.load_state_dict(state)
        self.reference = FSDPPolicy(
            model,
            device=self.policy.device,
            micro_batch_size=self.config.train.micro_batch_size,
            trainable=False,
            sync_module_states=path is None,
            min_layer_params=self.config.train.fsdp_min_layer_params,
            dynamic_batching=self.config.train.dynamic_batching,
            max_tokens_per_micro_batch=self.config.train.max_tokens_per_micro_batch,
            loss_seq_chunk_size=self.config.train.loss_seq_chunk_size,
            tp_size=self.config.train.tp_size,
        )
        if path is not None:
            self.reference.load_weights(path)

    def save_reference(self, path: str) -> None:
        """Write the reference policy's weights (a collective) so a resumed run keeps the same reference."""
        assert self.reference is not None, "init_reference first"
        self.reference.save_checkpoint(path, {"reference": True}, overwrite=True)

    def train_step(self, step: int) -> dict[str, float]:
        """Train on global step ``step``: ``minibatches_per_step`` DP rounds, ``ppo_epochs`` optimizer steps each."""
        assert self.policy is not None
        cfg = self.config
        rounds, epochs = cfg.train.minibatches_per_step, cfg.train.ppo_epochs
        rows = cfg.prompts_per_step * cfg.n_samples // (self.dp_size * rounds)
        totals: dict[str, float] = {}
        train_metrics: list[dict[str, float]] = []
        clock, train_s = QueueClock(), 0.0
        version = self.version  # the engines' version when this step's samples are on-policy
        for k in range(rounds):
            meta, data = self._read_round(step, k, rows, clock)
            t1 = time.perf_counter()
            # a step longer than the lease keeps its rows: the heartbeat extends the lease until the ack
            with self.client.keep_leased(meta):
                if "prompt_ids" in data.keys():  # noqa: SIM118 (the prompts trained on: a resume is checked by it)
                    totals_add(totals, {"prompts_crc_sum": float(prompts_checksum(rows_of(data["prompt_ids"])))})
                batch = build_train_batch(
                    data,
                    meta.group_ids,
                    pad_token_id=self.task.tokenizer.pad_token_id,
                    trainer_version=version,
                    max_staleness=cfg.max_staleness,
                    config=cfg,
                    images=self.images,
                )
                if cfg.train.max_train_groups is not None:
                    quota = cfg.train.max_train_groups // (self.dp_size * rounds)
                    rows_taken, groups_taken = take_groups(batch.tensors, meta.group_ids, quota)
                    width = int(_global_max(len(rows_taken), self.policy.device))
                    batch.tensors = pad_rows(batch.tensors, rows_taken, width)
                    batch.stats["trained_rows"] = float((batch.tensors["response_mask"] > 0).any(dim=1).sum())
                    batch.stats["trained_groups"] = float(groups_taken)
                totals_add(totals, batch.stats)
                t = batch.tensors
                if cfg.recompute_old_logprobs:
                    totals_add(totals, self._recompute_old_logprobs(t))
                if self.reference is not None:
                    t["ref_logprobs"] = self.reference.compute_logprobs(
                        t["input_ids"],
                        t["attention_mask"],
                        temperature=logprob_temperature(cfg.temperature),
                        pixel_values=t.get(PIXEL_VALUES),
                        image_counts=t.get(IMAGE_COUNTS),
                    )
                if _global_sum(batch.stats["trained_rows"], self.policy.device) > 0:
                    lrs = [self._rl_lr(rl_optimizer_step(version, k, e, rounds, epochs)) for e in range(epochs)]
                    # the engine's log-probs are at the rollout temperature: the policy's must be too, or the ratio
                    # is off from the first step
                    train_metrics += train_epochs(
                        self.policy, t, self._loss_fn, lrs=lrs, temperature=logprob_temperature(cfg.temperature)
                    )
            self.client.ack(meta)  # after the optimizer step (explicit acks: get_data left the rows leased)
            train_s += time.perf_counter() - t1
        self.version = version + 1
        out = _reduce_stats(totals, self.policy.device, self.tp_size)
        for name in train_metrics[0] if train_metrics else ():
            out[name] = float(np.mean([m[name] for m in train_metrics]))
        out.update(
            **clock.stats(),
            train_s=train_s,
            policy_version=float(self.version),
            optimizer_steps=len(train_metrics),
        )
        return out

    def _read_round(self, step: int, k: int, rows: int, clock: QueueClock) -> tuple[Any, Any]:
        """This rank's share of DP round ``k`` of ``step`` and its data. When a rank cannot read its share (a storage
        unit died: rows lost or down), every rank hands its share back and the round is asked again under a new id,
        so the ranks stay in step (lost rows come back as new rows, put again by the driver)."""
        cfg = self.config
        fields = (
            TRAJECTORY_FIELDS if cfg.trajectories else TRAIN_FIELDS + (PARTIAL_FIELDS if cfg.partial_rollout else [])
        ) + (IMAGE_FIELDS if self.images is not None else [])
        for attempt in itertools.count():
            round_id = f"train/{step}/{k}" + (f"/again{attempt}" if attempt else "")
            meta = clock.call(
                self.client.get_meta,
                fields,
                rows,
                global_step=step,
                task_name=TRAIN_TASK,
                sampler_params={"dp_rank": self.dp_rank, "dp_size": self.dp_size, "dp_group_id": round_id},
                get_n_samples=True,
                timeout=cfg.queue_timeout,
            )
            data = clock.call(read_or_none, self.client, meta, release=False)
            assert self.policy is not None
            if _global_sum(float(data is None), self.policy.device) == 0:
                return meta, data
            release_quietly(self.client, meta)
        raise AssertionError("unreachable")

    def _rl_lr(self, optimizer_step: int) -> float:
        """The RL learning rate of optimizer step ``optimizer_step`` (0-based, counted from the start of RL, see
        :func:`rl_optimizer_step`): a linear warm-up over ``train.lr_warmup_steps`` steps, then ``train.lr``."""
        return self.config.train.lr * warmup_factor(optimizer_step, self.config.train.lr_warmup_steps)

    def _recompute_old_logprobs(self, t: dict[str, torch.Tensor]) -> dict[str, float]:
        """Replace ``old_logprobs`` with the training model's, weight tokens by the rollout correction, and return
        the mismatch metrics as sums over this rank's response tokens."""
        assert self.policy is not None
        cfg = self.config
        old = self.policy.compute_logprobs(
            t["input_ids"],
            t["attention_mask"],
            temperature=logprob_temperature(cfg.temperature),
            pixel_values=t.get(PIXEL_VALUES),
            image_counts=t.get(IMAGE_COUNTS),
        )
        t["old_logprobs"] = old * t["attention_mask"].to(old.dtype)
        weights, metrics = rollout_correction(
            t["old_logprobs"],
            t["rollout_logprobs"],
            t["response_mask"],
            cfg.train.rollout_correction,
            high=cfg.train.rollout_is_high,
            low=cfg.train.rollout_is_low,
        )
        t["is_weights"] = weights
        tokens = float((t["response_mask"] > 0).sum())
        return {f"{name}_sum": value * tokens for name, value in metrics.items()} | {"mismatch_tokens": tokens}

    def _loss_fn(self, *, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        t = self.config.train
        knobs = {
            name: value
            for name, value in (("clip_low", t.clip_low), ("clip_high", t.clip_high), ("loss_agg", t.loss_agg))
            if value is not None
        }
        return policy_loss(
            t.loss,
            logprobs,
            batch["old_logprobs"],
            batch["advantages"],
            batch["response_mask"],
            ref_logprobs=batch.get("ref_logprobs"),
            token_weights=batch.get("is_weights"),
            kl_coef=t.kl_coef,
            kl_kind=t.kl_kind,
            **knobs,
        )

    # ---- SFT -----------------------------------------------------------------------------------------------
    def sft_steps(self, first_step: int, num_steps: int, lr: float, batch_size: int) -> dict[str, float]:
        """``num_steps`` supervised steps on the task's reference responses; this rank takes its share of rows."""
        assert self.policy is not None
        optimizer = self.policy.require_optimizer("sft_steps")
        for group in optimizer.param_groups:
            group["lr"] = lr
        if self._sft_prompts is None:  # built once: a large split takes a while to draw
            self._sft_prompts = self.task.prompts("train", self.config.num_train_prompts, self.config.task_seed)
        prompts = self._sft_prompts
        per_rank = batch_size // self.dp_size  # the ranks of a TP group take the same rows
        losses = []
        for step in range(first_step, first_step + num_steps):
            batch = sft_step_batch(prompts, self.config.seed, step, batch_size)
            batch = batch[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
            targets = [self.task.sft_target(p) for p in batch]
            tensors = pad_sequences([p["prompt_ids"] for p in batch], targets, self.task.tokenizer.pad_token_id)
            losses.append(self.policy.train_step(tensors, _nll_loss)["loss"])
        for group in optimizer.param_groups:
            group["lr"] = self.config.train.lr
        return {"sft_loss": float(np.mean(losses))}

    def reset_optimizer(self) -> None:
        """A fresh optimizer state (between SFT and RL, which use different learning rates)."""
        assert self.policy is not None
        self.policy.require_optimizer("reset_optimizer").state.clear()

    # ---- weights and checkpoints ---------------------------------------------------------------------------
    def weights(self) -> list[Any] | None:
        """A collective: rank 0 returns ``[ObjectRef]`` of the full state dict (in the object store), others None."""
        assert self.policy is not None
        state = self.policy.full_state_dict()
        return [ray.put(state)] if self.rank == 0 else None

    def publish_weights(self, channel_path: str, delta: bool = False) -> float:
        """A collective: gather the full weights; rank 0 writes them to the weight channel at ``channel_path`` as
        this rank's policy version (``delta``: marking the chunks that changed, see ``WeightChannel``). Returns the
        seconds it took."""
        assert self.policy is not None
        started = time.perf_counter()
        state = self.policy.full_state_dict()
        if self.rank == 0:
            channel = self._channels.get((channel_path, delta))
            if channel is None:  # kept: its files stay mapped between publishes
                channel = self._channels[(channel_path, delta)] = WeightChannel(channel_path, delta=delta)
            channel.write(self.version, state)
        return time.perf_counter() - started

    def save_hf(self, path: str) -> None:
        assert self.policy is not None
        self.policy.save_hf_pretrained(path)

    def save_checkpoint(
        self, path: str, extra_state: dict[str, Any], overwrite: bool = False, queue_dir: str | None = None
    ) -> float | None:
        """Save the policy (a collective). ``queue_dir``: rank 0 also saves the queue (``client.save_checkpoint``)
        into that subdirectory of the staging directory, so the model and the queue commit as one checkpoint;
        rank 0 then returns the seconds the queue's save took (None: it failed, the checkpoint has no queue)."""
        assert self.policy is not None
        stage = queue_stage(self.client, queue_dir) if queue_dir is not None and self.rank == 0 else None
        extra = {**extra_state, "policy_version": self.version}
        return self.policy.save_checkpoint(path, extra, overwrite=overwrite, stage=stage)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        assert self.policy is not None
        extra = self.policy.load_checkpoint(path)
        self.version = int(extra.get("policy_version", 0))
        return extra

    def set_version(self, version: int) -> None:
        self.version = version


def rl_adamw(config: TrainerConfig) -> AdamWConfig:
    """The RL policy's AdamW: ``train.lr``, ``train.beta1`` / ``train.beta2`` and ``train.weight_decay``."""
    train = config.train
    return AdamWConfig(lr=train.lr, betas=(train.beta1, train.beta2), weight_decay=train.weight_decay)


def train_epochs(
    policy: FSDPPolicy, tensors: dict[str, torch.Tensor], loss_fn: LossFn, *, lrs: list[float], temperature: float
) -> list[dict[str, float]]:
    """PPO epochs on one DP round's batch: one optimizer step (``policy.train_step``, a collective) per learning
    rate of ``lrs``, all on the same ``tensors``, so every epoch's ratio is against the same old log-probs (the
    policy before the first epoch's update when the trainer recomputes them); from the second epoch on it moves
    away from 1, and the clip bounds how far. Returns each step's metrics."""
    optimizer = policy.require_optimizer("train_epochs")
    metrics = []
    for lr in lrs:
        for group in optimizer.param_groups:
            group["lr"] = lr
        metrics.append(policy.train_step(tensors, loss_fn, temperature=temperature))
    return metrics


def rl_optimizer_step(version: int, k: int, epoch: int, rounds: int, epochs: int) -> int:
    """The RL optimizer step (0-based, as the learning-rate warm-up counts them) of PPO epoch ``epoch`` of DP round
    ``k`` of the global step that starts at policy ``version``: each step takes ``rounds x epochs`` of them.

    >>> [rl_optimizer_step(1, k, e, rounds=2, epochs=2) for k in range(2) for e in range(2)]
    [4, 5, 6, 7]
    """
    return (version * rounds + k) * epochs + epoch


def warmup_factor(optimizer_step: int, warmup_steps: int) -> float:
    """``min(1, (optimizer_step + 1) / warmup_steps)``; 1 without warm-up (``warmup_steps`` 0).

    >>> [warmup_factor(s, 4) for s in range(5)], warmup_factor(0, 0)
    ([0.25, 0.5, 0.75, 1.0, 1.0], 1.0)
    """
    return 1.0 if warmup_steps <= 0 else min(1.0, (optimizer_step + 1) / warmup_steps)


def logprob_temperature(sampling_temperature: float) -> float:
    """The temperature log-probs are scored at for a rollout at ``sampling_temperature``: the same, except greedy
    decoding (0), whose engines report ``log_softmax(logits)`` (see ``workers.engines.base.Generation``)."""
    return sampling_temperature if sampling_temperature > 0 else 1.0


def _nll_loss(*, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    mask = batch["response_mask"]
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1.0), {}


def _default_loss_agg(loss: str) -> str:
    import inspect

    from trainers.losses import LOSSES

    return str(inspect.signature(LOSSES[loss]).parameters["loss_agg"].default)


def _global_sum(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def _global_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def totals_add(totals: dict[str, float], values: dict[str, float]) -> None:
    for name, value in values.items():
        totals[name] = totals.get(name, 0.0) + value


def _reduce_stats(totals: dict[str, float], device: torch.device, tp_size: int = 1) -> dict[str, float]:
    """Sum the per-rank counters over ranks (max for maxima) and turn sums into means; the ``tp_size`` ranks of a TP
    group read the same rows, so only the first of each group counts."""
    names = sorted(n for n in totals if not n.endswith("_max"))
    # one all-gather of every rank's counters and maximum (summed and maxed here): one rendezvous, not two
    mine = torch.tensor([*(totals[n] for n in names), totals.get("staleness_max", 0.0)], dtype=torch.float64)
    gathered = torch.empty(dist.get_world_size() * len(mine), dtype=torch.float64, device=device)
    all_gather_single(gathered, mine.to(device))
    per_rank = gathered.view(dist.get_world_size(), len(mine)).cpu()
    s = dict(zip(names, per_rank[::tp_size, :-1].sum(0).tolist(), strict=True))
    peak = per_rank[:, -1].max()
    scored = max(s.get("scored_rows", 0.0), 1.0)
    rows = max(s.get("rows", 0.0), 1.0)
    return {
        "reward": s["reward_sum"] / scored,
        "accuracy": s["correct_sum"] / scored,
        "rows": s["rows"],
        "trained_rows": s["trained_rows"],
        "failed_rows": s["failed_rows"],
        "stale_rows": s["stale_rows"],
        "staleness_mean": s["staleness_sum"] / rows,
        "staleness_max": float(peak.item()),
        "response_len": s["response_len_sum"] / rows,
        # per trained token: how many versions behind the policy that sampled it was
        "staleness_token_mean": s.get("token_staleness_sum", 0.0) / max(s.get("trained_tokens", 0.0), 1.0),
        "entropy": s.get("neg_logprob_sum", 0.0) / max(s.get("trained_tokens", 0.0), 1.0),
        **({"trained_groups": s["trained_groups"]} if "trained_groups" in s else {}),
        **({"prompts_crc": s["prompts_crc_sum"]} if "prompts_crc_sum" in s else {}),
        **{
            name[: -len("_sum")]: s[name] / max(s["mismatch_tokens"], 1.0)
            for name in s
            if "mismatch_tokens" in s and name.endswith("_sum") and name.startswith(("mismatch_", "is_"))
        },
    }
