"""SequentialSampler: rows in the order they became ready (the default)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from transfer_queue.samplers.base import BaseSampler, ReadyRows


class SequentialSampler(BaseSampler):
    """Hands out ready rows first come, first served."""

    def sample(self, ready_indices: Sequence[int] | np.ndarray, batch_size: int, **kwargs: Any) -> Sequence[int]:
        return list(np.asarray(ready_indices, dtype=np.int64)[:batch_size])

    def select(self, ready: ReadyRows, batch_size: int, whole_groups: bool) -> np.ndarray:
        if whole_groups:
            return ready.first_groups(batch_size // ready.group_size)
        return ready.first_rows(batch_size)
