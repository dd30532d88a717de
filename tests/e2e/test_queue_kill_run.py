"""A demo run survives the death of a queue actor with every step trained on all its rows, none twice (issue 28,
section 3), run by tests/e2e/queue_kill_run.py: ``kill=unit`` SIGKILLs the storage unit holding step 1's prompts of a
run with ``queue_replicas=2`` (the second copies serve the reads, the restarted unit is refilled: no row is lost, no
prompt put again); ``kill=controller`` kills the controller of a run with ``queue_journal=true`` as step 1 is launched
(Ray restarts it, it replays its journal: the leases the workers and trainer ranks hold survive it, their acks after
the restart succeed, no row is handed out twice)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, N, STEPS = 8, 4, 4
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SHORT = [
    f"steps={STEPS}", f"prompts_per_step={PROMPTS}", f"n_samples={N}", "rollout.groups_per_request=2",
    "rollout.reward_groups_per_request=2", "task.num_train_prompts=64", "task.num_eval_prompts=16",
    "sft.max_steps=4", "sft.eval_every=2", "sft.batch_size=16", "queue_timeout=120",
]  # fmt: skip


def kill_run(out: Path, kill: str, *overrides: str) -> dict:
    cmd = [sys.executable, str(ROOT / "tests" / "e2e" / "queue_kill_run.py"), f"kill={kill}", f"output_dir={out}"]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run([*cmd, *SHORT, *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, f"run failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    grpo = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "grpo"]
    assert [r["step"] for r in grpo] == list(range(STEPS))  # every step finished
    assert [r["trained_rows"] for r in grpo] == [PROMPTS * N] * STEPS  # each row trained once: none twice, none left
    audits = [json.loads(line) for line in (out / "audit.jsonl").read_text().splitlines()]
    assert [a["step"] for a in audits] == list(range(STEPS))
    for audit in audits:  # every step trained all its rows, none lost
        train = audit["train"]
        assert train["rows"] == train["acknowledged"] == PROMPTS * N, audit
        assert train["ready"] == train["leased"] == train["dead_lettered"] == 0, audit
        assert audit["rows_lost"] == 0, audit
    return json.loads((out / "queue_kill.json").read_text())


def test_a_run_with_two_copies_of_each_row_loses_none_when_a_storage_unit_is_killed(tmp_path: Path) -> None:
    summary = kill_run(tmp_path / "unit", "unit", "queue_replicas=2", "num_storage_units=3")
    assert [k["step"] for k in summary["kills"]] == [1]
    assert summary["groups_put_again"] == 0  # nothing was lost: no prompt put again


def test_a_run_with_a_journal_survives_the_controller_being_killed(tmp_path: Path) -> None:
    summary = kill_run(tmp_path / "controller", "controller", "queue_journal=true", "checkpoint_queue=false")
    assert summary["kills"] == [{"step": 1, "controller": True}]
    assert summary["groups_put_again"] == 0  # the restarted controller replayed every committed row
