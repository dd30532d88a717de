"""Delivery bookkeeping: who leased which rows of which task until when, and which clients are still there.

Plain Python, no Ray, no sockets (the controller feeds it connections and disconnects). Per task a row is
ready -> leased -> acknowledged (see docs/architecture.md "Delivery"); the per-row state lives in
:class:`~transfer_queue.partition.TaskState`, and this module keeps the leases themselves:

- a :class:`Lease` is what one ``get_meta`` (or one DP round) handed out: its owner, task, rows and deadline;
- the deadlines, in a heap, so the earliest is found in O(1) and an expired one in O(log n);
- owners (one per client instance) and their connections: when the last connection of an owner closes, its leases
  are returned after a short grace (a client that reconnects at once keeps them).

A row's lease id identifies the lease that holds it: a lease that expires hands back only the rows that still
carry its id (an acknowledged row, or one handed back and leased again, is not touched).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer_queue.errors import InvalidRequest
from transfer_queue.metadata import PartitionKey

ACK_MODES = ("auto", "explicit")
ROUND_OWNER = "\x00dp-round"  # the owner of every DP round's lease (a client's owner never starts with a NUL)


@dataclass(frozen=True)
class TaskOptions:
    """How a task is delivered; ``None`` fields take the queue's defaults (QueueConfig).

    Args:
        ack: ``"auto"``: a ``get_data`` of a meta acknowledges its rows; ``"explicit"``: only ``ack(meta)`` does.
        lease_s: seconds a lease lasts before its unacknowledged rows go back to ready.
        max_deliveries: deliveries after which rows that come back go to the dead-letter list instead.
    """

    ack: str = "auto"
    lease_s: float | None = None
    max_deliveries: int | None = None

    def __post_init__(self) -> None:
        if self.ack not in ACK_MODES:
            raise InvalidRequest(f"ack must be one of {list(ACK_MODES)}, got {self.ack!r}")
        check_lease_s(self.lease_s)
        if self.max_deliveries is not None and (
            not isinstance(self.max_deliveries, int) or isinstance(self.max_deliveries, bool) or self.max_deliveries < 1
        ):
            raise InvalidRequest(f"max_deliveries must be an int >= 1 (or None), got {self.max_deliveries!r}")


def check_lease_s(lease_s: Any) -> None:
    if lease_s is not None and (
        isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not 0 < lease_s < float("inf")
    ):
        raise InvalidRequest(f"lease_s must be a finite number of seconds > 0 (or None), got {lease_s!r}")


@dataclass
class Lease:
    """Rows of one task handed to one owner (a client, or a DP round) until ``deadline``."""

    lease_id: int
    owner: str
    key: PartitionKey
    uid: int
    task_name: str
    rows: np.ndarray  # local rows
    deadline: float
    call_id: int = 0  # the client's id for the get_meta that took it (a cancel names it)
    remaining: int = 0  # rows still leased under this lease
    round_key: tuple[str, str] | None = None  # (task, dp_group_id) when the lease holds a DP round's shares


class LeaseBook:
    """Leases by id and by owner, their deadlines, and the connections of each owner."""

    def __init__(self) -> None:
        self.leases: dict[int, Lease] = {}
        self.by_owner: dict[str, set[int]] = {}
        self._heap: list[tuple[float, int]] = []
        self._next_id = 1
        self._owner_ids: dict[str, int] = {}
        self.owner_names: list[str] = []
        self.peers: dict[str, set[Hashable]] = {}  # owner -> its open connections
        self.owner_of_peer: dict[Hashable, str] = {}
        self.orphaned: dict[str, float] = {}  # owner whose last connection closed -> when its leases go back

    # ---- owners and their connections --------------------------------------------------------------------
    def owner_id(self, owner: str) -> int:
        """A small int for an owner, stored per row (ids are never reused)."""
        oid = self._owner_ids.get(owner)
        if oid is None:
            self.owner_names.append(owner)
            oid = self._owner_ids[owner] = len(self.owner_names)  # from 1: 0 means no holder
        return oid

    @property
    def round_holder(self) -> int:
        """The holder id of rows leased to a DP round (any rank of the round may acknowledge them)."""
        return self.owner_id(ROUND_OWNER)

    def connected(self, owner: str, peer: Hashable | None) -> None:
        """``owner`` spoke through connection ``peer`` (None: unknown, e.g. in tests)."""
        if not owner or peer is None or owner == ROUND_OWNER:
            return
        self.orphaned.pop(owner, None)
        if self.owner_of_peer.get(peer) != owner:
            self.owner_of_peer[peer] = owner
            self.peers.setdefault(owner, set()).add(peer)

    def disconnected(self, peer: Hashable, when: float) -> str | None:
        """Connection ``peer`` closed; returns its owner if that was the owner's last one (its leases go back at
        ``when`` unless it connects again first)."""
        owner = self.owner_of_peer.pop(peer, None)
        if owner is None:
            return None
        peers = self.peers.get(owner)
        if peers is not None:
            peers.discard(peer)
            if peers:
                return None
            del self.peers[owner]
        self.orphaned[owner] = when
        return owner

    def take_orphans(self, now: float) -> list[str]:
        """Owners whose grace after their last disconnect has passed."""
        gone = [owner for owner, when in self.orphaned.items() if when <= now]
        for owner in gone:
            del self.orphaned[owner]
        return gone

    # ---- leases -------------------------------------------------------------------------------------------
    def open(
        self, owner: str, key: PartitionKey, uid: int, task_name: str, rows: np.ndarray, deadline: float, call_id: int
    ) -> Lease:
        lease = Lease(self._next_id, owner, key, uid, task_name, rows, deadline, call_id, len(rows))
        self._next_id += 1
        self.leases[lease.lease_id] = lease
        self.by_owner.setdefault(owner, set()).add(lease.lease_id)
        heapq.heappush(self._heap, (deadline, lease.lease_id))
        return lease

    def settled(self, lease_ids: np.ndarray) -> None:
        """Rows leased under ``lease_ids`` (one entry per row) were acknowledged or handed back."""
        ids, counts = np.unique(lease_ids[lease_ids > 0], return_counts=True)
        for lease_id, count in zip(ids.tolist(), counts.tolist(), strict=True):
            lease = self.leases.get(lease_id)
            if lease is not None:
                lease.remaining -= count
                if lease.remaining <= 0:
                    self.close(lease)

    def close(self, lease: Lease) -> None:
        """Forget a lease (its heap entry is skipped when it comes up)."""
        self.leases.pop(lease.lease_id, None)
        owned = self.by_owner.get(lease.owner)
        if owned is not None:
            owned.discard(lease.lease_id)
            if not owned:
                del self.by_owner[lease.owner]

    def drop_partition(self, uid: int) -> None:
        """Forget the leases of a cleared partition (their rows are gone)."""
        for lease in [lease for lease in self.leases.values() if lease.uid == uid]:
            self.close(lease)

    def of_owner(self, owner: str) -> list[Lease]:
        return [self.leases[i] for i in sorted(self.by_owner.get(owner, ()))]

    def expired(self, now: float) -> list[Lease]:
        """Leases whose deadline passed (each once), earliest first."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._heap)
            lease = self.leases.get(lease_id)
            if lease is not None:
                out.append(lease)
        return out

    def next_deadline(self) -> float:
        while self._heap and self._heap[0][1] not in self.leases:
            heapq.heappop(self._heap)
        deadlines = [self._heap[0][0]] if self._heap else []
        return min([*deadlines, *self.orphaned.values()], default=float("inf"))
