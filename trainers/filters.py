"""Sample filters for GRPO batches: pure functions returning a boolean keep-mask over rows.

Row filters (``drop_zero_advantage``, ``skip_non_positive_advantage``, ``minimal_advantage``,
``max_trained_count``) judge each row on its own, after advantages are computed. ``nonzero_std_groups`` is
DAPO's dynamic sampling (slime's over-sample then filter): it judges whole groups and never splits one.
``FilterConfig`` + ``apply_filters`` switch them on from a trainer config; the masks combine with AND.

>>> rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])  # two groups of two: the first is constant
>>> apply_filters(FilterConfig(nonzero_std_groups=True), rewards=rewards, group_size=2)
tensor([False, False,  True,  True])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainers.advantages import group_reward_std


def drop_zero_advantage(advantages: Tensor, eps: float = 1e-8) -> Tensor:
    """Keep rows whose advantage is not ~0 (``|A| > eps``): they would contribute no gradient.

    Args:
        advantages: ``[N]`` one advantage per row.
        eps: tolerance around 0, ``>= 0``.

    Returns:
        ``[N]`` bool keep-mask.
    """
    _check_advantages(advantages)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return advantages.abs() > eps


def skip_non_positive_advantage(advantages: Tensor) -> Tensor:
    """Keep only rows with a strictly positive advantage (learn from better-than-average responses only).

    Args:
        advantages: ``[N]`` one advantage per row.

    Returns:
        ``[N]`` bool keep-mask.
    """
    _check_advantages(advantages)
    return advantages > 0


def minimal_advantage(advantages: Tensor, threshold: float) -> Tensor:
    """Keep rows whose advantage magnitude reaches ``threshold`` (``|A| >= threshold``).

    Args:
        advantages: ``[N]`` one advantage per row.
        threshold: minimum ``|A|``, ``>= 0``.

    Returns:
        ``[N]`` bool keep-mask.
    """
    _check_advantages(advantages)
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    return advantages.abs() >= threshold


def max_trained_count(trained_counts: Tensor, max_count: int) -> Tensor:
    """Keep replayed samples that were trained on fewer than ``max_count`` times.

    Args:
        trained_counts: ``[N]`` integer, how many optimizer passes each sample has already been in.
        max_count: the cap, ``>= 1``.

    Returns:
        ``[N]`` bool keep-mask.
    """
    if trained_counts.dim() != 1 or trained_counts.is_floating_point() or trained_counts.dtype == torch.bool:
        raise ValueError(
            f"trained_counts must be a 1-D integer tensor [N], got shape {tuple(trained_counts.shape)} "
            f"dtype {trained_counts.dtype}"
        )
    if isinstance(max_count, bool) or not isinstance(max_count, int) or max_count < 1:
        raise ValueError(f"max_count must be an int >= 1, got {max_count!r}")
    return trained_counts < max_count


def nonzero_std_groups(rewards: Tensor, group_size: int, eps: float = 1e-6, valid: Tensor | None = None) -> Tensor:
    """Keep whole groups whose rewards are not all equal (group std > ``eps``): DAPO dynamic sampling.

    A group where every response scored the same has zero advantage everywhere and teaches nothing. Rows outside
    ``valid`` (a failed reward, too stale) are left out of the statistics: their placeholder reward is no score, so
    a group whose scored rows all agree is constant however many of its rows failed.

    Args:
        rewards: ``[N]`` scalar reward per row, laid out group by group; ``N`` a multiple of ``group_size``.
        group_size: number of responses per prompt, ``>= 1``.
        eps: std at or below which a group counts as constant, ``>= 0``.
        valid: ``[N]`` bool, the rows whose reward counts; all when None.

    Returns:
        ``[N]`` bool keep-mask, constant within each group.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    keep_group = group_reward_std(rewards, group_size, valid) > eps
    return keep_group.repeat_interleave(group_size)


