"""Columns: one field's rows as a few raw buffers, and back.

A TensorDict is split into columns at put time and rebuilt from columns at get time:

- ``dense``: a ``[rows, *shape]`` tensor, one buffer; comes back dense (never as a nested tensor).
- ``jagged``: a nested tensor with the jagged layout, two buffers (``values [total, *shape]``, ``offsets
  int64 [rows + 1]``); comes back as a jagged nested tensor.
- ``object``: non-tensor data (str, bytes or msgpack-encodable values), one msgpack buffer; comes back as a
  ``NonTensorStack``, or, for a numpy array of ``str``, ``bytes`` or ``object`` (verl's ``non_tensor_batch``), as a
  numpy array of the same kind (the schema's dtype is then ``numpy.U``, ``numpy.S`` or ``numpy.O``). Elements are
  msgpack-encoded, never pickled; numpy scalars inside them travel as the Python numbers they hold.

Buffers are views of the tensors' memory (no copy on the way out) and tensors are built over received frames
(no copy on the way in). CUDA tensors are copied to host here.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

if TYPE_CHECKING:  # tensordict (and the torch._dynamo it pulls in) loads only where TensorDicts are built:
    # storage units move columns and never need it, and start seconds faster without it
    from tensordict import TensorDict, TensorDictBase

from transfer_queue.errors import BatchSizeMismatch, InvalidRequest, SchemaMismatch, UnknownField, UnsupportedValue
from transfer_queue.metadata import FieldSchema

Buffer = Any  # an object exposing the buffer protocol (numpy array, memoryview, zmq.Frame)

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    )
}


def _encode_numpy_scalar(value: Any) -> Any:
    if isinstance(value, np.generic):  # np.int64(3) in an object array: the number it holds
        return value.item()
    raise TypeError(f"Encoding objects of type {type(value).__name__} is unsupported")


_OBJECT_ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode_numpy_scalar)
NUMPY_KINDS = {"U": "numpy.U", "S": "numpy.S", "O": "numpy.O"}  # numpy dtype kind -> object column dtype


def _drop_fx_tracing_notice(record: logging.LogRecord) -> bool:
    return "is_fx_tracing will return true" not in record.getMessage()


# torch's own jagged constructor (nested_tensor_from_jagged) calls its deprecated is_fx_tracing, which logs a
# warning once per process: every actor printed it. Nothing here traces; drop exactly that notice.
logging.getLogger("torch.fx._symbolic_trace").addFilter(_drop_fx_tracing_notice)
_OBJECT_DECODER = msgspec.msgpack.Decoder()


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise UnsupportedValue(f"dtype {dtype} cannot travel through the queue; supported: {sorted(_DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise UnsupportedValue(f"unknown dtype {name!r}; supported: {sorted(_DTYPES)}") from None


def as_buffer(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def nbytes_of(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape`` (Python ints: no int64 wrap)."""
    return math.prod(int(d) for d in shape) * torch.empty((), dtype=dtype).element_size()


