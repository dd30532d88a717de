"""The controller's journal (``QueueConfig.journal_dir``): its bookkeeping on disk, so a controller that died is
started again where it was (issue 28 section 2).

The directory holds these files (``identity`` too: the session id, secret and port a restarted controller presents
again, readable by its user only):

``snapshot``
    a whole :class:`~transfer_queue.state.queue_state.QueueState` as
    :func:`~transfer_queue.state.snapshot.snapshot_state` writes it (msgpack), plus ``seq`` (the last log record it
    includes), ``next_block``, the live leases and ``next_lease``. Written atomically: a temporary file, fsynced,
    renamed over the old one, the directory fsynced.
``log``
    the changes since, appended: one record per serving pass that changed durable state (group commit: one
    ``write()`` for the pass, fsynced per ``journal_fsync`` before the pass's replies go out). A record is framed as
    ``<u32 length><u32 crc32><msgpack>`` and holds ``seq`` (one more than the record before it), the partitions
    dropped (cleared) by key, each partition the pass changed and the state's other fields (counters, cleared names,
    samplers' states, lost rows, task options). A partition's record holds it whole, as the snapshot does, when the
    journal does not hold it yet (created since) or its arrays grew; else its scalar fields and what changed since
    its last record: ``rows`` (their indexes, and those rows of each per-row array, of each task's consumption,
    lease ids, delivery counts and dead letters, their kv keys and custom meta), ``groups`` and ``blocks`` (the
    entries of the groups and blocks those rows held before or hold now: members, rows, references, bytes; None:
    gone) and ``dropped_tasks``.

Records are *outcomes*, not requests to run again: samplers and lease clocks are not deterministic, so replay only
assigns what the serving pass ended with. Replay loads the snapshot, then applies every record whose ``seq`` is
above the snapshot's (a crash between a snapshot's rename and the removal of the log segment it holds leaves records
the snapshot already holds: they are skipped). What a restore from a checkpoint redoes, replay redoes too: puts that
had not committed are gone (their rows freed), parked requests and connections are not kept. Task options
(``set_task_options``) are journaled; so are DP rounds whose lease is live, with that lease (below).

Leases are journaled (unlike a checkpoint's): a record also holds ``leases``, each client lease opened, renewed
(``extend_lease``) or closed (acknowledged, handed back, released, expired, cancelled) in the pass, as
``[id, owner, partition uid, task, duration, call id]`` (a DP round's lease adds its round: ``[dp_group_id, dp_size,
batch_size, fields, shares, released ranks]``; closed: ``[id]``), and each task's ``lease`` array (the
lease holding each row) with the rows marked; the snapshot holds every live lease and ``next_lease``. A get_meta's
reply goes out once the record of its lease is written, so nothing served is served again after a restart. Replay
holds each lease again over the rows still leased under its id, for its owner, its deadline re-armed its full
``duration`` (the ``lease_s`` it was granted, or the last ``extend_lease``'s seconds) from the replay: a monotonic
clock does not carry over to another process or host, so a lease gets at most ``duration`` more than it had left. Its
owner has no connection yet: the disconnect grace starts only once it connected again and closed its last
connection, so an owner that never comes back loses its rows at the re-armed deadline. A get_meta whose reply was lost
(the controller died after writing its lease's record) is asked again under the same (owner, call id): it is answered
with the rows of that lease (:meth:`~transfer_queue.state.delivery.Delivery.rows_of_call`), not new ones. The
automatic DP round numbers (:meth:`~transfer_queue.state.dp_rounds.DPRounds.journaled`) are kept with the state's
other fields: in the snapshot, and in a record (``auto_rounds``) when they changed.

To know what changed, each mutation of a partition marks the rows it changes (``PartitionState.mark``: commit, abort,
acks and leases, hand-backs and dead letters, clears, kv keys, custom meta, rows lost), and the groups and blocks they
held; the journal drains the marks of each partition it writes. A record costs O(what changed), whatever the
partition's size; marks past twice the partition's rows make its next record whole. Partitions changed by timers (a
lease expiring into a dead letter) or by a storage unit's restart (rows lost) are written by the next pass's record.
The log is folded into a new snapshot once it is longer than
``journal_snapshot_bytes`` and than the last snapshot, which bounds replay to about two snapshots' worth of bytes
(plus what was served while the last one was written).

``log.sealed-SEQ``
    while a snapshot is written: the log it holds (records up to SEQ). A snapshot is begun at a record boundary on
    the serving thread, which encodes the state (its consistent copy: the snapshot's bytes), renames the log to the
    sealed segment and begins a new log; the journal's thread writes the snapshot and then removes the segment. One
    at a time: while one is written, :meth:`Journal.snapshot_due` says no. A crash before the snapshot's rename
    replays the old snapshot, the sealed segment(s) and the log; after it, the segment's records are at or below the
    snapshot's ``seq`` and skipped. A controller started over a sealed segment writes a snapshot before it serves.

A ``write()`` that fails (or writes part of a record, then fails) has the log cut back to where it ended (the pass's
changes go with the next record, which holds every partition). A torn last record (the process died in the middle
of a ``write()``) is dropped on open; a record that fails its
checksum with more records after it is :class:`~transfer_queue.errors.JournalCorrupt`.

``removing``
    a journal being removed (:func:`remove_journal`: the queue was shut down): written first, removed after every
    other file. A start that finds it finishes the removal and starts empty (a removal cut short, its snapshot gone and
    its log not, would otherwise read as a damaged journal).
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import cloudpickle
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
    restore_units_book,
    snapshot_pieces,
    state_globals,
    unarray,
    units_book,
)

logger = logging.getLogger(__name__)

SNAPSHOT = "snapshot"
LOG = "log"
SEALED = LOG + ".sealed-"  # the log as it was when a snapshot was begun, removed once the snapshot is written
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


def sealed_segments(directory: str) -> list[tuple[int, str]]:
    """The log's sealed segments under ``directory`` (``log.sealed-SEQ``: the log as it was when a snapshot of the
    state at record SEQ was begun), oldest first, as (SEQ, path)."""
    out = []
    for name in os.listdir(directory):
        if name.startswith(SEALED) and name[len(SEALED) :].isdigit():
            out.append((int(name[len(SEALED) :]), os.path.join(directory, name)))
    return sorted(out)


def load(directory: str) -> tuple[dict[str, Any] | None, int]:
    """The snapshot under ``directory`` with the records of the log's sealed segments and of the log applied (None:
    no journal there yet), and the byte offset where the log's whole records end."""
    snap_path, log_path = os.path.join(directory, SNAPSHOT), os.path.join(directory, LOG)
    records: list[dict[str, Any]] = []
    for _, segment in sealed_segments(directory):
        records.extend(read_log(segment)[0])
    tail, good = read_log(log_path)
    records.extend(tail)
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
    # a journal written before leases were kept has none: its leased rows are ready again on replay
    leases = None if "leases" not in snapshot else {int(entry[0]): entry for entry in snapshot["leases"]}
    for record in records:
        if record["seq"] <= snapshot["seq"]:
            continue  # already in the snapshot (written after this record, its segment not yet removed)
        if record["seq"] != snapshot["seq"] + 1:
            raise JournalCorrupt(
                f"{directory}: record {record['seq']} follows record {snapshot['seq']}: the records between are "
                "missing (a log segment was lost)"
            )
        for key in record["drops"]:
            parts.pop(key, None)
        for d in record["parts"]:
            parts[d["key"]] = d if "rows" not in d else _patched(parts.get(d["key"]), d, log_path)
        if leases is not None:
            for entry in record.get("leases", ()):
                _assign(leases, int(entry[0]), entry if len(entry) > 1 else None)
        snapshot.update(record["globals"])
        snapshot["seq"] = record["seq"]
    snapshot["partitions"] = list(parts.values())
    if leases is not None:
        snapshot["leases"] = list(leases.values())
    return snapshot, good


