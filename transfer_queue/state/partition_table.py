"""PartitionTable: the live partitions of one queue, the step ring, and what was cleared.

Plain Python (no Ray, no sockets, no wire format). A partition is named by an ``int`` global step (in the ring of
``num_global_batch`` live steps) or a ``str`` partition id; each incarnation gets a fresh ``uid``, so a BatchMeta
from before a clear is stale. A cleared step stays cleared (and so does every step behind it); a cleared name is
remembered for a while (a reader of it fails at once) and may be opened again by a put.
"""

from __future__ import annotations

from typing import Any

from transfer_queue.config import QueueConfig
from transfer_queue.errors import InvalidRequest, PartitionCleared, UnknownPartition
from transfer_queue.metadata import PartitionKey, describe_partition
from transfer_queue.state.partition import PartitionState

# A cleared name forgotten: get_meta on it waits for a new put (and times out) instead of failing at once (defect 8).
CLEARED_NAMES_REMEMBERED = 1024  # ~240 bytes each: at most ~250 KB (issue 23 defect 9)


class PartitionTable:
    """Partitions by key, the highest cleared step, and the latest cleared names (bounded)."""

    def __init__(self, config: QueueConfig):
        self.config = config
        self.partitions: dict[PartitionKey, PartitionState] = {}
        self.max_cleared_step = -1
        self.cleared_names: dict[str, None] = {}  # the latest cleared string partitions, oldest first (bounded)
        self.next_uid = 1

    def check_key(self, key: Any) -> PartitionKey:
        """``key`` if it names a partition (an int step >= 0 whose indexes fit in int64, a non-empty str)."""
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise InvalidRequest(f"a partition is an int global_step or a str partition_id, got {key!r}")
        if isinstance(key, int) and key < 0:
            raise InvalidRequest(f"global_step must be >= 0, got {key}")
        if isinstance(key, int) and key >= (limit := (1 << 63) // self.config.rows_per_step):
            raise InvalidRequest(f"global_step must be < {limit} (its global indexes must fit in int64), got {key}")
        if isinstance(key, str) and not key:
            raise InvalidRequest("partition_id must be a non-empty str")
        return key

    def live(self, key: PartitionKey, reopen: bool = False) -> PartitionState | None:
        """The live partition, ``None`` if not opened yet; raises if it was cleared or is behind the window.

        ``reopen``: a put may open a cleared string partition again (a step, once cleared, stays cleared).
        """
        part = self.partitions.get(key)
        if part is not None:
            return part
        if isinstance(key, int) and key <= self.max_cleared_step:
            steps = sorted(k for k in self.partitions if isinstance(k, int))
            raise PartitionCleared(
                f"global_step={key} was cleared or lies behind the live window (steps up to {self.max_cleared_step} "
                f"were cleared; live steps: {steps})"
            )
        if isinstance(key, str) and key in self.cleared_names and not reopen:
            raise PartitionCleared(f"partition_id={key!r} was cleared")
        return None

    def known(self, key: Any) -> PartitionState:
        """The live partition ``key``; UnknownPartition if there is none."""
        key = self.check_key(key)
        part = self.partitions.get(key)
        if part is None:
            live = sorted(self.partitions, key=str)
            raise UnknownPartition(f"{describe_partition(key)} not found; live partitions: {live}")
        return part

    def keyed(self, key: Any) -> PartitionState:
        """The live partition ``key``, which must be used by key (kv_*)."""
        part = self.known(key)
        if not part.keyed:
            raise InvalidRequest(f"{part.name} is used by row (put), not by key")
        return part

    def open(self, key: PartitionKey, keyed: bool) -> PartitionState | None:
        """Open a partition for a put; ``None`` when the step ring is full (the put waits)."""
        if isinstance(key, int):
            live_steps = [k for k in self.partitions if isinstance(k, int)]
            if len(live_steps) >= self.config.num_global_batch:
                return None
            capacity = self.config.rows_per_step
            base = key * capacity
        else:
            capacity, base = None, 0
        part = PartitionState(
            key,
            self.next_uid,
            capacity,
            self.config.num_n_samples,
            base,
            keyed=keyed,
            max_fields=self.config.max_fields,
            promote_jagged=self.config.promote_jagged,
        )
        self.next_uid += 1
        self.partitions[key] = part
        return part

    def reopened(self, key: PartitionKey) -> None:
        """A put (or a tag) reached string partition ``key`` again: it is no longer cleared."""
        if isinstance(key, str):
            self.cleared_names.pop(key, None)

    def remove(self, key: PartitionKey) -> PartitionState | None:
        """Clear ``key``: forget the partition and remember it was cleared; ``None`` if it was not live (a no-op:
        it must not mark steps up to ``key`` as cleared)."""
        part = self.partitions.pop(key, None)
        if part is None:
            return None
        if isinstance(key, int):
            self.max_cleared_step = max(self.max_cleared_step, key)
        else:
            self.cleared_names[key] = None
            while len(self.cleared_names) > CLEARED_NAMES_REMEMBERED:
                del self.cleared_names[next(iter(self.cleared_names))]
        return part

    def by_uid(self, uid: int) -> PartitionState | None:
        return next((part for part in self.partitions.values() if part.uid == uid), None)

    @staticmethod
    def check_use(part: PartitionState, keyed: bool) -> None:
        """A partition is used one way: by row (put) or by key (kv_*)."""
        if part.keyed != keyed:
            how = "by key (kv_*)" if part.keyed else "by row (put)"
            raise InvalidRequest(f"{part.name} is used {how}; use one way per partition")