def from_buffer(buf: Buffer, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor over a received buffer, without a copy (the tensor keeps the buffer alive)."""
    view = memoryview(buf)
    expected = nbytes_of(dtype, shape)
    if view.nbytes != expected:
        raise InvalidRequest(f"a {dtype} buffer of shape {list(shape)} needs {expected} bytes, got {view.nbytes}")
    if expected == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    with warnings.catch_warnings():
        # Received frames are read-only memory we own; tensors built over them are never written in place.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(view, dtype=torch.uint8)
    return raw.view(dtype).reshape(tuple(shape))


def row_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A ``[rows, bytes per row]`` uint8 numpy view of a contiguous CPU tensor of any dtype (no copy)."""
    rows = tensor.shape[0]
    width = int(np.prod(tensor.shape[1:], dtype=np.int64)) * tensor.element_size()
    if tensor.numel() == 0:
        return np.zeros((rows, width), dtype=np.uint8)
    return tensor.reshape(-1).view(torch.uint8).numpy().reshape(rows, width)


def from_row_bytes(array: np.ndarray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The tensor ``[rows, *shape]`` of ``dtype`` over a ``[rows, bytes]`` uint8 array (no copy)."""
    if array.size == 0:
        return torch.empty((array.shape[0], *shape), dtype=dtype)
    return torch.from_numpy(np.ascontiguousarray(array).reshape(-1)).view(dtype).reshape(array.shape[0], *shape)


def take_rows(tensor: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """``tensor[rows]`` as one numpy gather: numpy copies on the calling thread, where torch would wake its
    intra-op thread pool (which fights the queue's servers for cores on small machines)."""
    return from_row_bytes(np.take(row_bytes(tensor), rows, axis=0), tensor.dtype, tensor.shape[1:])


def pinned_empty(nbytes: int) -> np.ndarray:
    """A uint8 array of ``nbytes`` in page-locked host memory, from torch's pinned-memory cache (reused once dropped):
    a copy between it and a GPU is a DMA at full speed, without the driver's copy through its own staging buffer."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A GPU tensor copied (and waited for) into contiguous page-locked host memory: what a put sends from."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor)
    return host


@dataclass
class Column:
    """One field's rows: a dense tensor, a (values, offsets) pair, or a list of objects."""

    schema: FieldSchema
    num_rows: int
    data: torch.Tensor | None = None  # dense: [rows, *shape]; jagged: values [total, *shape]
    offsets: torch.Tensor | None = None  # jagged: int64 [rows + 1], offsets[0] == 0
    objects: list[Any] | None = None  # object

    # ---- building -----------------------------------------------------------------------------------------
    @classmethod
    def from_value(cls, name: str, value: Any, num_rows: int) -> Column:
        if isinstance(value, torch.Tensor):
            if value.is_nested:  # before detach(): every op on a nested tensor goes through a slow dispatcher
                return cls._from_nested(name, value, num_rows)
            if value.layout != torch.strided or value.device.type == "meta":
                raise UnsupportedValue(
                    f"field {name!r}: a {value.layout} tensor on {value.device} cannot travel; only strided tensors "
                    "with data (dense, or nested for jagged rows)"
                )
            value = value.detach()
            if value.device.type == "cuda":
                value = pinned_copy(value)
            elif value.device.type != "cpu":
                value = value.to("cpu")
            if value.dim() == 0 or value.shape[0] != num_rows:
                raise BatchSizeMismatch(
                    f"field {name!r} has {value.shape[0] if value.dim() else 0} rows; the batch has {num_rows}"
                )
            value = value.contiguous()
            return cls(FieldSchema("dense", dtype_name(value.dtype), tuple(value.shape[1:])), num_rows, data=value)
        from tensordict import NonTensorData, NonTensorStack

        if isinstance(value, NonTensorData) and isinstance(value.data, np.ndarray) and value.data.ndim >= 1:
            value = value.data  # a TensorDict holds a numpy array of str/bytes/objects as one NonTensorData
        if isinstance(value, np.ndarray):
            if value.dtype.kind not in NUMPY_KINDS:  # numbers: a dense tensor
                try:
                    tensor = torch.from_numpy(np.ascontiguousarray(value))
                except TypeError:
                    raise UnsupportedValue(
                        f"field {name!r}: a numpy array of dtype {value.dtype} cannot travel; numbers, bool, str, "
                        "bytes and object arrays can"
                    ) from None
                return cls.from_value(name, tensor, num_rows)
            return cls.from_numpy(name, value, num_rows)
        if isinstance(value, NonTensorData):
            return cls.from_objects(name, [value.data] * num_rows, num_rows)
        if isinstance(value, NonTensorStack):
            return cls.from_objects(name, value.tolist(), num_rows)
        if isinstance(value, (list, tuple)):
            return cls.from_objects(name, list(value), num_rows)
        raise UnsupportedValue(f"field {name!r}: expected a tensor or non-tensor data, got {type(value).__name__}")

    @classmethod
    def from_objects(cls, name: str, objects: list[Any], num_rows: int, dtype: str = "object") -> Column:
        if len(objects) != num_rows:
            raise BatchSizeMismatch(f"field {name!r} has {len(objects)} rows; the batch has {num_rows}")
        try:
            _OBJECT_ENCODER.encode(objects)
        except (TypeError, OverflowError) as exc:
            raise UnsupportedValue(
                f"field {name!r}: non-tensor values must be str, bytes or msgpack-encodable; {_first_bad(objects)}"
                f" ({exc})"
            ) from None
        _check_round_trip(name, objects)
        return cls(FieldSchema("object", dtype, ()), num_rows, objects=objects)

    @classmethod
    def from_numpy(cls, name: str, array: np.ndarray, num_rows: int) -> Column:
        """A numpy array of str, bytes or objects, one row per entry of its first dimension."""
        if array.ndim == 0 or array.shape[0] != num_rows:
            raise BatchSizeMismatch(
                f"field {name!r} has {array.shape[0] if array.ndim else 0} rows; the batch has {num_rows}"
            )
        # one msgpack value per row: the element (1-D), or the row's elements flattened (more dimensions)
        objects = array.tolist() if array.ndim == 1 else [row.reshape(-1).tolist() for row in array]
        column = cls.from_objects(name, objects, num_rows, NUMPY_KINDS[array.dtype.kind])
        column.schema = FieldSchema("object", column.schema.dtype, tuple(array.shape[1:]))
        return column

    @classmethod
    def _from_nested(cls, name: str, value: torch.Tensor, num_rows: int) -> Column:
        if value.layout != torch.jagged:
            rows = list(value.unbind())
            try:
                value = torch.nested.nested_tensor(rows, layout=torch.jagged)
            except RuntimeError:  # torch: jagged tensors are ragged in one dimension only
                shapes = [list(r.shape) for r in rows[:4]]
                raise UnsupportedValue(
                    f"field {name!r}: a nested tensor whose rows differ in more than their first dimension cannot "
                    f"travel (row shapes {shapes}...); pad it, or split it into fields ragged in one dimension"
                ) from None
        if value.size(0) != num_rows:
            raise BatchSizeMismatch(f"field {name!r} has {value.size(0)} rows; the batch has {num_rows}")
        if value._ragged_idx != 1:  # type: ignore[attr-defined]
            raise UnsupportedValue(f"field {name!r}: only nested tensors ragged in their first row dimension travel")
        # The jagged layout's own buffers (a plain values tensor and offsets), read without the nested dispatcher.
        values = getattr(value, "_values", None)
        raw_offsets = getattr(value, "_offsets", None)
        if values is None or raw_offsets is None:
            values, raw_offsets = value.values(), value.offsets()  # type: ignore[attr-defined]
        values = values.detach().to("cpu")
        raw_offsets = raw_offsets.detach().to("cpu", torch.int64)
        offsets = raw_offsets - raw_offsets[0]
        if int(raw_offsets[0]) != 0 or values.shape[0] != int(offsets[-1]):
            values = values[int(raw_offsets[0]) : int(raw_offsets[-1])]
        values = values.contiguous()
        schema = FieldSchema("jagged", dtype_name(values.dtype), tuple(values.shape[1:]))
        return cls(schema, num_rows, data=values, offsets=offsets.contiguous())

    def as_jagged(self) -> Column:
        """A dense column ``[rows, n, *shape]`` as a jagged one whose every row has length ``n``; others as is."""
        if self.schema.kind != "dense":
            return self
        assert self.data is not None
        if self.data.dim() < 2:
            raise SchemaMismatch(
                f"a dense field of per-row shape {list(self.schema.shape)} has no dimension to be jagged along"
            )
        n = int(self.data.shape[1])
        values = self.data.reshape(self.num_rows * n, *self.data.shape[2:])
        offsets = torch.arange(self.num_rows + 1, dtype=torch.int64) * n
        schema = FieldSchema("jagged", self.schema.dtype, tuple(self.data.shape[2:]))
        return Column(schema, self.num_rows, values, offsets)

    # ---- slicing and sizes --------------------------------------------------------------------------------
    def slice(self, start: int, stop: int) -> Column:
        """Rows ``[start, stop)``; dense and jagged values are views, not copies."""
        n = stop - start
        if self.schema.kind == "dense":
            assert self.data is not None
            return Column(self.schema, n, data=self.data[start:stop])
        if self.schema.kind == "jagged":
            assert self.data is not None and self.offsets is not None
            offsets = self.offsets.numpy()  # numpy: a fraction of torch's per-op cost on these small arrays
            lo, hi = int(offsets[start]), int(offsets[stop])
            return Column(
                self.schema, n, data=self.data[lo:hi], offsets=torch.from_numpy(offsets[start : stop + 1] - lo)
            )
        assert self.objects is not None
        return Column(self.schema, n, objects=self.objects[start:stop])

    @property
    def nbytes(self) -> int:
        if self.schema.kind == "object":
            return len(_OBJECT_ENCODER.encode(self.objects))
        assert self.data is not None
        extra = self.offsets.numel() * 8 if self.offsets is not None else 0
        return self.data.numel() * self.data.element_size() + extra

    def row_lengths(self) -> np.ndarray | None:
        """Per-row lengths for length-balanced sampling: jagged row lengths, or the row sums of a 2-D mask."""
        if self.schema.kind == "jagged":
            assert self.offsets is not None
            return np.diff(self.offsets.numpy())
        if self.schema.kind == "dense" and self.data is not None and self.data.dim() == 2:
            if self.data.dtype in (torch.bfloat16, torch.float16):
                return self.data.to(torch.int64).sum(dim=1).numpy()
            return self.data.numpy().sum(axis=1, dtype=np.int64)  # numpy: no torch thread pool on the put path
        return None

    # ---- wire ---------------------------------------------------------------------------------------------
    def buffers(self) -> list[Buffer]:
        if self.schema.kind == "object":
            return [_OBJECT_ENCODER.encode(self.objects)]
        assert self.data is not None
        if self.schema.kind == "dense":
            return [as_buffer(self.data)]
        assert self.offsets is not None
        return [as_buffer(self.data), as_buffer(self.offsets)]

    @classmethod
    def from_buffers(cls, schema: FieldSchema, num_rows: int, buffers: Sequence[Buffer]) -> Column:
        if num_rows < 0:
            raise InvalidRequest(f"a column needs num_rows >= 0, got {num_rows}")
        if len(buffers) != nframes(schema):
            raise InvalidRequest(f"a {schema.kind} column needs {nframes(schema)} buffers, got {len(buffers)}")
        if schema.kind == "object":
            try:
                objects = _OBJECT_DECODER.decode(buffers[0])
            except msgspec.DecodeError as exc:
                raise InvalidRequest(f"malformed object column: {exc}") from None
            if not isinstance(objects, list) or len(objects) != num_rows:
                raise InvalidRequest(f"an object column of {num_rows} rows must decode to a list of {num_rows}")
            return cls(schema, num_rows, objects=objects)
        dtype = torch_dtype(schema.dtype)
        if schema.kind == "dense":
            return cls(schema, num_rows, data=from_buffer(buffers[0], dtype, (num_rows, *schema.shape)))
        offsets = from_buffer(buffers[1], torch.int64, (num_rows + 1,))
        total = int(offsets[-1])
        if int(offsets[0]) != 0 or (num_rows and bool((offsets[1:] < offsets[:-1]).any())):
            raise InvalidRequest("jagged offsets must start at 0 and never decrease")
        values = from_buffer(buffers[0], dtype, (total, *schema.shape))
        return cls(schema, num_rows, data=values, offsets=offsets)

    def to_value(self) -> Any:
        """The column as a TensorDict entry: a tensor, a jagged nested tensor or a NonTensorStack."""
        if self.schema.kind == "dense":
            return self.data
        if self.schema.kind == "jagged":
            assert self.data is not None and self.offsets is not None
            return torch.nested.nested_tensor_from_jagged(self.data, self.offsets)
        if self.schema.dtype in _NUMPY_DTYPES:
            return self._to_numpy()
        from tensordict import NonTensorStack

        return NonTensorStack(*self.objects) if self.objects else NonTensorStack(batch_size=[0])

    def _to_numpy(self) -> np.ndarray:
        assert self.objects is not None
        shape = self.schema.shape
        flat = [v for row in self.objects for v in row] if shape else self.objects
        kind = _NUMPY_DTYPES[self.schema.dtype]
        if kind == "O":  # element by element: numpy would turn nested lists into more dimensions
            array = np.empty(len(flat), dtype=object)
            for i, v in enumerate(flat):
                array[i] = v
        else:
            array = np.array(flat, dtype=kind) if flat else np.zeros(0, dtype=kind)
        return array.reshape(self.num_rows, *shape)


_NUMPY_DTYPES = {v: k for k, v in NUMPY_KINDS.items()}


# What comes back as itself: msgpack also encodes sets, dates, UUIDs, enums, dataclasses, ... but they come back as
# lists, strings or dicts (a set of ints as a list: ``LinkedList([[1], [2]])`` in a NonTensorStack), so they are
# refused at put time. Subclasses (an IntEnum, an OrderedDict) come back as their base; tuples come back as lists.
_LEAVES = (str, bytes, bool, int, float, type(None), np.generic)
_CONTAINERS = (list, tuple, dict)


def _check_round_trip(name: str, objects: list[Any]) -> None:
    """Raise UnsupportedValue naming the first row that holds a value that would not come back as itself."""
    for row, value in enumerate(objects):
        if isinstance(value, _LEAVES):
            continue
        bad = _lossy_part(value)
        if bad is not None:
            kind = type(bad).__qualname__ if type(bad).__module__ == "builtins" else _type_name(bad)
            raise UnsupportedValue(
                f"field {name!r}: row {row} holds a {kind}, which would not come back as itself (non-tensor values "
                "travel as msgpack: str, bytes, bool, int, float, None, numpy scalars, and lists, tuples and dicts of "
                "them; tuples come back as lists); convert it first, e.g. to a sorted list"
            )


def _lossy_part(value: Any) -> Any:
    """The first value inside ``value`` (or ``value`` itself) that is neither a leaf nor a container; None if none."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _LEAVES):
            continue
        if not isinstance(item, _CONTAINERS):
            return item
        if isinstance(item, dict):
            stack.extend(reversed([v for kv in item.items() for v in kv]))
        else:
            stack.extend(reversed(item))
    return None


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _first_bad(objects: list[Any]) -> str:
    """Names the first row whose value msgpack cannot encode, and its type."""
    for row, value in enumerate(objects):
        try:
            _OBJECT_ENCODER.encode(value)
        except (TypeError, OverflowError):
            return f"row {row} ({type(value).__name__}): {_bad_part(value)}"
    return "a value is too large"


def _bad_part(value: Any) -> str:
    """The innermost value that cannot be encoded (inside lists, tuples and dict values)."""
    inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else None
    for item in inner or ():
        try:
            _OBJECT_ENCODER.encode(item)
        except (TypeError, OverflowError):
            return _bad_part(item)
    if isinstance(value, int):
        return f"{value} lies outside msgpack's integer range"
    return f"{_type_name(value)} is not msgpack-encodable"


def nframes(schema: FieldSchema) -> int:
    return 2 if schema.kind == "jagged" else 1


def columns_from_tensordict(
    data: TensorDictBase | dict[str, Any], jagged: Sequence[str] = ()
) -> tuple[int, dict[str, Column]]:
    """Split a TensorDict (or a dict of equally long fields) into columns; returns (rows, columns).

    Dense fields named in ``jagged`` become jagged columns (ragged along their first per-row dimension), so that
    their length may differ from put to put.
    """
    from tensordict import NonTensorData, NonTensorStack, TensorDictBase

    if isinstance(data, TensorDictBase):
        if len(data.batch_size) < 1:
            raise InvalidRequest(
                f"put needs a TensorDict with a batch dimension, got batch_size={list(data.batch_size)}"
            )
        num_rows = int(data.batch_size[0])
        items = [(k, data.get(k)) for k in data.keys(include_nested=False, leaves_only=False)]
    elif isinstance(data, dict):
        sizes = {k: _rows_of(k, v) for k, v in data.items()}
        if len(set(sizes.values())) > 1:
            raise BatchSizeMismatch(f"fields of one put must have the same number of rows, got {sizes}")
        num_rows = next(iter(sizes.values()), 0)
        items = list(data.items())
    else:
        raise InvalidRequest(f"put expects a TensorDict, got {type(data).__name__}")
    if not items:
        raise InvalidRequest("put needs at least one field")
    columns = {}
    for name, value in items:
        if isinstance(value, TensorDictBase) and not isinstance(value, (NonTensorData, NonTensorStack)):
            raise UnsupportedValue(f"field {name!r}: nested TensorDicts are not supported; flatten the keys first")
        columns[str(name)] = Column.from_value(str(name), value, num_rows)
    unknown = [n for n in jagged if n not in columns]
    if unknown:
        raise UnknownField(f"jagged names fields {unknown} that the put does not have; it has {list(columns)}")
    for name in jagged:
        columns[name] = columns[name].as_jagged()
    return num_rows, columns


def _rows_of(name: Any, value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.size(0)) if value.dim() else 0
    if isinstance(value, np.ndarray):
        return int(value.shape[0]) if value.ndim else 0
    try:
        return len(value)
    except TypeError:
        raise UnsupportedValue(
            f"field {name!r}: expected a tensor, an array or a list of rows, got {type(value).__name__}"
        ) from None


def tensordict_from_columns(columns: dict[str, Column], num_rows: int) -> TensorDict:
    from tensordict import TensorDict

    return TensorDict({name: col.to_value() for name, col in columns.items()}, batch_size=[num_rows])


def concat_columns(parts: Sequence[Column], positions: Sequence[np.ndarray], num_rows: int) -> Column:
    """Assemble one column of ``num_rows`` rows from parts; ``positions[i]`` says where part i's rows go.

    One part covering every row in order is returned as is (no copy); otherwise rows are scattered once.
    """
    schema = parts[0].schema
    if len(parts) == 1 and np.array_equal(positions[0], np.arange(num_rows)):
        return parts[0]
    if schema.kind == "object":
        objects: list[Any] = [None] * num_rows
        for part, pos in zip(parts, positions, strict=True):
            assert part.objects is not None
            for p, obj in zip(pos.tolist(), part.objects, strict=True):
                objects[p] = obj
        return Column(schema, num_rows, objects=objects)
    if schema.kind == "dense":
        first = parts[0].data
        assert first is not None
        width = int(np.prod(first.shape[1:], dtype=np.int64)) * first.element_size()
        out = np.empty((num_rows, width), dtype=np.uint8)
        for part, pos in zip(parts, positions, strict=True):
            assert part.data is not None
            src = row_bytes(part.data)
            if len(pos) and pos[-1] - pos[0] == len(pos) - 1 and np.all(np.diff(pos) == 1):
                out[int(pos[0]) : int(pos[-1]) + 1] = src
            else:
                out[pos] = src
        return Column(schema, num_rows, data=from_row_bytes(out, first.dtype, first.shape[1:]))
    # jagged: lay the parts end to end, then take rows in destination order with one gather
    first = parts[0].data
    assert first is not None
    values = from_row_bytes(
        np.concatenate([row_bytes(p.data) for p in parts if p.data is not None]), first.dtype, first.shape[1:]
    )
    part_offsets, base = [np.zeros(1, dtype=np.int64)], 0
    for part in parts:
        assert part.offsets is not None
        part_offsets.append(part.offsets.numpy()[1:] + base)
        base += int(part.offsets[-1])
    order = np.argsort(np.concatenate(positions), kind="stable")
    data, offsets = jagged_take(values, np.concatenate(part_offsets), order)
    return Column(schema, num_rows, data=data, offsets=offsets)


def jagged_take(values: torch.Tensor, offsets: np.ndarray, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``rows`` of a jagged column (values + offsets), as new values and offsets, in one gather."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    new_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    if len(rows) and np.all(np.diff(rows) == 1):  # one contiguous run: a view
        return values[int(starts[0]) : int(starts[0]) + int(new_offsets[-1])], torch.from_numpy(new_offsets)
    index = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(int(new_offsets[-1]), dtype=np.int64)
    return take_rows(values, index), torch.from_numpy(new_offsets)
