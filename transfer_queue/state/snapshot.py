"""The controller's half of a checkpoint: a QueueState as bytes, and back (issue 8 section 4).

What is saved: partitions (rows, groups, schemas, production, lengths, kv keys, custom meta and kv tags), per-task
delivery state (acknowledged rows, delivery counts, dead letters; leased rows are turned back to ready), the step
window, cleared names, the id counters, the samplers' ``state_dict``, and the rows lost with storage units (with the
unit that took them, so ``client.lost_rows`` and the status calls still report them after a restore). What is not: open
puts (a put that had not committed is not in the checkpoint: its rows are freed, as if it had been aborted), parked
requests, connections and DP rounds (clients ask again; the rows of a round's unacknowledged shares are ready again),
remembered commits, and the storage units' restart counts (a restore starts fresh units).

Restoring onto another number of storage units renumbers blocks: a block of old unit ``u`` goes to new unit
``u % new_units`` under a fresh id (ids encode their unit: ``id % num_units``); :func:`block_map` computes the map
and :func:`restore_state` rewrites the partitions' cells with it.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import msgspec
import numpy as np

from transfer_queue.config import QueueConfig
from transfer_queue.errors import SnapshotError
from transfer_queue.metadata import FieldSchema
from transfer_queue.samplers import SamplerSpec
from transfer_queue.state.delivery import TaskOptions
from transfer_queue.state.lost_rows import CopiesMoved, LostRecord
from transfer_queue.state.partition import COMMITTED, LOST, RESERVED, PartitionState
from transfer_queue.state.queue_state import QueueState
from transfer_queue.state.ready_index import AVAILABLE, LEASED, TaskState

FORMAT_VERSION = 1
ROW_ARRAYS = _ARRAYS = ("state", "group", "length", "cell_length", "produced_mask", "block", "offset")
_DICTS = ("group_members", "block_refs", "block_nbytes", "keys", "row_keys")


def array_dict(a: np.ndarray) -> dict[str, Any]:
    """An array as the snapshot holds it (dtype, shape, bytes)."""
    return _array(a)


def unarray(d: dict[str, Any] | np.ndarray) -> np.ndarray:
    return _unarray(d)


def _array(a: np.ndarray, view: bool = False) -> dict[str, Any]:
    """``view``: the data as a view of ``a`` (encoded at once, before ``a`` changes: one copy, msgpack's)."""
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": memoryview(a).cast("B") if view else a.tobytes()}  # type: ignore[arg-type]


def _unarray(d: dict[str, Any] | np.ndarray) -> np.ndarray:
    if isinstance(d, np.ndarray):  # already decoded (the journal's replay patches arrays in place)
        return d
    return np.frombuffer(d["data"], dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def _partition(part: PartitionState, arrays: bool = True, dicts: bool = True, view: bool = False) -> dict[str, Any]:
    d: dict[str, Any] = {
        "key": part.key,
        "uid": part.uid,
        "capacity": part.capacity,
        "group_size": part.group_size,
        "base_index": part.base_index,
        "keyed": part.keyed,
        "closed": part.closed,
        "fields": {n: msgspec.to_builtins(s) for n, s in part.fields.items()},
        "num_rows": part.num_rows,
        "field_produced": list(part.field_produced),
    }
    if dicts:
        d["group_rows"] = part.group_rows  # lists of ints, encoded at once by every caller (no copy: 100k rows ~40 ms)
        # view (encoded at once): the dicts themselves, else copies
        d["dicts"] = {name: getattr(part, name) if view else dict(getattr(part, name)) for name in _DICTS}
        d["custom_meta"] = part.custom_meta if view else dict(part.custom_meta)  # set_custom_meta and kv tags
    if arrays:
        d["tasks"] = {
            name: {
                "consumption": _array(task.consumption, view),
                "deliveries": _array(task.deliveries, view),
                "lease": _array(task.lease, view),  # the lease holding each row (a journal keeps its leases)
                "dead": [[row, reason] for row, reason in task.dead.items()],
            }
            for name, task in part.tasks.items()
        }
        d["arrays"] = {name: _array(getattr(part, name), view) for name in _ARRAYS}
    return d


def state_globals(state: QueueState) -> dict[str, Any]:
    """The state's fields outside its partitions (counters, cleared names, samplers' states, lost rows), as
    :func:`snapshot_state` saves them."""
    samplers = {"": state.default_sampler.state_dict()}
    samplers.update({task: s.state_dict() for task, s in state.samplers.items()})
    samplers.update(state.pending_sampler_states)
    return {
        "max_cleared_step": state.max_cleared_step,
        "cleared_names": list(state.cleared_names),
        "next_uid": state._next_uid,
        "next_put": state._next_put,
        "samplers": samplers,
        # the units' restart counts and lost_below are not saved: a restore starts fresh units
        "lost": {"total": state.lost.total, "by_uid": state.lost.by_uid},
        # set_task_options: a task's ack mode, lease and max deliveries (a replayed controller serves it as before)
        "task_options": {task: dataclasses.asdict(o) for task, o in state.delivery.task_options.items()},
    }


def units_book(state: QueueState) -> dict[str, Any]:
    """The storage units' restarts as the controller counts them (restart counts, ``lost_below``, refills and the
    ranges lost with both copies): the journal keeps them, a checkpoint does not (a restore starts fresh units). A
    controller replaying its journal numbers a unit's next restart after the ones its clients saw."""
    book = state.lost
    return {
        "restarts": dict(book.restarts),
        "lost_below": dict(book.lost_below),
        "refilled_below": dict(book.refilled_below),
        "blocks_refilled": book.blocks_refilled,
        "lost_with": {u: [list(t) for t in ranges] for u, ranges in book.lost_with.items()},
        "lost_with_moved": {u: [list(t) for t in belows] for u, belows in book.lost_with_moved.items()},
        # replicas=2: the retired units' copies moved onto others (where, how far), in the order they were retired
        "moves": [[m.unit, dict(m.to), m.upto, m.below, m.restart] for m in book.moves],
        "blocks_rereplicated": book.blocks_rereplicated,
        "retired": sorted(book.retired),
    }


def restore_units_book(state: QueueState, units: dict[str, Any] | None) -> None:
    """Set what :func:`units_book` saved (None: a journal written before it was kept: nothing)."""
    if not units:
        return
    book = state.lost
    book.restarts = {int(u): int(n) for u, n in units["restarts"].items()}
    book.lost_below = {int(u): int(n) for u, n in units["lost_below"].items()}
    book.refilled_below = {int(u): int(n) for u, n in units["refilled_below"].items()}
    book.blocks_refilled = int(units["blocks_refilled"])
    book.lost_with = {int(u): [(int(a), int(b), int(c)) for a, b, c in r] for u, r in units["lost_with"].items()}
    book.lost_with_moved = {  # a journal written before: none (a client takes the moves as they stand)
        int(u): [tuple(int(b) for b in t) for t in r] for u, r in units.get("lost_with_moved", {}).items()
    }
    book.moves = []
    for u, to, upto, below, *restart in units.get("moves", ()):
        # a journal written before a move kept its unit's restart count: the count now (its unit's move)
        count = int(restart[0]) if restart else book.restarts.get(int(u), 0)
        book.moves.append(CopiesMoved(int(u), {int(s): int(t) for s, t in to.items()}, int(upto), int(below), count))
    book.blocks_rereplicated = int(units.get("blocks_rereplicated", 0))
    book.retired = {int(u) for u in units.get("retired", ())}
    state.ledger.moved_to = {t for move in book.moves for t in move.to.values()}


def partition_snapshot(part: PartitionState, arrays: bool = True, dicts: bool = True) -> dict[str, Any]:
    """One partition as :func:`snapshot_state` saves it (msgpack-able values, some shared with ``part``: encode it
    before the partition changes); ``arrays=False``: without its per-row arrays and tasks, ``dicts=False``: without
    its dicts (groups, blocks, kv keys, custom meta): the journal writes the rows and entries that changed."""
    return _partition(part, arrays, dicts)


def snapshot_state(state: QueueState, saved_by: dict[int, int] | None = None, **extra: Any) -> bytes:
    """The state as bytes (msgpack); open puts, parked requests and connections are left out. ``saved_by``
    (replicas=2: each block is saved once): unit -> the unit whose checkpoint files hold the blocks placed on it.
    ``extra``: more top-level fields (the journal's ``seq`` and ``next_block``)."""
    return msgspec.msgpack.encode(
        {
            "version": FORMAT_VERSION,
            "config": state.config.to_dict(),
            **state_globals(state),
            "partitions": [_partition(part) for part in state.partitions.values()],
            "saved_by": saved_by,
            **extra,
        }
    )


def snapshot_pieces(state: QueueState, **extra: Any) -> list[bytes]:
    """The state as :func:`snapshot_state` encodes it, in pieces whose concatenation is that msgpack: the top-level
    map (its last entry ``partitions``, an array header) and each partition's encoding. Encoding is the cheapest
    consistent copy of the state there is (cheaper than copying its dicts and lists: a partition's ``group_rows``
    lists are appended to in place); the pieces are the snapshot's bytes, for another thread to write."""
    parts = [msgspec.msgpack.encode(_partition(part, view=True)) for part in state.partitions.values()]
    n = len(parts)
    header = (
        bytes([0x90 | n]) if n < 16 else struct.pack(">BH", 0xDC, n) if n < 1 << 16 else struct.pack(">BI", 0xDD, n)
    )
    head = msgspec.msgpack.encode(
        {
            "version": FORMAT_VERSION,
            "config": state.config.to_dict(),
            **state_globals(state),
            "saved_by": None,
            **extra,
            "partitions": msgspec.Raw(header),  # last: the partitions' encodings follow it
        }
    )
    return [head, *parts]


def read_snapshot(blob: bytes) -> dict[str, Any]:
    try:
        snapshot = msgspec.msgpack.decode(blob)
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"the controller snapshot does not decode: {exc}") from None
    if not isinstance(snapshot, dict) or snapshot.get("version") != FORMAT_VERSION:
        version = snapshot.get("version") if isinstance(snapshot, dict) else None
        raise SnapshotError(f"the controller snapshot is format {version}; this build reads {FORMAT_VERSION}")
    return snapshot


def block_map(snapshot: dict[str, Any], new_units: int) -> tuple[dict[int, int], int]:
    """Old block id -> new block id for every block the snapshot's partitions reference, and the next free block
    counter. Old unit ``u``'s blocks go to new unit ``u % new_units``."""
    old_units = snapshot["config"]["num_storage_units"]
    mapping: dict[int, int] = {}
    counter = 0
    for part in snapshot["partitions"]:
        for block in sorted(int(b) for b in part["dicts"]["block_refs"]):
            mapping[block] = counter * new_units + (block % old_units) % new_units
            counter += 1
    return mapping, counter


def unit_restores(
    snapshot: dict[str, Any], mapping: dict[int, int], new_units: int, replica_of: list[int] | None
) -> list[tuple[list[int], dict[int, int]]]:
    """Per new storage unit, what it loads: the saved units' files holding its blocks, and its blocks (old id -> new
    id, from :func:`block_map`). A new unit loads the blocks placed on it and, with ``replica_of`` (the new queue's
    replicas=2), those placed on the units it holds the second copy of. A checkpoint of a replicated queue saved each
    block once, in the files of one of its holders (``saved_by``); one without saved every unit's own blocks."""
    old_units = snapshot["config"]["num_storage_units"]
    saved_by = {int(u): int(h) for u, h in (snapshot.get("saved_by") or {}).items()}
    out = []
    for unit in range(new_units):
        held = {unit} | {u for u, partner in enumerate(replica_of or ()) if partner == unit}
        blocks = {old: new for old, new in mapping.items() if new % new_units in held}
        files = sorted({saved_by.get(old % old_units, old % old_units) for old in blocks})
        out.append((files, blocks))
    return out


def _restore_partition(
    d: dict[str, Any], mapping: dict[int, int], config: QueueConfig, keep_leases: bool = False
) -> PartitionState:
    """A saved partition, under the restoring queue's ``max_fields`` and ``promote_jagged`` (as
    :meth:`PartitionTable.open` builds one), so a resumed run merges and bounds schemas as the saved one did.
    ``keep_leases`` (a journal's replay): leased rows stay leased under their lease ids, for
    :meth:`~transfer_queue.state.delivery.Delivery.restore_leases`; else they are ready again."""
    part = PartitionState(
        d["key"],
        d["uid"],
        d["capacity"],
        d["group_size"],
        d["base_index"],
        keyed=d["keyed"],
        max_fields=config.max_fields,
        promote_jagged=config.promote_jagged,
    )
    part.group_size = d["group_size"]
    part.closed = d["closed"]
    for name, schema in d["fields"].items():
        part.add_fields({name: msgspec.convert(schema, FieldSchema)})
    for name in _ARRAYS:
        setattr(part, name, _unarray(d["arrays"][name]))
    part.inflight_mask = np.zeros(len(part.state), dtype=np.uint64)
    part.num_rows = d["num_rows"]
    part.field_produced = list(d["field_produced"])
    part.group_members = {int(g): int(c) for g, c in d["dicts"]["group_members"].items()}
    part.keys = {str(k): int(r) for k, r in d["dicts"]["keys"].items()}
    part.row_keys = {int(r): str(k) for r, k in d["dicts"]["row_keys"].items()}
    part.group_rows = {int(g): [int(r) for r in rows] for g, rows in d["group_rows"].items()}
    part.custom_meta = {int(r): dict(v) for r, v in d.get("custom_meta", {}).items()}  # none in older snapshots
    # blocks renumbered for the storage units they now live on
    cells = part.block >= 0
    part.block[cells] = [mapping[int(b)] for b in part.block[cells].tolist()]
    part.block_refs = {mapping[int(b)]: int(c) for b, c in d["dicts"]["block_refs"].items()}
    part.block_nbytes = {mapping[int(b)]: int(n) for b, n in d["dicts"]["block_nbytes"].items() if int(b) in mapping}
    # puts that had not committed are not in the checkpoint: free their rows (and the keys they claimed)
    reserved = np.flatnonzero(part.state[: part.num_rows] == RESERVED)
    part.num_reserved = len(reserved)
    for row in reserved.tolist():
        key = part.row_keys.pop(row, None)
        if key is not None:
            part.keys.pop(key, None)
    part.free(reserved)
    part.num_committed = int(np.count_nonzero(part.state[: part.num_rows] == COMMITTED))
    part.num_lost = int(np.count_nonzero(part.state[: part.num_rows] == LOST))  # died with a storage unit before
    part.nbytes = sum(part.block_nbytes.values())
    for name, saved in d["tasks"].items():
        taken = _unarray(saved["consumption"])
        task = part.tasks[name] = TaskState.of_size(len(taken))  # ready indexes are rebuilt on first use
        if keep_leases and "lease" in saved:
            task.lease = _unarray(saved["lease"])
        else:  # a checkpoint's lease does not survive a restore: the rows are ready again
            taken[taken == LEASED] = AVAILABLE
        task.consumption = taken
        task.deliveries = _unarray(saved["deliveries"])
        task.dead = {int(row): str(reason) for row, reason in saved["dead"]}
    # DP rounds are not restored here: the rows of a round's unacknowledged shares are ready again (their lease is gone;
    # a journal's replay brings a round back with its lease, Delivery.restore_leases),
    # so a rank that asks for its round again after a restore gets a new share of ready rows, never a row twice.
    return part


def restore_state(
    snapshot: dict[str, Any],
    config: QueueConfig,
    sampler: SamplerSpec | None,
    mapping: dict[int, int],
    blocks: int,
    leases: list[list[Any]] | None = None,
) -> QueueState:
    """A QueueState from ``snapshot`` for ``config`` (its storage units may differ in number from the saved one);
    ``mapping`` and ``blocks`` from :func:`block_map`. Leased rows are ready again, unless ``leases`` (a journal's
    replay: the leases it kept, see :meth:`~transfer_queue.state.delivery.Delivery.restore_leases`) holds theirs;
    the default sampler loads its saved ``state_dict``, a task's sampler loads its own when it is registered again."""
    state = QueueState(config, sampler)
    state.max_cleared_step = snapshot["max_cleared_step"]
    state.cleared_names = dict.fromkeys(snapshot["cleared_names"])
    state._next_uid = snapshot["next_uid"]
    state._next_put = snapshot["next_put"]
    state._next_block = blocks
    for d in snapshot["partitions"]:
        part = _restore_partition(d, mapping, config, keep_leases=leases is not None)
        state.partitions[part.key] = part
        state.bytes_held += part.nbytes
    if leases is not None:
        state.delivery.restore_leases(leases, int(snapshot.get("next_lease", 1)))
    lost = snapshot.get("lost") or {"total": 0, "by_uid": {}}  # written before lost rows were saved: none
    live = {part.uid for part in state.partitions.values()}
    state.lost.total = int(lost["total"])
    state.lost.by_uid = {
        int(uid): {int(row): msgspec.convert(record, LostRecord) for row, record in rows.items()}
        for uid, rows in lost["by_uid"].items()
        if int(uid) in live
    }
    samplers = dict(snapshot["samplers"])
    state.default_sampler.load_state_dict(samplers.pop("", {}))
    state.pending_sampler_states = samplers
    for task, options in (snapshot.get("task_options") or {}).items():  # written before they were saved: none
        state.set_task_options(task, TaskOptions(**options))
    return state
