"""What the whole-queue status summary costs the controller (issue 23 defect 10), in process (no Ray, no sockets).

Builds a queue of ``--partitions`` live string partitions of 16 rows, each followed by ``train`` and one of
``--tasks`` task names (so the queue knows that many names), then times ``queue_summary`` (what every ``/metrics``
scrape, ``/status.json`` poll and ``client.status()`` runs under the controller's lock) and measures its JSON:

    .venv/bin/python benchmarks/status_summary.py [--shape 500x200 --shape 2000x500] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from transfer_queue.config import QueueConfig
from transfer_queue.controller.requests import RequestTable
from transfer_queue.metadata import FieldSchema
from transfer_queue.ops.status import queue_summary
from transfer_queue.state.queue_state import QueueState
from transfer_queue.wire import protocol as p

ROWS = 16
SCHEMA = {"x": FieldSchema("dense", "int8", ())}


def build(partitions: int, tasks: int) -> QueueState:
    state = QueueState(QueueConfig(global_batch_size=ROWS, num_global_batch=1), None)
    table = RequestTable(state)
    out: list[Any] = []

    def respond(value: Any, error: BaseException | None) -> None:
        if error is not None:
            raise error
        out.append(value)

    for i in range(partitions):
        name = f"p{i}"
        table.handle(p.Reserve(name, ROWS, SCHEMA, ROWS, None, None, None, None, None, 30.0), respond)
        table.handle(p.Commit(out[-1].put_id), respond)
        for task in ("train", f"t{i % tasks}"):
            table.handle(p.GetMeta(name, ["x"], 4, task, None, False, 1.0), respond)
    return state


def measure(partitions: int, tasks: int, reps: int) -> dict[str, Any]:
    state = build(partitions, tasks)
    seconds = []
    for _ in range(reps):
        started = time.perf_counter()
        summary = queue_summary(state)
        seconds.append(time.perf_counter() - started)
    size = len(json.dumps(summary, default=str).encode())
    return {"shape": f"{partitions}x{tasks}", "summary_ms": 1000 * statistics.median(seconds), "json_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="PARTITIONSxTASKS (repeatable); default 500x200, 2000x500")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    for shape in args.shape or ["500x200", "2000x500"]:
        partitions, tasks = (int(n) for n in shape.split("x"))
        result = measure(partitions, tasks, args.reps)
        print(f"{result['shape']:>9}: summary {result['summary_ms']:8.1f} ms, JSON {result['json_bytes']:>10,} bytes")


if __name__ == "__main__":
    main()
