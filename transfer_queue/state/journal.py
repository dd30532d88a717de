"""The controller's journal (``QueueConfig.journal_dir``): its bookkeeping on disk, so a controller that died is
started again where it was (issue 28 section 2).

The directory holds three files (``identity`` too: the session id, secret and port a restarted controller presents
again, readable by its user only):

``snapshot``
    a whole :class:`~transfer_queue.state.queue_state.QueueState` as
    :func:`~transfer_queue.state.snapshot.snapshot_state` writes it (msgpack), plus ``seq`` (the last log record it
    includes) and ``next_block``. Written atomically: a temporary file, fsynced, renamed over the old one, the
    directory fsynced.
``log``
    the changes since, appended: one record per serving pass that changed durable state (group commit: one
    ``write()`` for the pass, fsynced per ``journal_fsync`` before the pass's replies go out). A record is framed as
    ``<u32 length><u32 crc32><msgpack>`` and holds ``seq``, the partitions dropped (cleared) by key, each partition
    the pass changed and the state's other fields (counters, cleared names, samplers' states, lost rows). A
    partition's first record since the journal was opened or snapshotted (or since its arrays grew) holds it whole,
    as the snapshot does; the next ones hold its rows that changed (``rows``: their indexes, and those rows of each
    per-row array and of each task's consumption and delivery counts) and its dicts whole.

Records are *outcomes*, not requests to run again: samplers and lease clocks are not deterministic, so replay only
assigns what the serving pass ended with. Replay loads the snapshot, then applies every record whose ``seq`` is above
the snapshot's (a crash between a snapshot's rename and the log's truncation leaves records the snapshot already
holds: they are skipped). What a restore from a checkpoint redoes, replay redoes too: leased rows are ready again
(at-least-once: a leased, unacknowledged row is served again), puts that had not committed are gone (their rows
freed), parked requests and connections are not kept. Task options (``set_task_options``) and DP rounds are not
journaled: clients set them again.

To know which rows changed, the journal keeps a copy of each partition's per-row arrays as last written (its shadow: the
partition's array memory once more); a record costs the comparison with it, O(rows of the partitions the pass touched)
in numpy, plus the partitions' dicts. The log is folded into a new snapshot once it is longer than
``journal_snapshot_bytes`` and than the last snapshot, which bounds replay to about two snapshots' worth of bytes.

A torn last record (the process died in the middle of a ``write()``) is dropped on open; a record that fails its
checksum with more records after it is :class:`~transfer_queue.errors.JournalCorrupt`.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from transfer_queue.config import QueueConfig
from transfer_queue.errors import ConfigMismatch, JournalCorrupt, SnapshotError
from transfer_queue.samplers import SamplerSpec
from transfer_queue.state.partition import PartitionState
from transfer_queue.state.queue_state import QueueState
from transfer_queue.state.snapshot import (
    ROW_ARRAYS,
    array_dict,
    partition_snapshot,
    read_snapshot,
    restore_state,
    snapshot_state,
    state_globals,
    unarray,
)

SNAPSHOT = "snapshot"
LOG = "log"
_HEAD = struct.Struct("<II")  # payload length, crc32 of the payload
FSYNC_INTERVAL_S = 1.0  # journal_fsync="interval": at most this long between a record and its fsync
_CHECKED = ("global_batch_size", "num_n_samples", "num_storage_units")


def frame(payload: bytes) -> bytes:
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def read_log(path: str) -> tuple[list[dict[str, Any]], int]:
    """The records of the log at ``path`` and the byte offset where the last whole one ends (a torn tail after it is
    dropped). Raises JournalCorrupt for a record that fails its checksum or does not decode with bytes after it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return [], 0
    records, offset, size = [], 0, len(data)
    while offset < size:
        if offset + _HEAD.size > size:
            break  # torn: the header itself is cut
        length, crc = _HEAD.unpack_from(data, offset)
        end = offset + _HEAD.size + length
        if end > size:
            break  # torn: the payload is cut
        payload = data[offset + _HEAD.size : end]
        found = zlib.crc32(payload)
        if found != crc:
            if end == size:
                break  # torn: the last record, written in part
            raise JournalCorrupt(
                f"{path}: the record at byte {offset} fails its checksum (crc32 {found:#010x}, its header says "
                f"{crc:#010x}) and {size - end} bytes of records follow it; the journal is damaged"
            )
        try:
            record = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError as exc:
            raise JournalCorrupt(
                f"{path}: the record at byte {offset} passes its checksum but does not decode: {exc}"
            ) from None
        records.append(record)
        offset = end
    return records, offset


