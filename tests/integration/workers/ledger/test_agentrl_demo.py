"""recipe/agentrl_demo.py end to end: killed mid-run (SIGKILL) and resumed, it re-dispatches the tasks the dead run had
claimed and trains no record twice; in the slow tier, the full run learns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import recipe.agentrl_demo  # noqa: F401  (registers the demo's AdditionProblem in this process)
from workers.ledger import Ledger

ROOT = Path(__file__).resolve().parents[4]
SMALL = ["sft_target=0", "prompts_per_step=4", "num_generations=4", "num_tasks=32", "checkpoint_every=2", "lease_s=2"]


def demo(out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "recipe" / "agentrl_demo.py"), f"output_dir={out}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def running_tasks(url: str) -> list[tuple[str, int]]:
    ledger = Ledger(url)
    try:
        return [(t.id, t.epoch) for t in ledger.tasks("train") if t.status == "running"]
    finally:
        ledger.close()


@pytest.mark.slow  # two demo runs, each starting Ray: two to three minutes on a loaded 2-core machine
def test_killed_and_resumed_it_redispatches_claimed_tasks_and_trains_no_record_twice(tmp_path):
    out = tmp_path / "demo"
    first = demo(out, "steps=40", *SMALL)
    url = f"sqlite:///{out}/ledger.db"
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and first.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3 and running_tasks(url):
                break
            time.sleep(0.05)
        assert first.poll() is None, f"the demo ended before it could be killed:\n{first.stdout.read()[-3000:]}"
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the ledger's writer (the driver) dies with its process group
        first.wait(30)
    # read after the kill: a claim seen running a moment before may have finished before the kill landed
    running = running_tasks(url)
    assert running, "no task was claimed when the run was killed"
    killed_at = len((out / "metrics.jsonl").read_text().splitlines())

    second = demo(out, f"steps={killed_at + 6}", *SMALL)
    output, _ = second.communicate(timeout=300)
    assert second.returncode == 0, output[-3000:]
    assert "resumed from" in output
    ledger = Ledger(url)
    tasks = {(t.id, t.epoch): t for t in ledger.tasks("train")}
    claims = ledger.claims("train")
    for task_id, epoch in running:  # the dead run's claims expired; a claim of the resumed run finished the task
        mine = [c for c in claims if (c.task_id, c.epoch) == (task_id, epoch)]
        assert mine[0].status == "expired" and "lease ended" in mine[0].last_error, mine
        assert tasks[(task_id, epoch)].status == "done" and mine[-1].status == "done", mine
        assert mine[-1].attempt == 2, mine
    records = ledger.records("train")
    assert max(r.trained_count for r in records) == 1  # max_trained_count=1: never trained twice
    trained_steps = sorted({r.last_trained_step for r in records if r.trained_count})
    assert trained_steps[-1] == killed_at + 5
    keys = [(r.task_key, r.sample_index) for r in records]
    assert len(keys) == len(set(keys))


@pytest.mark.slow  # about 2 minutes on a quiet 2-core machine
def test_the_demo_learns(tmp_path):
    run = demo(tmp_path / "demo", "steps=250")
    output, _ = run.communicate(timeout=1800)
    assert run.returncode == 0, output[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "sft" and (tmp_path / "demo" / "metrics.png").exists()
    rows = [row for row in rows if row["kind"] == "grpo"]
    k = len(rows) // 5
    first, last = (sum(r["reward"] for r in part) / k for part in (rows[:k], rows[-k:]))
    # a fifth is 50 steps x 128 samples: a standard error of about 0.01, so 0.05 is a margin noise does not reach
    assert last > first + 0.05, output[-2000:]
