"""Advantages as plain lists, one per sample, in the samples' order.

- ``compute_advantages(rewards, baseline)``: ``reward - baseline`` (the quick reference's simple form).
- ``compute_group_advantages(rewards, group_size)``: GRPO's group-normalised ``(r - mean_g) / (std_g + eps)`` over
  rows laid out group by group (``trainers.advantages.group_advantages``: unbiased std, a constant group gets 0);
  ``normalize_std=False`` only subtracts the group mean (Dr. GRPO).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from orchestration.training.types import LibraryError
from trainers.advantages import group_advantages


def _rewards(rewards: Any, name: str) -> list[float]:
    if isinstance(rewards, torch.Tensor):
        rewards = rewards.detach().flatten().tolist()
    if isinstance(rewards, (str, bytes)) or not isinstance(rewards, Sequence):
        raise LibraryError(f"{name} needs a list of rewards, got {type(rewards).__name__}")
    values = []
    for i, reward in enumerate(rewards):
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise LibraryError(f"{name} needs finite numbers as rewards, reward {i} is {reward!r}")
        values.append(float(reward))
    return values


def compute_advantages(rewards: Sequence[float] | torch.Tensor, baseline: float = 0.0) -> list[float]:
    """``[r - baseline for r in rewards]``."""
    values = _rewards(rewards, "compute_advantages")
    if isinstance(baseline, bool) or not isinstance(baseline, (int, float)) or not math.isfinite(baseline):
        raise LibraryError(f"compute_advantages needs a finite number baseline, got {baseline!r}")
    return [r - float(baseline) for r in values]


def compute_group_advantages(
    rewards: Sequence[float] | torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """GRPO advantages of rewards laid out group by group (``len(rewards)`` a multiple of ``group_size``)."""
    values = _rewards(rewards, "compute_group_advantages")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise LibraryError(f"compute_group_advantages needs a group_size >= 1, got {group_size!r}")
    if len(values) % group_size:
        raise LibraryError(
            f"compute_group_advantages needs whole groups: {len(values)} rewards is not a multiple of "
            f"group_size={group_size}"
        )
    if not values:
        return []
    advantages = group_advantages(
        torch.tensor(values, dtype=torch.float64), group_size, normalize_std=normalize_std, eps=eps
    )
    return [float(a) for a in advantages.tolist()]
