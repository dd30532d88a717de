"""What parked get_meta calls cost the controller at 10k waiting clients (issue 23, "Scale"), in process (no Ray, no
sockets): a commit, a timer tick and every client's disconnect, with N waiters parked.

    PYTHONPATH=. .venv/bin/python benchmarks/waiters.py [--waiters 1000 --waiters 10000] [--commits 200] [--reps 3]

A queue of 4 live steps (``global_batch_size=256``, ``num_n_samples=4``: 1,024 rows each, their prompts committed)
and N parked get_metas, each from its own client (owner and connection), the way an RL run has them:

- 40% ``rollout`` for ``prompt_ids`` of steps 4..7, not opened yet (they wake when those steps are put);
- 30% ``reward`` for ``response_ids`` of a live step, 4 rows (one group);
- 15% ``train`` for ``response_ids`` + ``reward`` of a live step, 16 rows in whole groups;
- 5% ``train`` DP ranks (``dp_size=8``, 8 ranks per ``dp_group_id``, 4 rows each) of a live step;
- 10% ``eval`` for ``score`` of string partitions ``eval-0..15``, not opened yet.

Measured (medians):

- ``commit_ms``: controller time of one ``Commit`` (``RequestTable.handle``) of ``response_ids`` into one group of a
  live step: it can serve exactly one waiter (the ``reward`` waiter first in line on that step), which is then
  replaced by a new one (not timed), so N stays parked; ``evaluated`` is how many parked get_metas it re-evaluated;
- ``tick_ms``: one ``QueueState.tick`` with nothing due (a lease expiry, a put's or a waiter's deadline run one);
- ``disconnect_s``: every client's connection closing (``QueueState.on_disconnect``), one after the other, until no
  waiter is left; the median over ``--reps`` fresh queues.

Each run appends JSON lines (one per N) to ``benchmarks/results/waiters-<timestamp>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from transfer_queue.config import QueueConfig
from transfer_queue.controller.requests import RequestTable
from transfer_queue.metadata import FieldSchema
from transfer_queue.state.queue_state import QueueState
from transfer_queue.wire import protocol as p

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4  # live steps (the ring); waiters of steps 4..7 wait for steps not opened yet
GROUP = 4
BATCH = 256  # prompts per step: 1,024 rows
TOKEN = FieldSchema("dense", "int32", (8,))
SCALAR = FieldSchema("dense", "float32", ())
MIX = (("rollout", 0.40), ("reward", 0.30), ("train", 0.15), ("train-dp", 0.05), ("eval", 0.10))


class Bench:
    """A queue with N parked get_metas, each of its own client (owner ``c<i>``, connection ``i``)."""

    def __init__(self, waiters: int):
        config = QueueConfig(
            global_batch_size=BATCH, num_n_samples=GROUP, num_global_batch=STEPS, max_waiting_requests=4 * waiters
        )
        self.state = QueueState(config)
        self.table = RequestTable(self.state)
        self.answers: dict[int, Any] = {}  # client -> its answer (a meta or an error)
        self.evaluated = 0
        serve = self.state.reader.serve

        def counted(job: Any) -> Any:
            self.evaluated += 1
            return serve(job)

        self.state.reader.serve = counted  # type: ignore[method-assign]
        self.uid: dict[int, int] = {}
        for step in range(STEPS):
            reply = self.ok(p.Reserve(step, BATCH * GROUP, {"prompt_ids": TOKEN}, 32 * BATCH * GROUP))
            self.ok(p.Commit(reply.put_id))
            self.uid[step] = reply.partition_uid
        self.next_client = 0
        self.next_group = dict.fromkeys(range(STEPS), 0)
        counts = [int(share * waiters) for _, share in MIX]
        counts[0] += waiters - sum(counts)
        for (kind, _), count in zip(MIX, counts, strict=True):
            for i in range(count):
                self.park(kind, i)
        assert len(self.state.waiting) == waiters, (len(self.state.waiting), waiters)

    def ok(self, request: Any) -> Any:
        got: list[Any] = []
        self.table.handle(request, lambda value, error: got.append((value, error)))
        value, error = got[0]
        if error is not None:
            raise error
        return value

    def park(self, kind: str, i: int) -> int:
        """Park one get_meta of ``kind`` from a new client; returns the client."""
        client = self.next_client
        self.next_client += 1
        timeout = 300.0 + client % 300  # distinct deadlines, none due while measuring
        params = None
        if kind == "rollout":
            request = p.GetMeta(STEPS + i % STEPS, ["prompt_ids"], GROUP, "rollout", None, True, timeout)
        elif kind == "reward":
            request = p.GetMeta(i % STEPS, ["response_ids"], GROUP, "reward", None, False, timeout)
        elif kind == "train":
            request = p.GetMeta(i % STEPS, ["response_ids", "reward"], 4 * GROUP, "train", None, True, timeout)
        elif kind == "train-dp":
            params = {"dp_size": 8, "dp_rank": i % 8, "dp_group_id": f"train/{i // 8}"}
            request = p.GetMeta((i // 8) % STEPS, ["response_ids", "reward"], GROUP, "train", params, True, timeout)
        else:
            request = p.GetMeta(f"eval-{i % 16}", ["score"], 1, "eval", None, False, timeout)
        request.owner, request.call_id = f"c{client}", 1

        def respond(value: Any, error: BaseException | None) -> None:
            self.answers[client] = error if error is not None else value

        self.table.handle(request, respond, client)
        assert client not in self.answers, f"a {kind} get_meta was answered at once: {self.answers[client]}"
        return client

    def commit_responses(self, step: int) -> tuple[float, int]:
        """Commit ``response_ids`` into the next group of ``step``: (controller seconds, waiters evaluated)."""
        group = self.next_group[step]
        self.next_group[step] += 1
        rows = np.arange(group * GROUP, (group + 1) * GROUP, dtype=np.int64) + step * BATCH * GROUP
        request = p.Reserve(
            step, GROUP, {"response_ids": TOKEN}, 32 * GROUP, None, self.uid[step], p.pack_indexes(rows)
        )
        put_id = self.ok(request).put_id
        answered, evaluated = len(self.answers), self.evaluated
        started = time.perf_counter()
        self.ok(p.Commit(put_id))
        seconds = time.perf_counter() - started
        assert len(self.answers) == answered + 1, "the commit should serve exactly one reward waiter"
        return seconds, self.evaluated - evaluated

    def tick(self) -> float:
        started = time.perf_counter()
        self.state.tick()
        return time.perf_counter() - started

    def disconnect_all(self) -> float:
        """Every client's connection closes; returns the seconds it took."""
        clients = range(self.next_client)
        started = time.perf_counter()
        for client in clients:
            self.state.on_disconnect(client)
        seconds = time.perf_counter() - started
        assert len(self.state.waiting) == 0, len(self.state.waiting)
        return seconds


