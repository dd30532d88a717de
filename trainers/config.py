"""The trainer's own config: ``TrainConfig`` (the ``train`` section of a run's config) and ``TrainerConfig`` (that
section with the few run-wide values the trainer ranks read).

A run's whole config (``orchestration.config.RLConfig``, its other sections, the YAML loader and the key ranges)
belongs to the orchestration above this layer; :meth:`TrainerConfig.from_run` reads what the trainer needs of any
config of that shape (:class:`RunConfigView`), so this module never imports it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Literal, Protocol

from trainers.filters import FilterConfig


@dataclass
class TrainConfig:
    """The FSDP2 trainer: ranks, optimisation, loss and filters."""

    world_size: int = 2  # FSDP2 trainer ranks
    # tensor parallelism: groups of tp_size ranks split each decoder layer (Llama-style Hugging Face models), FSDP2
    # shards over the world_size // tp_size groups, each of which reads one data-parallel share; divides world_size
    tp_size: int = 1
    # pipeline, expert and context (sequence) parallelism: not supported, each refused above 1 when the config is
    # checked (naming what is)
    pp_size: int = 1  # pipeline-parallel degree: 1 only (not supported)
    ep_size: int = 1  # expert-parallel degree: 1 only (not supported)
    cp_size: int = 1  # context (sequence) parallel degree: 1 only (not supported)
    backend: str | None = None  # None: nccl on GPU, gloo on CPU
    num_gpus_per_rank: float = 0.0  # GPUs per trainer rank (0: CPU)
    # times a run restarts its trainer group when a trainer rank dies (its process killed): the run stops what it
    # started and resumes from its last checkpoint in the same process (orchestration/trainer_restarts.py); 0: a
    # rank's death ends the run
    max_restarts: int = 3
    # with max_restarts > 0 and periodic checkpoints: each step's rows stay in the queue until a checkpoint covers
    # the step, and the queue outlives a trainer-group restart, which trains them again from there instead of
    # generating them again (the queue holds up to checkpoint_interval more steps); false: cleared once trained
    restart_keeps_rows: bool = True
    # with restart_keeps_rows, at a trainer rank's death: seconds the rollout workers get to write the generations
    # they have in flight before they are stopped (kept in the queue for the restart instead of generated again);
    # 0: stopped at once
    restart_drain_s: float = 30.0
    lr: float = 5e-4  # AdamW learning rate of RL
    # linear warm-up of the RL learning rate over the first k optimizer steps (lr * min(1, (n + 1) / k)); Adam's
    # first steps move every weight by about lr whatever the gradient, which can knock a warmed-up policy over
    lr_warmup_steps: int = 0
    weight_decay: float = 0.0  # AdamW weight decay
    beta1: float = 0.9  # AdamW's first-moment decay (betas[0]), in [0, 1)
    beta2: float = 0.999  # AdamW's second-moment decay (betas[1]), in [0, 1)
    grad_clip: float = 1.0  # max global gradient norm
    micro_batch_size: int = 128  # rows per forward/backward pass (gradients accumulate over them)
    # a decoder layer with fewer parameters than this is sharded with the root module instead of as an FSDP unit of
    # its own: one all-gather and one reduce-scatter for all such layers (each collective is a rendezvous of every
    # rank); per-layer units bound a large model's memory (SmolLM2-135M's ~3.5M-parameter layers stay units)
    fsdp_min_layer_params: int = 1_000_000
    minibatches_per_step: int = 1  # optimizer steps per global step (one DP round each)
    # optimizer passes over each DP round's batch (PPO epochs), all against the same old log-probs: a global step
    # takes minibatches_per_step x ppo_epochs optimizer steps
    ppo_epochs: int = 1
    # recompute each decoder layer in the backward instead of keeping its activations: much less memory for one
    # more forward's compute, the same gradients (Hugging Face models)
    gradient_checkpointing: bool = False
    # pack each rank's rows into micro-batches of at most max_tokens_per_micro_batch padded tokens (rows x longest
    # row), rows of similar length together, each trimmed to its longest row, instead of micro_batch_size rows: less
    # padding computed, the same update (AgentRL's dynamic_batching)
    dynamic_batching: bool = False
    max_tokens_per_micro_batch: int = 4096  # a dynamic micro-batch's budget; a longer row gets one of its own
    # score at most this many positions at a time: the output head and log-softmax run chunk by chunk, each recomputed
    # in the backward, so the [B, T, V] float32 logits are never held whole (long sequences, large vocabularies);
    # the same log-probs and gradients. None: the whole sequence at once
    loss_seq_chunk_size: int | None = None
    # keep the activations saved for the backward in host memory (torch.autograd.graph.save_on_cpu) instead of on
    # the GPU: less GPU memory for copies over PCIe, the same gradients; nothing changes on a CPU trainer
    activation_offloading: bool = False
    loss: str = "grpo"  # one of trainers.losses.LOSSES
    clip_low: float | None = None  # None: the loss's own default
    clip_high: float | None = None  # upper clip range (clip-higher); None: the loss's own default
    loss_agg: str | None = None  # token-mean, seq-mean-token-mean or seq-mean-token-sum; None: the loss's own
    kl_coef: float = 0.0  # > 0 keeps a frozen reference policy and adds beta * KL
    kl_kind: str = "k3"  # KL estimator: k1, k2 or k3
    filters: FilterConfig = field(default_factory=FilterConfig)
    normalize_advantage_std: bool = True  # divide advantages by the group's std (GRPO) or not (Dr. GRPO)
    # Over-sampling with dynamic filtering (DAPO): roll out prompts_per_step groups, train on at most this many of
    # those the filters keep (e.g. filters.nonzero_std_groups); the others never reach the forward pass.
    # None: train on every group of the step.
    max_train_groups: int | None = None
    # Score the sampled tokens with the training model before the update, and use those as the old (proximal)
    # policy; the engine's log-probs are kept for the rollout correction. None: on when the trainer's and the
    # engine's numerics differ (another engine or device, so another dtype), in async mode (decoupled PPO needs the
    # proximal policy) and with several minibatches per step or several ppo_epochs.
    recompute_old_logprobs: bool | None = None
    rollout_correction: Literal["none", "tis", "mis"] = "tis"  # trainer-vs-engine IS weights (with recompute)
    rollout_is_high: float = 2.0  # TIS cap / MIS upper bound on exp(trainer - engine logprob)
    rollout_is_low: float | None = None  # MIS lower bound; None: 1 / rollout_is_high
    # partial rollouts: leave out of the loss the tokens sampled more than max_staleness versions ago (slime)
    mask_offpolicy_in_partial_rollout: bool = False


class RolloutView(Protocol):
    """What the trainer reads of a run's ``rollout`` section."""

    @property
    def temperature(self) -> float: ...
    @property
    def partial_rollout(self) -> bool: ...
    @property
    def generate_fn(self) -> str | None: ...