def load(directory: str) -> tuple[dict[str, Any] | None, int]:
    """The snapshot under ``directory`` with the log's records applied (None: no journal there yet), and the byte
    offset where the log's whole records end."""
    snap_path, log_path = os.path.join(directory, SNAPSHOT), os.path.join(directory, LOG)
    records, good = read_log(log_path)
    try:
        with open(snap_path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        if records:
            raise JournalCorrupt(
                f"{directory}: the journal has {len(records)} log records but no {SNAPSHOT} file"
            ) from None
        return None, good
    try:
        snapshot = read_snapshot(blob)
    except SnapshotError as exc:
        raise JournalCorrupt(f"{snap_path}: {exc}") from None
    parts = {d["key"]: d for d in snapshot["partitions"]}
    for record in records:
        if record["seq"] <= snapshot["seq"]:
            continue  # already in the snapshot (it was written after this record, the log not yet truncated)
        for key in record["drops"]:
            parts.pop(key, None)
        for d in record["parts"]:
            parts[d["key"]] = d if "rows" not in d else _patched(parts.get(d["key"]), d, log_path)
        snapshot.update(record["globals"])
        snapshot["seq"] = record["seq"]
    snapshot["partitions"] = list(parts.values())
    return snapshot, good


def _patched(base: dict[str, Any] | None, delta: dict[str, Any], path: str) -> dict[str, Any]:
    """Partition ``base`` (as the snapshot holds it, its arrays decoded as they are patched) with the rows of
    ``delta`` (a record of the rows that changed) applied."""
    if base is None or base["uid"] != delta["uid"]:
        raise JournalCorrupt(
            f"{path}: a record changes rows of partition {delta['key']!r} (uid {delta['uid']}), which the journal "
            f"before it does not hold{'' if base is None else ' (it holds uid ' + str(base['uid']) + ')'}"
        )
    rows = np.frombuffer(delta["rows"], dtype=np.int64)
    arrays = {name: unarray(base["arrays"][name]) for name in ROW_ARRAYS}
    for name in ROW_ARRAYS:
        if not arrays[name].flags.writeable:
            arrays[name] = arrays[name].copy()
        arrays[name][rows] = unarray(delta["arrays"][name])
    tasks = {}
    for name, task in delta["tasks"].items():
        if "rows" not in task:
            tasks[name] = task
            continue
        held = base["tasks"].get(name)
        if held is None:
            raise JournalCorrupt(f"{path}: a record changes rows of task {name!r}, which the journal does not hold")
        task_rows = np.frombuffer(task["rows"], dtype=np.int64)
        patched = {"dead": task["dead"]}
        for column in ("consumption", "deliveries"):
            values = unarray(held[column])
            if not values.flags.writeable:
                values = values.copy()
            values[task_rows] = unarray(task[column])
            patched[column] = values
        tasks[name] = patched
    out = {k: v for k, v in delta.items() if k != "rows"}
    out["arrays"], out["tasks"] = arrays, tasks
    return out


class Journal:
    """The open journal of a running controller: :meth:`record` once per serving pass, :meth:`snapshot` when
    :meth:`snapshot_due`. Not thread-safe: the serving thread owns it."""

    def __init__(
        self,
        directory: str,
        fsync: str = "always",
        snapshot_bytes: int = 64 << 20,
        seq: int = 0,
        log_end: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.directory = directory
        self.fsync = fsync
        self.snapshot_bytes = snapshot_bytes
        self.seq = seq
        self.clock = clock
        self.uids: dict[Any, int] = {}  # partition key -> uid, as the journal last wrote them
        # partition key -> the journal's copy of its per-row arrays as last written (the next record holds the rows
        # that differ); none after a start or a snapshot: the partition's next record is whole
        self._shadows: dict[Any, _Shadow] = {}
        self.snapshot_size = 0
        self.stats = {"records": 0, "bytes": 0, "fsyncs": 0, "snapshots": 0}
        self._synced_at = clock()
        self._unsynced = False
        self._fd = os.open(os.path.join(directory, LOG), os.O_WRONLY | os.O_CREAT, 0o600)
        os.ftruncate(self._fd, log_end)  # a torn tail is dropped before anything is appended after it
        os.lseek(self._fd, log_end, os.SEEK_SET)
        self.log_bytes = log_end

    def track(self, state: QueueState) -> None:
        """Take ``state``'s partitions as journaled (after a restore, or a snapshot)."""
        self.uids = {key: part.uid for key, part in state.partitions.items()}

    def record(self, state: QueueState, dirty: set[Any] | None, counters: bool = False) -> int:
        """Append what this pass changed: partitions in ``dirty`` (keys; None: all), those created and those removed
        since the last record, and the state's other fields (``counters``: they alone changed, e.g. a reserve handed
        out put and block ids). One ``write()``, fsynced per the policy. Returns the bytes written (0: nothing
        changed)."""
        current = {key: part.uid for key, part in state.partitions.items()}
        drops = [key for key in self.uids if key not in current]
        changed = [key for key, uid in current.items() if self.uids.get(key) != uid or dirty is None or key in dirty]
        if not drops and not changed and not counters:
            return 0
        shadows = {}
        try:
            parts = []
            for key in changed:
                d, shadows[key] = self._partition_record(state.partitions[key])
                parts.append(d)
            payload = msgspec.msgpack.encode(
                {
                    "seq": self.seq + 1,
                    "drops": drops,
                    "parts": parts,
                    "globals": {**state_globals(state), "next_block": state._next_block},
                }
            )
            data = frame(payload)
            os.write(self._fd, data)
        except BaseException:
            self._shadows.clear()  # they may hold rows this record did not get to write: the next ones are whole
            raise
        self.seq += 1
        for key in drops:
            self._shadows.pop(key, None)
        self._shadows.update(shadows)
        self.uids = current
        self.log_bytes += len(data)
        self.stats["records"] += 1
        self.stats["bytes"] += len(data)
        self._unsynced = True
        if self.fsync == "always":
            self.sync()
        else:
            self.sync_due()
        return len(data)

    def _partition_record(self, part: PartitionState) -> tuple[dict[str, Any], _Shadow]:
        """The record of ``part``: whole the first time (after a start or a snapshot) or when its arrays changed
        shape; else the rows that differ from what the journal holds (its shadow), with the partition's other fields
        whole. Returns the shadow it leaves (the journal's copy of the arrays, once written)."""
        d = partition_snapshot(part, arrays=False)
        shadow = self._shadows.get(part.key)
        arrays = {name: getattr(part, name) for name in ROW_ARRAYS}
        if (
            shadow is None
            or shadow.uid != part.uid
            or any(shadow.arrays[n].shape != a.shape or shadow.arrays[n].dtype != a.dtype for n, a in arrays.items())
        ):
            full = partition_snapshot(part)
            d["arrays"], d["tasks"] = full["arrays"], full["tasks"]
            return d, _Shadow.of(part)
        changed = np.zeros(len(part.state), dtype=bool)
        for name, a in arrays.items():
            differs = a != shadow.arrays[name]
            changed |= differs.any(axis=1) if differs.ndim > 1 else differs
        rows = np.flatnonzero(changed)
        d["rows"] = rows.astype(np.int64).tobytes()
        d["arrays"] = {name: array_dict(a[rows]) for name, a in arrays.items()}
        for name, a in arrays.items():
            shadow.arrays[name][rows] = a[rows]
        tasks: dict[str, Any] = {}
        for name, task in part.tasks.items():
            dead = [[row, reason] for row, reason in task.dead.items()]
            held = shadow.tasks.get(name)
            if held is None or len(held[0]) != len(task.consumption) or len(held[1]) != len(task.deliveries):
                tasks[name] = {
                    "consumption": array_dict(task.consumption),
                    "deliveries": array_dict(task.deliveries),
                    "dead": dead,
                }
                shadow.tasks[name] = (task.consumption.copy(), task.deliveries.copy())
                continue
            task_rows = np.flatnonzero((task.consumption != held[0]) | (task.deliveries != held[1]))
            tasks[name] = {
                "rows": task_rows.astype(np.int64).tobytes(),
                "consumption": array_dict(task.consumption[task_rows]),
                "deliveries": array_dict(task.deliveries[task_rows]),
                "dead": dead,
            }
            held[0][task_rows] = task.consumption[task_rows]
            held[1][task_rows] = task.deliveries[task_rows]
        for name in [n for n in shadow.tasks if n not in part.tasks]:
            del shadow.tasks[name]
        d["tasks"] = tasks
        return d, shadow

    def sync_due(self) -> None:
        """``journal_fsync="interval"``: fsync what was written if the last fsync is older than FSYNC_INTERVAL_S."""
        if self._unsynced and self.fsync == "interval" and self.clock() - self._synced_at >= FSYNC_INTERVAL_S:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._fd)
        self.stats["fsyncs"] += 1
        self._synced_at = self.clock()
        self._unsynced = False

    def snapshot_due(self) -> bool:
        return self.log_bytes > max(self.snapshot_bytes, self.snapshot_size)

    def snapshot(self, state: QueueState) -> int:
        """Write ``state`` as the new snapshot (atomically) and empty the log; returns the snapshot's size."""
        blob = snapshot_state(state, None, seq=self.seq, next_block=state._next_block)
        path = os.path.join(self.directory, SNAPSHOT)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(self.directory)
        # the records up to seq are in the snapshot now; a crash before this truncation replays none of them
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.fsync(self._fd)
        self.log_bytes = 0
        self.snapshot_size = len(blob)
        self.stats["snapshots"] += 1
        self.track(state)
        self._shadows.clear()  # the next record of each partition is whole: the snapshot is its new base
        return len(blob)

    def close(self) -> None:
        if self._fd >= 0:
            if self._unsynced and self.fsync != "never":
                self.sync()
            os.close(self._fd)
            self._fd = -1


class _Shadow:
    """The journal's copy of a partition's per-row arrays (and its tasks' consumption and deliveries), as written."""

    __slots__ = ("arrays", "tasks", "uid")

    def __init__(self, uid: int, arrays: dict[str, np.ndarray], tasks: dict[str, tuple[np.ndarray, np.ndarray]]):
        self.uid = uid
        self.arrays = arrays
        self.tasks = tasks

    @classmethod
    def of(cls, part: PartitionState) -> _Shadow:
        return cls(
            part.uid,
            {name: getattr(part, name).copy() for name in ROW_ARRAYS},
            {name: (t.consumption.copy(), t.deliveries.copy()) for name, t in part.tasks.items()},
        )


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_journal(config: QueueConfig, sampler: SamplerSpec | None = None) -> tuple[QueueState, Journal, bool]:
    """The state ``config.journal_dir`` holds (a fresh one when the directory has no journal yet, whose first
    snapshot is written now) and the journal open for appending; the bool says whether a journal was replayed.

    Raises:
        ConfigMismatch: the journal is of a queue with another ``global_batch_size``, ``num_n_samples`` or
            ``num_storage_units`` (its blocks live on that many units).
        JournalCorrupt: the journal does not read back.
    """
    directory = config.journal_dir
    if directory is None:
        raise ValueError("open_journal needs a config with a journal_dir")
    os.makedirs(directory, exist_ok=True)
    snapshot, log_end = load(directory)
    if snapshot is None:
        state = QueueState(config, sampler)
        journal = Journal(directory, config.journal_fsync, config.journal_snapshot_bytes, 0, log_end)
        journal.snapshot(state)
        return state, journal, False
    saved = snapshot["config"]
    for name in _CHECKED:
        if saved[name] != getattr(config, name):
            raise ConfigMismatch(
                f"the journal under {directory} is of a queue with {name}={saved[name]}; this one has "
                f"{name}={getattr(config, name)}"
            )
    identity = {int(b): int(b) for d in snapshot["partitions"] for b in d["dicts"]["block_refs"]}
    state = restore_state(snapshot, config, sampler, identity, int(snapshot["next_block"]))
    # the commits answered before are not remembered: a commit retried now of a put from before the restart is told
    # its outcome is unknown (RequestTimeout), never that its rows are not visible (they may well be)
    state.ledger.forgotten_upto = state._next_put - 1
    journal = Journal(directory, config.journal_fsync, config.journal_snapshot_bytes, int(snapshot["seq"]), log_end)
    journal.track(state)
    return state, journal, True


IDENTITY = "identity"


def read_identity(directory: str) -> dict[str, Any] | None:
    """What a controller started again over ``directory`` must present as before (its clients and storage units
    know it): ``session_id``, ``secret`` and its TCP ``port``; None before the first controller wrote it."""
    try:
        with open(os.path.join(directory, IDENTITY), "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return None
    try:
        identity = msgspec.msgpack.decode(blob)
    except msgspec.DecodeError as exc:
        raise JournalCorrupt(f"{os.path.join(directory, IDENTITY)} does not decode: {exc}") from None
    return dict(identity)


def write_identity(directory: str, session_id: str, secret: bytes, port: int) -> None:
    """Save the controller's identity under ``directory`` (readable by its user only: it holds the queue's secret)."""
    path = os.path.join(directory, IDENTITY)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, msgspec.msgpack.encode({"session_id": session_id, "secret": secret, "port": port}))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(directory)


def remove_journal(directory: str) -> None:
    """Remove the journal's files under ``directory`` (the queue was shut down: a new one starts empty)."""
    for name in (SNAPSHOT, SNAPSHOT + ".tmp", LOG, IDENTITY, IDENTITY + ".tmp"):
        try:
            os.remove(os.path.join(directory, name))
        except FileNotFoundError:
            pass
