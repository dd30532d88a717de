"""GRPOSampler: whole GRPO groups only, never split, never mixed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from transfer_queue.samplers.base import BaseSampler, ReadyRows


class GRPOSampler(BaseSampler):
    """Serves a group only when all ``num_n_samples`` of its rows are ready; ``batch_size`` must be a multiple
    of ``num_n_samples``. Groups are the partition's explicit group ids, never inferred from index adjacency.

    Args:
        num_n_samples: rows per group (responses per prompt); must match the controller's ``num_n_samples``.
    """

    serves_whole_groups = True

    def __init__(self, num_n_samples: int):
        if not isinstance(num_n_samples, int) or num_n_samples < 1:
            raise ValueError(f"GRPOSampler: num_n_samples must be an int >= 1, got {num_n_samples!r}")
        self.num_n_samples = num_n_samples

    def sample(self, ready_indices: Sequence[int] | np.ndarray, batch_size: int, **kwargs: Any) -> Sequence[int]:
        ready = np.asarray(ready_indices, dtype=np.int64)
        groups = kwargs.get("group_ids")
        groups = ready // self.num_n_samples if groups is None else np.asarray(groups, dtype=np.int64)
        chosen: list[int] = []
        for g in dict.fromkeys(groups.tolist()):  # groups in order of first appearance
            members = ready[groups == g]
            if len(members) == self.num_n_samples:
                chosen.extend(members.tolist())
                if len(chosen) >= batch_size:
                    break
        return chosen[:batch_size]

    def select(self, ready: ReadyRows, batch_size: int, whole_groups: bool) -> np.ndarray:
        return ready.first_groups(batch_size // ready.group_size)

    def __repr__(self) -> str:
        return f"GRPOSampler(num_n_samples={self.num_n_samples})"
