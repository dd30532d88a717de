"""Claims under contention and faults, on SQLite and a real PostgreSQL: 8 processes claiming 2,000 tasks, a worker
SIGKILLed mid-task, the PostgreSQL server stopped mid-run."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from collections import Counter

import pytest

from tests.integration.workers.ledger.claimers import claim_all, claim_and_hang
from tests.integration.workers.ledger.conftest import require_postgres
from tests.integration.workers.ledger.pg import PostgresServer
from workers.ledger import Ledger, LedgerUnavailable, Record, Task

CTX = multiprocessing.get_context("spawn")


def run_claimers(url: str, split: str, out_dir, processes: int, **kwargs) -> tuple[list[dict], float, list]:
    """Start ``processes`` claimers, release them together; their outputs, the seconds they took, the processes."""
    start = CTX.Event()
    procs = [
        CTX.Process(target=claim_all, args=(url, split, f"w{i}", start, str(out_dir / f"w{i}.json")), kwargs=kwargs)
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    return procs, start


def collect(procs, out_dir, timeout: float = 240) -> list[dict]:
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0, f"claimer {p.name} exited with {p.exitcode}"
    return [json.loads(path.read_text()) for path in sorted(out_dir.glob("w*.json"))]


# 2,000 tasks take one to two minutes per backend on a loaded 2-core machine: the default tier runs 200, the slow
# tier 2,000 (benchmarks/ledger_claims.py times them)
@pytest.mark.parametrize("num_tasks", [200, pytest.param(2000, marks=pytest.mark.slow)])
def test_eight_processes_claim_tasks_each_exactly_once_per_epoch(ledger_url, tmp_path, num_tasks):
    ledger = Ledger(ledger_url)
    for epoch in range(2):
        ledger.write_epoch("train", epoch, [Task(id=str(i)) for i in range(num_tasks // 2)], owner="test")
    # a lease far longer than the run: a task claimed twice here would be a bug, not a re-dispatch
    procs, start = run_claimers(ledger_url, "train", tmp_path, processes=8, lease_s=3600)
    time.sleep(3)  # let the spawned interpreters import before the clock starts
    began = time.perf_counter()
    start.set()
    outputs = collect(procs, tmp_path)
    seconds = time.perf_counter() - began
    claimed = Counter((task_id, epoch) for out in outputs for _, task_id, epoch, _ in out["claimed"])
    assert len(claimed) == num_tasks and set(claimed.values()) == {1}
    assert sum(1 for out in outputs if out["claimed"]) >= 2  # the work was shared
    assert ledger.task_counts("train") == {"done": num_tasks}
    assert len(ledger.records("train")) == num_tasks
    print(
        f"\n{ledger.backend}: 8 processes claimed+recorded+completed {num_tasks} tasks in {seconds:.2f} s "
        f"({num_tasks / seconds:.0f} tasks/s); per process: {[len(o['claimed']) for o in outputs]}"
    )


def test_a_sigkilled_worker_s_task_is_redispatched_after_its_lease_and_recorded_once(ledger_url, tmp_path):
    ledger = Ledger(ledger_url)
    ledger.write_epoch("train", 0, [Task(id="only")], owner="test")
    out = tmp_path / "doomed.json"
    doomed = CTX.Process(target=claim_and_hang, args=(ledger_url, "train", str(out), 1.0, 0.2))
    doomed.start()
    deadline = time.monotonic() + 60
    while not out.exists():
        assert time.monotonic() < deadline and doomed.is_alive(), "the doomed worker never claimed"
        time.sleep(0.05)
    held = json.loads(out.read_text())
    time.sleep(1.5)  # longer than the lease: heartbeats keep it
    assert ledger.claim("train", owner="rescuer", lease_s=30) is None
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join(10)
    killed = time.monotonic()
    while (got := ledger.claim("train", owner="rescuer", lease_s=30)) is None:
        assert time.monotonic() - killed < 30, "the task was never re-dispatched"
        time.sleep(0.05)
    redispatched_after = time.monotonic() - killed
    claim, task = got
    assert (claim.task_key, claim.attempt, task.id) == (held["task_key"], 2, "only")
    for sample in range(2):  # the rescuer writes both samples; sample 0 was written before the kill
        ledger.write_record(
            Record(task_key=claim.task_key, task_id="only", split="train", epoch=0, sample_index=sample)
        )
    ledger.complete(claim.id)
    assert sorted(r.sample_index for r in ledger.records("train")) == [0, 1]
    assert [r.score for r in ledger.records("train")] == [0.5, None]  # sample 0 is the doomed worker's, once
    assert [(c.owner.split("-")[0], c.status) for c in ledger.claims("train")] == [
        ("doomed", "expired"),
        ("rescuer", "done"),
    ]
    print(
        f"\n{ledger.backend}: a SIGKILLed worker's task re-dispatched {redispatched_after:.2f} s after the kill "
        "(lease 1 s)"
    )


def test_postgres_stopped_mid_run_workers_retry_and_nothing_is_recorded_twice(tmp_path):
    server = PostgresServer(require_postgres())
    try:
        server.start()
        url = server.create_database()
        ledger = Ledger(url)
        ledger.write_epoch("train", 0, [Task(id=str(i)) for i in range(400)], owner="test")
        procs, start = run_claimers(url, "train", tmp_path, processes=4, work_s=0.01, lease_s=5.0)
        start.set()
        deadline = time.monotonic() + 120
        while len(ledger.records("train")) < 60:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.stop()
        with pytest.raises(LedgerUnavailable, match="unavailable"):
            ledger.records("train")
        time.sleep(2.0)
        server.start()
        outputs = collect(procs, tmp_path)
        records = ledger.records("train")
        assert Counter(r.task_id for r in records) == Counter({str(i): 1 for i in range(400)})
        assert ledger.task_counts("train") == {"done": 400}
        assert sum(out["retries"] for out in outputs) > 0
        assert {e for out in outputs for e in out["errors"]} == {"LedgerUnavailable"}
        print(
            f"\nPostgreSQL stopped for ~2 s mid-run: {sum(o['retries'] for o in outputs)} retries across 4 workers, "
            f"400 tasks, 400 records, {len(ledger.claims('train'))} claims"
        )
        ledger.close()
    finally:
        server.destroy()
