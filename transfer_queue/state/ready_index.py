"""Per task of a partition: the rows ready for it (:class:`ReadyIndex`, kept incrementally as puts commit and rows
are leased, acknowledged or handed back) and its per-row delivery arrays (:class:`TaskState`). Plain numpy."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

import numpy as np

# a row's delivery state for one task
AVAILABLE, LEASED, CONSUMED, DEAD = 0, 1, 2, 3  # CONSUMED: acknowledged
ACKNOWLEDGED = CONSUMED
NO_HOLDER = 0  # owner ids start at 1, so fresh (zeroed) rows have no holder


class ReadyIndex:
    """Rows of one partition ready for one task and one set of fields, in the order they became ready.

    Rows live in a numpy FIFO with lazy deletion: ``pos[row]`` is the queue position of the row's live entry (-1:
    not ready), an entry is live when its row's ``pos`` points back at it, and the queue is compacted once dead
    entries outnumber live ones, so reading the first ``k`` ready rows costs O(k) however many rows were consumed
    before. ``groups`` holds, in readiness order, the groups whose ``group_size`` members are all ready (compacted
    the same way). ``produced`` counts committed rows having every field of the set, consumed or not.
    """

    def __init__(self, mask: int, group_size: int):
        self.mask = mask
        self.group_size = group_size
        self.produced = 0
        self.num_rows = 0
        self.pos = np.full(64, -1, dtype=np.int64)
        self.queue = np.zeros(64, dtype=np.int64)
        self.head = 0
        self.tail = 0
        self.group_count: dict[int, int] = {}  # kept only when group_size > 1 (else rows are the groups)
        self.groups: dict[int, None] = {}
        self._groups_removed = 0

    def add(self, rows: np.ndarray, group_of: np.ndarray) -> None:
        """Mark ``rows`` (distinct local rows) ready; rows already ready are ignored."""
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return
        if rows.max() >= len(self.pos):
            grown = np.full(max(int(rows.max()) + 1, 2 * len(self.pos)), -1, dtype=np.int64)
            grown[: len(self.pos)] = self.pos
            self.pos = grown
        rows = rows[self.pos[rows] < 0]
        if not len(rows):
            return
        if self.tail + len(rows) > len(self.queue):
            self._compact(extra=len(rows))
        self.queue[self.tail : self.tail + len(rows)] = rows
        self.pos[rows] = np.arange(self.tail, self.tail + len(rows))
        self.tail += len(rows)
        self.num_rows += len(rows)
        if self.group_size > 1:
            ids, inverse, counts = np.unique(group_of[rows], return_inverse=True, return_counts=True)
            last = np.zeros(len(ids), dtype=np.int64)
            np.maximum.at(last, inverse, np.arange(len(rows)))
            for j in np.argsort(last, kind="stable").tolist():  # a group is complete once its last member is
                g = int(ids[j])
                count = self.group_count.get(g, 0) + int(counts[j])
                self.group_count[g] = count
                if count == self.group_size:
                    self.groups[g] = None

    def remove(self, rows: np.ndarray, group_of: np.ndarray) -> None:
        """Rows are no longer ready (consumed, or forgotten); rows not in the index are ignored."""
        rows = np.asarray(rows, dtype=np.int64)
        rows = rows[(rows >= 0) & (rows < len(self.pos))]
        rows = rows[self.pos[rows] >= 0]
        if not len(rows):
            return
        self.pos[rows] = -1
        self.num_rows -= len(rows)
        if self.group_size > 1:
            for g, c in zip(*np.unique(group_of[rows], return_counts=True), strict=True):
                count = self.group_count[int(g)]
                if count == self.group_size:
                    del self.groups[int(g)]
                    self._groups_removed += 1
                if count == int(c):
                    del self.group_count[int(g)]
                else:
                    self.group_count[int(g)] = count - int(c)
            if self._groups_removed > len(self.groups) + 1024:
                self.groups = dict(self.groups)  # drop the dict's tombstones, which slow iteration from the front
                self._groups_removed = 0
        if (self.tail - self.head) - self.num_rows > self.num_rows + 1024:
            self._compact()

    def add_front(self, rows: np.ndarray, group_of: np.ndarray) -> None:
        """Mark ``rows`` ready ahead of every row ready now (rows handed back by an expired or orphaned lease are
        first in line); their groups that become complete go ahead of the other complete groups."""
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return
        if rows.max() >= len(self.pos):
            grown = np.full(max(int(rows.max()) + 1, 2 * len(self.pos)), -1, dtype=np.int64)
            grown[: len(self.pos)] = self.pos
            self.pos = grown
        rows = rows[self.pos[rows] < 0]
        k = len(rows)
        if not k:
            return
        if self.head < k:  # make room in front of the live entries
            entries = self.queue[self.head : self.tail]
            live = entries[self.pos[entries] == np.arange(self.head, self.tail)]
            queue = np.zeros(max(64, 2 * (len(live) + k), len(self.queue)), dtype=np.int64)
            queue[k : k + len(live)] = live
            self.pos[live] = np.arange(k, k + len(live))
            self.queue, self.head, self.tail = queue, k, k + len(live)
        self.head -= k
        self.queue[self.head : self.head + k] = rows
        self.pos[rows] = np.arange(self.head, self.head + k)
        self.num_rows += k
        if self.group_size > 1:
            completed = []
            for g, c in zip(*np.unique(group_of[rows], return_counts=True), strict=True):
                count = self.group_count.get(int(g), 0) + int(c)
                self.group_count[int(g)] = count
                if count == self.group_size:
                    completed.append(int(g))
            if completed:
                self.groups = {**dict.fromkeys(completed), **self.groups}
                self._groups_removed = 0

    def _compact(self, extra: int = 0) -> None:
        entries = self.queue[self.head : self.tail]
        live = entries[self.pos[entries] == np.arange(self.head, self.tail)]
        size = max(64, 2 * (len(live) + extra))
        if size > len(self.queue) or size < len(self.queue) // 4:
            self.queue = np.zeros(size, dtype=np.int64)
        self.queue[: len(live)] = live
        self.pos[live] = np.arange(len(live))
        self.head, self.tail = 0, len(live)

    def first_rows(self, k: int) -> np.ndarray:
        """The first ``k`` ready rows (fewer if fewer are ready), oldest first."""
        stop = self.head + k
        if stop <= self.tail:  # the common case: the queue's head is all live
            head = self.queue[self.head : stop]
            if np.array_equal(self.pos[head], np.arange(self.head, stop)):
                return head.copy()
        picked, need, p = [], k, self.head
        while need > 0 and p < self.tail:
            stop = min(self.tail, p + max(2 * need, 64))
            chunk = self.queue[p:stop]
            live = self.pos[chunk] == np.arange(p, stop)
            if p == self.head:  # leading dead entries are skipped for good
                self.head += int(np.argmax(live)) if live.any() else len(chunk)
            taken = chunk[live][:need]
            picked.append(taken)
            need -= len(taken)
            p = stop
        return np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)

    def first_groups(self, k: int) -> list[int]:
        """The first ``k`` groups whose members are all ready, oldest first."""
        return list(islice(self.groups, k))

    @property
    def rows(self) -> list[int]:
        """Every ready row, oldest first (for inspection; O(ready rows))."""
        return self.first_rows(self.num_rows).tolist()


@dataclass
class TaskState:
    """One task's delivery state of a partition, per row: ``consumption`` (AVAILABLE / LEASED / CONSUMED, i.e.
    acknowledged / DEAD), ``lease`` (the id of the lease that holds or last held it, 0: none), ``holder`` (the
    owner id of that lease, NO_HOLDER: none), ``deliveries`` (times handed out); the dead letters (row -> last
    reason); and the ready indexes by field mask."""

    consumption: np.ndarray
    ready: dict[int, ReadyIndex] = field(default_factory=dict)
    lease: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    holder: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    deliveries: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    dead: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of_size(cls, rows: int) -> TaskState:
        return cls(
            np.zeros(rows, dtype=np.int8),
            lease=np.zeros(rows, dtype=np.int64),
            holder=np.zeros(rows, dtype=np.int32),
            deliveries=np.zeros(rows, dtype=np.int32),
        )

    def grow(self, rows: int) -> None:
        extra = rows - len(self.consumption)
        if extra > 0:
            self.consumption = np.concatenate([self.consumption, np.zeros(extra, dtype=np.int8)])
            self.lease = np.concatenate([self.lease, np.zeros(extra, dtype=np.int64)])
            self.holder = np.concatenate([self.holder, np.zeros(extra, dtype=np.int32)])
            self.deliveries = np.concatenate([self.deliveries, np.zeros(extra, dtype=np.int32)])
