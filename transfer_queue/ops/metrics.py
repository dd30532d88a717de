"""Prometheus metrics of the controller and the storage units.

Recording is plain Python on the serving thread (a counter increment and a bisect per request, under the lock the
server holds anyway); ``prometheus_client`` runs only when a scrape arrives, in the HTTP thread, through a collector
that copies what it needs under that lock. So the hot path pays no lock of its own and no label lookup.

Every name starts with ``transfer_queue_``; labels stay bounded: request kinds, error types and storage units are
finite sets; per-task counters forget a task name no live partition follows (but the most recent few, see
:mod:`transfer_queue.state.events`); partitions appear only as live/closed counts (never one series per partition).

:class:`QueueEvents` is the hook for the queue's own logic (``QueueState.events``): the lease code calls
``events.lease_expired(task, rows)`` and ``events.redelivered(task, rows)``; the counters show up as
``transfer_queue_lease_expiries_total`` and ``transfer_queue_redeliveries_total``.
"""

from __future__ import annotations

import re
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from transfer_queue.state.events import QueueEvents
from transfer_queue.state.events import count as count_task

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RECENT_ERRORS = 20
ROW_STATES = ("ready", "leased", "acknowledged", "dead_lettered")


class Histogram:
    """Fixed buckets, no lock of its own (its owner's lock guards it)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, count of observations <= le), ..., ("+Inf", total)]``: Prometheus's bucket form."""
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


