"""Delivery bookkeeping: who leased which rows of which task until when, and which clients are still there.

Plain Python, no Ray, no sockets (the controller feeds it connections and disconnects). Per task a row is
ready -> leased -> acknowledged (see docs/architecture.md "Delivery"); the per-row state lives in
:class:`~transfer_queue.state.partition.TaskState`, and this module keeps the leases themselves
(:class:`LeaseBook`) and the rules over both (:class:`Delivery`):

- a :class:`Lease` is what one ``get_meta`` (or one DP round) handed out: its owner, task, rows and deadline;
- the deadlines, in a heap, so the earliest is found in O(1) and an expired one in O(log n);
- owners (one per client instance) and their connections: when the last connection of an owner closes, its leases
  are returned after a short grace (a client that reconnects at once keeps them). Nothing of an owner outlives its
  connections and the rows it holds: a week of short-lived clients leaves no trace (``forget_owners``).

A row's lease id identifies the lease that holds it: a lease that expires hands back only the rows that still
carry its id (an acknowledged row, or one handed back and leased again, is not touched).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer_queue.config import QueueConfig
from transfer_queue.errors import InvalidRequest, NotLeased, StaleBatchMeta
from transfer_queue.metadata import PartitionKey
from transfer_queue.state.dp_rounds import end_round, mark_released
from transfer_queue.state.events import QueueEvents
from transfer_queue.state.partition import DPRound, PartitionState, unique_in_order
from transfer_queue.state.partition_table import PartitionTable
from transfer_queue.state.ready_index import AVAILABLE, CONSUMED, DEAD, LEASED, NO_HOLDER

logger = logging.getLogger(__name__)

ACK_MODES = ("auto", "explicit")
ROUND_OWNER = "\x00dp-round"  # the owner of every DP round's lease (a client's owner never starts with a NUL)
# The table of owner ids is swept (the ids no live row carries are forgotten) when it has doubled since the last
# sweep, and holds at least this many before the first: a sweep reads every live row's holder once.
OWNER_SWEEP_MIN = 1024


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
    duration: float = 0.0  # seconds its deadline was last set ahead (a replayed journal re-arms it this long)

    def journaled(self) -> list[Any]:
        """The lease as the journal keeps it (its rows are the rows that carry its id; its deadline is re-armed)."""
        return [self.lease_id, self.owner, self.uid, self.task_name, self.duration, self.call_id]


class LeaseBook:
    """Leases by id and by owner, their deadlines, and the connections of each owner."""

    def __init__(self) -> None:
        self.leases: dict[int, Lease] = {}
        self.by_owner: dict[str, set[int]] = {}
        self.by_call: dict[tuple[str, int], int] = {}  # (owner, call id) -> the live lease that get_meta took
        self._heap: list[tuple[float, int]] = []
        self._next_id = 1
        self._owner_ids: dict[str, int] = {}  # the owners some row may carry as its holder
        self.next_owner_id = 1  # from 1: 0 means no holder; ids are never reused
        self._sweep_at = OWNER_SWEEP_MIN
        self.peers: dict[str, set[Hashable]] = {}  # owner -> its open connections
        self.owner_of_peer: dict[Hashable, str] = {}
        self.orphaned: dict[str, float] = {}  # owner whose last connection closed -> when its leases go back
        # journal_dir: the ids of the leases opened, extended or closed since the journal's last record (None: the
        # queue keeps no journal)
        self.changed: set[int] | None = None

    # ---- owners and their connections --------------------------------------------------------------------
    def owner_id(self, owner: str) -> int:
        """A small int for an owner, stored per row as the holder of the rows it leases (ids are never reused)."""
        oid = self._owner_ids.get(owner)
        if oid is None:
            oid = self._owner_ids[owner] = self.next_owner_id
            self.next_owner_id += 1
        return oid

    def holder_of(self, owner: str) -> int:
        """The holder id of ``owner``'s rows; -1 (no row's) for an owner that holds none."""
        return self._owner_ids.get(owner, -1)

    def sweep_due(self, owner: str) -> bool:
        """Whether the table of owner ids should be swept before ``owner`` gets an id: it is new, and the table
        doubled since the last sweep."""
        return owner not in self._owner_ids and len(self._owner_ids) >= self._sweep_at

    def forget_owners(self, in_use: np.ndarray) -> None:
        """Forget the ids of owners that no live row carries (``in_use[id]``: some row does). Such an owner holds
        no row, so a new id, if it leases again, serves it as its old one did; its leases and connections are
        kept by name and go with them."""
        for owner, oid in list(self._owner_ids.items()):
            if owner != ROUND_OWNER and not (oid < len(in_use) and in_use[oid]):
                del self._owner_ids[owner]
        self._sweep_at = max(OWNER_SWEEP_MIN, 2 * len(self._owner_ids))

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
        self.add(lease)
        return lease

    def add(self, lease: Lease) -> None:
        """Hold ``lease`` (opened now, or restored from the journal under its own id)."""
        self.leases[lease.lease_id] = lease
        self.by_owner.setdefault(lease.owner, set()).add(lease.lease_id)
        if lease.call_id:
            self.by_call[(lease.owner, lease.call_id)] = lease.lease_id
        heapq.heappush(self._heap, (lease.deadline, lease.lease_id))
        self._next_id = max(self._next_id, lease.lease_id + 1)
        if self.changed is not None:
            self.changed.add(lease.lease_id)

    @property
    def next_id(self) -> int:
        return self._next_id

    def skip_ids(self, next_id: int) -> None:
        """Never hand out a lease id below ``next_id`` (a replayed journal: ids its rows may still carry)."""
        self._next_id = max(self._next_id, next_id)

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
        if self.by_call.get((lease.owner, lease.call_id)) == lease.lease_id:
            del self.by_call[(lease.owner, lease.call_id)]
        if self.changed is not None:
            self.changed.add(lease.lease_id)
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
            if lease is not None and lease.deadline <= now:  # else: extended since, a later entry stands for it
                out.append(lease)
        return out

    def extend(self, lease: Lease, deadline: float) -> None:
        """Move ``lease``'s deadline (its earlier heap entry is skipped when it comes up)."""
        lease.deadline = deadline
        heapq.heappush(self._heap, (deadline, lease.lease_id))
        if self.changed is not None:
            self.changed.add(lease.lease_id)

    def next_deadline(self) -> float:
        while self._heap and (
            self._heap[0][1] not in self.leases or self.leases[self._heap[0][1]].deadline != self._heap[0][0]
        ):
            heapq.heappop(self._heap)
        deadlines = [self._heap[0][0]] if self._heap else []
        return min([*deadlines, *self.orphaned.values()], default=float("inf"))


