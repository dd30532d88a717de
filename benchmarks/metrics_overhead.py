"""What recording metrics costs the controller per request, in process (no Ray, no sockets).

The controller's hot path is ``RequestTable.handle`` plus encoding the reply; the metrics hook adds a
``perf_counter`` and ``ControllerMetrics.answered`` (a bisect and a few counter increments) per request. This times
both, interleaved call by call (a b b a a b ...) so that the load of a shared machine hits them alike; prints
medians:

    .venv/bin/python benchmarks/metrics_overhead.py [--reps 21] [--calls 1000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from transfer_queue.config import QueueConfig
from transfer_queue.controller.requests import RequestTable
from transfer_queue.metadata import FieldSchema
from transfer_queue.ops.metrics import ControllerMetrics
from transfer_queue.state.queue_state import QueueState
from transfer_queue.wire import protocol as p

ROWS = 100_000
BATCH = 32


def fresh_state() -> RequestTable:
    state = RequestTable(QueueState(QueueConfig(global_batch_size=BATCH, num_global_batch=1), None))
    out: list[Any] = []
    schema = {"x": FieldSchema("dense", "int8", ())}
    reserve = p.Reserve("bench", ROWS, schema, ROWS, None, None, None, None, None, 30.0)
    state.handle(reserve, lambda v, e: out.append(v))
    state.handle(p.Commit(out[0].put_id), lambda v, e: out.append(v))
    return state


def paired_calls_us(state: RequestTable, calls: int) -> tuple[float, float]:
    """Mean us per get_meta without and with the hook, the two interleaved call by call (tasks ``a`` and ``b``)."""
    metrics = ControllerMetrics()
    requests = {task: p.GetMeta("bench", ["x"], BATCH, task, None, False, 30.0) for task in ("a", "b")}
    totals = {"a": 0.0, "b": 0.0}
    sink: list[bytes] = []
    for i in range(2 * calls):
        task = "ab"[(i + i // 2) % 2]  # a b b a a b b a ...: neither goes first more often
        request, hooked = requests[task], task == "b"
        started = time.perf_counter()

        def respond(
            value: Any,
            error: BaseException | None,
            started: float = started,
            hooked: bool = hooked,
            request: Any = request,
        ) -> None:
            if hooked:
                metrics.answered("get_meta", started, request, value, error)
            sink.append(p.encode(value))

        state.handle(request, respond)
        totals[task] += time.perf_counter() - started
    return totals["a"] / calls * 1e6, totals["b"] / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    without, with_metrics = [], []
    for _ in range(args.reps):
        state = fresh_state()  # each rep reads fresh rows: 2 tasks x calls x 32 rows each < 100k per task
        for task in ("a", "b"):  # build both tasks' ready indexes before timing (a task's first call scans)
            state.handle(p.GetMeta("bench", ["x"], BATCH, task, None, False, 30.0), lambda v, e: None)
        a, b = paired_calls_us(state, args.calls)
        without.append(a)
        with_metrics.append(b)
    metrics = ControllerMetrics()
    request = p.GetMeta("bench", ["x"], BATCH, "t", None, False, 30.0)
    value = p.MetaWire("bench", 1, bytes(8 * BATCH), bytes(8 * BATCH), {}, b"", b"", "t", {})
    started = time.perf_counter()
    for _ in range(100_000):
        metrics.answered("get_meta", time.perf_counter(), request, value, None)
    alone = (time.perf_counter() - started) / 100_000 * 1e6
    a, b = statistics.median(without), statistics.median(with_metrics)
    paired = statistics.median(y - x for x, y in zip(without, with_metrics, strict=True))
    print(f"get_meta (batch {BATCH}, {ROWS} rows) RequestTable.handle + encode, median of {args.reps} reps:")
    print(f"  without metrics  {a:7.2f} us/call")
    print(f"  with metrics     {b:7.2f} us/call  ({b - a:+.2f} us, {100 * (b - a) / a:+.1f}%)")
    print(f"  median of the paired differences: {paired:+.2f} us/call")
    print(f"  the hook alone (perf_counter + ControllerMetrics.answered): {alone:.2f} us/call")


if __name__ == "__main__":
    main()
