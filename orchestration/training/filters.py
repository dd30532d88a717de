"""Group filters for ``RolloutConfig.filter_fn``: each takes one prompt's group of ``Sample``s and says whether it is
worth training on (True keeps the group).

- ``check_reward_nonzero_std``: the rewards are not all equal (DAPO dynamic sampling; the same test as
  ``trainers.filters.nonzero_std_groups``, which it calls): a constant group has zero advantage everywhere.
- ``check_min_reward``: the group's **mean** reward reaches ``threshold`` (``mean >= threshold``).
- ``check_response_diversity``: distinct responses / group size reaches ``min_unique_ratio``; a response is its
  text, or its trained-on tokens when the text is empty.
- ``check_quality_and_diversity``: ``check_reward_nonzero_std`` and ``check_response_diversity`` both pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from orchestration.training.types import LibraryError, Sample
from trainers.filters import nonzero_std_groups


def _check_group(samples: Sequence[Sample], name: str) -> None:
    if isinstance(samples, Sample) or not isinstance(samples, Sequence):
        raise LibraryError(f"{name} takes a group's list of Samples, got {type(samples).__name__}")
    if len(samples) == 0:
        raise LibraryError(f"{name} needs a group of at least one Sample, got an empty list")
    for i, sample in enumerate(samples):
        if not isinstance(sample, Sample):
            raise LibraryError(f"{name} takes Samples, item {i} is a {type(sample).__name__}")


def check_reward_nonzero_std(samples: Sequence[Sample], eps: float = 1e-6) -> bool:
    """True when the group's rewards are not all equal: unbiased std > ``eps`` (a group of one has std 0)."""
    _check_group(samples, "check_reward_nonzero_std")
    rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float64)
    if not bool(torch.isfinite(rewards).all()):
        raise LibraryError(f"check_reward_nonzero_std needs finite rewards, got {rewards.tolist()}")
    return bool(nonzero_std_groups(rewards, group_size=len(samples), eps=eps)[0])


def check_min_reward(samples: Sequence[Sample], threshold: float = 0.0) -> bool:
    """True when the group's mean reward is at least ``threshold``."""
    _check_group(samples, "check_min_reward")
    if not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise LibraryError(f"check_min_reward needs a finite number threshold, got {threshold!r}")
    return sum(float(s.reward) for s in samples) / len(samples) >= threshold


def _response_key(sample: Sample) -> str | tuple[int, ...]:
    if sample.response:
        return sample.response
    return tuple(t for t, w in zip(sample.tokens, sample.loss_mask, strict=True) if w > 0)


def check_response_diversity(samples: Sequence[Sample], min_unique_ratio: float = 0.5) -> bool:
    """True when distinct responses / group size >= ``min_unique_ratio`` (in ``[0, 1]``)."""
    _check_group(samples, "check_response_diversity")
    if not isinstance(min_unique_ratio, (int, float)) or not 0.0 <= min_unique_ratio <= 1.0:
        raise LibraryError(f"check_response_diversity needs min_unique_ratio in [0, 1], got {min_unique_ratio!r}")
    return len({_response_key(s) for s in samples}) / len(samples) >= min_unique_ratio


def check_quality_and_diversity(samples: Sequence[Sample], min_unique_ratio: float = 0.5, eps: float = 1e-6) -> bool:
    """True when the rewards differ (``check_reward_nonzero_std``) and the responses are diverse enough
    (``check_response_diversity``)."""
    return check_reward_nonzero_std(samples, eps=eps) and check_response_diversity(
        samples, min_unique_ratio=min_unique_ratio
    )
