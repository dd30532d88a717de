"""What a ``get_meta`` through a user sampler costs the controller on a large, mostly consumed partition (issue 23,
"Scale"), in process (no Ray, no sockets):

    PYTHONPATH=. .venv/bin/python benchmarks/user_sampler.py [--rows 1000000] [--ready 4096] [--calls 5] [--reps 3]
        [--sampler NAME ...] [--label before]

Builds one string partition of ``--rows`` rows of a tiny int8 field (10k-row puts through the controller's
``RequestTable``); for each task below, every row but the last ``--ready`` is consumed (``PartitionState.consume``)
and one untimed ``get_meta`` builds the task's ready index. Then times ``RequestTable.handle(GetMeta)`` with
``batch_size=32`` (``--calls`` calls per repetition, the median of each repetition, the median of ``--reps``):

- ``fast-path``: the built-in ``SequentialSampler`` (its ``select`` reads the incremental ready index);
- ``user-sample``: docs/samplers.md's ``NewestFirst`` (overrides ``sample`` only);
- ``user-filter``: docs/samplers.md's ``OnlyEvenRows`` (a numpy ``filter_ready_indices`` and ``sample``);
- ``seed-guide``: the upstream sampler guide's custom sampler with its blanks filled in (the ``NewestFirstSampler`` of
  tests/integration/transfer_queue/samplers/test_sampler_guide.py: a torch mask and a list comprehension over
  ``all_indices``);
- ``user-filter-ready-rows``, ``seed-guide-ready-rows``: the same two with ``ready_rows_only = True`` (their
  ``filter_ready_indices`` is handed the task's ready rows only; a class attribute the code before it ignores).

Prints the medians and their ratio to the fast path, and writes them as JSON lines to
``benchmarks/results/user-sampler-<timestamp>[-<label>].jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from transfer_queue.config import QueueConfig
from transfer_queue.controller.requests import RequestTable
from transfer_queue.metadata import FieldSchema
from transfer_queue.samplers import BaseSampler, SequentialSampler
from transfer_queue.state.queue_state import QueueState
from transfer_queue.wire import protocol as p

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"t": FieldSchema("dense", "int8", ())}
BATCH = 32


class NewestFirst(BaseSampler):  # docs/samplers.md, "Writing your own"
    def sample(self, ready_indices, batch_size, **kwargs):
        return sorted(ready_indices, reverse=True)[:batch_size]


class OnlyEvenRows(BaseSampler):  # docs/samplers.md, "Writing your own"
    def filter_ready_indices(
        self, all_indices, production_status, consumption_status, data_fields, field_mapping, **kwargs
    ):
        cols = [field_mapping[f] for f in data_fields]
        ready = production_status[:, cols].all(axis=1) & ~consumption_status & (all_indices % 2 == 0)
        return all_indices[ready]

    def sample(self, ready_indices, batch_size, **kwargs):
        return list(ready_indices[:batch_size])


class SeedGuideSampler(BaseSampler):  # the upstream guide's snippet, blanks filled in (test_sampler_guide.py)
    def sample(self, ready_indices, batch_size, **kwargs):
        return sorted(ready_indices, reverse=True)[:batch_size]

    def filter_ready_indices(
        self, all_indices, production_status, consumption_status, data_fields, field_mapping, **kwargs
    ):
        ready_mask = ~torch.as_tensor(consumption_status, dtype=torch.bool)
        for name in data_fields:
            ready_mask &= torch.as_tensor(production_status[:, field_mapping[name]], dtype=torch.bool)
        return [all_indices[i] for i in range(len(all_indices)) if ready_mask[i]]


class OnlyEvenReadyRows(OnlyEvenRows):
    ready_rows_only = True  # filter_ready_indices is handed the task's ready rows, not the whole table


class SeedGuideReadyRows(SeedGuideSampler):
    ready_rows_only = True


SAMPLERS: dict[str, type[BaseSampler]] = {
    "fast-path": SequentialSampler,
    "user-sample": NewestFirst,
    "user-filter": OnlyEvenRows,
    "user-filter-ready-rows": OnlyEvenReadyRows,
    "seed-guide": SeedGuideSampler,
    "seed-guide-ready-rows": SeedGuideReadyRows,
}


class Controller:
    """A QueueState in this process, fed requests through the controller's request table."""

    def __init__(self, rows: int):
        self.state = QueueState(QueueConfig(global_batch_size=64, num_global_batch=1))
        self.table = RequestTable(self.state)
        self.last: Any = None
        for start in range(0, rows, 10_000):
            n = min(10_000, rows - start)
            self.handle(p.Reserve("part", n, SCHEMA, n))
            self.handle(p.Commit(self.last.put_id))

    def _respond(self, value: Any, error: BaseException | None) -> None:
        if error is not None:
            raise error
        self.last = value

    def handle(self, request: Any) -> Any:
        self.last = None
        self.table.handle(request, self._respond)
        if self.last is None:
            raise RuntimeError(f"{type(request).__name__} was not answered at once")
        return self.last


