"""Checkpoints on disk: each storage unit writes and reads its own payload files, and a whole queue's checkpoint
(``client.save_checkpoint`` / ``init(restore_from=...)``) commits the controller's snapshot and the units' files
together (see the end of this module; the snapshot itself is transfer_queue.state.snapshot).

Layout under a checkpoint directory ``root``::

    root/unit-<u>/CURRENT          name of the committed snapshot (replaced atomically)
    root/unit-<u>/snap-<n>/        one committed snapshot: manifest.msgpack + payload.bin
    root/unit-<u>/.staging-*/      a save in progress (or one that crashed: removed by the next save)

A save writes a new ``snap-<n>`` in a staging directory (payload, then manifest, each fsynced), fsyncs the
directory, renames it into place, then replaces ``CURRENT`` (written to a temp file, fsynced, ``os.replace``) and
fsyncs ``unit-<u>``; only then are older snapshots removed. A crash at any point leaves ``CURRENT`` naming the
previous snapshot, whole. Loading checks the manifest's format and every buffer's CRC-32.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from transfer_queue.errors import CheckpointError
from transfer_queue.metadata import FieldSchema

__all__ = ["CheckpointError"]  # defined in transfer_queue.errors (it travels by name); importable from here too
FORMAT_VERSION = 1
ALIGN = 64  # buffers start on 64-byte boundaries in payload.bin (tensors over them are aligned)
CURRENT = "CURRENT"
MANIFEST = "manifest.msgpack"
PAYLOAD = "payload.bin"
STAGING_PREFIX = ".staging-"


class BufferEntry(msgspec.Struct, array_like=True, frozen=True):
    offset: int
    nbytes: int
    crc32: int


class ColumnEntry(msgspec.Struct, array_like=True, frozen=True):
    name: str
    schema: FieldSchema
    num_rows: int
    buffers: list[BufferEntry]


class BlockEntry(msgspec.Struct, array_like=True, frozen=True):
    block_id: int
    partition_uid: int
    num_rows: int
    columns: list[ColumnEntry]


class Manifest(msgspec.Struct, frozen=True):
    version: int
    unit: int
    num_units: int
    blocks: list[BlockEntry]


@dataclass
class SavedBlock:
    """One block as loaded: its id and partition as saved, and its columns over the loaded payload."""

    block_id: int
    partition_uid: int
    num_rows: int
    columns: dict[str, Any]  # name -> transfer_queue.wire.columns.Column


def unit_dir(root: str, unit: int) -> str:
    return os.path.join(root, f"unit-{unit}")


def _fsync_path(path: str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_payload(path: str, blocks: Iterable[Any]) -> list[BlockEntry]:
    """Write every block's column buffers into one file; return the manifest entries describing them."""
    entries = []
    offset = 0
    with open(path, "wb") as out:
        for block_id, block in blocks:
            columns = []
            for name, column in block.columns.items():
                buffers = []
                for buf in column.buffers():
                    view = memoryview(buf).cast("B")
                    pad = -offset % ALIGN
                    out.write(b"\0" * pad)
                    offset += pad
                    out.write(view)
                    buffers.append(BufferEntry(offset, view.nbytes, zlib.crc32(view)))
                    offset += view.nbytes
                columns.append(ColumnEntry(name, column.schema, column.num_rows, buffers))
            entries.append(BlockEntry(block_id, block.partition_uid, block.num_rows, columns))
        out.flush()
        os.fsync(out.fileno())
    return entries


def save_unit(root: str, unit: int, num_units: int, blocks: dict[int, Any]) -> str:
    """Write the blocks of storage unit ``unit`` (``BlockStore.blocks``) as its new committed snapshot under
    ``root``; returns the snapshot's directory. A crash before the return leaves the previous snapshot current."""
    directory = unit_dir(root, unit)
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):  # saves that crashed half-way
        if name.startswith(STAGING_PREFIX):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    previous = _current_name(directory)
    number = int(previous.removeprefix("snap-")) + 1 if previous else 0
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory)
    entries = _write_payload(os.path.join(staging, PAYLOAD), sorted(blocks.items()))
    with open(os.path.join(staging, MANIFEST), "wb") as out:
        out.write(msgspec.msgpack.encode(Manifest(FORMAT_VERSION, unit, num_units, entries)))
        out.flush()
        os.fsync(out.fileno())
    _fsync_path(staging)
    return _promote(directory, staging, f"snap-{number}", "snap-")


