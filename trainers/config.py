"""RLConfig: one source of truth for a GRPO run, loaded from YAML and checked before any actor starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from trainers.filters import FilterConfig
from trainers.losses import LOSSES


class ConfigError(ValueError):
    """A configuration is inconsistent; the message says which values clash and what would fit."""


@dataclass
class TaskConfig:
    """Which task (prompts, reward, tokenizer, starting policy) to train on."""

    name: str = "workers.tasks.addition:AdditionTask"  # "module:Class" of a rl_contracts.task.Task
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the task's constructor
    reward_fn: str | None = None  # "module:function" replacing the task's own reward, fn(response_text, **fields)
    num_train_prompts: int = 4096
    num_eval_prompts: int = 256
    seed: int = 0


@dataclass
class RolloutConfig:
    """Generation: engines, sampling, and how rows are taken from the queue."""

    num_workers: int = 1  # rollout worker actors, each with one engine
    engine: Literal["hf"] = "hf"  # the Engine interface is token in / token out; vLLM and SGLang engines plug in next
    engine_device: str = "cpu"
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    groups_per_request: int = 16  # GRPO groups a rollout worker takes from the queue at a time
    num_reward_workers: int = 1
    reward_groups_per_request: int = 16
    # Custom rollouts (workers/rollout_fns.py): "module:fn" of an async generate(prompts, engine, **kwargs) ->
    # list[Sample]; its kwargs; a group filter fn(samples) -> bool; a per-sample reward fn(sample) -> float.
    generate_fn: str | None = None
    generate_fn_kwargs: dict[str, Any] = field(default_factory=dict)
    filter_fn: str | None = None
    reward_fn: str | None = None
    # Task servers the run starts itself (python -m workers.agents.task_server ENV on 127.0.0.1), their URLs then
    # given to generate_fn as task_server_url; none when task_server_env is None.
    task_server_env: str | None = None
    num_task_servers: int = 1
    task_server_max_episodes: int | None = None


@dataclass
class TrainConfig:
    """The FSDP2 trainer: ranks, optimisation, loss and filters."""

    world_size: int = 2
    backend: str | None = None  # None: nccl on GPU, gloo on CPU
    num_gpus_per_rank: float = 0.0
    lr: float = 5e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 128
    minibatches_per_step: int = 1  # optimizer steps per global step (one DP round each)
    loss: str = "grpo"  # one of trainers.losses.LOSSES
    clip_low: float | None = None  # None: the loss's own default
    clip_high: float | None = None
    loss_agg: str | None = None
    kl_coef: float = 0.0  # > 0 keeps a frozen reference policy and adds beta * KL
    kl_kind: str = "k3"
    filters: FilterConfig = field(default_factory=FilterConfig)
    normalize_advantage_std: bool = True
    # Over-sampling with dynamic filtering (DAPO): roll out prompts_per_step groups, train on at most this many of
    # those the filters keep (e.g. filters.nonzero_std_groups); the others never reach the forward pass.
    # None: train on every group of the step.
    max_train_groups: int | None = None


@dataclass
class SFTConfig:
    """The supervised warm-up before RL (the SFT -> RL pipeline)."""

    enabled: bool = True
    lr: float = 1e-3
    batch_size: int = 64
    max_steps: int = 2000
    target_accuracy: float = 0.2  # stop once accuracy on the eval prompts reaches this
    target_metric: Literal["sampled", "greedy"] = "sampled"  # sampled at the rollout temperature, or greedy
    eval_every: int = 25


@dataclass
class RLConfig:
    """A whole GRPO run.

    The queue holds ``num_global_batch = max_staleness + 1`` steps of ``prompts_per_step * n_samples`` rows.
    """

    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    steps: int = 200
    prompts_per_step: int = 32
    n_samples: int = 8
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 0  # async: steps rollout may run ahead of training; older samples are not trained on
    # memory: via the object store; disk: a Hugging Face directory per version (engines off the cluster); shm: a
    # WeightChannel in shared memory that engines on this host pull from (no driver round trip; lets the driver
    # launch generation of step s+1 while step s trains, the engine waiting for the weights it needs)
    weight_sync: Literal["memory", "disk", "shm"] = "memory"
    sync_every: int = 1  # publish weights every k optimizer steps
    output_dir: str = "outputs/grpo"
    checkpoint_every: int = 0  # 0: only at the end
    resume: bool = True  # go on from the latest checkpoint in output_dir/checkpoints, if any
    init_from: str | None = None  # start RL from this checkpoint's weights (e.g. an SFT run's), fresh optimizer
    seed: int = 0
    num_storage_units: int = 2
    queue_timeout: float = 300.0
    eval_every: int = 0  # greedy accuracy on the eval prompts every k steps (0: never)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError on sizes that cannot work together, before any actor starts."""
        positive = {
            "steps": self.steps,
            "prompts_per_step": self.prompts_per_step,
            "n_samples": self.n_samples,
            "rollout.num_workers": self.rollout.num_workers,
            "rollout.num_reward_workers": self.rollout.num_reward_workers,
            "rollout.max_new_tokens": self.rollout.max_new_tokens,
            "rollout.groups_per_request": self.rollout.groups_per_request,
            "rollout.reward_groups_per_request": self.rollout.reward_groups_per_request,
            "train.world_size": self.train.world_size,
            "train.micro_batch_size": self.train.micro_batch_size,
            "train.minibatches_per_step": self.train.minibatches_per_step,
            "sync_every": self.sync_every,
            "num_storage_units": self.num_storage_units,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if self.mode == "sync" and self.max_staleness != 0:
            raise ConfigError(f"mode='sync' trains on-policy: max_staleness must be 0, got {self.max_staleness}")
        if self.mode == "async" and self.max_staleness < 1:
            raise ConfigError(f"mode='async' needs max_staleness >= 1 (rollout runs ahead), got {self.max_staleness}")
        if self.sync_every - 1 > self.max_staleness:
            raise ConfigError(
                f"sync_every={self.sync_every} leaves engines up to {self.sync_every - 1} versions behind, more than "
                f"max_staleness={self.max_staleness}; use mode='async' with max_staleness >= {self.sync_every - 1}"
            )
        rounds = self.train.world_size * self.train.minibatches_per_step
        if self.prompts_per_step % rounds:
            raise ConfigError(
                f"prompts_per_step={self.prompts_per_step} groups must split evenly over train.world_size="
                f"{self.train.world_size} ranks x train.minibatches_per_step={self.train.minibatches_per_step}; "
                f"use a multiple of {rounds}"
            )
        groups = self.train.max_train_groups
        if groups is not None and (not isinstance(groups, int) or groups < rounds or groups % rounds):
            raise ConfigError(
                f"train.max_train_groups must be a multiple of train.world_size x train.minibatches_per_step = "
                f"{rounds} (each rank's share of a round), got {groups!r}"
            )
        if groups is not None and groups > self.prompts_per_step:
            raise ConfigError(
                f"train.max_train_groups={groups} is more than the prompts_per_step={self.prompts_per_step} groups "
                "rolled out per step; over-sampling rolls out more prompts than it trains on"
            )
        if self.train.loss not in LOSSES:
            raise ConfigError(f"train.loss={self.train.loss!r} is not one of {sorted(LOSSES)}")
        if self.train.kl_coef < 0:
            raise ConfigError(f"train.kl_coef must be >= 0, got {self.train.kl_coef}")
        if not self.rollout.temperature >= 0:
            raise ConfigError(f"rollout.temperature must be >= 0, got {self.rollout.temperature}")

    @property
    def num_global_batch(self) -> int:
        """Steps the queue holds at once: the step in training plus the ones rollout may run ahead."""
        return self.max_staleness + 1

    @property
    def output_path(self) -> Path:
        return Path(self.output_dir)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RLConfig:
    """An RLConfig from a YAML file (nested sections as in the dataclasses), with dotted ``overrides`` on top.

    >>> load_config(None, {"steps": 10, "train.lr": 1e-3}).train.lr
    0.001
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping at the top level, got {type(raw).__name__}")
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    try:
        return msgspec.convert(raw, RLConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config{f' in {path}' if path else ''}: {exc}") from None


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["steps=10", "train.lr=1e-3"]`` -> ``{"steps": 10, "train.lr": 0.001}`` (values parsed as YAML)."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"an override is KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        out[key.strip()] = yaml.safe_load(value)
    return out


def config_from_cli(description: str, default_config: str | Path, argv: list[str] | None = None) -> RLConfig:
    """The config of a recipe run: ``[--config FILE] [key=value ...]`` on top of the recipe's default YAML."""
    import argparse

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(default_config), help="YAML config (see trainers/config.py)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. steps=20 train.lr=1e-3")
    args = parser.parse_args(argv)
    return load_config(args.config, parse_overrides(args.overrides))


def config_to_dict(config: RLConfig) -> dict[str, Any]:
    return msgspec.to_builtins(config)
