"""Controller side of issue 14 (upstream TransferQueue users): custom meta, kv tags, kv_list of every partition,
non-consuming reads, per-sample clears, jagged promotion, the configurable field limit. No Ray."""

from __future__ import annotations

import numpy as np
import pytest

from transfer_queue.config import QueueConfig
from transfer_queue.errors import InvalidRequest, SchemaMismatch, StaleBatchMeta
from transfer_queue.metadata import MAX_CUSTOM_META_BYTES, FieldSchema
from transfer_queue.state.partition_status import production_status
from transfer_queue.wire import protocol as p

X = {"x": FieldSchema("dense", "float32", ())}
SEQ = {"ids": FieldSchema("dense", "int64", (4,))}


def custom(q, meta, values):
    return q.ok(p.SetCustomMeta(meta.partition_uid, p.pack_indexes(meta.global_indexes), values))


def test_custom_meta_comes_back_with_get_meta_and_goes_with_the_row(make_queue):
    q = make_queue()
    meta = q.put("p", 4, X)
    custom(q, meta.select_samples([1, 3]), [{"score": 0.5}, {"src": "b", "n": [1, 2]}])
    got = q.get("p", "x", 4)
    assert got.custom_meta == [{}, {"score": 0.5}, {}, {"src": "b", "n": [1, 2]}]
    assert got.select_samples([3, 1]).custom_meta == [{"src": "b", "n": [1, 2]}, {"score": 0.5}]
    read = q.ok(p.GetCustomMeta(meta.partition_uid, p.pack_indexes(meta.global_indexes)))
    assert read == [{}, {"score": 0.5}, {}, {"src": "b", "n": [1, 2]}]
    custom(q, meta.select_samples([1]), [None])  # None removes it
    q.ok(p.ClearSamples(meta.partition_uid, p.pack_indexes(meta.global_indexes[3:])))
    assert q.state.partitions["p"].custom_meta == {}  # dropped with its row


def test_custom_meta_is_checked(make_queue):
    q = make_queue()
    meta = q.put("p", 2, X)
    with pytest.raises(InvalidRequest, match="custom meta needs one value per row: 2 rows, got 1"):
        custom(q, meta, [{}])
    with pytest.raises(InvalidRequest, match=r"the custom meta of global index 1 must be a dict \(or None\), got int"):
        custom(q, meta, [{}, 3])
    big = {"blob": "x" * MAX_CUSTOM_META_BYTES}
    with pytest.raises(InvalidRequest, match=f"at most {MAX_CUSTOM_META_BYTES} are allowed"):
        custom(q, meta, [big, {}])
    with pytest.raises(InvalidRequest, match=r"global indexes \[7\] are not committed rows of partition_id='p'"):
        q.ok(p.SetCustomMeta(meta.partition_uid, p.pack_indexes(np.array([7])), [{}]))
    q.clear("p")
    with pytest.raises(StaleBatchMeta, match="set_custom_meta of a meta whose partition"):
        custom(q, meta, [{}, {}])


def test_kv_tags_set_custom_meta_and_create_keys(make_queue):
    q = make_queue()
    q.kv_put("kv", ["a", "b"])
    meta = q.ok(p.KvTag("kv", ["b", "new"], [{"v": 1}, {"v": 2}])).to_meta()
    assert meta.keys == ["b", "new"] and meta.custom_meta == [{"v": 1}, {"v": 2}] and meta.fields == {}
    assert q.ok(p.KvList("kv", with_tags=True)) == {"a": {}, "b": {"v": 1}, "new": {"v": 2}}
    assert q.ok(p.KvLookup("kv", ["new"], None)).fields == {}  # a key created by its tag has no field yet
    q.kv_put("kv", ["new"])  # its fields arrive later, its tag stays
    assert q.ok(p.KvLookup("kv", ["new", "a"], None)).to_meta().custom_meta == [{"v": 2}, {}]
    q.put("rows", 1, X)
    with pytest.raises(InvalidRequest, match=r"partition_id='rows' is used by row \(put\); use one way"):
        q.ok(p.KvTag("rows", ["a"], [{}]))
    with pytest.raises(InvalidRequest, match=r"the custom meta of key 'z' must be a dict \(or None\), got int"):
        q.ok(p.KvTag("fresh", ["y", "z"], [{}, 3]))
    assert "fresh" not in q.state.partitions  # a refused tag creates neither keys nor a partition


