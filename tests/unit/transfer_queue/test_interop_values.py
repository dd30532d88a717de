"""Client side of issue 14 without Ray: numpy non-tensor arrays, jagged fields on request, DataProto in and out,
BatchMeta.split_for_ranks, ControllerInfo as JSON, the group-aware sampler helper, typed sampler errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from transfer_queue.errors import (
    BatchSizeMismatch,
    InvalidRequest,
    InvalidSampler,
    MalformedMessage,
    SchemaMismatch,
    UnknownField,
    UnsupportedValue,
)
from transfer_queue.interop import DataProtoParts, from_dataproto, to_dataproto
from transfer_queue.metadata import BatchMeta, FieldSchema
from transfer_queue.samplers import GroupSampler, make_sampler, sample_whole_groups
from transfer_queue.wire import protocol as p
from transfer_queue.wire.columns import Column, columns_from_tensordict, tensordict_from_columns


def through_the_wire(data: Any, jagged: tuple[str, ...] = ()) -> TensorDict:
    rows, columns = columns_from_tensordict(data, jagged)
    received = {
        name: Column.from_buffers(c.schema, c.num_rows, [bytes(memoryview(b)) for b in c.buffers()])
        for name, c in columns.items()
    }
    return tensordict_from_columns(received, rows)


# ---- numpy arrays of str, bytes, objects -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "array",
    [
        np.array(["a", "bb", ""]),
        np.array([b"x", b"yy", b"z"]),
        np.array([{"role": "user"}, [1, 2], None], dtype=object),
        np.array(["u1", "u2", "u3"], dtype=object),
        np.array([["a", "b"], ["c", "d"], ["e", "f"]]),
    ],
    ids=["str", "bytes", "dicts", "object-str", "2-d"],
)
def test_numpy_arrays_round_trip_as_the_same_kind(array):
    td = TensorDict({"x": torch.arange(3)}, batch_size=[3])
    td.set_non_tensor("f", array)
    back = through_the_wire(td)["f"]
    assert isinstance(back, np.ndarray) and back.dtype.kind == array.dtype.kind and back.shape == array.shape
    assert back.tolist() == array.tolist()
    picked = through_the_wire({"f": array[[2, 0]]})["f"]  # a dict of fields takes numpy arrays as well
    assert picked.tolist() == array[[2, 0]].tolist()


def test_numpy_scalars_inside_object_arrays_travel_as_numbers():
    back = through_the_wire({"f": np.array([np.float32(1.5), np.int64(7)], dtype=object)})["f"]
    assert back.tolist() == [1.5, 7]


def test_a_value_that_cannot_travel_names_field_row_and_type():
    array = np.array(["ok", {"inner": object()}], dtype=object)
    with pytest.raises(UnsupportedValue, match=r"field 'raw': .* row 1 \(dict\): builtins.object is not msgpack"):
        columns_from_tensordict({"raw": array})
    with pytest.raises(UnsupportedValue, match=r"field 'l': .* row 0 \(complex\)"):
        columns_from_tensordict({"l": [1j]})


def test_numpy_arrays_of_numbers_are_dense_tensors():
    back = through_the_wire({"f": np.arange(6, dtype=np.float32).reshape(3, 2)})["f"]
    assert isinstance(back, torch.Tensor) and back.tolist() == [[0, 1], [2, 3], [4, 5]]


def test_numpy_and_list_columns_have_different_schemas():
    _, cols = columns_from_tensordict({"a": ["x"], "b": np.array(["x"]), "c": np.array([["x", "y"]])})
    assert cols["a"].schema == FieldSchema("object", "object", ())
    assert cols["b"].schema == FieldSchema("object", "numpy.U", ())
    assert cols["c"].schema.describe() == "object numpy.U[2]"


# ---- jagged on request ------------------------------------------------------------------------------------------
def test_dense_fields_named_jagged_become_jagged():
    back = through_the_wire({"resp": torch.arange(6).reshape(2, 3), "m": torch.ones(2, 3, 2)}, ("resp", "m"))
    assert back["resp"].is_nested and [r.tolist() for r in back["resp"].unbind()] == [[0, 1, 2], [3, 4, 5]]
    assert back["m"].is_nested and back["m"].unbind()[0].shape == (3, 2)
    with pytest.raises(UnknownField, match=r"jagged names fields \['nope'\] that the put does not have"):
        columns_from_tensordict({"a": torch.zeros(2, 2)}, ("nope",))
    with pytest.raises(SchemaMismatch, match=r"per-row shape \[\] has no dimension to be jagged along"):
        columns_from_tensordict({"a": torch.zeros(2)}, ("a",))


def test_nested_tensors_ragged_in_two_dimensions_get_a_typed_error():
    ragged = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(3, 4)])
    with pytest.raises(UnsupportedValue, match=r"field 'f': a nested tensor whose rows differ in more than their"):
        Column.from_value("f", ragged, 2)


# ---- DataProto --------------------------------------------------------------------------------------------------
@dataclass
class FakeDataProto:
    """What verl.DataProto holds, for tests that must not import verl."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