def _promote(root: str, staging: str, name: str, prefix: str) -> str:
    """Rename the fsynced ``staging`` directory to ``root/name``, point ``CURRENT`` at it (written aside, fsynced,
    swapped in) and only then remove the older ``prefix*`` directories. Returns the new directory."""
    final = os.path.join(root, name)
    shutil.rmtree(final, ignore_errors=True)  # left by a crash after its rename, before CURRENT named it
    os.rename(staging, final)
    pointer = os.path.join(root, f"{CURRENT}.tmp")
    with open(pointer, "w") as out:
        out.write(name)
        out.flush()
        os.fsync(out.fileno())
    os.replace(pointer, os.path.join(root, CURRENT))
    _fsync_path(root)
    for old in os.listdir(root):
        if old.startswith(prefix) and old != name:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def _current_name(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, CURRENT)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def read_manifest(root: str, unit: int) -> tuple[str, Manifest]:
    """The committed snapshot's directory and manifest of ``unit``."""
    directory = unit_dir(root, unit)
    name = _current_name(directory)
    if name is None:
        raise CheckpointError(f"no committed checkpoint of storage unit {unit} under {directory}")
    snapshot = os.path.join(directory, name)
    path = os.path.join(snapshot, MANIFEST)
    try:
        with open(path, "rb") as f:
            manifest = msgspec.msgpack.decode(f.read(), type=Manifest)
    except (OSError, msgspec.DecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if manifest.version != FORMAT_VERSION or manifest.unit != unit:
        raise CheckpointError(
            f"{path} holds format {manifest.version} of unit {manifest.unit}; expected format {FORMAT_VERSION} "
            f"of unit {unit}"
        )
    return snapshot, manifest


def load_unit(root: str, unit: int) -> list[SavedBlock]:
    """The blocks storage unit ``unit`` saved in its committed snapshot, with every buffer checked."""
    from transfer_queue.wire.columns import Column

    snapshot, manifest = read_manifest(root, unit)
    path = os.path.join(snapshot, PAYLOAD)
    payload = np.fromfile(path, dtype=np.uint8)
    out = []
    for block in manifest.blocks:
        columns = {}
        for column in block.columns:
            buffers = []
            for entry in column.buffers:
                view = payload[entry.offset : entry.offset + entry.nbytes]
                if view.nbytes != entry.nbytes or zlib.crc32(view.data) != entry.crc32:
                    raise CheckpointError(
                        f"{path}: block {block.block_id} field {column.name!r} is damaged (size or CRC-32 differs)"
                    )
                buffers.append(view)
            columns[column.name] = Column.from_buffers(column.schema, column.num_rows, buffers)
        out.append(SavedBlock(block.block_id, block.partition_uid, block.num_rows, columns))
    return out


def restore_into(store: Any, saved: Iterable[SavedBlock], block_ids: dict[int, int] | None = None) -> int:
    """Write loaded blocks into a ``BlockStore`` through its ordinary write path (so its checks and byte counts
    apply); ``block_ids`` renumbers blocks (restoring onto another number of units: the controller's map, old id ->
    an id this unit owns). Returns the payload bytes written."""
    from transfer_queue.wire import protocol as p

    before = store.nbytes
    for block in saved:
        specs = [p.ColumnSpec(n, c.schema, c.num_rows, len(c.buffers())) for n, c in block.columns.items()]
        buffers = [b for c in block.columns.values() for b in c.buffers()]
        block_id = block_ids.get(block.block_id, block.block_id) if block_ids else block.block_id
        store.write(p.Write(block.partition_uid, block_id, block.num_rows, specs), buffers)
    return store.nbytes - before


# ---- a whole queue's checkpoint: the controller's snapshot and every unit's files, committed together ---------
# root/CURRENT names the committed checkpoint; root/ckpt-<n>/ holds controller.msgpack and unit-<u>/ (each unit
# writes its own, see save_unit); root/.staging-ckpt-* is a save in progress. The whole directory is renamed into
# place only after every unit saved, so a crash mid-save leaves the previous checkpoint current and whole.
CONTROLLER = "controller.msgpack"


def begin_save(root: str) -> tuple[str, str]:
    """A fresh staging directory for the next checkpoint under ``root``, and the name it will take."""
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):  # saves that crashed half-way
        if name.startswith(STAGING_PREFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    previous = _current_name(root)
    number = int(previous.removeprefix("ckpt-")) + 1 if previous else 0
    return tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}ckpt-{number}-", dir=root), f"ckpt-{number}"


def write_controller(staging: str, blob: bytes) -> None:
    with open(os.path.join(staging, CONTROLLER), "wb") as out:
        out.write(blob)
        out.flush()
        os.fsync(out.fileno())


def commit_save(root: str, staging: str, name: str) -> str:
    """Make the staged checkpoint the current one; older ones are removed after. Returns its directory."""
    for sub in os.listdir(staging):
        if os.path.isdir(os.path.join(staging, sub)):
            _fsync_path(os.path.join(staging, sub))
    _fsync_path(staging)
    final = _promote(root, staging, name, "ckpt-")
    # Saves the controller gave up: it removed their staging directories, but a unit that was still writing into one
    # (slow, not stalled) can leave files behind, or recreate it. Every unit has answered this save by now, and a unit
    # answers in order, so none writes into an older staging directory any more: sweep what is left.
    for stale in os.listdir(root):
        if stale.startswith(STAGING_PREFIX):
            shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
    return final


def current_checkpoint(root: str) -> str:
    """The committed checkpoint's directory under ``root``."""
    name = _current_name(root)
    if name is None:
        raise CheckpointError(f"no committed queue checkpoint under {root} (no {CURRENT} file)")
    return os.path.join(root, name)


def read_controller(checkpoint: str) -> bytes:
    path = os.path.join(checkpoint, CONTROLLER)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
