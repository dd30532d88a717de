"""BatchMeta and FieldSchema: what a batch is without its tensors; selection, chunking, concatenation, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transfer_queue.errors import InvalidRequest, UnknownField
from transfer_queue.metadata import BatchMeta, FieldSchema
from transfer_queue.wire import protocol as p

F32 = FieldSchema("dense", "float32", ())
TOKENS = FieldSchema("jagged", "int64", ())


def meta(rows: int = 6, fields=("a", "b"), uid: int = 7, partition=3, start: int = 0, **extra) -> BatchMeta:
    """Rows ``start..start+rows`` with block = 100 * column + row and offset = row, so cells are easy to trace."""
    index = np.arange(start, start + rows)
    cols = np.arange(len(fields))
    return BatchMeta(
        partition,
        uid,
        index,
        index // 2,
        dict.fromkeys(fields, F32),
        100 * cols[None, :] + index[:, None],
        np.repeat(index[:, None], len(fields), axis=1),
        "train",
        dict(extra),
    )


def cells(m: BatchMeta) -> dict[str, list[tuple[int, int, int]]]:
    """Per field: (global index, block, offset) of each row, in order."""
    return {
        name: list(zip(m.global_indexes.tolist(), m.blocks[:, j].tolist(), m.offsets[:, j].tolist(), strict=True))
        for j, name in enumerate(m.field_names)
    }


# ---- FieldSchema ---------------------------------------------------------------------------------------------
def test_field_schema_describes_itself():
    assert F32.describe() == "dense float32[]"
    assert FieldSchema("dense", "bfloat16", (2, 3)).describe() == "dense bfloat16[2, 3]"
    assert TOKENS.describe() == "jagged int64[*]"
    assert FieldSchema("jagged", "float32", (4,)).describe() == "jagged float32[*, 4]"
    assert FieldSchema("object", "object").describe() == "object"


def test_field_schema_is_validated():
    with pytest.raises(InvalidRequest, match=r"a field's shape has no negative dimension, got \[2, -1\]"):
        FieldSchema("dense", "float32", (2, -1))
    with pytest.raises(InvalidRequest, match="a field's kind is dense, jagged or object, got 'sparse'"):
        FieldSchema("sparse", "float32")  # type: ignore[arg-type]


# ---- BatchMeta basics ------------------------------------------------------------------------------------------
def test_a_batch_meta_normalises_its_arrays():
    m = BatchMeta("val", 1, [4, 5], [0, 0], {"a": F32}, [[1], [1]], [[0], [1]], None, {"keys": ["k4", "k5"]})
    assert m.global_indexes.dtype == np.int64 and m.blocks.shape == (2, 1)
    assert (len(m), m.size, m.global_step, m.field_names, m.keys) == (2, 2, None, ["a"], ["k4", "k5"])
    assert meta().global_step == 3
    assert repr(meta(rows=10)).startswith("BatchMeta(partition_id=3, size=10, fields=['a', 'b'], global_indexes=")
    empty = BatchMeta.empty("val", task_name="t")
    assert (len(empty), empty.fields, empty.blocks.shape, empty.task_name) == (0, {}, (0, 0), "t")


def test_a_batch_meta_refuses_inconsistent_arrays():
    with pytest.raises(InvalidRequest, match="BatchMeta needs one group id per row: 2 rows, got 1"):
        BatchMeta(0, 1, [0, 1], [0], {"a": F32}, [0, 0], [0, 0])
    with pytest.raises(InvalidRequest, match=r"BatchMeta needs 2 x 2 blocks \(rows x fields\), got 2"):
        BatchMeta(0, 1, [0, 1], [0, 0], {"a": F32, "b": F32}, [0, 0], [0, 0, 0, 0])
    with pytest.raises(InvalidRequest, match=r"BatchMeta needs 2 x 1 offsets \(rows x fields\), got 3"):
        BatchMeta(0, 1, [0, 1], [0, 0], {"a": F32}, [0, 0], [0, 0, 0])


def test_batch_metas_travel_over_the_wire_unchanged():
    original = meta(keys=[f"k{i}" for i in range(6)], dp_rank=1)
    back = p.decode_as(p.encode(p.MetaWire.from_meta(original)), p.MetaWire).to_meta()
    assert cells(back) == cells(original) and back.fields == original.fields
    assert (back.partition_id, back.partition_uid, back.task_name, back.extra) == (3, 7, "train", original.extra)
    assert back.group_ids.tolist() == original.group_ids.tolist()


# ---- selection ---------------------------------------------------------------------------------------------------
def test_select_samples_takes_rows_in_the_order_given():
    m = meta(keys=[f"k{i}" for i in range(6)])
    picked = m.select_samples([4, 0, -1])
    assert picked.global_indexes.tolist() == [4, 0, 5] and picked.group_ids.tolist() == [2, 0, 2]
    assert cells(picked)["b"] == [(4, 104, 4), (0, 100, 0), (5, 105, 5)]
    assert picked.keys == ["k4", "k0", "k5"] and picked.extra is not m.extra
    assert len(m.select_samples([])) == 0
    with pytest.raises(InvalidRequest, match=r"select_samples: positions must lie in \[0, 6\), got \[1, 6\]"):
        m.select_samples([1, 6])


def test_select_fields_keeps_rows_and_picks_columns():
    m = meta(fields=("a", "b", "c"))
    picked = m.select_fields(["c", "a"])
    assert picked.field_names == ["c", "a"]
    assert cells(picked) == {"c": cells(m)["c"], "a": cells(m)["a"]}
    assert m.select_fields(["b", "b"]).field_names == ["b"]  # a field named twice is taken once
    with pytest.raises(UnknownField, match=r"fields \['z'\] are not in this batch; it has \['a', 'b', 'c'\]"):
        m.select_fields(["a", "z"])


def test_a_bare_str_is_one_field_name():
    m = meta(fields=("a", "b", "ab"))
    assert m.select_fields("ab").field_names == ["ab"]  # not the fields 'a' and 'b'
    with pytest.raises(UnknownField, match=r"fields \['ba'\] are not in this batch"):
        m.select_fields("ba")


# ---- chunk ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", range(0, 9))
@pytest.mark.parametrize("chunks", range(1, 6))
def test_chunk_splits_like_torch_chunk(rows, chunks):
    m = meta(rows=rows)
    pieces = m.chunk(chunks)
    expected = torch.chunk(torch.arange(rows), chunks)
    assert [p.global_indexes.tolist() for p in pieces] == [t.tolist() for t in expected]
    assert all(p.fields == m.fields and p.partition_uid == m.partition_uid for p in pieces)


def test_chunk_needs_at_least_one_piece():
    with pytest.raises(InvalidRequest, match="chunk: chunks must be >= 1, got 0"):
        meta().chunk(0)


# ---- concat and union ----------------------------------------------------------------------------------------
def test_concat_undoes_chunk():
    m = meta(rows=7, keys=[f"k{i}" for i in range(7)])
    back = BatchMeta.concat(m.chunk(3))
    assert cells(back) == cells(m) and back.keys == m.keys and back.group_ids.tolist() == m.group_ids.tolist()
    assert BatchMeta.concat([m]) is not m and cells(BatchMeta.concat([m])) == cells(m)


def test_concat_aligns_fields_given_in_another_order():
    first, second = meta(rows=2), meta(rows=2, start=2)
    swapped = second.select_fields(["b", "a"])
    joined = BatchMeta.concat([first, swapped])
    assert joined.field_names == ["a", "b"]
    assert cells(joined) == {k: cells(first)[k] + cells(second)[k] for k in ("a", "b")}


def test_concat_refuses_other_partitions_and_other_fields():
    with pytest.raises(InvalidRequest, match="concat needs at least one BatchMeta, got an empty list"):
        BatchMeta.concat([])
    with pytest.raises(
        InvalidRequest, match=r"concat: all metas must come from one partition; got 3 \(uid 7\) and 3 \(uid 8\)"
    ):
        BatchMeta.concat([meta(), meta(uid=8)])
    with pytest.raises(
        InvalidRequest, match=r"concat: all metas must have the same fields; got \['a', 'b'\] and \['a'\]"
    ):
        BatchMeta.concat([meta(), meta(fields=("a",))])
    with pytest.raises(InvalidRequest, match="concat: all metas must have the same fields"):
        BatchMeta.concat([meta(fields=("a",)), BatchMeta(3, 7, [9], [4], {"a": TOKENS}, [1], [0])])


def test_union_fields_adds_the_other_metas_columns():
    ab = meta(fields=("a", "b"), dp_rank=0)
    bc = BatchMeta(3, 7, ab.global_indexes, ab.group_ids, {"b": F32, "c": TOKENS}, np.full((6, 2), 9), np.ones((6, 2)))
    both = ab.union_fields(bc)
    assert both.field_names == ["a", "b", "c"] and both.fields["c"] == TOKENS
    assert cells(both)["b"] == cells(ab)["b"]  # a field in both keeps this meta's cells
    assert [c[1:] for c in cells(both)["c"]] == [(9, 1)] * 6
    assert both.extra == {"dp_rank": 0}
    with pytest.raises(
        InvalidRequest, match="union_fields: both metas must name the same rows of the same partition in order"
    ):
        ab.union_fields(ab.select_samples([1, 0, 2, 3, 4, 5]))
    with pytest.raises(InvalidRequest, match="union_fields"):
        ab.union_fields(meta(uid=8))
