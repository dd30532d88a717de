"""The library's data types: ``Sample`` (one generated sequence, the unit every ``generate_fn`` returns),
``RolloutBatch`` (samples laid out for training) and the configs of the loops and the rollout manager.

Names and fields follow the rollouts quick reference that docs/library.md maps to ours. A ``Sample``'s ``tokens`` are
the whole sequence (prompt then response) and ``loss_mask`` says, per token, whether it is trained on (0 prompt,
1 response; fractional weights allowed). ``RolloutBatch.to_fields`` / ``from_fields`` convert to and from the queue's
jagged fields (``rl_contracts.rows.jagged``), so a batch travels through a ``TransferQueueClient`` as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_contracts.rows import float_rows_of, jagged, rows_of


class LibraryError(ValueError):
    """A value handed to the training library does not fit; the message says what was expected and what came."""


@dataclass
class Sample:
    """One generated sequence and what training needs of it.

    Args:
        prompt: the prompt, as text (or chat messages) for logs and reward functions.
        response: the response text.
        tokens: every token id of the sequence, prompt first.
        loss_mask: one weight per token of ``tokens``: 0 on prompt tokens, 1 on response tokens.
        reward: the sequence's scalar reward (RL only).
        metadata: anything else (the reward function's verdict, the group id, the policy version...).
    """

    prompt: Any = ""
    response: str = ""
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[float] = field(default_factory=list)
    reward: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.loss_mask) != len(self.tokens):
            raise LibraryError(
                f"Sample.loss_mask needs one weight per token: {len(self.tokens)} tokens, "
                f"{len(self.loss_mask)} loss_mask values"
            )
        if not isinstance(self.reward, (int, float)) or isinstance(self.reward, bool):
            raise LibraryError(f"Sample.reward must be a number, got {type(self.reward).__name__}")

    @property
    def response_length(self) -> int:
        """How many tokens are trained on (``loss_mask`` > 0)."""
        return sum(1 for weight in self.loss_mask if weight > 0)


@dataclass
class RolloutBatch:
    """Samples laid out for training: one entry per sample in each list.

    Args:
        tokens: token ids of each sequence.
        loss_masks: per-token weights of each sequence (as ``Sample.loss_mask``).
        rewards: each sequence's reward.
        response_lengths: each sequence's trained-on token count.
        metadata: batch-level information (``metadata["samples"]``: each sample's own metadata, when built by
            ``from_samples``).
    """

    tokens: list[list[int]]
    loss_masks: list[list[float]]
    rewards: list[float]
    response_lengths: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {
            "tokens": len(self.tokens),
            "loss_masks": len(self.loss_masks),
            "rewards": len(self.rewards),
            "response_lengths": len(self.response_lengths),
        }
        if len(set(sizes.values())) > 1:
            raise LibraryError(f"RolloutBatch needs one entry per sample in every list, got lengths {sizes}")
        for i, (ids, mask) in enumerate(zip(self.tokens, self.loss_masks, strict=True)):
            if len(ids) != len(mask):
                raise LibraryError(f"sample {i} of the RolloutBatch has {len(ids)} tokens and {len(mask)} loss weights")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_samples(cls, samples: Sequence[Sample], **metadata: Any) -> RolloutBatch:
        """The batch of ``samples``, in order; each sample's metadata lands in ``metadata["samples"]``."""
        return cls(
            tokens=[list(s.tokens) for s in samples],
            loss_masks=[[float(w) for w in s.loss_mask] for s in samples],
            rewards=[float(s.reward) for s in samples],
            response_lengths=[s.response_length for s in samples],
            metadata={**metadata, "samples": [dict(s.metadata) for s in samples]},
        )

    def to_samples(self) -> list[Sample]:
        """The batch's samples back (prompt and response texts are not kept by a batch: empty)."""
        per_sample = self.metadata.get("samples") or [{} for _ in self.tokens]
        return [
            Sample(tokens=list(ids), loss_mask=list(mask), reward=reward, metadata=dict(meta))
            for ids, mask, reward, meta in zip(self.tokens, self.loss_masks, self.rewards, per_sample, strict=True)
        ]

    def to_fields(self) -> dict[str, torch.Tensor]:
        """The queue's fields of this batch: ``tokens`` (jagged int64), ``loss_mask`` (jagged float32), ``reward``
        and ``response_length`` (one value per row); ``client.put(batch.to_fields(), ...)`` puts one row per sample."""
        return {
            "tokens": jagged(self.tokens, torch.int64),
            "loss_mask": jagged(self.loss_masks, torch.float32),
            "reward": torch.tensor(self.rewards, dtype=torch.float32),
            "response_length": torch.tensor(self.response_lengths, dtype=torch.int64),
        }

    @classmethod
    def from_fields(cls, data: Any) -> RolloutBatch:
        """The batch of the rows read from the queue (``client.get_data``) holding ``to_fields``' fields."""
        names = set(data.keys())  # a TensorDict refuses ``in`` on itself
        missing = [name for name in ("tokens", "loss_mask", "reward") if name not in names]
        if missing:
            raise LibraryError(f"rows of a RolloutBatch need fields tokens, loss_mask and reward; missing {missing}")
        masks = float_rows_of(data["loss_mask"])
        lengths = (
            data["response_length"].tolist()
            if "response_length" in names
            else [sum(1 for w in mask if w > 0) for mask in masks]
        )
        return cls(
            tokens=rows_of(data["tokens"]),
            loss_masks=masks,
            rewards=[float(r) for r in data["reward"].tolist()],
            response_lengths=[int(n) for n in lengths],
        )


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LibraryError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class SFTTrainingConfig:
    """``run_sft_training``'s settings."""

    num_steps: int = 1000  # optimizer steps
    batch_size: int = 4  # samples per step
    log_every: int = 100  # steps between metric lines
    checkpoint_every: int = 500  # steps between checkpoints (0: only at the end)

    def __post_init__(self) -> None:
        _positive("SFTTrainingConfig.num_steps", self.num_steps)
        _positive("SFTTrainingConfig.batch_size", self.batch_size)
        _positive("SFTTrainingConfig.log_every", self.log_every)


@dataclass
class RLTrainingConfig:
    """``run_rl_training``'s settings."""

    num_steps: int = 1000  # training steps (one rollout batch each)
    sync_every: int = 10  # steps between weight syncs to the engines
    baseline: float = 0.0  # subtracted from rewards when no group baseline applies (compute_advantages)
    log_every: int = 10  # steps between metric lines
    checkpoint_every: int = 100  # steps between checkpoints (0: only at the end)
    # groups of more than one sample: GRPO's group-normalised advantages; False (or groups of one): reward - baseline
    group_normalize: bool = True

    def __post_init__(self) -> None:
        _positive("RLTrainingConfig.num_steps", self.num_steps)
        _positive("RLTrainingConfig.sync_every", self.sync_every)
        _positive("RLTrainingConfig.log_every", self.log_every)
        if not math.isfinite(self.baseline):
            raise LibraryError(f"RLTrainingConfig.baseline must be finite, got {self.baseline}")


@dataclass
class RolloutConfig:
    """What the rollout manager generates and keeps.

    Args:
        batch_size: prompts per batch (each gives ``n_samples_per_prompt`` samples).
        n_samples_per_prompt: samples per prompt (a GRPO group).
        over_sampling_factor: generate ``ceil(batch_size * factor)`` prompts' groups, keep ``batch_size`` of those
            passing ``filter_fn``, carry the rest to the next batch.
        generate_fn: ``generate_fn(prompts)`` or ``generate_fn(prompts, engine)``, sync or async, returning
            ``n_samples_per_prompt`` samples per prompt, prompt by prompt.
        reward_fn: ``reward_fn(sample) -> float`` (sync or async) setting each sample's reward.
        filter_fn: ``filter_fn(group_samples) -> bool``; False drops the group.
    """

    batch_size: int = 32
    n_samples_per_prompt: int = 1
    over_sampling_factor: float = 1.0
    generate_fn: Callable[..., Any] | None = None
    reward_fn: Callable[..., Any] | None = None
    filter_fn: Callable[[list[Sample]], bool] | None = None

    def __post_init__(self) -> None:
        _positive("RolloutConfig.batch_size", self.batch_size)
        _positive("RolloutConfig.n_samples_per_prompt", self.n_samples_per_prompt)
        if not (isinstance(self.over_sampling_factor, (int, float)) and self.over_sampling_factor >= 1.0):
            raise LibraryError(
                f"RolloutConfig.over_sampling_factor must be a number >= 1.0, got {self.over_sampling_factor!r}"
            )
        for name in ("generate_fn", "reward_fn", "filter_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise LibraryError(f"RolloutConfig.{name} must be callable or None, got {type(value).__name__}")
