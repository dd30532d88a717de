"""Which rows a get_meta hands out: the view built-in samplers select from, and the seed's two-method protocol
for user samplers, whose answers are checked before any row is served (ready, not served yet, whole groups). Both
read the task's ready index: a user sampler is handed the ready rows (O(ready rows)); only a
``filter_ready_indices`` of the seed's form reads the whole table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transfer_queue.errors import SamplerError, TransferQueueError
from transfer_queue.samplers import BaseSampler
from transfer_queue.state.partition import COMMITTED, PartitionState
from transfer_queue.state.ready_index import AVAILABLE, ReadyIndex


@dataclass
class ReadyView:
    """What built-in samplers see of a ready index (local rows)."""

    part: PartitionState
    index: ReadyIndex
    group_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.group_size = self.part.group_size

    def num_rows(self) -> int:
        return self.index.num_rows

    def num_groups(self) -> int:
        return self.index.num_rows if self.group_size == 1 else len(self.index.groups)

    def first_rows(self, k: int) -> np.ndarray:
        return self.part.first_rows(self.index, k)

    def first_groups(self, k: int) -> np.ndarray:
        return self.part.first_groups(self.index, k)


def select_with_user_sampler(
    part: PartitionState,
    index: ReadyIndex | None,
    sampler: BaseSampler,
    params: dict[str, Any],
    task_name: str,
    fields: list[str],
    whole_groups: bool,
    count: int,
) -> np.ndarray:
    """The seed's two-method protocol, for samplers that override it. ``index``: the task's ready index for
    ``fields`` (None: a field is unknown, nothing is ready).

    ``sample`` is handed the ready rows, read from ``index`` in O(ready rows) and in global index order; a
    ``filter_ready_indices`` override is handed the whole table (O(rows)), or, with ``ready_rows_only``, the ready
    rows only."""
    if index is None:
        return np.zeros(0, np.int64)
    task = part.task(task_name)
    kwargs = {
        **params,
        "task_name": task_name,
        "partition_id": part.key,
        "num_n_samples": part.group_size,
    }
    try:
        if type(sampler).filter_ready_indices is BaseSampler.filter_ready_indices:
            ready = ready_rows(index) + part.base_index  # what the default filter finds, without reading the table
        else:
            ready = filtered(part, sampler, task.consumption, index, fields, kwargs)
        if whole_groups:  # whole groups only, members side by side: any prefix of whole groups is whole
            ready = complete_groups(part, ready)
            ready = ready[groups_together(part.group[ready - part.base_index])]
        chosen = sampler.sample(ready, count, group_ids=part.group[ready - part.base_index], **kwargs)
        chosen_rows = np.asarray(chosen, dtype=np.int64).reshape(-1)
    except TransferQueueError:
        raise
    except Exception as exc:
        raise SamplerError(f"{type(sampler).__name__} raised {type(exc).__name__}: {exc}") from exc
    check_ready(part, task.consumption, chosen_rows, fields, "sample")
    if len(chosen_rows) > count:
        raise SamplerError(f"{type(sampler).__name__}.sample returned {len(chosen_rows)} rows for batch_size={count}")
    if not np.isin(chosen_rows, ready).all():
        raise SamplerError(f"{type(sampler).__name__}.sample returned indexes that were not in ready_indices")
    rows = chosen_rows - part.base_index
    if whole_groups and len(complete_groups(part, chosen_rows)) != len(chosen_rows):
        raise SamplerError(f"{type(sampler).__name__}.sample split a GRPO group; whole groups were asked for")
    if whole_groups:  # members of a group side by side, as DP splits and consumers expect
        rows = rows[groups_together(part.group[rows])]
    return rows


def ready_rows(index: ReadyIndex) -> np.ndarray:
    """The rows of a ready index in index order, as the whole table lists them: O(ready rows)."""
    return np.sort(index.first_rows(index.num_rows))


def filtered(
    part: PartitionState,
    sampler: BaseSampler,
    consumption: np.ndarray,
    index: ReadyIndex,
    fields: list[str],
    kwargs: dict[str, Any],
) -> np.ndarray:
    """What the sampler's own ``filter_ready_indices`` finds ready (checked): among every committed row (the seed's
    form), or, with ``ready_rows_only``, among the rows ready for the task (``index``)."""
    if sampler.ready_rows_only:
        rows = ready_rows(index)
        consumed = np.zeros(len(rows), dtype=bool)
    else:
        rows = part.committed_rows()
        consumed = consumption[rows] != AVAILABLE
    ready = sampler.filter_ready_indices(
        rows + part.base_index,
        part.production_matrix(rows),
        consumed,
        list(fields),
        dict(part.field_col),
        group_ids=part.group[rows],
        **kwargs,
    )
    ready = np.asarray(ready, dtype=np.int64).reshape(-1)
    check_ready(part, consumption, ready, fields, "filter_ready_indices")
    return ready


def check_ready(
    part: PartitionState, consumption: np.ndarray, indexes: np.ndarray, fields: list[str], what: str
) -> None:
    rows = indexes - part.base_index
    if len(rows) and (rows.min() < 0 or rows.max() >= part.num_rows):
        raise SamplerError(f"{what} returned global indexes outside {part.name}")
    if len(np.unique(rows)) != len(rows):
        raise SamplerError(f"{what} returned the same global index twice")
    mask = np.uint64(part.field_mask(fields))
    ok = (part.state[rows] == COMMITTED) & ((part.produced_mask[rows] & mask) == mask)
    ok &= consumption[rows] == AVAILABLE
    if not ok.all():
        bad = (indexes[~ok][:5]).tolist()
        raise SamplerError(f"{what} of the task's sampler returned rows that are not ready or already served: {bad}")


def complete_groups(part: PartitionState, indexes: np.ndarray) -> np.ndarray:
    """The indexes whose whole group is among ``indexes``."""
    if part.group_size == 1 or not len(indexes):
        return indexes
    groups = part.group[indexes - part.base_index]
    ids, counts = np.unique(groups, return_counts=True)
    full = ids[counts == part.group_size]
    return indexes[np.isin(groups, full)]


def groups_together(groups: np.ndarray) -> np.ndarray:
    """The order that puts members of a group side by side, groups in order of first appearance (stable)."""
    if not len(groups):
        return np.zeros(0, dtype=np.int64)
    _, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
    return np.argsort(first[inverse.reshape(-1)], kind="stable")


def checked_shares(
    shares: Any, rows: np.ndarray, num_shares: int, group_of: np.ndarray | None, sampler: str
) -> list[np.ndarray]:
    """What a sampler's ``split`` returned, checked: ``num_shares`` int arrays that partition ``rows`` exactly
    (every row in exactly one share) and, where ``group_of`` (row -> group id) is given, never put members of one
    group into two shares; else :class:`SamplerError`."""
    where = f"{sampler}.split"
    if not isinstance(shares, (list, tuple)) or len(shares) != num_shares:
        got = len(shares) if isinstance(shares, (list, tuple)) else type(shares).__name__
        raise SamplerError(f"{where} must return {num_shares} shares (one per DP rank), got {got}")
    arrays = [np.asarray(share, dtype=np.int64).reshape(-1) for share in shares]
    joined = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    if len(joined) != len(rows) or not np.array_equal(np.sort(joined), np.sort(rows)):
        twice = len(joined) - len(np.unique(joined))
        raise SamplerError(
            f"{where} must split the round's {len(rows)} rows into disjoint shares that cover them all; its shares "
            f"hold {len(joined)} rows ({twice} given twice, {len(np.setdiff1d(rows, joined))} left out, "
            f"{len(np.setdiff1d(joined, rows))} not in the round)"
        )
    if group_of is not None:
        per_share = [np.unique(group_of[share]) for share in arrays]
        if sum(len(g) for g in per_share) != len(np.unique(group_of[joined])):
            raise SamplerError(f"{where} put members of one GRPO group into two shares; whole groups were asked for")
    return arrays
