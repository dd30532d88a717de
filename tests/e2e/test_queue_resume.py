"""An async demo run killed (SIGKILL of its process group) after a checkpoint, while rows of the steps launched ahead
are in the queue, and resumed: the checkpoint's queue snapshot comes back, the rows produced before the crash are
trained (not generated again), the rows that were in flight are generated again, and every prompt batch of the run
is trained exactly once, in order, as an uninterrupted run draws them (checked by each step's ``prompts_crc``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl_contracts.prompts import PromptSource, prompts_checksum
from rl_contracts.task import load_task
from tests.e2e.test_demo import ROOT, SHORT, run_demo
from trainers.checkpoint import latest_checkpoint
from trainers.config import load_config

pytestmark = pytest.mark.timeout(900)
STEPS = 10
KNOBS = ("mode=async", "max_staleness=2", "checkpoint_every=1", "weight_sync=memory")


def start_demo(out: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, str(ROOT / "recipe" / "demo.py"), f"output_dir={out}", *SHORT, *overrides]
    log = (out.parent / "first.log").open("w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def metric_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def expected_crcs(out: Path, steps: int) -> list[float]:
    """The prompts_crc of each step of an uninterrupted run: its prompt batches, each row n_samples times."""
    cfg = load_config(out / "config.yaml")
    task = load_task(cfg.task.name, cfg.task.kwargs)
    source = PromptSource(task.prompts("train", cfg.task.num_train_prompts, cfg.task.seed), cfg.seed)
    batches = [source.next_batch(cfg.prompts_per_step) for _ in range(steps)]
    return [float(cfg.n_samples * prompts_checksum(p["prompt_ids"] for p in batch)) for batch in batches]


@pytest.mark.slow  # two demo runs, each starting Ray: two to four minutes on a loaded 2-core machine
def test_an_async_run_killed_after_a_checkpoint_trains_the_rows_its_queue_held(tmp_path):
    out = tmp_path / "async"
    first = start_demo(out, f"steps={STEPS}", *KNOBS)
    deadline = time.monotonic() + 600
    try:
        # a checkpoint with steps in flight, past the first one (whose steps ahead may still be empty)
        while time.monotonic() < deadline and first.poll() is None:
            saves = [r for r in metric_rows(out) if r["kind"] == "checkpoint" and r["queue_steps"]]
            if saves and saves[-1]["step"] >= 2:
                break
            time.sleep(0.05)
        log = (tmp_path / "first.log").read_text()
        assert first.poll() is None, f"the demo ended before it could be killed:\n{log[-3000:]}"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
    latest = latest_checkpoint(out / "checkpoints")
    saved = json.loads((latest / "checkpoint.json").read_text())["extra_state"]
    resumed_at, queued = saved["step"], saved["queue"]["steps"]
    assert queued and queued[0] == resumed_at and (latest / "queue" / "CURRENT").is_file()
    killed = metric_rows(out)

    second = run_demo(out, f"steps={STEPS}", *KNOBS)
    said = re.search(
        r"resumed from step (\d+): (\d+) rows of steps \[([\d, ]+)\] restored from the queue checkpoint, "
        r"(\d+) re-launched",
        second.stdout,
    )
    assert said, second.stdout[-3000:]
    restored, relaunched = int(said[2]), int(said[4])
    assert int(said[1]) == resumed_at and [int(s) for s in said[3].split(",")] == queued
    assert restored + relaunched == len(queued) * 32  # 8 prompts x 4 samples per step
    assert restored > 0, "no row of the queue checkpoint was restored"

    # the run's lineage: the killed run's steps before the checkpoint, then the resumed run's
    rows = metric_rows(out)
    resume = next(i for i, r in enumerate(rows) if r["kind"] == "resume")
    assert rows[resume] == {
        "kind": "resume",
        "step": resumed_at,
        "restored_steps": queued,
        "restored_rows": restored,
        "relaunched_rows": relaunched,
    }
    assert rows[:resume] == killed
    before = [r for r in killed if r["kind"] == "grpo" and r["step"] < resumed_at]
    after = [r for r in rows[resume:] if r["kind"] == "grpo"]
    lineage = before + after
    # every prompt batch trained exactly once, in the order an uninterrupted run draws them: none skipped, none twice
    assert [r["step"] for r in lineage] == list(range(STEPS))
    assert [r["prompts_crc"] for r in lineage] == expected_crcs(out, STEPS)
    assert all(r["rows"] == 32 for r in lineage)
    # the restored rows were trained: the resumed run generated only the others of the restored steps
    assert sum(r["rows"] - r["generated_rows"] for r in after if r["step"] in queued) == restored
    assert all(r["generated_rows"] == r["rows"] for r in after if r["step"] not in queued)