class RequestLog:
    """A server's requests by kind: counts, latency histograms, errors by type and the last few errors."""

    def __init__(self) -> None:
        self.latency: dict[str, Histogram] = {}
        self.errors: Counter[tuple[str, str]] = Counter()
        self.recent_errors: deque[dict[str, Any]] = deque(maxlen=RECENT_ERRORS)

    def record(self, kind: str, seconds: float, error: BaseException | None = None) -> None:
        hist = self.latency.get(kind)
        if hist is None:
            hist = self.latency[kind] = Histogram(LATENCY_BUCKETS)
        hist.observe(seconds)
        if error is not None:
            self.record_error(kind, error)

    def record_error(self, kind: str, error: BaseException) -> None:
        name = type(error).__name__
        self.errors[(kind, name)] += 1
        self.recent_errors.append({"time": time.time(), "kind": kind, "type": name, "message": str(error)[:500]})

    def request_counts(self) -> dict[str, int]:
        return {kind: hist.count for kind, hist in self.latency.items()}

    def errors_by_type(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for (_, name), count in self.errors.items():
            out[name] += count
        return dict(out)


class ControllerMetrics(RequestLog):
    """What the controller records per request; the rest of its metrics is read from the queue's state."""

    def __init__(self) -> None:
        super().__init__()
        self.get_meta_wait = Histogram(WAIT_BUCKETS)
        self.puts = 0
        self.put_rows = 0
        self.gets: Counter[str] = Counter()  # by task
        self.get_rows: Counter[str] = Counter()

    def answered(self, kind: str, started: float, request: Any, value: Any, error: BaseException | None) -> None:
        """A request was answered (at once, or after waiting: then its wait counts too)."""
        seconds = time.perf_counter() - started
        self.record(kind, seconds, error)
        if error is not None or value is None:
            return
        if kind == "commit":
            self.puts += 1
            self.put_rows += len(value.global_indexes) // 8  # packed int64
        elif kind == "get_meta":
            task = request.task_name
            count_task(self.gets, task)
            count_task(self.get_rows, task, len(value.global_indexes) // 8)
            if "wait_s" in value.extra:
                self.get_meta_wait.observe(seconds)


class StorageMetrics(RequestLog):
    """What a storage unit records per request: latency by kind, errors, payload bytes in (writes) and out (reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_in = 0
        self.bytes_out = 0


def nbytes(buffers: Iterable[Any]) -> int:
    """Bytes in ``buffers`` (numpy arrays, tensors, memoryviews, bytes, ZeroMQ frames)."""
    total = 0
    for buffer in buffers:
        size = getattr(buffer, "nbytes", None)
        total += size if isinstance(size, int) else memoryview(buffer).nbytes
    return total


# ---- the prometheus side (scrape time only) -------------------------------------------------------------------
def _request_families(component: str, log: RequestLog, extra: dict[str, str]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    keys = ["component", *extra, "kind"]
    hist = HistogramMetricFamily(
        "transfer_queue_request_seconds", "Time from a request's arrival to its answer, by kind", labels=keys
    )
    total = CounterMetricFamily("transfer_queue_requests", "Requests answered, by kind", labels=keys)
    for kind, h in sorted(log.latency.items()):
        values = [component, *extra.values(), kind]
        hist.add_metric(values, h.cumulative(), h.sum)
        total.add_metric(values, h.count)
    errors = CounterMetricFamily(
        "transfer_queue_errors", "Requests answered with an error, by kind and error type", labels=[*keys, "type"]
    )
    for (kind, name), count in sorted(log.errors.items()):
        errors.add_metric([component, *extra.values(), kind, name], count)
    yield from (hist, total, errors)


def _gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    g = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    g.add_metric(list((labels or {}).values()), value)
    return g


def _counter(name: str, doc: str, by: str, values: Mapping[str, float]) -> Any:
    from prometheus_client.core import CounterMetricFamily

    c = CounterMetricFamily(name, doc, labels=[by])
    for key, value in sorted(values.items()):
        c.add_metric([key], value)
    return c


def rl_metric_name(key: str) -> str:
    """``transfer_queue_rl_<key>`` with the key made a valid Prometheus name."""
    return "transfer_queue_rl_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def controller_families(summary: dict[str, Any], metrics: ControllerMetrics, events: QueueEvents) -> Iterator[Any]:
    """The controller's metric families from a status summary (``transfer_queue.ops.status.queue_summary``) and the
    request metrics; both were copied under the controller's lock."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    rows = GaugeMetricFamily(
        "transfer_queue_rows", "Committed rows of live partitions by delivery state, per task", labels=["task", "state"]
    )
    for task, counts in sorted(summary["tasks"].items()):
        for state in ROW_STATES:
            rows.add_metric([task, state], counts[state])
    yield rows
    parts = GaugeMetricFamily("transfer_queue_partitions", "Live partitions, open or closed", labels=["state"])
    parts.add_metric(["live"], summary["partitions_live"])
    parts.add_metric(["closed"], summary["partitions_closed"])
    yield parts
    yield _gauge("transfer_queue_rows_committed", "Committed rows in live partitions", summary["rows_committed"])
    yield _gauge("transfer_queue_rows_in_flight", "Rows reserved by puts not committed yet", summary["rows_in_flight"])
    yield _gauge("transfer_queue_open_puts", "Puts between reserve and commit", summary["open_puts"])
    yield _gauge("transfer_queue_get_meta_waiting", "get_meta requests waiting for rows", summary["waiting_get_meta"])
    yield _gauge("transfer_queue_puts_waiting", "Puts waiting for room in the queue", summary["waiting_puts"])
    yield _gauge("transfer_queue_clients_connected", "Client connections to the controller", summary["clients"])
    storage = summary["storage"]
    yield _gauge("transfer_queue_bytes_held", "Payload bytes held or reserved in the queue", storage["bytes_held"])
    yield _gauge("transfer_queue_bytes_budget", "Payload bytes the storage units may hold in all", storage["budget"])
    used = GaugeMetricFamily(
        "transfer_queue_storage_committed_bytes", "Committed payload bytes by storage unit", labels=["unit"]
    )
    budget = GaugeMetricFamily("transfer_queue_storage_budget_bytes", "Byte budget by storage unit", labels=["unit"])
    up = GaugeMetricFamily("transfer_queue_storage_unit_up", "1 if the controller reaches the unit", labels=["unit"])
    for unit in storage["units"]:
        label = [str(unit["unit"])]
        used.add_metric(label, unit["bytes"])
        budget.add_metric(label, unit["budget"])
        up.add_metric(label, 1 if unit["up"] else 0)
    yield from (used, budget, up)
    puts = CounterMetricFamily("transfer_queue_puts", "Puts committed")
    puts.add_metric([], metrics.puts)
    put_rows = CounterMetricFamily("transfer_queue_put_rows", "Rows committed by puts")
    put_rows.add_metric([], metrics.put_rows)
    yield from (puts, put_rows)
    yield _counter("transfer_queue_gets", "get_meta requests served, per task", "task", dict(metrics.gets))
    yield _counter("transfer_queue_get_rows", "Rows handed out by get_meta, per task", "task", dict(metrics.get_rows))
    wait = HistogramMetricFamily(
        "transfer_queue_get_meta_wait_seconds", "How long served get_meta requests waited for their rows"
    )
    wait.add_metric([], metrics.get_meta_wait.cumulative(), metrics.get_meta_wait.sum)
    yield wait
    expiries = events.lease_expiries
    yield _counter("transfer_queue_lease_expiries", "Leased rows back to ready at their deadline", "task", expiries)
    yield _counter("transfer_queue_redeliveries", "Rows handed out again", "task", events.redeliveries)
    yield from _request_families("controller", metrics, {})
    last = summary["run"]["last"]
    if last:
        for key, value in sorted(last.items()):
            yield _gauge(rl_metric_name(key), f"The RL run's {key} at its last step", value)


def storage_families(stats: dict[str, Any], metrics: StorageMetrics) -> Iterator[Any]:
    """A storage unit's metric families from its stats (``BlockStore.stats``) and request metrics."""
    from prometheus_client.core import CounterMetricFamily

    unit = {"unit": str(stats["unit"])}
    yield _gauge("transfer_queue_storage_bytes_used", "Payload bytes this storage unit holds", stats["bytes"], unit)
    yield _gauge("transfer_queue_storage_blocks", "Blocks this storage unit holds", stats["blocks"], unit)
    yield _gauge("transfer_queue_storage_rss_bytes", "Resident memory of this storage unit", stats["rss_bytes"], unit)
    shm = stats.get("shm")
    if shm is not None:  # QueueConfig.shared_memory
        yield _gauge("transfer_queue_storage_shm_bytes", "Shared-memory segments open (blocks, grants, free)",
                     shm["segment_bytes"], unit)  # fmt: skip
        yield _gauge("transfer_queue_storage_shm_free_bytes", "Shared-memory segments kept free for reuse",
                     shm["free_bytes"], unit)  # fmt: skip
    for name, doc, value in (
        ("transfer_queue_storage_bytes_in", "Payload bytes written to this unit", metrics.bytes_in),
        ("transfer_queue_storage_bytes_out", "Payload bytes read from this unit", metrics.bytes_out),
    ):
        c = CounterMetricFamily(name, doc, labels=["unit"])
        c.add_metric([unit["unit"]], value)
        yield c
    yield from _request_families("storage", metrics, unit)


class SnapshotCollector:
    """A prometheus_client collector that yields the families ``families()`` builds at each scrape."""

    def __init__(self, families: Callable[[], Iterable[Any]]):
        self._families = families

    def collect(self) -> Iterator[Any]:
        yield from self._families()

    def describe(self) -> list[Any]:
        return []  # unchecked collector: names are not known before the first scrape


def render(families: Callable[[], Iterable[Any]]) -> bytes:
    """The Prometheus text exposition of ``families()``."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(families))
    return generate_latest(registry)