def proto() -> FakeDataProto:
    responses = torch.nested.nested_tensor([torch.arange(2), torch.arange(3), torch.arange(1)], layout=torch.jagged)
    batch = TensorDict({"input_ids": torch.arange(12).reshape(3, 4), "responses": responses}, batch_size=[3])
    arrays = {
        "uid": np.array(["p0", "p0", "p1"], dtype=object),
        "raw_prompt": np.array([[{"role": "user", "content": "hi"}]] * 3 + [None], dtype=object)[:3],
        "data_source": np.array(["gsm8k", "gsm8k", "math"]),
    }
    return FakeDataProto(batch, arrays, {"temperature": 0.7, "eos_token_id": [2]})


def test_dataproto_round_trips_through_the_wire():
    original = proto()
    back = to_dataproto(through_the_wire(from_dataproto(original)), dataproto_cls=FakeDataProto)
    assert isinstance(back, FakeDataProto) and back.meta_info == original.meta_info
    assert back.batch["input_ids"].tolist() == original.batch["input_ids"].tolist()
    assert [r.tolist() for r in back.batch["responses"].unbind()] == [[0, 1], [0, 1, 2], [0]]
    assert set(back.non_tensor_batch) == set(original.non_tensor_batch)
    for name, array in original.non_tensor_batch.items():
        got = back.non_tensor_batch[name]
        assert got.dtype == array.dtype and got.tolist() == array.tolist()


def test_to_dataproto_without_a_class_and_with_lists():
    parts = to_dataproto(TensorDict({"x": torch.zeros(2), "tags": ["a", ["b"]]}, batch_size=[2]), meta_info={"k": 1})
    assert isinstance(parts, DataProtoParts) and len(parts) == 2 and parts.meta_info == {"k": 1}
    assert parts.non_tensor_batch["tags"].dtype == object and parts.non_tensor_batch["tags"].tolist() == ["a", ["b"]]


def test_from_dataproto_checks_its_input():
    with pytest.raises(InvalidRequest, match="expects an object with batch, non_tensor_batch and meta_info, got dict"):
        from_dataproto({})
    bad = FakeDataProto(TensorDict({"a": torch.zeros(2)}, batch_size=[2]), {"s": np.array(["x"])})
    with pytest.raises(BatchSizeMismatch, match=r"non_tensor_batch\['s'\] has 1 rows; the batch has 2"):
        from_dataproto(bad)
    clash = FakeDataProto(TensorDict({"a": torch.zeros(1)}, batch_size=[1]), {"a": np.array(["x"])})
    with pytest.raises(InvalidRequest, match=r"field 'a' is both in DataProto\.batch and in non_tensor_batch"):
        from_dataproto(clash)
    only_arrays = from_dataproto(FakeDataProto(None, {"s": np.array(["x", "y"])}), meta_info_field=None)
    assert list(only_arrays.batch_size) == [2] and set(only_arrays.keys()) == {"s"}


# ---- BatchMeta.split_for_ranks ----------------------------------------------------------------------------------
def meta_of(rows: int) -> BatchMeta:
    none = np.zeros((rows, 0))
    return BatchMeta(
        "p", 1, np.arange(rows), np.arange(rows), {}, none, none, extra={"keys": [str(i) for i in range(rows)]}
    )


@pytest.mark.parametrize("rows", range(0, 8))
@pytest.mark.parametrize("k", range(1, 5))
def test_split_for_ranks_gives_k_pieces_differing_by_at_most_one(rows, k):
    pieces = meta_of(rows).split_for_ranks(k)
    sizes = [len(piece) for piece in pieces]
    assert len(pieces) == k and sum(sizes) == rows and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)[::-1]
    assert np.concatenate([piece.global_indexes for piece in pieces]).tolist() == list(range(rows))
    assert [key for piece in pieces for key in piece.keys] == [str(i) for i in range(rows)]
    with pytest.raises(InvalidRequest, match="split_for_ranks: k must be an int >= 1, got 0"):
        meta_of(rows).split_for_ranks(0)