_DELTA_ONLY = ("rows", "arrays", "tasks", "groups", "blocks", "row_keys", "custom_meta", "dropped_tasks")


def _writable(a: np.ndarray) -> np.ndarray:
    return a if a.flags.writeable else a.copy()


def _assign(d: dict[Any, Any], key: Any, value: Any) -> None:
    """``d[key] = value``; ``None``: no entry."""
    if value is None:
        d.pop(key, None)
    else:
        d[key] = value


def _patched(base: dict[str, Any] | None, delta: dict[str, Any], path: str) -> dict[str, Any]:
    """Partition ``base`` (as the snapshot holds it, its arrays decoded as they are patched) with ``delta`` (a record
    of the rows and dict entries that changed) applied."""
    if base is None or base["uid"] != delta["uid"]:
        raise JournalCorrupt(
            f"{path}: a record changes rows of partition {delta['key']!r} (uid {delta['uid']}), which the journal "
            f"before it does not hold{'' if base is None else ' (it holds uid ' + str(base['uid']) + ')'}"
        )
    rows = np.frombuffer(delta["rows"], dtype=np.int64)
    arrays = {name: _writable(unarray(base["arrays"][name])) for name in ROW_ARRAYS}
    for name, values in delta["arrays"].items():  # none: only the tasks' arrays or custom meta of the rows changed
        arrays[name][rows] = unarray(values)
    dicts, group_rows, custom_meta = base["dicts"], base["group_rows"], base["custom_meta"]
    for group, members, listed in delta["groups"]:
        _assign(dicts["group_members"], group, members)
        _assign(group_rows, group, listed)
    for block, refs, nbytes in delta["blocks"]:
        _assign(dicts["block_refs"], block, refs)
        _assign(dicts["block_nbytes"], block, nbytes)
    row_list = rows.tolist()
    for row, key, meta in zip(row_list, delta["row_keys"], delta["custom_meta"], strict=True):
        _assign(dicts["row_keys"], row, key)
        _assign(custom_meta, row, meta)
    dicts["keys"] = {key: row for row, key in dicts["row_keys"].items()}  # a kv key and its row are set and go together
    tasks = {name: task for name, task in base["tasks"].items() if name not in delta["dropped_tasks"]}
    size = len(arrays["state"])
    for name, task in delta["tasks"].items():
        held = tasks.get(name)
        if held is None:  # a task the partition took up since (or dropped and took up again): from a fresh one
            consumption, deliveries, dead = np.zeros(size, np.int8), np.zeros(size, np.int32), {}
        else:
            consumption = _writable(unarray(held["consumption"]))
            deliveries = _writable(unarray(held["deliveries"]))
            dead = dict(held["dead"])
        consumption[rows] = unarray(task["consumption"])
        deliveries[rows] = unarray(task["deliveries"])
        for row, reason in zip(row_list, task["dead"], strict=True):
            _assign(dead, row, reason)
        tasks[name] = {"consumption": consumption, "deliveries": deliveries, "dead": [[r, x] for r, x in dead.items()]}
        if "lease" in task:  # the lease holding each row (journals written before leases were kept: none)
            fresh = held is None or "lease" not in held
            lease = np.zeros(size, np.int64) if fresh else _writable(unarray(held["lease"]))  # type: ignore[index]
            lease[rows] = unarray(task["lease"])
            tasks[name]["lease"] = lease
    out = {k: v for k, v in delta.items() if k not in _DELTA_ONLY}
    out.update(arrays=arrays, tasks=tasks, dicts=dicts, group_rows=group_rows, custom_meta=custom_meta)
    return out


