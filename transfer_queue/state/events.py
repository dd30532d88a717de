"""What the queue's logic reports as it runs: the event sink the bookkeeping calls (``QueueState.events``).

The controller's metrics (:mod:`transfer_queue.ops.metrics`) read these counters at scrape time as
``transfer_queue_lease_expiries_total`` and ``transfer_queue_redeliveries_total``; the bookkeeping never imports
the metrics.
"""

from __future__ import annotations

from collections import Counter


class QueueEvents:
    """Counters of events inside the queue's logic that a status query cannot recount later (by task name)."""

    def __init__(self) -> None:
        self.lease_expiries: Counter[str] = Counter()
        self.redeliveries: Counter[str] = Counter()

    def lease_expired(self, task_name: str, rows: int = 1) -> None:
        """Leased rows of ``task_name`` went back to ready because their deadline passed or their client left."""
        self.lease_expiries[task_name] += rows

    def redelivered(self, task_name: str, rows: int = 1) -> None:
        """Rows of ``task_name`` were handed out again after an expiry or a release."""
        self.redeliveries[task_name] += rows
