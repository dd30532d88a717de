"""What the status calls report of one partition: production, delivery state counts per task, dead letters.

Read-only views of a :class:`~transfer_queue.state.partition.PartitionState` (``self`` is the partition).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transfer_queue.state.partition import COMMITTED, PartitionState
from transfer_queue.state.ready_index import AVAILABLE, CONSUMED, DEAD, LEASED


def production_status(self: PartitionState) -> dict[str, Any]:
    """The partition's rows, bytes and fields (what ``client.get_production_status`` answers)."""
    return {
        "partition_id": self.key,
        "partition_uid": self.uid,
        "capacity": self.capacity,
        "rows": self.num_committed,
        "rows_in_flight": self.num_reserved,
        "rows_lost": self.num_lost,
        "closed": self.sealed,
        "bytes": self.nbytes,
        "fields": {
            n: {"schema": self.fields[n].describe(), "produced": self.field_produced[c]}
            for n, c in self.field_col.items()
        },
    }


def row_state_counts(self: PartitionState, task_name: str) -> dict[str, int]:
    """Committed rows of the partition by delivery state for ``task_name``: ``ready`` (not handed out; ready
    for a request whose fields they all have), ``leased``, ``acknowledged``, ``dead_lettered``."""
    task = self.tasks.get(task_name)
    if task is None:
        return {"ready": self.num_committed, "leased": 0, "acknowledged": 0, "dead_lettered": 0}
    states = task.consumption[: self.num_rows][self.state[: self.num_rows] == COMMITTED]
    counts = np.bincount(states, minlength=4)
    return {
        "ready": int(counts[AVAILABLE]),
        "leased": int(counts[LEASED]),
        "acknowledged": int(counts[CONSUMED]),
        "dead_lettered": int(counts[DEAD]),
    }


def dead_letters(self: PartitionState, task_name: str) -> list[dict[str, Any]]:
    """The rows dead-lettered for ``task_name``: global index, deliveries, and the last reason they came back."""
    task = self.tasks.get(task_name)
    if task is None:
        return []
    return [
        {"global_index": self.base_index + row, "deliveries": int(task.deliveries[row]), "reason": reason}
        for row, reason in task.dead.items()
    ]


def consumption_status(self: PartitionState, task_name: str | None) -> dict[str, Any]:
    """Per task: ``consumed`` (rows handed out: leased, acknowledged or dead-lettered), ``rows`` (committed),
    and the row counts by delivery state (:func:`row_state_counts`)."""
    names = [task_name] if task_name is not None else list(self.tasks)
    out = {}
    for name in names:
        counts = row_state_counts(self, name)
        consumed = counts["leased"] + counts["acknowledged"] + counts["dead_lettered"]
        out[name] = {"consumed": consumed, "rows": self.num_committed, **counts}
    return {"partition_id": self.key, "tasks": out, "rows_lost": self.num_lost}