def test_custom_meta_follows_rows_through_select_and_concat():
    m = meta_of(3)
    m.extra["custom_meta"] = [{"a": 0}, {}, {"a": 2}]
    assert m.select_samples([2, 0]).custom_meta == [{"a": 2}, {"a": 0}]
    assert BatchMeta.concat(m.split_for_ranks(2)).custom_meta == m.custom_meta
    assert meta_of(2).custom_meta == [{}, {}]


# ---- ControllerInfo as JSON -------------------------------------------------------------------------------------
def test_controller_info_round_trips_as_json():
    info = p.ControllerInfo(
        p.PROTOCOL_VERSION, "s1", p.Endpoint("tcp://127.0.0.1:5", "/tmp/c.sock", "h"), [p.Endpoint("tcp://x:1")],
        {"global_batch_size": 4, "seqlen_fields": ["attention_mask"]}, b"\x00\xffsecret",
    )  # fmt: skip
    text = info.to_json()
    assert isinstance(text, str) and p.ControllerInfo.from_json(text) == info
    with pytest.raises(MalformedMessage, match="not a ControllerInfo in JSON"):
        p.ControllerInfo.from_json('{"protocol_version": 1}')


# ---- samplers ---------------------------------------------------------------------------------------------------
def test_sample_whole_groups_takes_complete_groups_in_order():
    ready, groups = [10, 11, 12, 13, 14, 15], [0, 1, 0, 2, 1, 3]
    assert sample_whole_groups(ready, groups, 4, 2).tolist() == [10, 12, 11, 14]  # group 2 and 3 are incomplete
    assert sample_whole_groups(ready, groups, 3, 2).tolist() == [10, 12]
    picked = sample_whole_groups(ready, groups, 4, 2, choose=lambda ids, k: ids[::-1][:k])
    assert picked.tolist() == [11, 14, 10, 12]
    with pytest.raises(ValueError, match=r"choose must return at most 2 distinct ids of complete groups, got \[3\]"):
        sample_whole_groups(ready, groups, 4, 2, choose=lambda ids, k: [3])


class LastGroupsFirst(GroupSampler):
    def sample_groups(self, group_ids, num_groups, **kwargs):
        return group_ids[::-1][:num_groups]


def test_group_sampler_subclasses_choose_groups():
    sampler = LastGroupsFirst()
    assert sampler.serves_whole_groups and not sampler.uses_fast_path
    got = sampler.sample([0, 1, 2, 3, 4, 5], 4, group_ids=np.array([0, 0, 1, 1, 2, 2]), num_n_samples=2)
    assert list(got) == [4, 5, 2, 3]


def test_a_sampler_spec_that_is_not_one_is_a_typed_error():
    with pytest.raises(
        InvalidSampler, match="sampler must be a BaseSampler, a BaseSampler class or a callable, got int"
    ):
        make_sampler(42)  # type: ignore[arg-type]
    assert issubclass(InvalidSampler, TypeError) and issubclass(InvalidSampler, InvalidRequest)


# ---- every bad value is a TransferQueueError ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (5, "expected a tensor, an array or a list of rows, got int"),
        (None, "expected a tensor, an array or a list of rows, got NoneType"),
        (np.array(["2020-01-01"], dtype="datetime64[D]"), r"a numpy array of dtype datetime64\[D\] cannot travel"),
        (np.zeros(2, dtype=[("a", "i4")]), "a numpy array of dtype .* cannot travel"),
        (torch.zeros(2, 2).to_sparse(), "a torch.sparse_coo tensor on cpu cannot travel"),
        (torch.zeros(2, device="meta"), "a torch.strided tensor on meta cannot travel"),
        ([1 << 70, 1], r"row 0 \(int\): 1180591620717411303424 lies outside msgpack's integer range"),
    ],
    ids=["int", "none", "datetime", "structured", "sparse", "meta", "huge-int"],
)
def test_values_that_cannot_travel_get_unsupported_value(value, message):
    with pytest.raises(UnsupportedValue, match=rf"field 'x': .*{message}"):
        columns_from_tensordict({"x": value})


def test_numpy_scalars_in_requests_are_numbers():
    request = p.GetMeta("p", ["x"], 2, "train", {"dp_rank": np.int64(1), "dp_size": np.int32(2)})
    decoded = p.decode_controller_request(p.encode(request))
    assert decoded.sampler_params == {"dp_rank": 1, "dp_size": 2}