def measure(waiters: int, commits: int, reps: int) -> dict[str, Any]:
    bench = Bench(waiters)
    commit_s, evaluated = [], []
    for k in range(commits):
        seconds, count = bench.commit_responses(k % STEPS)
        commit_s.append(seconds)
        evaluated.append(count)
        bench.park("reward", k)  # the waiter served is replaced: N stay parked
    ticks = [bench.tick() for _ in range(20)]
    disconnects = [bench.disconnect_all()]
    for _ in range(reps - 1):
        disconnects.append(Bench(waiters).disconnect_all())
    return {
        "waiters": waiters,
        "commits": commits,
        "commit_ms": 1e3 * statistics.median(commit_s),
        "commit_ms_p90": 1e3 * float(np.percentile(commit_s, 90)),
        "evaluated_per_commit": statistics.median(evaluated),
        "tick_ms": 1e3 * statistics.median(ticks),
        "disconnect_s": statistics.median(disconnects),
        "disconnect_s_all": disconnects,
        "reps": reps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", type=int, action="append", help="parked get_metas (repeatable); 1000, 10000")
    parser.add_argument("--commits", type=int, default=200, help="commits timed per N")
    parser.add_argument("--reps", type=int, default=3, help="queues whose clients all disconnect, per N")
    parser.add_argument("--label", help="what code is measured (default: this checkout's commit)")
    args = parser.parse_args()
    git = ["git", "rev-parse", "--short", "HEAD"]
    label = args.label or subprocess.run(git, capture_output=True, text=True, cwd=ROOT).stdout.strip()
    rows = []
    for waiters in args.waiters or [1000, 10000]:
        row = {**measure(waiters, args.commits, args.reps), "code": label, "loadavg_1m": os.getloadavg()[0]}
        rows.append(row)
        print(
            f"{waiters:>6} waiters: commit {row['commit_ms']:7.3f} ms (p90 {row['commit_ms_p90']:.3f}, "
            f"{row['evaluated_per_commit']:.0f} waiters evaluated), tick {row['tick_ms']:7.3f} ms, "
            f"all disconnect {row['disconnect_s']:7.3f} s, load {row['loadavg_1m']:.1f}",
            flush=True,
        )
    if len(rows) > 1:
        small, large = rows[0], rows[-1]
        scale = large["waiters"] / small["waiters"]
        print(
            f"x{scale:g} waiters: commit x{large['commit_ms'] / small['commit_ms']:.2f}, "
            f"disconnect-all x{large['disconnect_s'] / small['disconnect_s']:.2f} (linear: x{scale:g})"
        )
    out = ROOT / "benchmarks" / "results" / f"waiters-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"results: {out}")


if __name__ == "__main__":
    main()
