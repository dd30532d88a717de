"""The ledger under contention and crashes, on SQLite (WAL) and a real PostgreSQL started here on 127.0.0.1.

    PYTHONPATH=. .venv/bin/python benchmarks/ledger_claims.py [--tasks 2000] [--processes 8] [--reps 3]

Per backend and repetition: ``--tasks`` tasks (two epochs) claimed, recorded and completed by ``--processes``
processes released together (each task: 3 transactions); every task must be claimed exactly once per epoch. Then a
worker holding a 1 s lease with heartbeats is SIGKILLed: the seconds until its task is re-dispatched. Prints medians
(and the load average: on a shared machine the figures move with it) and writes them as JSON lines to
``benchmarks/results/ledger-<timestamp>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.workers.ledger.claimers import claim_all, claim_and_hang  # noqa: E402
from tests.integration.workers.ledger.pg import PostgresServer, postgres_bin  # noqa: E402
from workers.ledger import Ledger, Task  # noqa: E402

CTX = multiprocessing.get_context("spawn")


def contention(url: str, tasks: int, processes: int, out_dir: Path) -> float:
    ledger = Ledger(url)
    ledger.reset()
    for epoch in range(2):
        ledger.write_epoch("train", epoch, [Task(id=str(i)) for i in range(tasks // 2)], owner="bench")
    start = CTX.Event()
    procs = [
        # a lease far longer than the run: a task claimed twice here would be a bug, not a re-dispatch
        CTX.Process(
            target=claim_all, args=(url, "train", f"w{i}", start, str(out_dir / f"w{i}.json")), kwargs={"lease_s": 3600}
        )
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    time.sleep(3)  # imports done before the clock starts
    began = time.perf_counter()
    start.set()
    for p in procs:
        p.join()
    seconds = time.perf_counter() - began
    rows = [row for i in range(processes) for row in json.loads((out_dir / f"w{i}.json").read_text())["claimed"]]
    claimed = Counter((task_id, epoch) for _, task_id, epoch, _ in rows)
    if len(claimed) != tasks or set(claimed.values()) != {1}:
        twice = [row for row in rows if claimed[(row[1], row[2])] > 1]
        raise AssertionError(
            f"{url}: {len(claimed)} distinct tasks claimed, counts {Counter(claimed.values())}: {twice}"
        )
    ledger.close()
    return seconds


def redispatch_after_kill(url: str, out_dir: Path, lease_s: float = 1.0) -> float:
    ledger = Ledger(url)
    ledger.reset()
    ledger.write_epoch("train", 0, [Task(id="only")], owner="bench")
    marker = out_dir / "doomed.json"
    marker.unlink(missing_ok=True)
    doomed = CTX.Process(target=claim_and_hang, args=(url, "train", str(marker), lease_s, 0.2))
    doomed.start()
    while not marker.exists():
        time.sleep(0.01)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join()
    killed = time.monotonic()
    while ledger.claim("train", owner="rescuer", lease_s=30) is None:
        time.sleep(0.01)
    seconds = time.monotonic() - killed
    ledger.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ledger-bench-"))
    server = None
    results = []
    try:
        for backend in args.backends:
            if backend == "postgresql":
                bindir = postgres_bin()
                if bindir is None:
                    print("postgresql: skipped (no server binaries under /usr/lib/postgresql)")
                    continue
                server = PostgresServer(bindir)
                server.start()
                url = server.create_database()
            else:
                url = f"sqlite:///{work}/ledger.db"
            times, kills = [], []
            for rep in range(args.reps):
                times.append(contention(url, args.tasks, args.processes, work))
                kills.append(redispatch_after_kill(url, work))
                print(f"{backend} rep {rep}: {times[-1]:.2f} s, re-dispatch {kills[-1]:.2f} s", flush=True)
            row = {
                "backend": backend,
                "tasks": args.tasks,
                "processes": args.processes,
                "reps": args.reps,
                "median_s": statistics.median(times),
                "median_tasks_per_s": args.tasks / statistics.median(times),
                "redispatch_median_s": statistics.median(kills),
                "lease_s": 1.0,
                "loadavg_1m": os.getloadavg()[0],
            }
            results.append(row)
            print(
                f"{backend}: {args.processes} processes, {args.tasks} tasks claimed+recorded+completed once each: "
                f"median {row['median_s']:.2f} s ({row['median_tasks_per_s']:.0f} tasks/s); SIGKILLed worker's task "
                f"re-dispatched after a median {row['redispatch_median_s']:.2f} s (lease 1 s); "
                f"load {row['loadavg_1m']:.1f}"
            )
    finally:
        if server is not None:
            server.destroy()
    out = ROOT / "benchmarks" / "results" / f"ledger-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in results))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
