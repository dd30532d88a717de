"""A storage unit's checkpoint files: saved and loaded back whole (dense, jagged and object fields), committed
atomically (a crash at any point of a save leaves the previous snapshot current and loadable), damage detected,
and restored into a unit of another layout through the ordinary write path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.unit.transfer_queue.storage.test_block_store import expected, read, row_values, rows, write
from transfer_queue.errors import CheckpointError
from transfer_queue.storage import checkpoint as ckpt
from transfer_queue.storage.checkpoint import load_unit, restore_into, save_unit
from transfer_queue.storage.unit import BlockStore


def store_with(*ranges: tuple[int, int]) -> BlockStore:
    """Unit 0 of 2, one block per range (block ids 0, 2, 4, ...: the ones unit 0 owns)."""
    store = BlockStore(0, 2)
    for k, (start, stop) in enumerate(ranges):
        write(store, 2 * k, rows(start, stop))
    return store


def round_trip(root: str) -> list[tuple]:
    restored = BlockStore(0, 2)
    restore_into(restored, load_unit(root, 0))
    out, _ = read(restored, [(0, i) for i in range(3)] + [(2, i) for i in range(2)])
    return row_values(out)


def test_a_saved_unit_loads_back_whole(tmp_path) -> None:
    store = store_with((0, 3), (10, 12))
    save_unit(str(tmp_path), 0, 2, store.blocks)
    loaded = load_unit(str(tmp_path), 0)
    assert [(b.block_id, b.partition_uid, b.num_rows) for b in loaded] == [(0, 5, 3), (2, 5, 2)]
    assert round_trip(str(tmp_path)) == expected([0, 1, 2, 10, 11])
    restored = BlockStore(0, 2)
    assert restore_into(restored, loaded) == store.nbytes


def test_a_new_save_replaces_the_old_snapshot(tmp_path) -> None:
    save_unit(str(tmp_path), 0, 2, store_with((0, 3), (10, 12)).blocks)
    save_unit(str(tmp_path), 0, 2, store_with((20, 23), (30, 32)).blocks)
    assert round_trip(str(tmp_path)) == expected([20, 21, 22, 30, 31])
    assert sorted(os.listdir(ckpt.unit_dir(str(tmp_path), 0))) == ["CURRENT", "snap-1"]


@pytest.mark.parametrize("crash_at", ["payload", "manifest", "rename", "pointer"])
def test_a_crash_mid_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch, crash_at: str) -> None:
    root = str(tmp_path)
    save_unit(root, 0, 2, store_with((0, 3), (10, 12)).blocks)

    class Crash(Exception):
        pass

    def crash(*_: object, **__: object) -> None:
        raise Crash

    real_fsync = os.fsync
    fsyncs = {"payload": 0, "manifest": 1}
    calls = {"fsync": 0}

    def fsync(fd: int) -> None:
        if crash_at in fsyncs and calls["fsync"] == fsyncs[crash_at]:
            raise Crash
        calls["fsync"] += 1
        real_fsync(fd)

    monkeypatch.setattr(ckpt.os, "fsync", fsync)
    if crash_at == "rename":
        monkeypatch.setattr(ckpt.os, "rename", crash)
    if crash_at == "pointer":
        monkeypatch.setattr(ckpt.os, "replace", crash)
    with pytest.raises(Crash):
        save_unit(root, 0, 2, store_with((20, 23), (30, 32)).blocks)
    monkeypatch.undo()
    assert round_trip(root) == expected([0, 1, 2, 10, 11])  # the previous snapshot, whole
    save_unit(root, 0, 2, store_with((40, 43), (50, 52)).blocks)  # the next save cleans up and commits
    assert round_trip(root) == expected([40, 41, 42, 50, 51])
    assert not [n for n in os.listdir(ckpt.unit_dir(root, 0)) if n.startswith(ckpt.STAGING_PREFIX)]


def test_damage_and_absence_are_checkpoint_errors(tmp_path) -> None:
    root = str(tmp_path)
    with pytest.raises(CheckpointError, match=r"no committed checkpoint of storage unit 0 under .*unit-0"):
        load_unit(root, 0)
    snapshot = save_unit(root, 0, 2, store_with((0, 3), (10, 12)).blocks)
    payload = Path(snapshot, ckpt.PAYLOAD)
    data = bytearray(payload.read_bytes())
    data[0] ^= 0xFF
    payload.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"block 0 field 'ids' is damaged \(size or CRC-32 differs\)"):
        load_unit(root, 0)
    with pytest.raises(CheckpointError, match=r"holds format 1 of unit 0; expected format 1 of unit 1"):
        os.makedirs(ckpt.unit_dir(root, 1))
        os.symlink(snapshot, os.path.join(ckpt.unit_dir(root, 1), "snap-0"))
        Path(ckpt.unit_dir(root, 1), "CURRENT").write_text("snap-0")
        load_unit(root, 1)


def test_restoring_onto_another_layout_renumbers_blocks(tmp_path) -> None:
    save_unit(str(tmp_path), 0, 2, store_with((0, 3), (10, 12)).blocks)
    one_unit = BlockStore(0, 1)  # the queue restarts with one unit: the controller maps the block ids
    restore_into(one_unit, load_unit(str(tmp_path), 0), block_ids={0: 7, 2: 9})
    out, _ = read(one_unit, [(7, 0), (9, 1)])
    assert row_values(out) == expected([0, 11])


def test_a_late_units_files_in_an_abandoned_staging_directory_are_swept_by_the_next_commit(tmp_path) -> None:
    root = str(tmp_path)
    abandoned, _ = ckpt.begin_save(root)  # a save the controller gave up on (a unit too slow) ...
    ckpt.write_controller(abandoned, b"first")
    staging, name = ckpt.begin_save(root)  # ... swept when the next save begins, then recreated by the slow unit
    os.makedirs(os.path.join(abandoned, "unit-1"))  # still writing its part of the abandoned save (seen in a CI run)
    ckpt.write_controller(staging, b"second")
    final = ckpt.commit_save(root, staging, name)
    assert sorted(os.listdir(root)) == ["CURRENT", os.path.basename(final)]
