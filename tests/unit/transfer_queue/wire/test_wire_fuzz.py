"""Hostile input: whatever arrives over the wire gets a typed error, and the queue keeps serving.

- random bytes and random msgpack structures fed to the protocol decoders raise nothing but MalformedMessage;
- structurally valid but hostile requests (negative sizes, huge numbers, wrong types inside sampler_params, bad
  index bytes, unknown put ids, ...) get a value or a TransferQueueError from ``RequestTable.handle``, and rows
  committed before are still served exactly as they were;
- ``BlockStore.write`` with inconsistent specs, buffer counts or byte lengths raises a TransferQueueError and
  stores nothing.

The hypothesis profile (``ci``: 200 examples, no deadline) is registered in tests/unit/conftest.py.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from transfer_queue.errors import MalformedMessage, TransferQueueError
from transfer_queue.metadata import FieldSchema
from transfer_queue.storage.unit import BlockStore
from transfer_queue.wire import protocol as p
from transfer_queue.wire.columns import columns_from_tensordict

F32 = FieldSchema("dense", "float32", ())
INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
HUGE = st.sampled_from([1 << 31, 1 << 62, (1 << 63) - 1, (1 << 64) - 1])

DECODERS = [p.decode_controller_request, p.decode_storage_request, p.decode_envelope, p.decode_reply_header]


def tags_and_fields(union: Any) -> dict[str, tuple[str, ...]]:
    return {t.__struct_config__.tag: t.__struct_fields__ for t in union.__args__}


CONTROLLER = tags_and_fields(p.ControllerRequest)
STORAGE = tags_and_fields(p.StorageRequest)

msgpack_values = st.recursive(
    st.none() | st.booleans() | INT64 | HUGE | st.floats() | st.text(max_size=8) | st.binary(max_size=24),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


def tagged(tags: dict[str, tuple[str, ...]], values: st.SearchStrategy) -> st.SearchStrategy:
    """Dicts that look like requests: a real tag and some of its field names, with values from ``values``."""
    return st.sampled_from(sorted(tags)).flatmap(
        lambda tag: st.fixed_dictionaries(
            {"type": st.just(tag)}, optional={name: values for name in tags[tag] if name != "type"}
        )
    )


# ---- the decoders --------------------------------------------------------------------------------------------
def decode_all(raw: bytes) -> None:
    for decode in DECODERS:
        try:
            decode(raw)
        except MalformedMessage:
            pass


INVALID_UTF8 = {
    "envelope": (p.decode_envelope, b"\x93\x01\xa3\x00\x00\x80\x01"),
    "reply-header": (p.decode_reply_header, b"\x92\x00\xa3\x00\x00\x80"),
    "controller": (p.decode_controller_request, b"\x82\xa4type\xa5clear\xa9partition\xa2\xc3\x28"),
    "storage": (p.decode_storage_request, b"\x81\xa4type\xa2\xc3\x28"),
}


@pytest.mark.parametrize("what", sorted(INVALID_UTF8))
def test_invalid_utf8_in_a_string_is_a_malformed_message(what):
    decode, raw = INVALID_UTF8[what]
    with pytest.raises(MalformedMessage, match="malformed"):
        decode(raw)


@given(st.binary(max_size=256))
def test_random_bytes_only_raise_malformed_message(raw):
    decode_all(raw)


@given(msgpack_values | tagged(CONTROLLER, msgpack_values) | tagged(STORAGE, msgpack_values))
def test_random_msgpack_only_raises_malformed_message(value):
    decode_all(msgspec.msgpack.encode(value))
    decode_all(msgspec.msgpack.encode([value, value, value]))  # envelopes are arrays


def test_decoders_name_what_was_malformed():
    for raw, what in [(b"\xc1", "controller request"), (p.encode({"type": "nope"}), "controller request")]:
        try:
            p.decode_controller_request(raw)
        except MalformedMessage as exc:
            assert str(exc).startswith(f"malformed {what}: ")
        else:
            raise AssertionError("decoded garbage")


def test_a_negative_dimension_in_a_schema_is_malformed():
    def reserve(shape: list[int]) -> bytes:
        fields = {"x": ["dense", "float32", shape]}
        return p.encode({"type": "reserve", "partition": 0, "num_rows": 1, "fields": fields, "nbytes": 4})

    assert p.decode_controller_request(reserve([2])).fields["x"] == FieldSchema("dense", "float32", (2,))  # control
    with pytest.raises(
        MalformedMessage,
        match=r"^malformed controller request: a field's shape has no negative dimension, got \[-1\]",
    ):
        p.decode_controller_request(reserve([-1]))


# ---- hostile requests to the controller's state ----------------------------------------------------------------
def packed(values: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(values, max_size=6).map(lambda v: np.asarray(v, dtype=np.int64).astype("<i8").tobytes())


def mostly(valid: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    """Usually a value that passes validation (so requests get deep into the state), sometimes a hostile one."""
    return st.integers(0, 3).flatmap(lambda i: hostile if i == 0 else valid)


INDEX_BYTES = mostly(st.none(), st.binary(max_size=20) | packed(st.integers(0, 7)) | packed(INT64))
NAMES = st.sampled_from(["x", "y", "z", ""])
SCHEMAS = mostly(
    st.sampled_from([["dense", "float32", []], ["dense", "int64", [2]], ["jagged", "int64", []]]),
    st.tuples(
        st.sampled_from(["dense", "jagged", "object", "sparse"]),
        st.sampled_from(["float32", "int64", "object", "nonsense"]),
        st.lists(st.integers(-1, 3) | HUGE, max_size=2),
    ),
)
FIELD_VALUES: dict[str, st.SearchStrategy] = {
    "partition": mostly(st.sampled_from([0, 1, 2, "keep", "kv", "s"]), HUGE | st.sampled_from([-1, ""]) | HUGE),
    "num_rows": mostly(st.sampled_from([1, 2, 4]), st.integers(-2, 9) | HUGE),
    "nbytes": mostly(st.integers(0, 64), st.integers(-8, -1) | HUGE | st.just(-(1 << 63))),
    "group_ids": INDEX_BYTES,
    "target_uid": mostly(st.none(), st.integers(1, 4) | HUGE),
    "target_indexes": INDEX_BYTES,
    "lengths": INDEX_BYTES,
    "directory": st.text(max_size=8),  # QueueState refuses save_checkpoint (the controller's server handles it)
    "length_fields": mostly(st.none(), st.lists(st.sampled_from(["x", "y", "z", ""]), max_size=3)),
    "keys": mostly(st.none(), st.lists(st.sampled_from(["a", "b", ""]), max_size=4)),
    "timeout": mostly(st.just(5.0), st.sampled_from([float("nan"), float("inf"), -1.0, 0.0, 1e-9, 1e300])),
    "put_id": mostly(st.integers(1, 6), st.integers(-1, 0) | HUGE),
    "batch_size": mostly(st.sampled_from([1, 2, 4]), st.integers(-1, 9) | HUGE),
    "task_name": mostly(st.sampled_from(["train", "t"]), st.just("")),
    "sampler_params": mostly(
        st.none(),
        st.dictionaries(
            st.sampled_from(["dp_rank", "dp_size", "dp_group_id", "group_ids", "all_indices", "task_name", "junk"]),
            mostly(st.integers(0, 2), st.integers(-2, -1) | HUGE | msgpack_values),
            max_size=4,
        ),
    ),
    "get_n_samples": st.booleans(),
    "peek": st.booleans(),
    "with_tags": st.booleans(),
    "values": st.lists(mostly(st.none() | st.dictionaries(st.text(max_size=3), msgpack_values), msgpack_values)),
    "include_run_history": st.booleans(),
    "partition_uid": mostly(st.integers(1, 4), HUGE),
    "global_indexes": INDEX_BYTES,
    "client_id": st.text(max_size=4),
    "lease_s": mostly(
        st.none() | st.sampled_from([1.0, 600.0]), st.sampled_from([float("nan"), float("inf"), -1.0, 0.0])
    ),
    "seconds": mostly(st.sampled_from([1.0, 60.0]), st.sampled_from([float("nan"), float("inf"), -1.0, 0.0, 1e9])),
    "owner": st.sampled_from(["", "a", "b"]),
    "call_id": mostly(st.integers(0, 3), HUGE),
    "explicit": st.booleans(),
    "again": st.booleans(),
    "reply": st.booleans(),
    "dp_group_id": mostly(st.none() | st.sampled_from(["g", "auto-0"]), st.text(max_size=3)),
    "ack": mostly(st.sampled_from(["auto", "explicit"]), st.text(max_size=3)),
    "next_auto_round": mostly(st.none() | st.integers(0, 3), st.integers(-2, -1) | HUGE),
    "max_deliveries": mostly(st.none() | st.integers(1, 3), st.integers(-1, 0) | HUGE),
}
FIELD_VALUES_BY_TAG: dict[tuple[str, str], st.SearchStrategy] = {
    ("reserve", "fields"): mostly(
        st.dictionaries(st.sampled_from(["x", "y", "z"]), SCHEMAS, min_size=1, max_size=2),
        st.dictionaries(NAMES, SCHEMAS, max_size=3),
    ),
    ("get_meta", "fields"): mostly(
        st.lists(st.sampled_from(["x", "y"]), min_size=1, max_size=2, unique=True), st.lists(NAMES, max_size=4)
    ),
    ("kv_lookup", "fields"): st.none() | st.lists(NAMES, max_size=3),
}


def required(tag: str) -> tuple[str, ...]:
    struct = next(t for t in p.ControllerRequest.__args__ if t.__struct_config__.tag == tag)
    return struct.__struct_fields__[: len(struct.__struct_fields__) - len(struct.__struct_defaults__)]


def hostile_request(tag: str) -> st.SearchStrategy:
    """A request dict of ``tag``: every required field and some optional ones, with hostile values."""
    values = {name: FIELD_VALUES_BY_TAG.get((tag, name), FIELD_VALUES.get(name)) for name in CONTROLLER[tag]}
    return st.fixed_dictionaries(
        {"type": st.just(tag), **{n: v for n, v in values.items() if n in required(tag)}},
        optional={n: v for n, v in values.items() if n not in required(tag)},
    )


# puts and get_metas carry the most to check: they come as often as all the other requests together
HOSTILE = st.sampled_from(["reserve", "get_meta", *sorted(set(CONTROLLER) - {"hello"})]).flatmap(hostile_request)


def decoded_or_none(raw: dict) -> Any:
    try:
        return p.decode_controller_request(p.encode(raw))
    except MalformedMessage:
        return None


def spares_the_kept_partition(request: Any, kept_uid: int) -> bool:
    """Clearing the kept partition (or some of its rows) is a legitimate request; everything else must leave its rows
    alone."""
    if isinstance(request, p.ClearSamples):
        return request.partition_uid != kept_uid
    return not (isinstance(request, p.Clear | p.KvClear) and request.partition == "keep")


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(HOSTILE, min_size=1, max_size=6))
def test_hostile_requests_get_typed_errors_and_leave_earlier_data_intact(make_queue, raw_requests):
    q = make_queue(global_batch_size=4, num_n_samples=2, num_global_batch=4, storage_unit_bytes=1 << 20)
    kept = q.put("keep", 4, {"x": F32})
    kept = kept.union_fields(q.put("keep", 4, {"y": F32}, metadata=kept))
    q.put(0, 4, {"x": F32})
    q.kv_put("kv", ["a"])
    replies = []
    for raw in raw_requests:
        request = decoded_or_none(raw)
        if (
            request is None
            or isinstance(request, p.Hello)
            or not spares_the_kept_partition(request, kept.partition_uid)
        ):
            continue
        replies.append((request, q.send(request)))  # an exception escaping handle fails the test here
    q.advance(1e301)  # every wait ends (timeouts are finite, up to 1e300 s here), and so does every open put
    for request, reply in replies:
        assert reply.calls == 1, f"{request} was answered {reply.calls} times"
        assert reply.error is None or isinstance(reply.error, TransferQueueError), (request, reply.error)
    assert q.state.bytes_held >= 0
    for part in q.state.partitions.values():
        assert part.capacity is None or part.num_rows <= part.capacity
    # the rows committed before are served as they were, to a task nobody used
    got = q.get("keep", ["x", "y"], 4, "check")
    assert got.global_indexes.tolist() == kept.global_indexes.tolist()
    assert got.blocks.tolist() == kept.blocks.tolist() and got.offsets.tolist() == kept.offsets.tolist()


def test_a_partition_behind_int64_is_refused(make_queue):
    q = make_queue(global_batch_size=4)
    reply = q.send(p.GetMeta((1 << 64) - 1, ["x"], 1, "t"))
    assert "global_step must be < 2305843009213693952 (its global indexes must fit in int64)" in str(reply.error)
    reply = q.send(q.reserve_request("s", (1 << 40), {"x": F32}, nbytes=0))
    assert "a put holds at most 16777216 rows, got num_rows=1099511627776; split it" in str(reply.error)
    reply = q.send(q.reserve_request("s", 1, {"x": F32}, nbytes=-1))
    assert "nbytes must be >= 0, got -1" in str(reply.error)
    q.put("s", 4, {"x": F32})
    q.ok(p.ClosePartition("s"))
    reply = q.send(q.get_request("s", "x", 1, sampler_params={"dp_rank": 0, "dp_size": 10**12}))
    assert "dp_size must lie in [1, 65536], got 1000000000000" in str(reply.error)


# ---- hostile writes to a storage unit ------------------------------------------------------------------------
def valid_write() -> tuple[p.Write, list[bytes]]:
    data = TensorDict(
        {
            "ids": torch.arange(6).reshape(3, 2),
            "resp": torch.nested.nested_tensor(
                [torch.arange(2), torch.arange(0), torch.arange(1)], layout=torch.jagged
            ),
            "tag": NonTensorStack("a", "b", "c"),
        },
        batch_size=[3],
    )
    _, columns = columns_from_tensordict(data)
    specs = [p.ColumnSpec(n, c.schema, c.num_rows, len(c.buffers())) for n, c in columns.items()]
    return p.Write(1, 0, 3, specs), [bytes(memoryview(b)) for c in columns.values() for b in c.buffers()]


SPEC_SCHEMAS = st.builds(
    FieldSchema,
    st.sampled_from(["dense", "jagged", "object"]),
    st.sampled_from(["int64", "float32", "bool", "bfloat16", "object", "nonsense"]),
    st.lists(st.integers(0, 4) | HUGE, max_size=2).map(tuple),
)
SPECS = st.builds(
    p.ColumnSpec, st.sampled_from(["ids", "resp", "tag", "x"]), SPEC_SCHEMAS, st.integers(-2, 5), st.integers(-1, 3)
)


@st.composite
def hostile_writes(draw: st.DrawFn) -> tuple[p.Write, list[bytes]]:
    write, buffers = valid_write()
    specs = list(write.columns)
    num_rows = write.num_rows
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["spec", "drop", "add", "truncate", "grow", "swap", "rows", "random"]))
        if how == "spec" and specs:
            specs[draw(st.integers(0, len(specs) - 1))] = draw(SPECS)
        elif how == "drop" and buffers:
            del buffers[draw(st.integers(0, len(buffers) - 1))]
        elif how == "add":
            buffers.insert(draw(st.integers(0, len(buffers))), draw(st.binary(max_size=24)))
        elif how in ("truncate", "grow") and buffers:
            i = draw(st.integers(0, len(buffers) - 1))
            buffers[i] = buffers[i][:-1] if how == "truncate" else buffers[i] + b"\x00" * 8
        elif how == "swap" and len(buffers) > 1:
            i, j = draw(st.lists(st.integers(0, len(buffers) - 1), min_size=2, max_size=2, unique=True))
            buffers[i], buffers[j] = buffers[j], buffers[i]
        elif how == "rows":
            num_rows = draw(st.integers(-2, 5))
        else:
            specs = draw(st.lists(SPECS, max_size=3))
            buffers = draw(st.lists(st.binary(max_size=32), max_size=5))
    return p.Write(write.partition_uid, write.block_id, num_rows, specs), buffers


@given(hostile_writes())
def test_inconsistent_writes_raise_typed_errors_and_store_nothing(write_and_buffers):
    write, buffers = write_and_buffers
    store = BlockStore(unit=0, num_units=1)
    try:
        store.write(write, buffers)
    except TransferQueueError:
        assert store.blocks == {} and store.nbytes == 0 and store.by_partition == {}
    else:  # the mutations happened to leave a consistent write: it must read back
        assert store.stats()["blocks"] == 1


def test_the_unmutated_write_is_stored():
    write, buffers = valid_write()
    store = BlockStore(unit=0, num_units=1)
    store.write(write, buffers)
    assert store.stats()["bytes"] == sum(len(b) for b in buffers)
