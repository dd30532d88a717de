"""The ledger under contention and crashes, and claims at scale, on SQLite (WAL) and a real PostgreSQL started here on
127.0.0.1.

    PYTHONPATH=. .venv/bin/python benchmarks/ledger_claims.py [--tasks 2000] [--processes 8] [--reps 3]
    PYTHONPATH=. .venv/bin/python benchmarks/ledger_claims.py --at-scale 100000 1000000 [--seconds 10] [--reps 3]

Per backend and repetition: ``--tasks`` tasks (two epochs) claimed, recorded and completed by ``--processes``
processes released together (each task: 3 transactions); every task must be claimed exactly once per epoch. Then a
worker holding a 1 s lease with heartbeats is SIGKILLed: the seconds until its task is re-dispatched. Prints medians
(and the load average: on a shared machine the figures move with it) and writes them as JSON lines to
``benchmarks/results/ledger-<timestamp>.jsonl``.

``--at-scale N ...`` measures instead, per table size N, backend and repetition: a ledger preloaded with N pending tasks
of one epoch (bulk ``INSERT ... SELECT`` over a generated series, then settled: SQLite's WAL checkpointed, PostgreSQL
vacuumed, analysed and checkpointed, as autovacuum and the checkpointer would), the scheduler's poll
(``SamplingScheduler.epoch_progress``, what it runs every 0.2 s; median of ``--polls`` calls), then ``--processes``
processes released together that claim (``Ledger.claim``, leases far longer than the run) as fast as they can for
``--seconds``: claims/s over all of them, the p50 claim latency, and the claims the database refused
(``LedgerUnavailable``: on SQLite, no write lock within the 60 s busy timeout). Every repetition reloads the table,
so each one starts from N pending tasks. Each claimed task is checked to be distinct. ``--batch K``: each call claims
K tasks (``Ledger.claim_many``); the p50 is then a call's.
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

from sqlalchemy import insert, text  # noqa: E402

from tests.integration.workers.ledger.claimers import claim_all, claim_and_hang  # noqa: E402
from tests.integration.workers.ledger.pg import PostgresServer, postgres_bin  # noqa: E402
from workers.ledger import (  # noqa: E402
    AsyncSampler,
    Ledger,
    LedgerUnavailable,
    SamplingConfig,
    SamplingScheduler,
    Task,
    schema,
)
from workers.ledger.models import task_type_name  # noqa: E402

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


TASK_COLUMNS = "task_id, split, epoch, type, payload, status, attempts, created_at, updated_at"
# N rows from a generated series in one statement: the preload of a million tasks takes seconds, not minutes
PRELOAD = {
    "sqlite": (
        f"INSERT INTO ledger_tasks ({TASK_COLUMNS}) WITH RECURSIVE seq(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM seq "
        "WHERE i + 1 < :n) SELECT CAST(i AS TEXT), :split, 0, :type, '{}', 'pending', 0, :now, :now FROM seq"
    ),
    "postgresql": (
        f"INSERT INTO ledger_tasks ({TASK_COLUMNS}) SELECT i::text, :split, 0, :type, '{{}}'::json, 'pending', 0, "
        ":now, :now FROM generate_series(0, :n - 1) AS i"
    ),
}


def preload(url: str, backend: str, tasks: int, split: str = "train") -> Ledger:
    """A fresh ledger holding ``tasks`` pending tasks of epoch 0 of ``split`` (as ``write_epoch`` writes them)."""
    ledger = Ledger(url)
    ledger.reset()
    now = time.time()
    with ledger._tx() as conn:
        conn.execute(
            insert(schema.epochs).values(split=split, epoch=0, num_tasks=tasks, written_by="bench", written_at=now)
        )
        conn.execute(text(PRELOAD[backend]), dict(n=tasks, split=split, type=task_type_name(Task), now=now))
    # settled, as a ledger is a while after its epoch was written: the preload's pages written back to the database
    # (SQLite: the WAL checkpointed; PostgreSQL: vacuumed, analysed and checkpointed, what autovacuum and the
    # checkpointer do), so that the claims are not timed against that write-back
    if backend == "postgresql":
        with ledger._engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.exec_driver_sql("VACUUM ANALYZE")
            conn.exec_driver_sql("CHECKPOINT")
    else:  # outside a transaction, which the ledger's connections always begin
        raw = ledger._engine.raw_connection()
        try:
            raw.cursor().execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            raw.close()
    return ledger


def claim_for(url: str, split: str, owner: str, ready, seconds: float, out_path: str, batch: int = 1) -> None:
    """Open the ledger, wait at ``ready`` for the others, then claim tasks of ``split`` one after another for
    ``seconds`` (``batch`` > 1: that many per call, ``Ledger.claim_many``); write each claimed task's key, each call's
    latency to ``out_path``, and how many calls the database refused (``LedgerUnavailable``: on SQLite, the write
    lock not had within its 60 s busy timeout)."""
    ledger = Ledger(url)
    keys, latencies, refused = [], [], 0
    ready.wait()
    began = time.perf_counter()
    while (now := time.perf_counter()) - began < seconds:
        try:
            if batch == 1:
                one = ledger.claim(split, owner=owner, lease_s=3600)
                got = [] if one is None else [one]
            else:
                got = ledger.claim_many(split, owner, batch, lease_s=3600)
        except LedgerUnavailable:
            refused += 1
            continue
        latencies.append(time.perf_counter() - now)
        if not got:
            break
        keys += [claim.task_key for claim, _ in got]
    elapsed = time.perf_counter() - began
    with open(out_path, "w") as f:
        json.dump({"keys": keys, "latencies": latencies, "elapsed": elapsed, "refused": refused}, f)
    ledger.close()


class _Idle(AsyncSampler):  # the scheduler wants a sampler class; the benchmark only polls
    async def run(self) -> None:
        pass

    async def evaluate_record(self, record) -> float:
        return 0.0


def scheduler_poll_ms(ledger: Ledger, url: str, out_dir: Path, polls: int) -> float:
    cfg = SamplingConfig(output_dir=str(out_dir), db_connection_string=url)
    scheduler = SamplingScheduler(cfg, _Idle, dataset=[], split="train", ledger=ledger)
    times = []
    for _ in range(polls):
        began = time.perf_counter()
        scheduler.epoch_progress(0)
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def claims_at_scale(
    url: str, backend: str, tasks: int, processes: int, seconds: float, polls: int, out_dir: Path, batch: int = 1
):
    """One repetition at ``tasks`` tasks: (claims/s, p50 latency s of a claim call, scheduler poll ms, preload s,
    calls the database refused)."""
    began = time.perf_counter()
    ledger = preload(url, backend, tasks)
    loaded = time.perf_counter() - began
    poll_ms = scheduler_poll_ms(ledger, url, out_dir, polls)
    ready = CTX.Barrier(processes + 1)  # every claimer has its ledger open before the clock starts
    outs = [out_dir / f"c{i}.json" for i in range(processes)]
    procs = [
        CTX.Process(target=claim_for, args=(url, "train", f"c{i}", ready, seconds, str(outs[i]), batch))
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    ready.wait()
    for p in procs:
        p.join()
        assert p.exitcode == 0, f"claimer {p.name} exited with {p.exitcode}"
    results = [json.loads(path.read_text()) for path in outs]
    keys = [k for r in results for k in r["keys"]]
    if len(keys) != len(set(keys)):
        raise AssertionError(f"{url}: {len(keys) - len(set(keys))} tasks claimed twice")
    rate = sum(len(r["keys"]) / r["elapsed"] for r in results)
    p50 = statistics.median(lat for r in results for lat in r["latencies"])
    ledger.close()
    return rate, p50, poll_ms, loaded, sum(r["refused"] for r in results)


def at_scale(args, backend: str, url: str, work: Path) -> list[dict]:
    rows = []
    for tasks in args.at_scale:
        reps = [
            claims_at_scale(url, backend, tasks, args.processes, args.seconds, args.polls, work, args.batch)
            for _ in range(args.reps)
        ]
        for i, (rate, p50, poll, loaded, refused) in enumerate(reps):
            print(
                f"{backend} {tasks} tasks rep {i}: {rate:.0f} claims/s, p50 claim {p50 * 1000:.1f} ms, "
                f"scheduler poll {poll:.1f} ms (preload {loaded:.1f} s), {refused} claims refused",
                flush=True,
            )
        row = {
            "mode": "at_scale",
            "backend": backend,
            "tasks": tasks,
            "processes": args.processes,
            "seconds": args.seconds,
            "batch": args.batch,
            "reps": args.reps,
            "claims_per_s": [r[0] for r in reps],
            "median_claims_per_s": statistics.median(r[0] for r in reps),
            "median_p50_claim_ms": statistics.median(r[1] for r in reps) * 1000,
            "median_scheduler_poll_ms": statistics.median(r[2] for r in reps),
            "refused_claims": [r[4] for r in reps],
            "loadavg_1m": os.getloadavg()[0],
        }
        print(
            f"{backend}: {tasks} tasks, {args.processes} claimers: median {row['median_claims_per_s']:.0f} claims/s, "
            f"p50 claim {row['median_p50_claim_ms']:.1f} ms, scheduler poll {row['median_scheduler_poll_ms']:.1f} ms; "
            f"load {row['loadavg_1m']:.1f}",
            flush=True,
        )
        rows.append(row)
    return rows


def contention_and_kill(args, backend: str, url: str, work: Path) -> list[dict]:
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
    print(
        f"{backend}: {args.processes} processes, {args.tasks} tasks claimed+recorded+completed once each: "
        f"median {row['median_s']:.2f} s ({row['median_tasks_per_s']:.0f} tasks/s); SIGKILLed worker's task "
        f"re-dispatched after a median {row['redispatch_median_s']:.2f} s (lease 1 s); "
        f"load {row['loadavg_1m']:.1f}"
    )
    return [row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"])
    parser.add_argument("--at-scale", nargs="+", type=int, metavar="TASKS", help="claims/s at these table sizes")
    parser.add_argument("--seconds", type=float, default=10.0, help="--at-scale: each repetition's claiming window")
    parser.add_argument("--polls", type=int, default=10, help="--at-scale: scheduler polls timed per repetition")
    parser.add_argument("--batch", type=int, default=1, help="--at-scale: tasks per claim call (claim_many if > 1)")
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
            if args.at_scale:
                results += at_scale(args, backend, url, work)
            else:
                results += contention_and_kill(args, backend, url, work)
    finally:
        if server is not None:
            server.destroy()
    out = ROOT / "benchmarks" / "results" / f"ledger-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in results))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
