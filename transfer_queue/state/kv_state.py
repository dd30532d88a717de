"""KvState: partitions used by key (``kv_*``), rows' custom meta, and forgetting single rows.

Plain Python (no Ray, no sockets, no wire format). A string partition is used either by row (``put``) or by key
(``kv_put``, where a key names one row and a put of it upserts fields). Tags (custom meta) are small dicts per row.
Puts by key go through the :class:`~transfer_queue.state.put_ledger.PutLedger` like every put; this class answers
lookups, listings and tags, and clears keys or rows (their blocks are freed through the ledger once no row uses them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from transfer_queue.errors import FieldAlreadyProduced, InvalidRequest, StaleBatchMeta, UnknownField, UnknownKey
from transfer_queue.metadata import BatchMeta, PartitionKey, check_custom_meta
from transfer_queue.state.partition import COMMITTED, PartitionState
from transfer_queue.state.partition_table import PartitionTable
from transfer_queue.state.put_ledger import PutLedger


class KvState:
    """Keys and tags of the queue's partitions.

    Args:
        table: the live partitions.
        ledger: frees the blocks of cleared rows.
        rows_changed: called with a partition key whose rows changed (its waiting getters retry).
    """

    def __init__(self, table: PartitionTable, ledger: PutLedger, rows_changed: Callable[[PartitionKey], None]):
        self.table = table
        self.ledger = ledger
        self.rows_changed = rows_changed

    def lookup(self, partition: Any, keys: list[str], fields: list[str] | None) -> BatchMeta:
        """The meta of ``keys`` (every one committed) with ``fields`` (None: the fields every key has)."""
        part = self.table.keyed(partition)
        missing = [k for k in keys if k not in part.keys or part.state[part.keys[k]] != COMMITTED]
        if missing:
            raise UnknownKey(f"keys {missing[:10]} are not in {part.name}")
        rows = np.asarray([part.keys[k] for k in keys], dtype=np.int64)
        names = fields
        if names is None:
            names = [n for n, c in part.field_col.items() if np.all(part.block[rows, c] >= 0)]
        for n in names:
            col = part.field_col.get(n)
            if col is None or np.any(part.block[rows, col] < 0):
                lacking = [k for k, r in zip(keys, rows.tolist(), strict=True) if col is None or part.block[r, col] < 0]
                raise UnknownField(f"field {n!r} is not set for keys {lacking[:10]} in {part.name}")
        return part.meta(rows, list(names), None, {"keys": list(keys)})

    def list_keys(self, partition: Any, with_tags: bool) -> Any:
        """The committed keys of ``partition`` (None: of every partition used by key), with their tags if asked."""
        if partition is None:
            keyed = [part for part in self.table.partitions.values() if part.keyed]
            return {part.key: _keys_of(part, with_tags) for part in keyed}
        part = self.table.partitions.get(self.table.check_key(partition))
        if part is None:  # never opened, or cleared: no keys
            return {} if with_tags else []
        if not part.keyed:
            raise InvalidRequest(f"{part.name} is used by row (put), not by key")
        return _keys_of(part, with_tags)

    def tag(self, partition: Any, keys: list[str], values: list[Any]) -> BatchMeta:
        """Set the tags of ``keys``, creating keys that do not exist yet (with no fields, as upstream does)."""
        key = self.table.check_key(partition)
        if not isinstance(key, str) or len(keys) != len(values) or len(set(keys)) != len(keys):
            raise InvalidRequest(f"kv tags need a str partition and one tag per distinct key, got {len(keys)} keys")
        check_custom_meta(list(values), [f"key {k!r}" for k in keys])  # before anything changes
        part = self.table.live(key, reopen=True)
        if part is not None:
            self.table.check_use(part, keyed=True)
        part = part or self.table.open(key, keyed=True)
        assert part is not None  # a str partition always opens
        self.table.reopened(key)
        if any(k in part.keys and part.state[part.keys[k]] != COMMITTED for k in keys):
            raise FieldAlreadyProduced(f"another put is creating some of these keys in {part.name} right now")
        new = [k for k in keys if k not in part.keys]
        if new:
            rows = part.allocate(len(new), None)
            for k, row in zip(new, rows.tolist(), strict=True):
                part.keys[k], part.row_keys[row] = row, k
            none = np.zeros(0, dtype=np.int64)
            part.commit(rows, [], none, none, None, np.ones(len(rows), dtype=bool))
        rows = np.asarray([part.keys[k] for k in keys], dtype=np.int64)
        part.set_custom_meta(rows, list(values))
        return part.meta(rows, [], None, {"keys": list(keys)})

    def set_custom_meta(self, uid: int, indexes: np.ndarray, values: list[Any]) -> None:
        part = self.table.by_uid(uid)
        if part is None:
            raise StaleBatchMeta(f"set_custom_meta of a meta whose partition (uid {uid}) was cleared")
        rows = part.committed_rows_of(indexes, "set_custom_meta")
        part.set_custom_meta(rows, list(values))

    def get_custom_meta(self, uid: int, indexes: np.ndarray) -> list[dict[str, Any]]:
        part = self.table.by_uid(uid)
        if part is None:
            raise StaleBatchMeta(f"get_custom_meta of a meta whose partition (uid {uid}) was cleared")
        rows = indexes - part.base_index
        return [part.custom_meta.get(row, {}) for row in rows.tolist()]

    def clear_samples(self, uid: int, indexes: np.ndarray) -> None:
        """Forget committed rows (a no-op for rows cleared before, or a cleared partition)."""
        part = self.table.by_uid(uid)
        if part is None:
            return  # its partition was cleared: the rows are gone already
        rows = indexes - part.base_index
        rows = rows[(rows >= 0) & (rows < part.num_rows)]
        rows = np.unique(rows[part.state[rows] == COMMITTED])  # rows cleared before are skipped (idempotent)
        if np.any(part.inflight_mask[rows]):
            raise FieldAlreadyProduced(f"some rows of {part.name} are being written by an open put; clear them after")
        for row in rows.tolist():
            key = part.row_keys.pop(row, None)
            if key is not None:
                part.keys.pop(key, None)
        self.ledger.drop_blocks(part, part.remove_rows(rows))
        self.rows_changed(part.key)  # a closed partition may now have served everything that is left
        self.ledger.space_freed()

    def clear_keys(self, partition: Any, keys: list[str]) -> None:
        """Forget ``keys`` of ``partition`` (unknown keys and partitions are a no-op)."""
        part = self.table.partitions.get(self.table.check_key(partition))
        if part is None:
            return
        found = list(dict.fromkeys(k for k in keys if k in part.keys))
        busy = [k for k in found if part.state[part.keys[k]] != COMMITTED or part.inflight_mask[part.keys[k]]]
        if busy:
            raise FieldAlreadyProduced(
                f"keys {busy[:10]} of {part.name} are being written by an open put; clear them after it commits"
            )
        rows = [part.keys.pop(k) for k in found]
        if not rows:
            return
        for row in rows:
            part.row_keys.pop(row, None)
        self.ledger.drop_blocks(part, part.remove_rows(np.asarray(rows, dtype=np.int64)))


def _keys_of(part: PartitionState, with_tags: bool) -> Any:
    keys = [(k, row) for k, row in part.keys.items() if part.state[row] == COMMITTED]
    if with_tags:
        return {k: part.custom_meta.get(row, {}) for k, row in keys}
    return [k for k, _ in keys]