class Journal:
    """The open journal of a running controller: :meth:`record` once per serving pass, :meth:`snapshot` when
    :meth:`snapshot_due`. Not thread-safe: the serving thread owns it (a snapshot is written by a thread of its own,
    which touches only its files)."""

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
        self._specs: dict[str, bytes] = {}  # the registered samplers (QueueState.sampler_specs) it last wrote
        # partition key -> (uid, rows, columns) of its arrays as the journal holds them: a partition it does not hold
        # or whose arrays grew since is written whole, else its rows and entries marked changed (PartitionState.mark)
        self._shapes: dict[Any, tuple[int, int, int]] = {}
        self.snapshot_size = 0
        # snapshots: begun; snapshots_written: written and their segments removed; snapshot_failures: not written
        # (their segments stay, replayed, until a later snapshot is written); snapshot_pause_s: the serving thread's
        # part of the last one (encode the state, seal the log)
        self.stats: dict[str, float] = {
            "records": 0,
            "bytes": 0,
            "fsyncs": 0,
            "snapshots": 0,
            "snapshots_written": 0,
            "snapshot_failures": 0,
            "snapshot_pause_s": 0.0,
        }
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tq-journal-snapshot")
        self._pending: Future[int] | None = None  # the snapshot being written (one at a time)
        self._synced_at = clock()
        self._unsynced = False
        self._torn = False  # a failed write may have left part of a record after log_bytes
        self._fd = os.open(os.path.join(directory, LOG), os.O_WRONLY | os.O_CREAT, 0o600)
        os.ftruncate(self._fd, log_end)  # a torn tail is dropped before anything is appended after it
        os.lseek(self._fd, log_end, os.SEEK_SET)
        self.log_bytes = log_end

    def track(self, state: QueueState) -> None:
        """Take ``state``'s partitions as journaled (after a restore, or a snapshot): what changes in them from now on
        is marked, and written with their next record."""
        self.uids = {key: part.uid for key, part in state.partitions.items()}
        self._shapes = {key: _shape(part) for key, part in state.partitions.items()}
        self._specs = dict(state.sampler_specs)
        for part in state.partitions.values():
            part.clear_marks()
        state.delivery.leases.changed = set()  # the leases opened, extended or closed from now on

    def record(self, state: QueueState, dirty: set[Any] | None, counters: bool = False, marked: bool = False) -> int:
        """Append what this pass changed: partitions in ``dirty`` (keys; None: all), those created and those removed
        since the last record, with ``marked`` every partition with changes marked (timers changed them: leases that
        expired into dead letters, rows lost with a unit), and the state's other fields (``counters``: they alone
        changed, e.g. a reserve handed out put and block ids). One ``write()``, fsynced per the policy. Returns the
        bytes written (0: nothing changed)."""
        current = {key: part.uid for key, part in state.partitions.items()}
        drops = [key for key in self.uids if key not in current]
        book = state.delivery.leases
        if book.changed:  # leases granted, renewed, acknowledged, handed back: their rows are marked too
            marked = True
        changed = [
            key
            for key, part in state.partitions.items()
            if self.uids.get(key) != part.uid or dirty is None or key in dirty or (marked and part.dirty)
        ]
        specs = state.sampler_specs != self._specs  # a sampler registered since the last record
        rounds = state.rounds.changed  # automatic DP round numbers taken (or forgotten) since
        if not drops and not changed and not counters and not book.changed and not specs and not rounds:
            return 0
        parts = [self._partition_record(state.partitions[key]) for key in changed]
        more: dict[str, Any] = {"sampler_specs": dict(state.sampler_specs)} if specs else {}
        if rounds:
            more["auto_rounds"] = state.rounds.journaled()
        payload = msgspec.msgpack.encode(
            {
                "seq": self.seq + 1,
                "drops": drops,
                "parts": parts,
                "leases": state.delivery.journaled_leases(changed=True),
                "globals": {
                    **state_globals(state),
                    "next_block": state._next_block,
                    "next_lease": book.next_id,
                    "units": units_book(state),
                    **more,
                },
            }
        )
        data = frame(payload)
        self._append(data)  # raises: the marks stay, the log holds no part of this record
        self.seq += 1
        for key in drops:
            self._shapes.pop(key, None)
        for key in changed:
            part = state.partitions[key]
            part.clear_marks()
            self._shapes[key] = _shape(part)
        self.uids = current
        self._specs = dict(state.sampler_specs)
        if rounds:
            state.rounds.changed = False
        if book.changed is not None:
            book.changed.clear()
        self.log_bytes += len(data)
        self.stats["records"] += 1
        self.stats["bytes"] += len(data)
        self._unsynced = True
        if self.fsync == "always":
            self.sync()
        else:
            self.sync_due()
        return len(data)

    def _append(self, data: bytes) -> None:
        """Write ``data`` at the log's end, all of it (``os.write`` may write less); on any failure the log is cut back
        to where it ended before, so it never holds part of a record with whole ones written after it."""
        if self._torn:  # an earlier failure could not cut its bytes: cut them before appending after them
            self._cut()
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except BaseException:
            self._torn = True
            try:
                self._cut()
            except OSError:
                logger.exception("the journal under %s could not cut its log to %d B", self.directory, self.log_bytes)
            raise

    def _cut(self) -> None:
        os.ftruncate(self._fd, self.log_bytes)
        os.lseek(self._fd, self.log_bytes, os.SEEK_SET)
        self._torn = False

    def _partition_record(self, part: PartitionState) -> dict[str, Any]:
        """The record of ``part``: whole when the journal does not hold it (created since, or cleared and created
        again), when its arrays grew, or when more changed than it has rows; else the rows marked changed (each per-row
        array's and each task's values of them, their kv keys and custom meta) and the entries of the groups and
        blocks they held, with the partition's scalar fields. Costs O(what changed), never O(rows)."""
        if part.dirty_all or self._shapes.get(part.key) != _shape(part):
            return partition_snapshot(part)
        d = partition_snapshot(part, arrays=False, dicts=False)
        none = np.zeros(0, dtype=np.int64)
        rows = np.unique(np.concatenate(part.dirty_rows)) if part.dirty_rows else none
        # marks of the tasks' arrays or custom meta alone (a lease, an ack): the per-row arrays, the rows' groups and
        # blocks did not change, only the blocks marked (freed) are written
        cells = part.dirty_cells
        groups = np.unique(np.concatenate([*part.dirty_groups, part.group[rows] if cells else none]))
        blocks = np.unique(np.concatenate([*part.dirty_blocks, part.block[rows].reshape(-1) if cells else none]))
        row_list = rows.tolist()
        d["rows"] = rows.tobytes()
        d["arrays"] = {name: array_dict(getattr(part, name)[rows]) for name in ROW_ARRAYS} if cells else {}
        d["groups"] = [[g, part.group_members.get(g), part.group_rows.get(g)] for g in groups[groups >= 0].tolist()]
        d["blocks"] = [[b, part.block_refs.get(b), part.block_nbytes.get(b)] for b in blocks[blocks >= 0].tolist()]
        d["row_keys"] = [part.row_keys.get(row) for row in row_list]
        d["custom_meta"] = [part.custom_meta.get(row) for row in row_list]
        d["dropped_tasks"] = sorted(part.dropped_tasks)
        d["tasks"] = {
            name: {
                "consumption": array_dict(task.consumption[rows]),
                "deliveries": array_dict(task.deliveries[rows]),
                "lease": array_dict(task.lease[rows]),
                "dead": [task.dead.get(row) for row in row_list],
            }
            for name, task in part.tasks.items()
        }
        return d

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
        """Whether the log is longer than ``journal_snapshot_bytes`` and than the last snapshot, and no snapshot is
        being written (one at a time: while one is, the log grows past the bound, by what the serving thread writes
        while the snapshot's bytes go to disk; the first pass after it was written begins the next)."""
        return self.writing() is None and self.log_bytes > max(self.snapshot_bytes, self.snapshot_size)

    def writing(self) -> Future[int] | None:
        """The snapshot being written, if any (one that finished is accounted for first)."""
        if self._pending is not None and self._pending.done():
            self._finished(self._pending)
        return self._pending

    def _finished(self, future: Future[int]) -> None:
        self._pending = None
        try:
            self.snapshot_size = future.result()
        except Exception:
            # the sealed segments stay: replay reads the last snapshot written and every segment after it
            self.stats["snapshot_failures"] += 1
            logger.exception("the journal under %s could not write its snapshot", self.directory)
        else:
            self.stats["snapshots_written"] += 1

    def wait(self) -> None:
        """Wait for the snapshot being written, if any."""
        if self._pending is not None:
            self._finished(self._pending)  # its result() waits

    def snapshot(self, state: QueueState, wait: bool = True) -> None:
        """Begin a snapshot of ``state`` at this record boundary: encode it (the serving thread's part, a consistent
        copy: the snapshot's bytes), seal the log (renamed ``log.sealed-SEQ``, a new log begun: the records from now
        on are changes of this snapshot), and have a thread of the journal's own write it (a temporary file, fsynced,
        renamed over the old snapshot, the directory fsynced) and then remove the sealed segments it holds. ``wait``:
        return once it is written. A snapshot still being written is waited for first.

        Every crash point replays the same state: before the rename, the old snapshot and every segment; after it,
        the new snapshot and the records of the segments past its ``seq`` (those of the sealed ones it holds are
        skipped)."""
        self.wait()
        started = time.perf_counter()
        pieces = snapshot_pieces(
            state,
            seq=self.seq,
            next_block=state._next_block,
            units=units_book(state),
            leases=state.delivery.journaled_leases(changed=False),
            next_lease=state.delivery.leases.next_id,
            sampler_specs=dict(state.sampler_specs),
            auto_rounds=state.rounds.journaled(),
        )
        self._seal()
        self.track(state)  # the snapshot is the base the partitions' next records change
        self.stats["snapshots"] += 1
        self.stats["snapshot_pause_s"] = time.perf_counter() - started
        self._pending = self._writer.submit(_write_snapshot, self.directory, pieces, self.seq)
        if wait:
            pending, self._pending = self._pending, None
            self.snapshot_size = pending.result()  # raises what the write raised
            self.stats["snapshots_written"] += 1

    def _seal(self) -> None:
        """Rename the log ``log.sealed-SEQ`` (its records synced first, unless ``journal_fsync="never"``) and begin a
        new one. An empty log is kept as it is (a segment of no records: nothing to seal)."""
        if self._torn:
            self._cut()
        if self.log_bytes == 0:
            return
        if self._unsynced and self.fsync != "never":
            self.sync()
        log = os.path.join(self.directory, LOG)
        sealed = os.path.join(self.directory, f"{SEALED}{self.seq}")
        os.rename(log, sealed)
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except BaseException:  # no new log: the old one is the log again (appended to as before; a later seal retries)
            os.rename(sealed, log)
            raise
        os.close(self._fd)
        self._fd = fd
        _fsync_dir(self.directory)  # both names: a crash now replays the sealed segment, then the new log
        self.log_bytes = 0
        self._unsynced = False

    def close(self) -> None:
        self.wait()
        self._writer.shutdown(wait=True)
        if self._fd >= 0:
            if self._unsynced and self.fsync != "never":
                self.sync()
            os.close(self._fd)
            self._fd = -1


