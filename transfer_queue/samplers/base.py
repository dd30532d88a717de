"""BaseSampler: what a ``get_meta`` returns, given what is ready.

A sampler has the seed's two methods:

- ``filter_ready_indices(all_indices, production_status, consumption_status, data_fields, field_mapping,
  **kwargs)`` -> the global indexes ready for the calling task. ``all_indices`` is a 1-D int64 array of the
  partition's committed global indexes; ``production_status`` a ``(rows, fields)`` bool array aligned with it;
  ``field_mapping`` maps a field name to its column; ``consumption_status`` a 1-D bool array (True: consumed or
  leased by this task); ``kwargs`` hold the ``sampler_params`` plus ``task_name``, ``partition_id``,
  ``num_n_samples`` and ``group_ids`` (aligned with ``all_indices``).
- ``sample(ready_indices, batch_size, **kwargs)`` -> the global indexes to hand out (``kwargs`` as above, with
  ``group_ids`` aligned with ``ready_indices``).

Built-in samplers also implement :meth:`BaseSampler.select`, a fast path over the controller's incremental ready
index (O(batch), never a scan). The controller uses it only when a subclass overrides neither of the two seed
methods, so a user subclass that changes either gets exactly the behaviour it wrote. A user subclass costs O(ready
rows) per call: its ``sample`` is handed the ready rows, read from the same ready index, and the whole table is read
only for a ``filter_ready_indices`` of the seed's form; one that sets :attr:`BaseSampler.ready_rows_only` is handed
the ready rows instead (the same arguments, one row per ready row).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np


class ReadyRows(Protocol):
    """The controller's view of rows ready for one task and one set of fields (local row numbers)."""

    group_size: int

    def num_rows(self) -> int: ...

    def num_groups(self) -> int: ...

    def first_rows(self, k: int) -> np.ndarray: ...

    def first_groups(self, k: int) -> np.ndarray: ...


class BaseSampler(ABC):
    """Decides which ready rows a ``get_meta`` returns. Subclass it and implement :meth:`sample`.

    >>> class NewestFirst(BaseSampler):
    ...     def sample(self, ready_indices, batch_size, **kwargs):
    ...         return sorted(ready_indices, reverse=True)[:batch_size]
    """

    #: serve whole GRPO groups only (as ``get_n_samples=True`` does for any sampler)
    serves_whole_groups: bool = False
    #: hand ``filter_ready_indices`` only the rows ready for the task (O(ready rows) per call), not every committed
    #: row of the partition (the seed's form, O(rows)); for a readiness rule that reads each row on its own
    ready_rows_only: bool = False

    def filter_ready_indices(
        self,
        all_indices: np.ndarray,
        production_status: np.ndarray,
        consumption_status: np.ndarray,
        data_fields: Sequence[str],
        field_mapping: dict[str, int],
        **kwargs: Any,
    ) -> np.ndarray:
        """Global indexes whose requested fields are all produced and that this task has not consumed.

        The controller calls it only where a subclass overrides it, with every committed row of the partition, or,
        where :attr:`ready_rows_only` is set, with the rows ready for the task only (``consumption_status`` all
        False): the answer must be a subset of those rows either way.
        """
        all_indices = np.asarray(all_indices, dtype=np.int64)
        cols = [field_mapping[f] for f in data_fields]
        produced = np.asarray(production_status, dtype=bool)[:, cols].all(axis=1)
        return all_indices[produced & ~np.asarray(consumption_status, dtype=bool)]

    @abstractmethod
    def sample(self, ready_indices: Sequence[int] | np.ndarray, batch_size: int, **kwargs: Any) -> Sequence[int]:
        """Choose up to ``batch_size`` of ``ready_indices`` (global indexes) to hand out."""

    def select(self, ready: ReadyRows, batch_size: int, whole_groups: bool) -> np.ndarray:
        """Fast path of built-in samplers: local rows to hand out, read from the incremental ready index."""
        raise NotImplementedError

    def split(self, rows: np.ndarray, num_shares: int, lengths: np.ndarray, group_size: int) -> list[np.ndarray]:
        """Split the rows of one DP round into ``num_shares`` shares, one per DP rank (contiguous by default).

        ``group_size > 1`` means rows come group by group and a group is never split across shares.
        """
        units = len(rows) // group_size
        bounds = [round(i * units / num_shares) * group_size for i in range(num_shares + 1)]
        return [rows[bounds[i] : bounds[i + 1]] for i in range(num_shares)]

    def default_sampler_params(self) -> dict[str, Any]:
        """``sampler_params`` this sampler applies when the caller does not pass them (DPSampler: its rank)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    @property
    def uses_fast_path(self) -> bool:
        """True when the controller may call :meth:`select` instead of the two seed methods."""
        cls = type(self)
        owner = next((c for c in cls.__mro__ if "select" in c.__dict__), BaseSampler)
        return (
            owner is not BaseSampler
            and cls.filter_ready_indices is BaseSampler.filter_ready_indices
            and cls.sample is owner.sample  # type: ignore[attr-defined]
        )


SamplerSpec = BaseSampler | type[BaseSampler] | Callable[[], BaseSampler]