def test_kv_list_of_every_partition_and_of_unknown_ones(make_queue):
    q = make_queue()
    q.kv_put("one", ["a"])
    q.kv_put("two", ["b", "c"])
    q.put("rows", 1, X)
    assert q.ok(p.KvList()) == {"one": ["a"], "two": ["b", "c"]}  # partitions used by row are not listed
    assert q.ok(p.KvList(None, with_tags=True)) == {"one": {"a": {}}, "two": {"b": {}, "c": {}}}
    assert q.ok(p.KvList("nope")) == [] and q.ok(p.KvList("nope", with_tags=True)) == {}


def test_peek_does_not_consume(make_queue):
    q = make_queue()
    q.put("p", 4, X)
    peeked = q.ok(p.GetMeta("p", ["x"], 2, "train", peek=True)).to_meta()
    again = q.ok(p.GetMeta("p", ["x"], 2, "train", peek=True)).to_meta()
    assert peeked.global_indexes.tolist() == again.global_indexes.tolist() == [0, 1]
    assert q.get("p", "x", 4).global_indexes.tolist() == [0, 1, 2, 3]  # still ready for the task: served now
    with pytest.raises(InvalidRequest, match=r"a non-consuming get_meta \(peek\) cannot take part in a DP round"):
        q.ok(p.GetMeta("p", ["x"], 1, "train", {"dp_size": 2, "dp_rank": 0}, peek=True))


def test_clear_samples_forgets_rows_and_frees_their_blocks(make_queue):
    q = make_queue()
    first = q.put("p", 2, X)
    second = q.put("p", 2, X)
    held = q.state.bytes_held
    q.ok(p.ClearSamples(first.partition_uid, p.pack_indexes(first.global_indexes[:1])))
    assert q.state.bytes_held == held  # the block still holds row 1
    q.ok(p.ClearSamples(first.partition_uid, p.pack_indexes(first.global_indexes)))  # row 0 again: skipped
    assert q.state.bytes_held == held - first_bytes(first)
    assert any(isinstance(m, p.DropBlocks) for _, m in q.table.outbox)
    assert q.get("p", "x", 2).global_indexes.tolist() == second.global_indexes.tolist()  # only they are left
    status = production_status(q.state.partitions["p"])
    assert status["rows"] == 2 and status["fields"]["x"]["produced"] == 2
    q.clear("p")
    q.ok(p.ClearSamples(first.partition_uid, p.pack_indexes(first.global_indexes)))  # a cleared partition: no-op


def first_bytes(meta) -> int:
    return 4 * len(meta)  # the harness reserves 4 bytes per row and field


def test_clear_samples_of_a_kv_partition_forgets_the_keys(make_queue):
    q = make_queue()
    meta = q.kv_put("kv", ["a", "b", "c"])
    q.ok(p.ClearSamples(meta.partition_uid, p.pack_indexes(meta.global_indexes[1:2])))
    assert q.ok(p.KvList("kv")) == ["a", "c"]


def test_a_changing_length_is_a_schema_mismatch_unless_promoted(make_queue):
    q = make_queue()
    q.put("p", 1, SEQ)
    longer = {"ids": FieldSchema("dense", "int64", (6,))}
    with pytest.raises(
        SchemaMismatch, match=r"stored as dense int64\[4\] .* the put has dense int64\[6\]; put it with"
    ):
        q.put("p", 1, longer)
    promoting = make_queue(promote_jagged=True)
    promoting.put("p", 1, SEQ)
    meta = promoting.put("p", 1, longer)
    assert meta.fields["ids"] == FieldSchema("jagged", "int64", ())
    promoting.put("p", 1, {"ids": FieldSchema("jagged", "int64", ())})  # jagged puts keep fitting
    with pytest.raises(SchemaMismatch, match="stored as jagged int64"):  # another dtype never fits
        promoting.put("p", 1, {"ids": FieldSchema("dense", "float32", (4,))})
    with pytest.raises(SchemaMismatch, match="stored as jagged int64"):  # nor another trailing shape
        promoting.put("p", 1, {"ids": FieldSchema("dense", "int64", (4, 2))})


def test_the_field_limit_is_configurable_and_says_so(make_queue):
    q = make_queue(max_fields=2)
    q.put("p", 1, {"a": X["x"], "b": X["x"]})
    with pytest.raises(
        InvalidRequest, match=r"at most 2 fields \(QueueConfig.max_fields, at most 64\); .* adds 1 more"
    ):
        q.put("p", 1, {"c": X["x"]})
    with pytest.raises(InvalidRequest, match=r"max_fields must be an int in \[1, 64\]"):
        QueueConfig(4, max_fields=65)