def write_snapshot(directory: str, pieces: list[bytes]) -> None:
    """Write the snapshot (``pieces``, concatenated) under ``directory`` atomically: a temporary file, fsynced,
    renamed over the old snapshot, the directory fsynced. A crash before the rename leaves the old snapshot."""
    path = os.path.join(directory, SNAPSHOT)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for piece in pieces:
            view = memoryview(piece)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(directory)


def _write_snapshot(directory: str, pieces: list[bytes], seq: int) -> int:
    """The journal's writer thread: write the snapshot of the state at record ``seq``, then remove the log segments
    sealed up to ``seq`` (their records are in it). Returns the snapshot's size."""
    write_snapshot(directory, pieces)
    for sealed, path in sealed_segments(directory):
        if sealed <= seq:
            os.remove(path)
    return sum(len(piece) for piece in pieces)


def _shape(part: PartitionState) -> tuple[int, int, int]:
    return part.uid, len(part.state), part.block.shape[1]


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
    if os.path.exists(os.path.join(directory, REMOVING)):  # the last queue's shutdown died removing its journal
        logger.warning("the journal under %s was being removed when its process died: removed now", directory)
        _finish_removal(directory)
    snapshot, log_end = load(directory)
    if snapshot is None:
        state = QueueState(config, sampler)
        journal = Journal(directory, config.journal_fsync, config.journal_snapshot_bytes, 0, log_end)
        try:
            journal.snapshot(state)
        except BaseException:
            journal.close()
            raise
        return state, journal, False
    saved = snapshot["config"]
    for name in _CHECKED:
        if saved[name] != getattr(config, name):
            raise ConfigMismatch(
                f"the journal under {directory} is of a queue with {name}={saved[name]}; this one has "
                f"{name}={getattr(config, name)}"
            )
    identity = {int(b): int(b) for d in snapshot["partitions"] for b in d["dicts"]["block_refs"]}
    leases = snapshot.get("leases")  # None: a journal written before leases were kept
    state = restore_state(snapshot, config, sampler, identity, int(snapshot["next_block"]), leases)
    restore_units_book(state, snapshot.get("units"))  # the units' restarts as the clients saw them
    # the automatic DP round numbers: each rank goes on with its next round (written before they were kept: none)
    state.rounds.restore(snapshot.get("auto_rounds") or [], state.partitions)
    for task, spec in (snapshot.get("sampler_specs") or {}).items():  # registered again, their states loaded
        try:
            state.register_sampler(task, cloudpickle.loads(spec))
        except Exception:  # its class is gone from this build, or it no longer loads: its clients register it again
            logger.exception("the journal under %s holds a sampler of task %r that does not load", directory, task)
    # the commits answered before are not remembered: a commit retried now of a put from before the restart is told
    # its outcome is unknown (RequestTimeout), never that its rows are not visible (they may well be)
    state.ledger.forgotten_upto = state._next_put - 1
    journal = Journal(directory, config.journal_fsync, config.journal_snapshot_bytes, int(snapshot["seq"]), log_end)
    try:
        journal.snapshot_size = os.path.getsize(os.path.join(directory, SNAPSHOT))  # the bound: longer than it, too
        journal.track(state)
        if sealed_segments(directory):  # the controller died while a snapshot was written: write it again, now
            try:
                journal.snapshot(state)
            except Exception:  # the state replayed: serve on; the segments stay, replayed until a snapshot is written
                journal.stats["snapshot_failures"] += 1
                logger.exception("the journal under %s could not write its catch-up snapshot", directory)
    except BaseException:
        journal.close()
        raise
    return state, journal, True


