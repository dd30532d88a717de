"""BlockStore: a storage unit's blocks without sockets: writes over received frames, gathers, tombstones, stats."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from transfer_queue.errors import (
    InvalidRequest,
    PartitionCleared,
    PutExpired,
    StaleBatchMeta,
    TransferQueueError,
    UnknownField,
)
from transfer_queue.storage.unit import BlockStore
from transfer_queue.wire import protocol as p
from transfer_queue.wire.columns import Column, columns_from_tensordict
from transfer_queue.wire.unix_socket import GatheredFrame

UID = 5


def rows(start: int, stop: int) -> TensorDict:
    """Rows ``start..stop`` of a batch with a dense, a jagged and an object field; row i holds values from i."""
    n = stop - start
    return TensorDict(
        {
            "ids": torch.arange(start, stop).repeat_interleave(3).reshape(n, 3),
            "resp": torch.nested.nested_tensor(
                [torch.full((i % 3,), i, dtype=torch.int32) for i in range(start, stop)], layout=torch.jagged
            ),
            "tag": NonTensorStack(*[f"t{i}" for i in range(start, stop)]),
        },
        batch_size=[n],
    )


def frames_of(data: TensorDict) -> tuple[list[p.ColumnSpec], list[np.ndarray]]:
    """What a client sends: a spec per column and its buffers, as received frames (fresh, writable memory)."""
    _, columns = columns_from_tensordict(data)
    specs = [p.ColumnSpec(name, c.schema, c.num_rows, len(c.buffers())) for name, c in columns.items()]
    frames = [
        np.frombuffer(bytearray(bytes(memoryview(b))), dtype=np.uint8) for c in columns.values() for b in c.buffers()
    ]
    return specs, frames


def write(store: BlockStore, block_id: int, data: TensorDict, uid: int = UID) -> list[np.ndarray]:
    specs, frames = frames_of(data)
    store.write(p.Write(uid, block_id, len(data), specs), frames)
    return frames


def read(store: BlockStore, cells: list[tuple[int, int]], names=("ids", "resp", "tag"), uid: int = UID):
    """Read (block, offset) cells of every field; returns the fields as values and the reply's raw buffers."""
    blocks = p.pack_indexes(np.array([b for b, _ in cells]))
    offsets = p.pack_indexes(np.array([o for _, o in cells]))
    reply, buffers = store.read(p.Read(uid, [p.ReadField(n, blocks, offsets) for n in names]))
    out, i = {}, 0
    for spec in reply.columns:
        out[spec.name] = Column.from_buffers(spec.schema, spec.num_rows, buffers[i : i + spec.nframes]).to_value()
        i += spec.nframes
    return out, buffers


def row_values(out: dict) -> list[tuple]:
    """(first id, response, tag) per row, to compare with the rows that were written."""
    resp, tags = out["resp"].unbind(), out["tag"].tolist()
    return [(int(out["ids"][k, 0]), resp[k].tolist(), tags[k]) for k in range(len(out["ids"]))]


def expected(global_rows: list[int]) -> list[tuple]:
    return [(i, [i] * (i % 3), f"t{i}") for i in global_rows]


@pytest.fixture
def store() -> BlockStore:
    """Unit 0 of 2 holding blocks 0 (rows 0-3), 2 (rows 4-5) and 4 (rows 6-9)."""
    store = BlockStore(unit=0, num_units=2)
    write(store, 0, rows(0, 4))
    write(store, 2, rows(4, 6))
    write(store, 4, rows(6, 10))
    return store


def test_a_contiguous_run_of_one_block_is_read_as_views(store):
    frames = write(store, 6, rows(10, 14))
    out, buffers = read(store, [(6, 1), (6, 2), (6, 3)])
    assert row_values(out) == expected([11, 12, 13])
    ids, values = buffers[0], buffers[1]  # dense ids, then jagged resp values: views of the received frames
    assert np.shares_memory(np.asarray(ids), frames[0]) and np.shares_memory(np.asarray(values), frames[1])