class TaskView(Protocol):
    """What the trainer reads of a run's ``task`` section."""

    @property
    def num_train_prompts(self) -> int: ...
    @property
    def seed(self) -> int: ...


class RunConfigView(Protocol):
    """What :meth:`TrainerConfig.from_run` reads of a run's config: ``orchestration.config.RLConfig`` is one (mypy
    checks it where the run calls ``from_run``); the trainer layer names the shape, not the run's class."""

    @property
    def train(self) -> TrainConfig: ...
    @property
    def rollout(self) -> RolloutView: ...
    @property
    def task(self) -> TaskView: ...
    @property
    def seed(self) -> int: ...
    @property
    def prompts_per_step(self) -> int: ...
    @property
    def n_samples(self) -> int: ...
    @property
    def max_staleness(self) -> int: ...
    @property
    def queue_timeout(self) -> float: ...
    @property
    def recompute_old_logprobs(self) -> bool: ...


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """What the trainer ranks (``trainers.grpo.GRPOTrainerRank``) and ``trainers.grpo.build_train_batch`` read: the
    run's ``train`` section and the few run-wide values the trainer needs, so a run's whole config stays with its
    orchestration. :meth:`from_run` builds it from a run's config (:class:`RunConfigView`); it is picklable (it
    crosses Ray to the ranks)."""

    train: TrainConfig  # the FSDP2 trainer's section: ranks, optimisation, loss, filters, rollout correction
    seed: int  # seeds the starting weights (torch.manual_seed) and the SFT batches (the run's seed)
    prompts_per_step: int  # GRPO groups per global step: with n_samples, the rows a step trains on
    n_samples: int  # rows per GRPO group (the group size the filters see)
    max_staleness: int  # policy versions a sample may lag the trainer's and still be trained on
    queue_timeout: float  # seconds a rank's queue read waits for its share
    recompute_old_logprobs: bool  # score the old policy with the training model (the run's resolved choice)
    temperature: float  # the rollout's sampling temperature: log-probs are scored at it (0, greedy: at 1)
    partial_rollout: bool  # rows carry response_versions (a weight update may cut a generation)
    trajectories: bool  # rows are multi-turn trajectories (tokens, loss_mask, logprobs) of a rollout.generate_fn
    num_train_prompts: int  # the task's training split, the SFT warm-up's prompts ...
    task_seed: int  # ... drawn with this seed (the task's)

    @classmethod
    def from_run(cls, config: RunConfigView) -> TrainerConfig:
        """The trainer's part of a run's ``config`` (its ``train`` section copied: the run's stays its own)."""
        return cls(
            train=copy.deepcopy(config.train),
            seed=config.seed,
            prompts_per_step=config.prompts_per_step,
            n_samples=config.n_samples,
            max_staleness=config.max_staleness,
            queue_timeout=config.queue_timeout,
            recompute_old_logprobs=config.recompute_old_logprobs,
            temperature=config.rollout.temperature,
            partial_rollout=config.rollout.partial_rollout,
            trajectories=bool(config.rollout.generate_fn),
            num_train_prompts=config.task.num_train_prompts,
            task_seed=config.task.seed,
        )