def measure(rows: int, ready: int, calls: int, reps: int, names: list[str]) -> list[dict[str, Any]]:
    ctl = Controller(rows)
    part = ctl.state.partitions["part"]
    results = []
    for name in names:
        ctl.state.register_sampler(name, SAMPLERS[name]())
        part.consume(name, np.arange(rows - ready, dtype=np.int64))  # all but the last `ready` rows
        request = p.GetMeta("part", ["t"], BATCH, name, None, False, 60.0)
        ctl.handle(request)  # untimed: builds the task's ready index (one scan)
        per_rep = []
        for _ in range(reps):
            seconds = []
            for _ in range(calls):
                started = time.perf_counter()
                meta = ctl.handle(request)
                seconds.append(time.perf_counter() - started)
                if len(meta.to_meta()) != BATCH:
                    raise RuntimeError(f"{name}: get_meta served {len(meta.to_meta())} rows, not {BATCH}")
            per_rep.append(1000 * statistics.median(seconds))
        results.append(
            {
                "sampler": name,
                "rows": rows,
                "ready": ready,
                "batch_size": BATCH,
                "calls": calls,
                "reps": reps,
                "median_ms": statistics.median(per_rep),
                "reps_ms": per_rep,
                "loadavg_1m": os.getloadavg()[0],
            }
        )
        print(f"{name:>22}: {results[-1]['median_ms']:10.2f} ms per get_meta (reps {per_rep})", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--ready", type=int, default=4096, help="rows left unconsumed for each task")
    parser.add_argument("--calls", type=int, default=5, help="get_metas per repetition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sampler", action="append", choices=list(SAMPLERS), help="(repeatable) default: all")
    parser.add_argument("--label", default="", help="kept in every result line and in the file name (e.g. before)")
    args = parser.parse_args()
    if args.ready < 2 * BATCH * (1 + args.calls * args.reps):  # OnlyEvenRows serves half of them
        parser.error(f"--ready must be at least {2 * BATCH * (1 + args.calls * args.reps)} for these --calls/--reps")
    results = measure(args.rows, args.ready, args.calls, args.reps, args.sampler or list(SAMPLERS))
    fast = next((r["median_ms"] for r in results if r["sampler"] == "fast-path"), None)
    for r in results:
        r["ratio_to_fast_path"] = None if not fast else r["median_ms"] / fast
        r["label"] = args.label
    if fast:
        print("ratio to the fast path: " + ", ".join(f"{r['sampler']} {r['ratio_to_fast_path']:.1f}" for r in results))
    out = (
        ROOT
        / "benchmarks"
        / "results"
        / f"user-sampler-{time.strftime('%Y%m%d-%H%M%S')}{'-' * bool(args.label)}{args.label}.jsonl"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in results))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
