"""Columns: a TensorDict's fields as raw buffers and back (dense, jagged, object), gathers and scatters of rows."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import uuid
import warnings

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from transfer_queue.errors import BatchSizeMismatch, InvalidRequest, UnsupportedValue
from transfer_queue.metadata import FieldSchema
from transfer_queue.wire.columns import (
    _DTYPES,
    Column,
    as_buffer,
    columns_from_tensordict,
    concat_columns,
    from_buffer,
    jagged_take,
    pinned_empty,
    tensordict_from_columns,
)


def wire(column: Column) -> Column:
    """The column as a storage unit or client receives it: read-only bytes, one frame per buffer."""
    frames = [bytes(memoryview(b)) for b in column.buffers()]
    return Column.from_buffers(column.schema, column.num_rows, frames)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (works for every dtype, including those without comparison kernels)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(as_buffer(a.contiguous())) == bytes(as_buffer(b.contiguous()))


def rows_of(value: torch.Tensor) -> list[torch.Tensor]:
    return list(value.unbind()) if value.is_nested else list(value)


def jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def random_dense(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),), generator=gen)
    data = raw.to(torch.uint8).view(dtype).reshape(shape)
    return data if dtype != torch.bool else data.view(torch.uint8).remainder(2).to(torch.bool)


# ---- dense ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(_DTYPES.values()), ids=list(_DTYPES))
@pytest.mark.parametrize("shape", [(5,), (5, 3), (5, 2, 3), (0, 4)], ids=["rows", "row-vector", "row-matrix", "empty"])
def test_dense_round_trip(dtype, shape):
    value = random_dense(dtype, shape, torch.Generator().manual_seed(0))
    column = Column.from_value("f", value, shape[0])
    assert column.schema == FieldSchema("dense", str(dtype).removeprefix("torch."), shape[1:])
    back = wire(column).to_value()
    assert not back.is_nested and same_tensor(back, value)
    assert column.nbytes == value.numel() * value.element_size()


def test_dense_buffers_are_views_both_ways():
    value = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    (buf,) = Column.from_value("f", value, 4).buffers()
    assert buf.ctypes.data == value.data_ptr()  # no copy on the way out
    frame = np.frombuffer(bytearray(bytes(buf)), dtype=np.uint8)
    back = Column.from_buffers(FieldSchema("dense", "float32", (3,)), 4, [frame])
    assert back.data is not None and back.data.data_ptr() == frame.ctypes.data  # none on the way in
    assert torch.equal(back.data, value)


def test_non_contiguous_and_grad_tensors_travel():
    value = torch.arange(12.0, requires_grad=True).reshape(3, 4).t()
    back = wire(Column.from_value("f", value, 4)).to_value()
    assert torch.equal(back, value.detach()) and not back.requires_grad


# ---- jagged --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rows",
    [
        [torch.arange(3), torch.arange(0), torch.arange(5)],
        [torch.zeros(0, 2), torch.ones(2, 2), torch.zeros(0, 2)],
        [torch.randn(2, 2, 3), torch.randn(1, 2, 3)],
        [torch.arange(0), torch.arange(0)],
        [torch.tensor([True, False]), torch.tensor([True])],
        [torch.randn(4).to(torch.bfloat16), torch.randn(1).to(torch.bfloat16)],
    ],
    ids=["empty-row", "trailing-dim", "trailing-dims", "all-empty", "bool", "bfloat16"],
)
def test_jagged_round_trip(rows):
    value = jagged(rows)
    column = Column.from_value("f", value, len(rows))
    assert column.schema.kind == "jagged" and column.schema.shape == tuple(rows[0].shape[1:])
    assert column.row_lengths().tolist() == [len(r) for r in rows]
    back = wire(column).to_value()
    assert back.is_nested
    assert all(same_tensor(a, b) for a, b in zip(rows_of(back), rows, strict=True))


def test_jagged_tensors_over_part_of_their_values_send_only_their_rows():
    value = torch.nested.nested_tensor_from_jagged(torch.arange(7), torch.tensor([2, 5, 6]))  # rows [2 3 4] [5]
    column = Column.from_value("f", value, 2)
    assert column.offsets.tolist() == [0, 3, 4] and column.data.tolist() == [2, 3, 4, 5]
    assert [r.tolist() for r in rows_of(wire(column).to_value())] == [[2, 3, 4], [5]]


def test_strided_nested_tensors_become_jagged():
    with warnings.catch_warnings():  # torch says once per process that nested tensors are a prototype
        warnings.simplefilter("ignore", UserWarning)
        value = torch.nested.nested_tensor([torch.arange(2), torch.arange(3)])
    back = wire(Column.from_value("f", value, 2)).to_value()
    assert back.layout == torch.jagged and [r.tolist() for r in rows_of(back)] == [[0, 1], [0, 1, 2]]


def test_jagged_take_gathers_rows_in_any_order():
    values = torch.arange(10)
    offsets = np.array([0, 2, 2, 5, 10])  # rows [0 1] [] [2 3 4] [5..9]
    data, new = jagged_take(values, offsets, np.array([3, 0, 1, 0]))
    assert data.tolist() == [5, 6, 7, 8, 9, 0, 1, 0, 1] and new.tolist() == [0, 5, 7, 7, 9]
    view, new = jagged_take(values, offsets, np.array([1, 2, 3]))  # one contiguous run: a view, no copy
    assert view.data_ptr() == values[2:].data_ptr() and new.tolist() == [0, 0, 3, 8]
    empty, new = jagged_take(values, offsets, np.array([], dtype=np.int64))
    assert len(empty) == 0 and new.tolist() == [0]


# ---- object --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "objects",
    [["a", "bé", ""], [b"\x00\xff", b""], [{"k": [1, 2.5, None]}, {}], [1, "mixed", [True]]],
    ids=["str", "bytes", "dict", "mixed"],
)
def test_object_round_trip(objects):
    column = Column.from_value("f", objects, len(objects))
    assert column.schema == FieldSchema("object", "object", ())
    assert wire(column).to_value().tolist() == objects


def test_object_columns_from_tensordicts():
    td = TensorDict({"a": torch.arange(3), "s": NonTensorData("hi", batch_size=[3])}, batch_size=[3])
    td["t"] = NonTensorStack("x", "y", "z")
    num_rows, columns = columns_from_tensordict(td)
    assert num_rows == 3
    assert columns["s"].objects == ["hi"] * 3  # NonTensorData is broadcast to every row
    assert columns["t"].objects == ["x", "y", "z"]
    back = tensordict_from_columns({k: wire(c) for k, c in columns.items()}, 3)
    assert back["t"] == ["x", "y", "z"] and back["s"] == ["hi"] * 3
    assert torch.equal(back["a"], torch.arange(3))


def test_empty_columns_round_trip():
    dense = wire(Column.from_value("f", torch.zeros(0, 3), 0)).to_value()
    assert dense.shape == (0, 3)
    schema = FieldSchema("jagged", "int64", (2,))
    empty = Column(schema, 0, data=torch.zeros(0, 2, dtype=torch.int64), offsets=torch.zeros(1, dtype=torch.int64))
    back = wire(empty).to_value()
    assert back.is_nested and back.size(0) == 0
    objects = wire(Column.from_value("o", [], 0))
    assert objects.objects == [] and len(tensordict_from_columns({"o": objects}, 0)) == 0


# ---- tensordicts ---------------------------------------------------------------------------------------------
def test_a_tensordict_round_trips_with_every_kind():
    td = TensorDict(
        {
            "ids": torch.arange(6).reshape(3, 2),
            "mask": torch.ones(3, 2, dtype=torch.bool),
            "resp": jagged([torch.arange(1), torch.arange(0), torch.arange(4)]),
            "tag": NonTensorStack("a", "b", "c"),
        },
        batch_size=[3],
    )
    num_rows, columns = columns_from_tensordict(td)
    back = tensordict_from_columns({k: wire(c) for k, c in columns.items()}, num_rows)
    assert back.batch_size == torch.Size([3])
    assert torch.equal(back["ids"], td["ids"]) and torch.equal(back["mask"], td["mask"])
    assert [len(r) for r in back["resp"].unbind()] == [1, 0, 4]
    assert back["tag"] == ["a", "b", "c"]
    assert {k: c.schema.kind for k, c in columns.items()} == {
        "ids": "dense",
        "mask": "dense",
        "resp": "jagged",
        "tag": "object",
    }


def test_dicts_of_fields_are_accepted_and_must_agree_on_rows():
    num_rows, columns = columns_from_tensordict({"a": torch.zeros(2), "b": ["x", "y"]})
    assert num_rows == 2 and set(columns) == {"a", "b"}
    with pytest.raises(BatchSizeMismatch, match=r"fields of one put must have the same number of rows, got"):
        columns_from_tensordict({"a": torch.zeros(2), "b": ["x"]})


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (torch.zeros(3), BatchSizeMismatch, "field 'f' has 3 rows; the batch has 2"),
        (torch.tensor(1.0), BatchSizeMismatch, "field 'f' has 0 rows; the batch has 2"),
        (["a"], BatchSizeMismatch, "field 'f' has 1 rows; the batch has 2"),
        (jagged([torch.arange(1)] * 3), BatchSizeMismatch, "field 'f' has 3 rows; the batch has 2"),
        ({1, 2}, UnsupportedValue, "field 'f': expected a tensor or non-tensor data, got set"),
        ([object(), 1], UnsupportedValue, "field 'f': non-tensor values must be str, bytes or msgpack-encodable"),
        (torch.zeros(2, dtype=torch.float8_e4m3fn), UnsupportedValue, "dtype torch.float8_e4m3fn cannot travel"),
    ],
    ids=["rows", "0-d", "list-rows", "jagged-rows", "set", "object", "dtype"],
)
def test_bad_values_get_typed_errors(value, error, message):
    with pytest.raises(error, match=message):
        Column.from_value("f", value, 2)


def test_bad_tensordicts_get_typed_errors():
    with pytest.raises(InvalidRequest, match=r"put needs a TensorDict with a batch dimension, got batch_size=\[\]"):
        columns_from_tensordict(TensorDict({"a": torch.zeros(2)}, batch_size=[]))
    with pytest.raises(UnsupportedValue, match="field 'n': nested TensorDicts are not supported"):
        columns_from_tensordict(TensorDict({"n": TensorDict({"a": torch.zeros(2)}, [2])}, batch_size=[2]))
    with pytest.raises(InvalidRequest, match="put needs at least one field"):
        columns_from_tensordict(TensorDict({}, batch_size=[2]))
    with pytest.raises(InvalidRequest, match="put expects a TensorDict, got list"):
        columns_from_tensordict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(UnsupportedValue, match="only nested tensors ragged in their first row dimension"):
        ragged_last = torch.nested.nested_tensor_from_jagged(torch.zeros(4, 3), torch.tensor([0, 2, 4])).transpose(1, 2)
        Column.from_value("f", ragged_last, 2)


# ---- receiving malformed buffers -----------------------------------------------------------------------------
DENSE = FieldSchema("dense", "int32", (2,))
JAGGED = FieldSchema("jagged", "int64", ())


@pytest.mark.parametrize(
    ("schema", "num_rows", "buffers", "error", "message"),
    [
        (DENSE, 2, [b"\x00" * 16, b""], InvalidRequest, "a dense column needs 1 buffers, got 2"),
        (DENSE, 2, [b"\x00" * 15], InvalidRequest, r"a torch.int32 buffer of shape \[2, 2\] needs 16 bytes, got 15"),
        (DENSE, -1, [b""], InvalidRequest, "a column needs num_rows >= 0, got -1"),
        (FieldSchema("dense", "str", ()), 1, [b"\x00"], UnsupportedValue, "unknown dtype 'str'"),
        (JAGGED, -1, [b"", b""], InvalidRequest, "a column needs num_rows >= 0, got -1"),
        (JAGGED, 1, [b"", np.array([1, 0]).tobytes()], InvalidRequest, "jagged offsets must start at 0"),
        (JAGGED, 2, [b"", np.array([0, 2, 1]).tobytes()], InvalidRequest, "jagged offsets must start at 0 and never"),
        (JAGGED, 1, [b"\x00" * 8, np.array([0, 2]).tobytes()], InvalidRequest, r"needs 16 bytes, got 8"),
        (FieldSchema("object", "object", ()), 2, [b"\xc1"], InvalidRequest, "malformed object column"),
        (FieldSchema("object", "object", ()), 2, [b"\x91\x01"], InvalidRequest, "must decode to a list of 2"),
    ],
    ids=[
        "buffer-count",
        "byte-length",
        "negative-rows",
        "dtype",
        "jagged-negative-rows",
        "offsets-start",
        "offsets-decrease",
        "values-length",
        "msgpack",
        "object-rows",
    ],
)
def test_malformed_buffers_get_typed_errors(schema, num_rows, buffers, error, message):
    with pytest.raises(error, match=message):
        Column.from_buffers(schema, num_rows, buffers)


def test_from_buffer_checks_the_byte_count():
    assert from_buffer(b"", torch.float32, (0, 5)).shape == (0, 5)
    with pytest.raises(InvalidRequest, match=r"a torch.float32 buffer of shape \[3\] needs 12 bytes, got 4"):
        from_buffer(b"\x00" * 4, torch.float32, (3,))


# ---- gathers and scatters ------------------------------------------------------------------------------------
def take(column: Column, rows: np.ndarray) -> Column:
    """Rows of a column in the given order (what a storage unit sends for one block)."""
    if column.schema.kind == "object":
        return Column(column.schema, len(rows), objects=[column.objects[i] for i in rows.tolist()])
    if column.schema.kind == "dense":
        return Column(column.schema, len(rows), data=column.data[torch.from_numpy(rows)])
    data, offsets = jagged_take(column.data, column.offsets.numpy(), rows)
    return Column(column.schema, len(rows), data=data, offsets=offsets)


@pytest.mark.parametrize("kind", ["dense", "jagged", "object"])
@pytest.mark.parametrize("seed", range(5))
def test_concat_columns_puts_every_row_where_it_belongs(kind, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    if kind == "dense":
        value = torch.randn(n, 3)
    elif kind == "jagged":
        value = jagged([torch.arange(int(rng.integers(0, 4))) + 10 * i for i in range(n)])
    else:
        value = [f"row{i}" for i in range(n)]
    column = Column.from_value("f", value, n)
    # the rows arrive in pieces (like several storage blocks), each piece in a shuffled order
    order = rng.permutation(n)
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(0, 3))), replace=False))
    positions = np.split(order, cuts)
    parts = [take(column, pos) for pos in positions]
    out = concat_columns(parts, positions, n)
    assert out.num_rows == n
    expected, got = column.to_value(), out.to_value()
    if kind == "object":
        assert got.tolist() == expected.tolist()
    else:
        assert all(torch.equal(a, b) for a, b in zip(rows_of(got), rows_of(expected), strict=True))


def test_concat_of_one_part_in_order_is_the_part_itself():
    column = Column.from_value("f", torch.arange(4), 4)
    assert concat_columns([column], [np.arange(4)], 4) is column


def test_slices_are_views():
    column = Column.from_value("f", jagged([torch.arange(2), torch.arange(3), torch.arange(1)]), 3)
    part = column.slice(1, 3)
    assert part.offsets.tolist() == [0, 3, 4] and part.data.data_ptr() == column.data[2:].data_ptr()
    dense = Column.from_value("f", torch.arange(6).reshape(3, 2), 3)
    assert dense.slice(1, 2).data.data_ptr() == dense.data[1].data_ptr()


def test_row_lengths_of_masks_and_jagged_fields():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    assert Column.from_value("attention_mask", mask, 3).row_lengths().tolist() == [2, 0, 3]
    assert Column.from_value("scalar", torch.zeros(3), 3).row_lengths() is None
    assert Column.from_value("text", ["a", "b", "c"], 3).row_lengths() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_copied_to_host():
    value = torch.arange(6, device="cuda").reshape(3, 2)
    column = Column.from_value("f", value, 3)
    assert column.data.device.type == "cpu" and column.data.is_pinned()  # a DMA, no staging copy in the driver
    transposed = Column.from_value("t", torch.arange(6, device="cuda").reshape(2, 3).t(), 3)
    assert transposed.data.is_contiguous() and transposed.data.tolist() == [[0, 3], [1, 4], [2, 5]]
    assert torch.equal(wire(column).to_value(), value.cpu())
    nested = jagged([torch.arange(2, device="cuda"), torch.arange(1, device="cuda")])
    back = wire(Column.from_value("n", nested, 2)).to_value()
    assert [r.tolist() for r in rows_of(back)] == [[0, 1], [0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_empty_is_page_locked_host_memory():
    array = pinned_empty(1 << 20)
    assert array.shape == (1 << 20,) and array.dtype == np.uint8
    assert torch.from_numpy(array).is_pinned()


def test_building_a_jagged_tensor_logs_no_torch_fx_notice(caplog):
    import logging

    import torch.fx._symbolic_trace as fx_trace

    fx_trace.is_fx_tracing_warning.cache_clear()  # torch logs it once per process: make this call the first
    with caplog.at_level(logging.WARNING):
        torch.nested.nested_tensor_from_jagged(torch.arange(6), torch.tensor([0, 2, 6]))
    assert not [r for r in caplog.records if "is_fx_tracing" in r.getMessage()]


# ---- values msgpack carries but that would come back as something else ---------------------------------------
class _Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class _Point:
    x: int


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([{1}, {2}], r"row 0 holds a set"),
        (NonTensorStack(*[{1}, {2}]), r"row 0 holds a set"),
        ([frozenset({1}), frozenset()], r"row 0 holds a frozenset"),
        (["a", {"k": [1, {2}]}], r"row 1 holds a set"),
        ([datetime.date(2020, 1, 1), None], r"row 0 holds a datetime.date"),
        ([1, decimal.Decimal("1.5")], r"row 1 holds a decimal.Decimal"),
        ([uuid.UUID(int=0), None], r"row 0 holds a uuid.UUID"),
        ([_Color.RED, None], r"row 0 holds a .*_Color"),
        ([_Point(1), None], r"row 0 holds a .*_Point"),
        ([bytearray(b"a"), b"b"], r"row 0 holds a bytearray"),
        (np.array([{1}, {2}], dtype=object), r"row 0 holds a set"),
    ],
    ids=[
        "set",
        "stack-of-sets",
        "frozenset",
        "nested",
        "date",
        "decimal",
        "uuid",
        "enum",
        "dataclass",
        "bytearray",
        "numpy-object",
    ],
)
def test_values_that_would_not_come_back_as_themselves_are_refused(value, message):
    with pytest.raises(UnsupportedValue, match=rf"^field 'f': {message}, which would not come back as itself"):
        Column.from_value("f", value, 2)


def test_the_refusal_says_what_travels():
    with pytest.raises(UnsupportedValue) as caught:
        Column.from_value("tags", [{"a"}, {"b"}], 2)
    assert str(caught.value) == (
        "field 'tags': row 0 holds a set, which would not come back as itself (non-tensor values travel as msgpack: "
        "str, bytes, bool, int, float, None, numpy scalars, and lists, tuples and dicts of them; tuples come back as "
        "lists); convert it first, e.g. to a sorted list"
    )


def test_plain_values_still_travel():
    rows = [{"a": [1, 2.5, None, True]}, ("x", b"y", np.int64(3))]
    assert wire(Column.from_value("f", rows, 2)).objects == [{"a": [1, 2.5, None, True]}, ["x", b"y", 3]]