@dataclass(frozen=True)
class FilterConfig:
    """Which sample filters a trainer applies; everything off by default."""

    drop_zero_advantage: bool = False  # drop rows with |A| <= zero_advantage_eps
    zero_advantage_eps: float = 1e-8  # tolerance for drop_zero_advantage
    skip_non_positive_advantage: bool = False  # keep only rows with A > 0
    minimal_advantage: float | None = None  # keep rows with |A| >= this; None = off
    max_trained_count: int | None = None  # keep rows trained on fewer times than this; None = off
    nonzero_std_groups: bool = False  # drop whole groups whose rewards are all equal (dynamic sampling)
    zero_std_eps: float = 1e-6  # group std at or below which a group counts as constant

    def __post_init__(self) -> None:
        if self.zero_advantage_eps < 0:
            raise ValueError(f"zero_advantage_eps must be >= 0, got {self.zero_advantage_eps}")
        if self.minimal_advantage is not None and self.minimal_advantage < 0:
            raise ValueError(f"minimal_advantage must be >= 0 or None, got {self.minimal_advantage}")
        if self.max_trained_count is not None and self.max_trained_count < 1:
            raise ValueError(f"max_trained_count must be >= 1 or None, got {self.max_trained_count}")
        if self.zero_std_eps < 0:
            raise ValueError(f"zero_std_eps must be >= 0, got {self.zero_std_eps}")


def apply_filters(
    config: FilterConfig,
    *,
    advantages: Tensor | None = None,
    rewards: Tensor | None = None,
    group_size: int | None = None,
    trained_counts: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """AND together the keep-masks of every filter ``config`` switches on.

    Args:
        config: which filters to apply.
        advantages: ``[N]``, needed by the advantage filters.
        rewards: ``[N]`` laid out group by group, needed by ``nonzero_std_groups``.
        group_size: responses per prompt, needed by ``nonzero_std_groups``.
        trained_counts: ``[N]`` integer, needed by ``max_trained_count``.
        valid: ``[N]`` bool, rows whose reward counts in ``nonzero_std_groups``'s statistics; all when None.

    Returns:
        ``[N]`` bool keep-mask (all True when no filter is on).

    Raises:
        ValueError: when an enabled filter's input is missing, or the inputs disagree on ``N``.
    """
    masks: list[Tensor] = []
    needs_advantages = (
        config.drop_zero_advantage or config.skip_non_positive_advantage or config.minimal_advantage is not None
    )
    if needs_advantages:
        advantages = _require("advantages", advantages, "the advantage filters")
        if config.drop_zero_advantage:
            masks.append(drop_zero_advantage(advantages, config.zero_advantage_eps))
        if config.skip_non_positive_advantage:
            masks.append(skip_non_positive_advantage(advantages))
        if config.minimal_advantage is not None:
            masks.append(minimal_advantage(advantages, config.minimal_advantage))
    if config.max_trained_count is not None:
        trained_counts = _require("trained_counts", trained_counts, "max_trained_count")
        masks.append(max_trained_count(trained_counts, config.max_trained_count))
    if config.nonzero_std_groups:
        rewards = _require("rewards", rewards, "nonzero_std_groups")
        if group_size is None:
            raise ValueError("FilterConfig.nonzero_std_groups needs group_size, got None")
        masks.append(nonzero_std_groups(rewards, group_size, config.zero_std_eps, valid))

    given = [t for t in (advantages, rewards, trained_counts) if t is not None]
    if not given:
        raise ValueError("apply_filters needs at least one of advantages, rewards, trained_counts, got none")
    num_rows = {t.shape[0] for t in given}
    if len(num_rows) != 1:
        raise ValueError(f"advantages, rewards and trained_counts must have the same N, got {sorted(num_rows)}")
    keep = torch.ones(given[0].shape[0], dtype=torch.bool, device=given[0].device)
    for mask in masks:
        keep &= mask.to(keep.device)
    return keep


def _require(name: str, tensor: Tensor | None, needed_by: str) -> Tensor:
    if tensor is None:
        raise ValueError(f"FilterConfig enables {needed_by}, which needs {name} [N], got None")
    return tensor


def _check_advantages(advantages: Tensor) -> None:
    if advantages.dim() != 1:
        raise ValueError(f"advantages must be 1-D [N] (one per row), got shape {tuple(advantages.shape)}")