def test_reads_gather_across_blocks_in_any_order(store):
    cells = [(4, 3), (0, 0), (2, 1), (0, 2), (4, 0), (0, 1), (2, 0)]
    out, _ = read(store, cells)
    assert row_values(out) == expected([9, 0, 5, 2, 6, 1, 4])
    out, _ = read(store, [(0, 2), (0, 2), (0, 0)])  # the same row twice, and rows out of order in one block
    assert row_values(out) == expected([2, 2, 0])


def test_a_read_of_runs_of_blocks_in_order_sends_the_blocks_rows_without_copying_them(store):
    cells = [(0, 2), (0, 3), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2)]  # rows 2..8: a run in each of three blocks
    blocks = p.pack_indexes(np.array([b for b, _ in cells]))
    offsets = p.pack_indexes(np.array([o for _, o in cells]))
    request = p.Read(UID, [p.ReadField(n, blocks, offsets) for n in ("ids", "resp", "tag")])
    plain_reply, plain = store.read(request)
    reply, gathered = store.read(request, gathered=True)
    assert reply == plain_reply
    ids, values = gathered[0], gathered[1]  # dense ids, jagged resp values: the blocks' own memory, end to end
    assert isinstance(ids, GatheredFrame) and isinstance(values, GatheredFrame) and len(ids.views) == 3
    assert np.shares_memory(np.asarray(ids.views[0]), np.asarray(store.blocks[0].columns["ids"].buffers()[0]))
    joined = [g.join() if isinstance(g, GatheredFrame) else np.frombuffer(g, dtype=np.uint8) for g in gathered]
    assert [bytes(j) for j in joined] == [bytes(memoryview(b).cast("B")) for b in plain]
    out, i = {}, 0
    for spec in reply.columns:
        out[spec.name] = Column.from_buffers(spec.schema, spec.num_rows, joined[i : i + spec.nframes]).to_value()
        i += spec.nframes
    assert row_values(out) == expected(list(range(2, 9)))
    # blocks interleaved in the reply (block 0, block 2, block 0 again) are gathered the old way: one new buffer
    _, mixed = store.read(p.Read(UID, [p.ReadField("ids", p.pack_indexes(np.array([0, 2, 0])),
                                                   p.pack_indexes(np.array([0, 0, 1])))]), gathered=True)  # fmt: skip
    assert not isinstance(mixed[0], GatheredFrame)
    assert np.asarray(mixed[0]).view(np.int64).reshape(3, 3)[:, 0].tolist() == [0, 4, 1]


def test_stats_count_the_bytes_of_the_frames(store):
    before = store.stats()
    assert before["blocks"] == 3 and before["unit"] == 0
    frames = write(store, 6, rows(10, 12))
    assert store.stats()["bytes"] == before["bytes"] + sum(f.nbytes for f in frames)


def test_dropped_blocks_refuse_late_writes_and_reads(store):
    store.drop_blocks(UID, [2, 8])  # block 8 was never written: its late write is refused too
    with pytest.raises(
        PutExpired, match="block 8 belongs to a put that was aborted or already finished; the write was dropped"
    ):
        write(store, 8, rows(0, 1))
    with pytest.raises(StaleBatchMeta, match=r"block 2 of field 'ids' is gone .*; get a fresh BatchMeta"):
        read(store, [(0, 0), (2, 0)])
    assert row_values(read(store, [(4, 0)])[0]) == expected([6])  # other blocks are untouched


def test_a_dropped_partition_refuses_late_writes_and_stale_reads(store):
    other = write(store, 10, rows(0, 2), uid=UID + 1)
    store.drop_partition(UID)
    with pytest.raises(PartitionCleared, match=f"partition uid {UID} was cleared; the write was dropped"):
        write(store, 12, rows(0, 1))
    with pytest.raises(StaleBatchMeta, match=f"the rows of this BatchMeta were cleared \\(partition uid {UID}\\)"):
        read(store, [(0, 0)])
    assert store.stats()["blocks"] == 1 and store.stats()["bytes"] == sum(f.nbytes for f in other)
    store.drop_partition(UID + 1)
    store.drop_blocks(UID + 1, [10])  # dropping what is gone is a no-op
    assert (store.stats()["blocks"], store.stats()["bytes"]) == (0, 0)
    assert store.blocks == {} and store.by_partition == {}


