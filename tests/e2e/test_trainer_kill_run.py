"""A demo run survives the death of a trainer rank (issue 28, section 3): tests/e2e/trainer_kill_run.py SIGKILLs
trainer rank 1 while step 3 trains; the run stops what it started and resumes from its last checkpoint in the same
process (orchestration/trainer_restarts.py), finishes every step and exits 0. Every step has one row in
metrics.jsonl (the rows past the checkpoint were cut back and written again) and the restart is counted once. The
queue outlived the restart (``train.restart_keeps_rows``): the steps trained since the checkpoint (every 3 steps) were
trained again from their kept rows, none of them generated again."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_demo import ROOT, SHORT

STEPS = 6
CHECKPOINT_EVERY = 3  # checkpoint 3 before the kill in step 3's training; the steps trained after it are kept
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
RESTART = re.compile(
    r"trainer rank 1 died at step (\d+); restarting the trainer group from checkpoint (\S+) \(restart 1 of 3\)"
)


def killing_run(out: Path, *overrides: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """tests/e2e/trainer_kill_run.py to ``STEPS`` steps in ``out``; its result (exit 0 asserted) and whole log."""
    cmd = [
        sys.executable, str(ROOT / "tests" / "e2e" / "trainer_kill_run.py"), f"output_dir={out}", *SHORT,
        f"steps={STEPS}", *overrides,
    ]  # fmt: skip
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, f"run failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result, result.stdout + result.stderr


def test_a_run_whose_trainer_rank_is_killed_restarts_the_trainer_group_and_finishes(tmp_path: Path) -> None:
    out = tmp_path / "trainer_kill"
    result, log = killing_run(out, f"checkpoint_every={CHECKPOINT_EVERY}")
    assert "killing trainer rank 1" in result.stdout, result.stdout[-3000:]
    said = RESTART.search(log)
    assert said, log[-4000:]
    died_at, checkpoint = int(said[1]), Path(said[2])
    resumed = re.search(rf"resumed from {re.escape(str(checkpoint))} at step (\d+)", result.stdout)
    assert resumed, result.stdout[-3000:]
    resumed_at = int(resumed[1])
    # the checkpoint before the step that was training (or one earlier, had it died mid-save)
    latest = CHECKPOINT_EVERY * (died_at // CHECKPOINT_EVERY)
    assert died_at >= 3 and resumed_at in (latest, latest - CHECKPOINT_EVERY), said[0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in rows if r["kind"] == "grpo"]
    assert [r["step"] for r in grpo] == list(range(STEPS))  # each step once: the rows past the checkpoint cut back
    assert [r["restarts_trainer"] for r in grpo] == [1 if s == resumed_at else 0 for s in range(STEPS)]
    # the queue was kept: the restart resumed the steps from the checkpoint on from it, those trained since the
    # checkpoint with all their rows (trained again from them, none generated again)
    [resume] = [r for r in rows if r["kind"] == "resume"]
    assert "restored from the queue kept" in result.stdout, result.stdout[-3000:]
    assert resume["step"] == resumed_at and resume["restored_steps"][0] == resumed_at, resume
    retrained = [r for r in grpo if resumed_at <= r["step"] < died_at]
    assert [r["generated_rows"] for r in retrained] == [0.0] * len(retrained), retrained
    assert resume["restored_rows"] >= len(retrained) * grpo[0]["rows"], resume


def test_a_death_before_the_first_checkpoint_restarts_from_the_start_with_the_queue_kept(tmp_path: Path) -> None:
    """No SFT warm-up and no checkpoint before the kill in step 3: the restart starts from the same weights as the
    run did, and the queue is kept as for a checkpoint: the steps trained before the death are trained again from
    their kept rows, none generated again."""
    out = tmp_path / "trainer_kill_start"
    result, log = killing_run(out, f"checkpoint_every={STEPS}", "sft.enabled=false")
    said = re.search(r"trainer rank 1 died at step (\d+); restarting the trainer group from the start of GRPO", log)
    assert said, log[-4000:]
    died_at = int(said[1])
    assert "restored from the queue kept" in result.stdout, result.stdout[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in rows if r["kind"] == "grpo"]
    assert [r["step"] for r in grpo] == list(range(STEPS))
    [resume] = [r for r in rows if r["kind"] == "resume"]
    assert resume["step"] == 0 and resume["restored_steps"][0] == 0, resume
    retrained = [r for r in grpo if r["step"] < died_at]
    assert retrained and [r["generated_rows"] for r in retrained] == [0.0] * len(retrained), retrained
