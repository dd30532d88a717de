"""QueueClock: what a worker's queue calls cost, apart from the time it waited for upstream stages."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from transfer_queue import BatchMeta

T = TypeVar("T")


class QueueClock:
    """Charges each queue call's wall time and CPU time. A ``get_meta`` that was parked until rows were produced
    reports how long (``meta.extra["wait_s"]``): that is the pipeline waiting, not the queue working, so it is
    counted apart.

    >>> clock = QueueClock()
    >>> meta = clock.call(client.get_meta, ["prompt_ids"], 8, global_step=0)  # doctest: +SKIP
    >>> clock.stats()  # doctest: +SKIP
    {'queue_s': 0.0004, 'queue_cpu_s': 0.0003, 'wait_s': 0.0}
    """

    def __init__(self) -> None:
        self.queue_s = 0.0
        self.queue_cpu_s = 0.0
        self.wait_s = 0.0

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        started, cpu = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        waited = out.extra.get("wait_s", 0.0) if isinstance(out, BatchMeta) else 0.0
        self.wait_s += waited
        self.queue_s += time.perf_counter() - started - waited
        self.queue_cpu_s += time.thread_time() - cpu
        return out

    def stats(self) -> dict[str, float]:
        return {"queue_s": self.queue_s, "queue_cpu_s": self.queue_cpu_s, "wait_s": self.wait_s}
