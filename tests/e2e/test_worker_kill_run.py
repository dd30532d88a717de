"""A demo run survives the death of a rollout worker and of a reward worker (issue 28, section 3): tests/e2e/
worker_kill_run.py SIGKILLs rollout worker 0 while it holds rows of step 1 and reward worker 0 while it holds rows of
step 3. Ray restarts them (``rollout.max_worker_restarts``), the rows they held come back to the queue
(``disconnect_grace`` after their connections closed), the run's supervisor makes their step calls again: every step
trains all its rows, none is lost, none is produced or trained twice, and the step rows count the restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, N, STEPS = 8, 4, 5
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def run_with_kills(out: Path, *extra: str) -> list[dict]:
    """The run of tests/e2e/worker_kill_run.py with ``extra`` overrides, checked: both deaths survived, every step
    trained all its rows, each once; returns its GRPO metric rows."""
    cmd = [
        sys.executable, str(ROOT / "tests" / "e2e" / "worker_kill_run.py"), f"output_dir={out}", f"steps={STEPS}",
        f"prompts_per_step={PROMPTS}", f"n_samples={N}", "rollout.groups_per_request=2",
        "rollout.reward_groups_per_request=2", "task.num_train_prompts=64", "task.num_eval_prompts=16",
        "sft.max_steps=4", "sft.eval_every=2", "sft.batch_size=16", "queue_timeout=120", *extra,
    ]  # fmt: skip
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, f"run failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    summary = json.loads((out / "worker_kill.json").read_text())
    assert sorted((k["step"], k["kind"]) for k in summary["kills"]) == [(1, "rollout"), (3, "reward")], summary
    assert summary["restarts"] == {"rollout": 1, "reward": 1}, summary
    grpo = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "grpo"]
    assert [r["step"] for r in grpo] == list(range(STEPS))  # every step finished
    assert sum(r["restarts_rollout"] for r in grpo) == 1 and sum(r["restarts_reward"] for r in grpo) == 1
    assert all(r["rows"] == PROMPTS * N for r in grpo), [r["rows"] for r in grpo]  # every step trained full rows
    audits = [json.loads(line) for line in (out / "audit.jsonl").read_text().splitlines()]
    assert [a["step"] for a in audits] == list(range(STEPS))
    for audit in audits:
        train = audit["train"]
        assert train["rows"] == train["acknowledged"] == PROMPTS * N, audit  # every row trained, each once
        assert train["ready"] == train["leased"] == train["dead_lettered"] == 0, audit
        assert audit["rows_lost"] == 0, audit
        assert audit["produced"]["response_ids"] == audit["produced"]["reward"] == PROMPTS * N, audit
        assert Counter(audit["live_groups"]) == dict.fromkeys(range(PROMPTS), N), audit  # no row put twice
    return grpo


def test_a_run_survives_a_killed_rollout_worker_and_reward_worker_with_every_row_trained_once(tmp_path: Path) -> None:
    run_with_kills(tmp_path / "worker_kill")


def test_a_rollout_worker_killed_mid_generation_resumes_its_checkpointed_partials(tmp_path: Path) -> None:
    """rollout.checkpoint_inflight: the worker is killed once its rows of step 1 have checkpoints; the redo of its
    call resumes them (the step's row counts the tokens kept), none too stale (sync: the same version)."""
    grpo = run_with_kills(
        tmp_path / "inflight", "rollout.partial_rollout=true", "rollout.checkpoint_inflight=true",
        "rollout.chunk_tokens=1", "rollout.max_new_tokens=16",
    )  # fmt: skip
    resumed = {r["step"]: r["resumed_tokens"] for r in grpo}
    assert resumed[1] > 0 and sum(resumed.values()) == resumed[1], resumed
    assert sum(r["stale_partials"] for r in grpo) == 0