class Delivery:
    """Leases, acknowledgements, hand-backs and dead letters of every task, over the partitions' per-row arrays.

    Args:
        config: the queue's defaults (``lease_s``, ``max_deliveries``).
        table: the live partitions (a lease of a cleared partition is forgotten).
        clock: the queue's clock.
        wake: called with a new deadline (the owner's timer must fire by then).
        rows_back: called with a partition key and the task whose rows came back to ready (its getters retry).
    """

    def __init__(
        self,
        config: QueueConfig,
        table: PartitionTable,
        clock: Callable[[], float],
        wake: Callable[[float], None],
        rows_back: Callable[[PartitionKey, str], None],
    ):
        self.config = config
        self.table = table
        self.clock = clock
        self.wake = wake
        self.rows_back = rows_back
        self.leases = LeaseBook()
        self.task_options: dict[str, TaskOptions] = {}
        self.events = QueueEvents()  # the metrics hook: lease expiries, re-deliveries (transfer_queue.ops.metrics)

    # ---- per-task options ------------------------------------------------------------------------------------
    def options(self, task_name: str) -> TaskOptions:
        return self.task_options.get(task_name) or TaskOptions()

    @staticmethod
    def check_task_name(task_name: Any) -> None:
        if not isinstance(task_name, str) or not task_name:
            raise InvalidRequest(f"task_name must be a non-empty str, got {task_name!r}")

    def set_options(self, task_name: str, options: TaskOptions) -> None:
        self.check_task_name(task_name)
        self.task_options[task_name] = options

    def lease_s(self, task_name: str, lease_s: float | None) -> float:
        """How long a lease of this call lasts: its own ``lease_s``, else the task's, else the queue's."""
        if lease_s is not None:
            return float(lease_s)
        task_lease = self.options(task_name).lease_s
        return float(task_lease) if task_lease is not None else self.config.lease_s

    def max_deliveries(self, task_name: str) -> int:
        task_max = self.options(task_name).max_deliveries
        return task_max if task_max is not None else self.config.max_deliveries

    # ---- leasing and handing back ----------------------------------------------------------------------------
    def lease(
        self,
        part: PartitionState,
        task_name: str,
        rows: np.ndarray,
        owner: str,
        lease_s: float,
        call_id: int,
        round_key: tuple[str, str] | None = None,
    ) -> Lease:
        deadline = self.clock() + lease_s
        if self.leases.sweep_due(owner):
            self.leases.forget_owners(self._holders_in_use())
        lease = self.leases.open(owner, part.key, part.uid, task_name, rows, deadline, call_id)
        lease.round_key = round_key
        lease.duration = float(lease_s)
        again = int(np.count_nonzero(part.task(task_name).deliveries[rows]))
        if again:
            self.events.redelivered(task_name, again)
        part.lease(task_name, rows, lease.lease_id, self.leases.owner_id(owner))
        self.wake(deadline)
        return lease

    def _holders_in_use(self) -> np.ndarray:
        """``in_use[id]``: some row of a live partition has owner id ``id`` as its holder (leased to it, or
        acknowledged by it: it may release them)."""
        in_use = np.zeros(self.leases.next_owner_id, dtype=bool)
        for part in self.table.partitions.values():
            for task in part.tasks.values():
                in_use[task.holder] = True
        return in_use

    def give_back(self, lease: Lease, reason: str) -> None:
        """The rows ``lease`` still holds go back to ready for its task, first in line (or to the dead letters)."""
        self.leases.close(lease)
        part = self.table.partitions.get(lease.key)
        if part is None or part.uid != lease.uid:
            return
        task = part.tasks.get(lease.task_name)
        if task is None:  # its consumption was reset since
            return
        rows = lease.rows[(task.lease[lease.rows] == lease.lease_id) & (task.consumption[lease.rows] == LEASED)]
        if lease.round_key is not None:
            end_round(part, lease.round_key, lease.lease_id)
        if not len(rows):
            return
        if reason in ("lease expired", "client disconnected"):
            self.events.lease_expired(lease.task_name, len(rows))
        dead = part.give_back(lease.task_name, rows, reason, self.max_deliveries(lease.task_name))
        if len(dead):
            logger.warning(
                "%d rows of task %r in %s were delivered %d times; dead-lettered (%s)",
                len(dead),
                lease.task_name,
                part.name,
                self.max_deliveries(lease.task_name),
                reason,
            )
        self.rows_back(part.key, lease.task_name)

    # ---- the journal (journal_dir) ----------------------------------------------------------------------------
    def journaled_leases(self, changed: bool) -> list[list[Any]]:
        """The leases as the journal keeps them (``Lease.journaled``): ``changed``: those opened, extended or
        closed since the last record (a closed one as ``[lease_id]``), else every live one. A DP round's lease also
        keeps its round (:meth:`_journaled_round`: the ranks' shares), so the ranks fetch and acknowledge their
        shares after a restart as before it."""
        book = self.leases
        ids = sorted(book.changed or ()) if changed else sorted(book.leases)
        out: list[list[Any]] = []
        for lease_id in ids:
            lease = book.leases.get(lease_id)
            if lease is None:
                out.append([lease_id])
            elif lease.round_key is None:
                out.append(lease.journaled())
            else:
                dp_round = self._journaled_round(lease)
                out.append([lease_id] if dp_round is None else [*lease.journaled(), dp_round])
        return out

    def _journaled_round(self, lease: Lease) -> list[Any] | None:
        """``[dp_group_id, dp_size, batch_size, fields, shares (local rows per rank), released ranks]`` of the DP
        round ``lease`` holds; None when its partition forgot the round (nobody can ask for its shares again)."""
        assert lease.round_key is not None
        part = self.table.by_uid(lease.uid)
        dp_round = None if part is None else part.rounds.get(lease.round_key)
        if dp_round is None or dp_round.shares is None or dp_round.lease_id != lease.lease_id:
            return None
        return [
            lease.round_key[1], dp_round.dp_size, dp_round.batch_size, list(dp_round.fields),
            [share.tolist() for share in dp_round.shares], sorted(dp_round.released),
        ]  # fmt: skip

    def restore_leases(self, saved: list[list[Any]], next_id: int) -> int:
        """Hold again the leases a replayed journal kept (``journaled_leases``): each over the rows of its partition
        and task that are leased under its id, for its owner, its deadline re-armed ``duration`` seconds from now
        (the restart: a monotonic clock does not carry over to another process or host). Its owner has no connection
        yet, so the disconnect grace does not run until it connected again and closed its last connection: an owner
        that never comes back loses its rows at the re-armed deadline. A DP round's lease brings its round back to the
        partition (its shares: each rank fetches and acknowledges its own as before the restart). Leased rows of no
        kept lease are ready again. Returns the leases restored."""
        by_id = {int(entry[0]): entry for entry in saved if len(entry) > 1}
        now = self.clock()
        restored = 0
        for part in self.table.partitions.values():
            for task_name, task in part.tasks.items():
                leased = np.flatnonzero(task.consumption == LEASED)
                if not len(leased):
                    continue
                ids = task.lease[leased]
                for lease_id in np.unique(ids).tolist():
                    rows = leased[ids == lease_id]
                    entry = by_id.get(int(lease_id))
                    if entry is None or entry[2] != part.uid or entry[3] != task_name:
                        task.consumption[rows] = AVAILABLE
                        task.lease[rows] = 0
                        task.holder[rows] = NO_HOLDER
                        continue
                    owner, duration, call_id = entry[1], entry[4], entry[5]
                    deadline = now + float(duration)
                    lease = Lease(lease_id, str(owner), part.key, part.uid, task_name, rows, deadline, int(call_id))
                    lease.remaining, lease.duration = len(rows), float(duration)
                    if len(entry) > 6:  # a DP round's lease, with its round
                        group_id, dp_size, batch_size, fields, shares, released = entry[6]
                        lease.round_key = (task_name, str(group_id))
                        part.rounds[lease.round_key] = DPRound(
                            int(dp_size), int(batch_size), tuple(fields),
                            shares=[np.asarray(share, dtype=np.int64) for share in shares],
                            released={int(rank) for rank in released}, lease_id=int(lease_id), lease_s=float(duration),
                        )  # fmt: skip
                    self.leases.add(lease)
                    task.holder[rows] = self.leases.owner_id(lease.owner)
                    self.wake(lease.deadline)
                    restored += 1
        self.leases.skip_ids(next_id)
        return restored

    def expire(self, now: float) -> None:
        """Hand back the rows of expired leases and of owners gone for good."""
        # rows handed back go in front of the ready ones: the latest lease first, so the oldest ends up in front
        for lease in reversed(self.leases.expired(now)):
            self.give_back(lease, "lease expired")
        for owner in self.leases.take_orphans(now):
            for lease in reversed(self.leases.of_owner(owner)):
                self.give_back(lease, "client disconnected")

    def rows_of_call(self, part: PartitionState, task_name: str, owner: str, call_id: int) -> np.ndarray | None:
        """The rows of ``part``'s task that get_meta ``call_id`` of ``owner`` was served and still holds leased (None:
        no live lease of that call). The client asks a get_meta again under the same call id after ServerGone
        (``restart_retry_s``): the controller may have leased rows (and journaled the lease) and died, or lost the
        connection, before its reply went out; the retry is answered with those rows, not new ones, so none stays
        leased to a client that never learned which they were."""
        if not owner or not call_id or owner == ROUND_OWNER:
            return None
        lease = self.leases.leases.get(self.leases.by_call.get((owner, call_id), 0))
        if lease is None or lease.uid != part.uid or lease.task_name != task_name:
            return None
        task = part.task(task_name)
        rows = lease.rows[(task.lease[lease.rows] == lease.lease_id) & (task.consumption[lease.rows] == LEASED)]
        return rows if len(rows) else None

    def cancel(self, owner: str, call_id: int) -> None:
        """Hand back what get_meta ``call_id`` of ``owner`` was served."""
        for lease in self.leases.of_owner(owner):
            if lease.call_id == call_id and call_id:
                self.give_back(lease, "cancelled")

    # ---- acknowledging and releasing -------------------------------------------------------------------------
    def held_rows(
        self, uid: int, task_name: str, indexes: np.ndarray, owner: str, what: str, dp_group_id: str | None = None
    ) -> tuple[PartitionState, np.ndarray, np.ndarray, np.ndarray]:
        """The partition, the distinct rows named, and per row: held by ``owner``, held by DP round
        ``dp_group_id`` (under that round's own lease: not rows a later round took after its lease expired)."""
        part = self.table.by_uid(uid)
        if part is None:
            raise StaleBatchMeta(
                f"{what} of a BatchMeta whose partition (uid {uid}) was cleared: its rows no longer "
                "exist; get a fresh BatchMeta"
            )
        rows = indexes - part.base_index
        rows = unique_in_order(rows[(rows >= 0) & (rows < part.num_rows)])
        task = part.task(task_name)
        holder = task.holder[rows]
        by_round = holder == self.leases.round_holder
        if dp_group_id is None:
            ours = np.zeros(len(rows), dtype=bool)
        else:
            ours = by_round & np.isin(task.lease[rows], self._round_leases(part, (task_name, dp_group_id), rows))
        return part, rows, holder == self.leases.holder_of(owner), ours

    def _round_leases(self, part: PartitionState, round_key: tuple[str, str], rows: np.ndarray) -> list[int]:
        """The lease ids under which round ``round_key`` held ``rows``: its own (kept while the partition remembers
        the round) and any live lease opened for it."""
        task = part.task(round_key[0])
        dp_round = part.rounds.get(round_key)
        ids = [dp_round.lease_id] if dp_round is not None and dp_round.lease_id else []
        for lease_id in np.unique(task.lease[rows]).tolist():
            lease = self.leases.leases.get(lease_id)
            if lease is not None and lease.round_key == round_key:
                ids.append(lease_id)
        return ids

    def ack(
        self,
        uid: int,
        task_name: str,
        indexes: np.ndarray,
        owner: str,
        explicit: bool,
        dp_group_id: str | None = None,
        again: bool = False,
    ) -> dict[str, int] | None:
        """Acknowledge rows ``owner`` holds, or its DP round ``dp_group_id`` still holds (a late ack of a round whose
        lease expired acknowledges nothing another round took since); ``explicit`` (the user's ack): rows not held
        are NotLeased. ``again``: the client asks again after ServerGone (its first ack may have been applied and the
        reply lost), so rows ``owner`` acknowledged already are no error, and so are rows acknowledged before a
        replay of the journal (it keeps no holder: the controller may have died between the ack's record and its
        reply)."""
        if not explicit and (self.options(task_name).ack == "explicit" or self.table.by_uid(uid) is None):
            return None  # a get_data's acknowledgement: the task acknowledges by itself / the meta is stale
        part, rows, mine, ours = self.held_rows(uid, task_name, indexes, owner, "ack", dp_group_id)
        task = part.task(task_name)
        state = task.consumption[rows]
        take = (state == LEASED) & (mine | ours)
        if explicit:
            # TP peers of a DP rank acknowledge the same share: once counts; so does the owner's ack asked again,
            # and rows acknowledged before a replay (the journal keeps no holder: its first ack may be one of them)
            # (and rows whose holder's id was forgotten since: an owner whose connections all closed holding no
            # lease loses its id, so the first ack's rows no longer name it; with again any acknowledged row counts)
            done = state == CONSUMED if again else (state == CONSUMED) & ours
            bad = ~(take | done)
            if bad.any():
                by_round = task.holder[rows[bad]] == self.leases.round_holder
                raise NotLeased(
                    _not_leased_message(part, task_name, rows[bad], state[bad], mine[bad] | ours[bad], by_round, "ack")
                )
        acked = rows[take]
        if len(acked):
            self.leases.settled(task.lease[acked])
            part.acknowledge(task_name, acked)
        return {"acknowledged": len(acked)}

    def extend(
        self,
        uid: int,
        task_name: str,
        indexes: np.ndarray,
        owner: str,
        seconds: float,
        dp_group_id: str | None = None,
    ) -> dict[str, int]:
        """Set the deadline of the leases holding the rows named to now + ``seconds`` (``client.extend_lease``).

        Every row must be leased to ``owner`` (or to its DP round ``dp_group_id``, under that round's own lease);
        otherwise NotLeased names the others and nothing is extended. A round's rows a peer rank already acknowledged
        are skipped, as ``ack`` does. A lease's deadline is per ``get_meta``: its rows not named move with it.
        """
        self.config.check_extension(seconds)
        part, rows, mine, rounds = self.held_rows(uid, task_name, indexes, owner, "extend_lease", dp_group_id)
        task = part.task(task_name)
        state = task.consumption[rows]
        held = (state == LEASED) & (mine | rounds)
        bad = ~(held | ((state == CONSUMED) & rounds))
        if bad.any():
            by_round = task.holder[rows[bad]] == self.leases.round_holder
            raise NotLeased(
                _not_leased_message(
                    part, task_name, rows[bad], state[bad], mine[bad] | rounds[bad], by_round, "extend_lease"
                )
            )
        deadline = self.clock() + float(seconds)
        for lease_id in np.unique(task.lease[rows[held]]).tolist():
            lease = self.leases.leases.get(lease_id)
            if lease is not None:
                lease.duration = float(seconds)
                self.leases.extend(lease, deadline)
        self.wake(deadline)
        return {"extended": int(held.sum())}

    def release(
        self, uid: int, task_name: str, indexes: np.ndarray, owner: str, dp_group_id: str | None = None
    ) -> None:
        """Hand back rows the caller holds (leased or acknowledged by it, or held by its DP round ``dp_group_id``),
        behind the rows ready now; rows it does not hold (another round's, after its own round's lease expired), or
        names twice, are ignored. A row delivered ``max_deliveries`` times is dead-lettered instead."""
        part, rows, mine, ours = self.held_rows(uid, task_name, indexes, owner, "release", dp_group_id)
        task = part.task(task_name)
        state = task.consumption[rows]
        rows = rows[((state == LEASED) | (state == CONSUMED)) & (mine | ours)]
        leased = rows[task.consumption[rows] == LEASED]
        lease_ids = task.lease[leased]
        self.leases.settled(lease_ids)
        if self.leases.changed is not None:  # a DP round's lease still live is journaled again: its released ranks
            self.leases.changed.update(i for i in np.unique(lease_ids).tolist() if i in self.leases.leases)
        worn = rows[task.deliveries[rows] >= self.max_deliveries(task_name)]
        if len(worn):
            part.give_back(task_name, worn, "released", self.max_deliveries(task_name))
        part.release(task_name, rows)
        mark_released(part, task_name, rows)
        self.rows_back(part.key, task_name)


def _not_leased_message(
    part: PartitionState,
    task_name: str,
    rows: np.ndarray,
    state: np.ndarray,
    mine: np.ndarray,
    by_round: np.ndarray,
    what: str = "ack",
) -> str:
    index = rows + part.base_index
    why = {
        "leased to another client": index[(state == LEASED) & ~mine & ~by_round],
        "leased to another DP round": index[(state == LEASED) & ~mine & by_round],
        "already acknowledged": index[state == CONSUMED],
        "not leased (never handed out, or handed back: lease expired, client gone, released)": index[
            state == AVAILABLE
        ],
        "dead-lettered": index[state == DEAD],
    }
    detail = "; ".join(f"{what}: {idx[:20].tolist()}" for what, idx in why.items() if len(idx))
    return (
        f"{what} of {len(rows)} rows of task {task_name!r} in {part.name} that this client does not hold "
        f"(global indexes {index[:20].tolist()}): {detail}"
    )