IDENTITY = "identity"


def read_identity(directory: str) -> dict[str, Any] | None:
    """What a controller started again over ``directory`` must present as before (its clients and storage units
    know it): ``session_id``, ``secret`` and its TCP ``port``; ``units`` (each storage unit's endpoint as last known,
    a list of its fields) and ``replica_of`` (replicas=2: the pairs fixed at the queue's start) where written; None
    before the first controller wrote it."""
    if os.path.exists(os.path.join(directory, REMOVING)):  # being removed (open_journal finishes it): none
        return None
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


def write_identity(
    directory: str,
    session_id: str,
    secret: bytes,
    port: int,
    units: list[list[Any]] | None = None,
    replica_of: list[int] | None = None,
) -> None:
    """Save the controller's identity under ``directory`` (readable by its user only: it holds the queue's secret),
    atomically (written again when a storage unit's endpoint changes). ``units``, ``replica_of``: see
    :func:`read_identity`."""
    path = os.path.join(directory, IDENTITY)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    identity: dict[str, Any] = {"session_id": session_id, "secret": secret, "port": port}
    if units is not None:
        identity["units"] = units
    if replica_of is not None:
        identity["replica_of"] = replica_of
    try:
        os.write(fd, msgspec.msgpack.encode(identity))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(directory)


