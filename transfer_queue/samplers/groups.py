"""Whole GRPO groups for user samplers: pick groups, and the rows follow.

A user sampler's ``sample(ready_indices, batch_size, **kwargs)`` gets ``group_ids`` (aligned with
``ready_indices``) and ``num_n_samples`` in ``kwargs``. With ``get_n_samples=True`` the controller hands it only
complete groups, and refuses an answer that splits one. :func:`sample_whole_groups` makes such an answer from a
choice of groups; :class:`GroupSampler` is a base class whose subclasses choose groups and never see rows.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from transfer_queue.samplers.base import BaseSampler

ChooseGroups = Callable[[np.ndarray, int], Sequence[int]]


def sample_whole_groups(
    ready_indices: Sequence[int] | np.ndarray,
    group_ids: Sequence[int] | np.ndarray,
    batch_size: int,
    group_size: int,
    choose: ChooseGroups | None = None,
) -> np.ndarray:
    """Up to ``batch_size`` of ``ready_indices``, made of whole groups of ``group_size`` members.

    Args:
        ready_indices, group_ids: the ready rows and the group of each (as a sampler's ``sample`` gets them).
        batch_size: rows wanted; ``batch_size // group_size`` groups at most.
        group_size: members of a complete group (``kwargs["num_n_samples"]``).
        choose: ``choose(complete_groups, k)`` -> the ids of at most ``k`` of them to serve (default: the first
            ``k`` in order of first appearance). Ids it returns that are not complete groups are refused.

    Returns:
        The chosen groups' ready indexes, members of a group side by side, groups in the order chosen.

    >>> sample_whole_groups([10, 11, 12, 13, 14], [0, 0, 1, 1, 2], batch_size=4, group_size=2).tolist()
    [10, 11, 12, 13]
    """
    ready = np.asarray(ready_indices, dtype=np.int64).reshape(-1)
    groups = np.asarray(group_ids, dtype=np.int64).reshape(-1)
    if len(ready) != len(groups):
        raise ValueError(f"group_ids must be aligned with ready_indices: {len(groups)} ids for {len(ready)} rows")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    ids, first, counts = np.unique(groups, return_index=True, return_counts=True)
    complete = ids[counts == group_size][np.argsort(first[counts == group_size], kind="stable")]
    k = min(batch_size // group_size, len(complete))
    chosen = np.asarray(list(choose(complete, k)) if choose is not None else complete[:k], dtype=np.int64)
    if len(chosen) > k or len(np.unique(chosen)) != len(chosen) or not np.isin(chosen, complete).all():
        raise ValueError(f"choose must return at most {k} distinct ids of complete groups, got {chosen.tolist()}")
    return np.concatenate([ready[groups == g] for g in chosen.tolist()]) if len(chosen) else np.zeros(0, np.int64)


class GroupSampler(BaseSampler):
    """A sampler that chooses GRPO groups, never single rows: implement :meth:`sample_groups`.

    It always serves whole groups (as ``get_n_samples=True`` asks of any sampler).

    >>> class NewestGroupsFirst(GroupSampler):
    ...     def sample_groups(self, group_ids, num_groups, **kwargs):
    ...         return group_ids[::-1][:num_groups]
    """

    serves_whole_groups = True

    @abstractmethod
    def sample_groups(self, group_ids: np.ndarray, num_groups: int, **kwargs: Any) -> Sequence[int]:
        """Choose at most ``num_groups`` of the complete, ready ``group_ids`` (in readiness order) to serve."""

    def sample(self, ready_indices: Sequence[int] | np.ndarray, batch_size: int, **kwargs: Any) -> Sequence[int]:
        row_groups = kwargs.pop("group_ids", None)  # the rows' groups; sample_groups gets the complete ones
        group_size = int(kwargs.get("num_n_samples", 1))
        if row_groups is None:  # called by hand without groups: every row is its own group
            row_groups, group_size = np.arange(len(ready_indices)), 1
        chosen = sample_whole_groups(
            ready_indices, row_groups, batch_size, group_size, lambda ids, k: self.sample_groups(ids, k, **kwargs)
        )
        return chosen.tolist()
