"""What the queue's logic reports as it runs: the event sink the bookkeeping calls (``QueueState.events``).

The controller's metrics (:mod:`transfer_queue.ops.metrics`) read these counters at scrape time as
``transfer_queue_lease_expiries_total`` and ``transfer_queue_redeliveries_total``; the bookkeeping never imports
the metrics.

Per-task counters are bounded: a task name that no live partition follows any more is forgotten when a partition
is cleared, except the :data:`IDLE_TASK_SERIES` most recently counted such names (so a stage that reads one step at
a time keeps its series between steps, and a run with a new task name per step keeps a bounded number).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

IDLE_TASK_SERIES = 32  # per-task counter names no live partition follows, kept (the most recently counted)


def count(counter: Counter[str], task_name: str, n: int = 1) -> None:
    """``counter[task_name] += n``, moving the name to the end (the most recently counted)."""
    counter[task_name] = counter.pop(task_name, 0) + n


class QueueEvents:
    """Counters of events inside the queue's logic that a status query cannot recount later (by task name)."""

    def __init__(self) -> None:
        self.lease_expiries: Counter[str] = Counter()
        self.redeliveries: Counter[str] = Counter()
        self.task_counters: list[Counter[str]] = [self.lease_expiries, self.redeliveries]  # pruned together

    def lease_expired(self, task_name: str, rows: int = 1) -> None:
        """Leased rows of ``task_name`` went back to ready because their deadline passed or their client left."""
        count(self.lease_expiries, task_name, rows)

    def redelivered(self, task_name: str, rows: int = 1) -> None:
        """Rows of ``task_name`` were handed out again after an expiry or a release."""
        count(self.redeliveries, task_name, rows)

    def track(self, *counters: Counter[str]) -> None:
        """Prune ``counters`` (per task name, updated with :func:`count`) with these (the controller's get counters)."""
        self.task_counters.extend(counters)

    def forget_idle(self, followed: Iterable[str]) -> None:
        """Forget the per-task counts of names no live partition follows, but the latest :data:`IDLE_TASK_SERIES`."""
        live = set(followed)
        for counter in self.task_counters:
            idle = [name for name in counter if name not in live]
            for name in idle[: max(0, len(idle) - IDLE_TASK_SERIES)]:
                del counter[name]