REMOVING = "removing"  # a journal being removed: a start that finds it finishes the removal and starts empty


def remove_journal(directory: str) -> None:
    """Remove the journal's files under ``directory`` (the queue was shut down: a new one starts empty). Atomic: the
    marker ``removing`` is written first (the directory fsynced), then the files are removed, the marker last; a
    process that dies in between leaves the marker, and :func:`open_journal` over it finishes the removal and starts
    empty (a half-removed journal, its snapshot gone and its log not, would otherwise be JournalCorrupt)."""
    if not os.path.isdir(directory):
        return
    marker = os.path.join(directory, REMOVING)
    os.close(os.open(marker, os.O_WRONLY | os.O_CREAT, 0o600))
    _fsync_dir(directory)
    _finish_removal(directory)


def _finish_removal(directory: str) -> None:
    """Remove the journal's files under ``directory``, then the ``removing`` marker (a journal it marks)."""
    names = [SNAPSHOT, SNAPSHOT + ".tmp", LOG, IDENTITY, IDENTITY + ".tmp"]
    for path in [*(os.path.join(directory, n) for n in names), *(path for _, path in sealed_segments(directory))]:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
    _fsync_dir(directory)  # the files are gone before the marker is: a crash now still finds it
    os.remove(os.path.join(directory, REMOVING))
    _fsync_dir(directory)