def test_a_read_of_another_partitions_block_is_stale(store):
    with pytest.raises(StaleBatchMeta, match="block 0 of field 'ids' is gone"):
        read(store, [(0, 0)], uid=UID + 1)


@pytest.mark.parametrize(
    ("field", "blocks", "offsets", "error", "message"),
    [
        ("nope", [0], [0], UnknownField, r"field 'nope' is not in block 0; it has \['ids', 'resp', 'tag'\]"),
        ("ids", [0], [4], InvalidRequest, "offsets of field 'ids' lie outside block 0"),
        ("ids", [0], [-1], InvalidRequest, "offsets of field 'ids' lie outside block 0"),
        ("ids", [0, 0], [0], InvalidRequest, "field 'ids': 2 block ids but 1 offsets"),
        ("ids", [], [], InvalidRequest, "field 'ids': a read needs at least one row"),
        ("ids", [7], [0], StaleBatchMeta, "block 7 of field 'ids' is gone"),
    ],
    ids=["unknown-field", "offset-past-end", "negative-offset", "lengths", "empty", "unknown-block"],
)
def test_bad_reads_get_typed_errors(store, field, blocks, offsets, error, message):
    spec = p.ReadField(field, p.pack_indexes(np.array(blocks)), p.pack_indexes(np.array(offsets)))
    with pytest.raises(error, match=message):
        store.read(p.Read(UID, [spec]))


def test_bad_writes_get_typed_errors_and_store_nothing(store):
    specs, frames = frames_of(rows(0, 2))
    snapshot = (dict(store.blocks), store.nbytes)
    cases = [
        (p.Write(UID, 1, 2, specs), frames, r"block 1 belongs to storage unit 1, not 0"),
        (p.Write(UID, 0, 2, specs), frames, "block 0 was already written"),
        (p.Write(UID, 6, 2, specs), frames[:-1], "the write describes 4 buffers and carries 3"),
        (p.Write(UID, 6, 3, specs), frames, r"column 'ids': 2 rows in a block of 3"),
        (p.Write(UID, 6, 2, [specs[0], specs[0]]), frames[:2], r"column 'ids': 2 rows in a block of 2"),
        (p.Write(UID, 6, 2, specs), [frames[0][:-1], *frames[1:]], r"needs 48 bytes, got 47"),
        (p.Write(UID, 6, 2, specs), [frames[0], frames[2], frames[1], frames[3]], "needs"),
    ]
    for request, buffers, message in cases:
        with pytest.raises(TransferQueueError, match=message):
            store.write(request, buffers)
        assert (store.blocks, store.nbytes) == snapshot, message


def test_a_column_spec_whose_frame_count_disagrees_with_its_schema_is_refused(store):
    specs, frames = frames_of(rows(0, 2))
    bad = [p.ColumnSpec(s.name, s.schema, s.num_rows, s.nframes + 1) for s in specs]
    with pytest.raises(InvalidRequest, match="declares 2 frames; a dense column has 1"):
        store.write(p.Write(UID, 6, 2, bad), frames)


def test_a_write_must_carry_its_reservation_and_no_more_bytes_than_reserved() -> None:
    from transfer_queue.wire.auth import write_token

    secret = b"s" * 32
    store = BlockStore(0, 1, secret)
    specs, frames = frames_of(rows(0, 4))
    nbytes = sum(f.nbytes for f in frames)

    def write(block_id: int, max_bytes: int, token: bytes) -> None:
        store.write(p.Write(UID, block_id, 4, specs, max_bytes, token), frames)

    with pytest.raises(InvalidRequest, match="block 1: the write does not carry the controller's reservation"):
        write(1, nbytes, b"")
    with pytest.raises(InvalidRequest, match="block 2: the write does not carry the controller's reservation"):
        write(2, nbytes, write_token(secret, UID, 1, 4, nbytes))  # a token of another block
    with pytest.raises(InvalidRequest, match=f"block 3 carries {nbytes} bytes; its put reserved {nbytes - 1}"):
        write(3, nbytes - 1, write_token(secret, UID, 3, 4, nbytes - 1))  # the put declared less than it sends
    assert store.nbytes == 0 and not store.blocks
    write(4, nbytes, write_token(secret, UID, 4, 4, nbytes))
    assert store.nbytes == nbytes
