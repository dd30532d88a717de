"""GRPO group-relative advantages: one scalar per sequence, normalised within its group of responses.

Rows are laid out group by group, as the GRPO sampler hands them out: with ``group_size=n``, rows
``[k*n, (k+1)*n)`` are the ``n`` responses to prompt ``k``. ``group_advantages_by_id`` takes arbitrary
group ids instead, for batches that were filtered or shuffled.

Conventions:
    - The group standard deviation is the unbiased (Bessel-corrected, divide by ``n - 1``) one, as
      ``torch.std`` computes it in verl's ``compute_grpo_outcome_advantage`` and TRL's GRPO trainer.
    - A group whose rewards are all equal gets advantage exactly 0, never NaN or ``±tiny / eps``. A group of
      one response is such a group: with no other response there is no baseline to compare against.
    - Statistics are computed in float64 and returned in the rewards' dtype (float32 for integer rewards).
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-normalised GRPO advantages for rows laid out group by group.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` with the unbiased std of group ``g``; with ``normalize_std=False``
    only the group mean is subtracted (Dr. GRPO).

    Args:
        rewards: ``[N]`` scalar reward per row, finite; ``N`` a multiple of ``group_size``.
        group_size: number of responses per prompt (``n`` in GRPO), ``>= 1``.
        normalize_std: divide by the group standard deviation (GRPO) or not (Dr. GRPO).
        eps: added to the std before dividing, ``>= 0``.

    Returns:
        ``[N]`` advantages, 0 for every row of a group whose rewards are all equal.

    Raises:
        ValueError: on a non-1-D or non-finite ``rewards``, a bad ``group_size``, or a negative ``eps``.

    >>> group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
    tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """
    rewards = _check_rewards(rewards)
    _check_group_size(rewards, group_size)
    group_ids = torch.arange(rewards.numel(), device=rewards.device) // group_size
    return group_advantages_by_id(rewards, group_ids, normalize_std=normalize_std, eps=eps)


def group_advantages_by_id(
    rewards: Tensor, group_ids: Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Group-normalised GRPO advantages where ``group_ids[i]`` names the group of row ``i``.

    Same math as ``group_advantages``; rows of a group need not be contiguous.

    Args:
        rewards: ``[N]`` scalar reward per row, finite.
        group_ids: ``[N]`` integer group id per row (any values, e.g. a prompt's ``global_index``).
        normalize_std: divide by the group standard deviation (GRPO) or not (Dr. GRPO).
        eps: added to the std before dividing, ``>= 0``.

    Returns:
        ``[N]`` advantages in the rewards' dtype.

    Raises:
        ValueError: on a non-1-D or non-finite ``rewards``, a mismatched or non-integer ``group_ids``,
            or a negative ``eps``.
    """
    rewards = _check_rewards(rewards)
    inverse = _check_group_ids(rewards, group_ids)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = rewards.double()
    mean, std = _group_stats(r, inverse)
    centered = r - mean[inverse]
    constant = std[inverse] == 0
    advantages = centered / (std[inverse] + eps) if normalize_std else centered
    return torch.where(constant, torch.zeros_like(advantages), advantages).to(rewards.dtype)


def group_reward_std(rewards: Tensor, group_size: int, valid: Tensor | None = None) -> Tensor:
    """Unbiased standard deviation of the rewards of each group (rows laid out group by group).

    Used by dynamic sampling (``trainers.filters.nonzero_std_groups``) to drop groups that carry no signal.

    Args:
        rewards: ``[N]`` scalar reward per row, finite where ``valid``; ``N`` a multiple of ``group_size``.
        group_size: number of responses per prompt, ``>= 1``.
        valid: ``[N]`` bool, the rows that count (e.g. not failed, not stale); all when None. The others are left
            out of their group's statistics, whatever their reward holds.

    Returns:
        ``[N // group_size]`` std per group over its valid rows, exactly 0 for a group whose valid rewards are
        all equal or that has fewer than two valid rows.

    Raises:
        ValueError: on a non-1-D or non-finite ``rewards``, a bad ``group_size`` or a mismatched ``valid``.

    >>> group_reward_std(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
    tensor([0.7071, 0.0000])
    >>> group_reward_std(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2, valid=torch.tensor([1, 0, 1, 1]).bool())
    tensor([0., 0.])
    """
    if valid is not None:
        if valid.shape != rewards.shape or valid.dtype != torch.bool:
            raise ValueError(
                f"valid must be a bool tensor of the rewards' shape {tuple(rewards.shape)}, "
                f"got {valid.dtype} {tuple(valid.shape)}"
            )
        rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    rewards = _check_rewards(rewards)
    _check_group_size(rewards, group_size)
    num_groups = rewards.numel() // group_size
    inverse = torch.arange(rewards.numel(), device=rewards.device) // group_size
    r = rewards.double()
    if valid is not None:
        r, inverse = r[valid], inverse[valid]
    _, std = _group_stats(r, inverse, num_groups)
    return std.to(rewards.dtype)


def _group_stats(r: Tensor, inverse: Tensor, num_groups: int | None = None) -> tuple[Tensor, Tensor]:
    """Per-group mean and unbiased std of float64 ``r``; ``inverse[i]`` in ``[0, G)`` is row ``i``'s group.

    A group with fewer than two rows has std 0."""
    if num_groups is None:
        num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    counts = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros_like(counts).index_add_(0, inverse, r) / counts.clamp(min=1)
    squares = torch.zeros_like(counts).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    std = (squares / (counts - 1).clamp(min=1)).sqrt()
    # Rounding in the mean can leave a tiny nonzero std for equal rewards; pin those groups to exactly 0.
    group_max = torch.zeros_like(counts).scatter_reduce_(0, inverse, r, reduce="amax", include_self=False)
    group_min = torch.zeros_like(counts).scatter_reduce_(0, inverse, r, reduce="amin", include_self=False)
    return mean, torch.where(group_max == group_min, torch.zeros_like(std), std)


def _check_rewards(rewards: Tensor) -> Tensor:
    if not isinstance(rewards, Tensor):
        raise ValueError(f"rewards must be a torch.Tensor [N], got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    bad = (~torch.isfinite(rewards)).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"rewards must be finite, got non-finite values at rows {bad[:8].tolist()}")
    return rewards


def _check_group_size(rewards: Tensor, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"rewards has N={rewards.numel()} rows, expected a multiple of group_size={group_size}")


def _check_group_ids(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Validate ``group_ids`` and return them renumbered to ``[0, G)``."""
    if not isinstance(group_ids, Tensor) or group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        got = group_ids.dtype if isinstance(group_ids, Tensor) else type(group_ids).__name__
        raise ValueError(f"group_ids must be an integer torch.Tensor, got {got}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids must have the shape of rewards: expected {tuple(rewards.shape)}, got {tuple(group_ids.shape)}"
        )
    _, inverse = torch.unique(group_ids.to(rewards.device), return_inverse=True)
    return inverse
