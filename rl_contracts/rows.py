"""Row helpers for the queue's jagged token fields: lists of ids in, a jagged nested tensor out, and back."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def jagged(rows: list[list[Any]], dtype: torch.dtype) -> torch.Tensor:
    """A jagged nested tensor from lists of different lengths, built as values + offsets in one pass (building it
    from one small tensor per row costs milliseconds per batch)."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = torch.tensor([x for r in rows for x in r], dtype=dtype)
    return torch.nested.nested_tensor_from_jagged(values, torch.from_numpy(offsets))


def rows_of(nested: torch.Tensor) -> list[list[int]]:
    """Lists of token ids from a jagged nested tensor of integers (one gather for the whole batch)."""
    return _rows(nested)


def float_rows_of(nested: torch.Tensor) -> list[list[float]]:
    """Lists of floats (log-probs, loss masks) from a jagged nested tensor of floats."""
    return _rows(nested)


def _rows(nested: torch.Tensor) -> list[list[Any]]:
    # a jagged nested tensor has offsets(); torch's Tensor stubs do not declare it
    offsets = nested.offsets().tolist()  # type: ignore[attr-defined]
    values = nested.values().tolist()
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
