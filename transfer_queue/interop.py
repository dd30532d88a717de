"""verl's ``DataProto`` in and out of the queue, without importing verl.

A ``DataProto`` is three things: ``batch`` (a TensorDict of tensors, first dimension = rows), ``non_tensor_batch``
(a dict of numpy arrays, one entry per row: str, bytes or objects) and ``meta_info`` (a dict about the whole
batch). :func:`from_dataproto` turns one into the TensorDict that ``put`` takes; :func:`to_dataproto` turns what
``get_data`` returns back into one. Numpy arrays keep their kind (``str``, ``bytes``, ``object``), jagged tensors
stay jagged, and ``meta_info`` travels (when asked) as one non-tensor field, the same dict on every row.

>>> from transfer_queue.interop import from_dataproto, to_dataproto
>>> client.put(from_dataproto(proto), global_step=0)  # doctest: +SKIP
>>> proto = to_dataproto(client.get_data(meta), dataproto_cls=verl.DataProto)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from transfer_queue.errors import BatchSizeMismatch, InvalidRequest, UnsupportedValue

META_INFO_FIELD = "meta_info"


@dataclass
class DataProtoParts:
    """What :func:`to_dataproto` returns when no ``dataproto_cls`` is given: DataProto's three attributes."""

    batch: TensorDict | None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        return len(next(iter(self.non_tensor_batch.values()), ()))


def from_dataproto(proto: Any, meta_info_field: str | None = META_INFO_FIELD) -> TensorDict:
    """The TensorDict to ``put`` for a DataProto-shaped object (``batch``, ``non_tensor_batch``, ``meta_info``).

    Args:
        proto: anything with those three attributes (``verl.DataProto`` or :class:`DataProtoParts`).
        meta_info_field: store a non-empty ``meta_info`` under this field (msgpack-encodable values only; the
            same dict on every row); ``None`` leaves it out.

    Raises:
        InvalidRequest (not DataProto-shaped, or a name clash), BatchSizeMismatch (arrays of another length than
        the batch), UnsupportedValue (a value that cannot travel, naming its field and row).
    """
    if not all(hasattr(proto, a) for a in ("batch", "non_tensor_batch", "meta_info")):
        raise InvalidRequest(
            f"from_dataproto expects an object with batch, non_tensor_batch and meta_info, got {type(proto).__name__}"
        )
    batch, arrays, meta_info = proto.batch, dict(proto.non_tensor_batch or {}), dict(proto.meta_info or {})
    if batch is not None and not isinstance(batch, TensorDictBase):
        raise InvalidRequest(f"DataProto.batch must be a TensorDict or None, got {type(batch).__name__}")
    if batch is not None and len(batch.batch_size) < 1:
        raise InvalidRequest(f"DataProto.batch needs a batch dimension, got batch_size={list(batch.batch_size)}")
    rows = int(batch.batch_size[0]) if batch is not None else len(next(iter(arrays.values()), ()))
    out = TensorDict({}, batch_size=[rows])
    if batch is not None:
        for key in batch.keys(include_nested=False, leaves_only=False):
            out.set(key, batch.get(key))
    for name, array in arrays.items():
        if name in out:
            raise InvalidRequest(f"field {name!r} is both in DataProto.batch and in non_tensor_batch")
        if not isinstance(array, np.ndarray):
            raise UnsupportedValue(f"non_tensor_batch[{name!r}] must be a numpy array, got {type(array).__name__}")
        if array.ndim == 0 or array.shape[0] != rows:
            got = array.shape[0] if array.ndim else 0
            raise BatchSizeMismatch(f"non_tensor_batch[{name!r}] has {got} rows; the batch has {rows}")
        out.set_non_tensor(name, array)
    if meta_info and meta_info_field is not None:
        if meta_info_field in out:
            raise InvalidRequest(f"field {meta_info_field!r} is taken by the batch; pass another meta_info_field")
        out.set(meta_info_field, NonTensorStack(*([meta_info] * rows)) if rows else NonTensorStack(batch_size=[0]))
    return out


def to_dataproto(
    data: TensorDictBase,
    dataproto_cls: Any = None,
    meta_info: dict[str, Any] | None = None,
    meta_info_field: str | None = META_INFO_FIELD,
) -> Any:
    """A DataProto from what ``get_data`` returned: tensors (dense and jagged) go to ``batch``, numpy and other
    non-tensor fields to ``non_tensor_batch`` (numpy arrays; lists become object arrays).

    Args:
        data: a TensorDict from ``get_data`` (or ``kv_batch_get``).
        dataproto_cls: the class to build (e.g. ``verl.DataProto``), called with ``batch=``, ``non_tensor_batch=``
            and ``meta_info=``; ``None`` returns a :class:`DataProtoParts`.
        meta_info: merged over the ``meta_info`` stored by :func:`from_dataproto`.
        meta_info_field: the field :func:`from_dataproto` stored ``meta_info`` in (``None``: none).
    """
    if not isinstance(data, TensorDictBase) or len(data.batch_size) < 1:
        raise InvalidRequest(f"to_dataproto expects a TensorDict with a batch dimension, got {type(data).__name__}")
    rows = int(data.batch_size[0])
    tensors: dict[str, torch.Tensor] = {}
    arrays: dict[str, np.ndarray] = {}
    info: dict[str, Any] = {}
    for key in data.keys(include_nested=False, leaves_only=False):
        value = data.get(key)
        if key == meta_info_field and isinstance(value, (NonTensorStack, NonTensorData)):
            stored = value.tolist() if isinstance(value, NonTensorStack) else [value.data]
            info = dict(stored[0]) if stored and isinstance(stored[0], dict) else {}
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, NonTensorData) and isinstance(value.data, np.ndarray):
            arrays[key] = value.data
        elif isinstance(value, np.ndarray):
            arrays[key] = value
        elif isinstance(value, (NonTensorStack, NonTensorData)):
            items = value.tolist() if isinstance(value, NonTensorStack) else [value.data] * rows
            array = np.empty(len(items), dtype=object)
            for i, item in enumerate(items):  # element by element: nested lists stay one element each
                array[i] = item
            arrays[key] = array
        else:
            raise UnsupportedValue(f"field {key!r}: to_dataproto cannot place a {type(value).__name__}")
    batch = TensorDict(tensors, batch_size=[rows]) if tensors else None
    info.update(meta_info or {})
    if dataproto_cls is None:
        return DataProtoParts(batch, arrays, info)
    return dataproto_cls(batch=batch, non_tensor_batch=arrays, meta_info=info)
