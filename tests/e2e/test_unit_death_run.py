"""A demo run survives storage-unit deaths with no prompt skipped (issue 8, section 4): tests/e2e/unit_death_run.py
kills the unit holding step 1's prompts as they are put and the one holding step 3's a moment later; Ray restarts them,
the queue reports their rows lost, the driver puts the lost prompts again, workers and trainer ranks hand back what they
cannot read. Every step finishes, and every prompt group of every step is trained exactly once: by the trainer's
acknowledgements, once either as live rows or (trained before they were lost) as lost rows."""

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


@pytest.mark.slow
def test_a_run_survives_storage_unit_deaths_and_trains_every_prompt_group_once(tmp_path: Path) -> None:
    out = tmp_path / "unit_death"
    cmd = [
        sys.executable, str(ROOT / "tests" / "e2e" / "unit_death_run.py"), f"output_dir={out}", f"steps={STEPS}",
        f"prompts_per_step={PROMPTS}", f"n_samples={N}", "rollout.groups_per_request=2",
        "rollout.reward_groups_per_request=2", "task.num_train_prompts=64", "task.num_eval_prompts=16",
        "sft.max_steps=4", "sft.eval_every=2", "sft.batch_size=16", "queue_timeout=120",
    ]  # fmt: skip
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, f"run failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    summary = json.loads((out / "unit_death.json").read_text())
    assert [k["step"] for k in summary["kills"]] == [1, 3]
    assert sum(summary["restarts"].values()) == 2  # both killed units came back (Ray restarted them)
    grpo = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "grpo"]
    assert [r["step"] for r in grpo] == list(range(STEPS))  # every step finished
    audits = [json.loads(line) for line in (out / "audit.jsonl").read_text().splitlines()]
    assert [a["step"] for a in audits] == list(range(STEPS))
    for audit in audits:
        train = audit["train"]
        assert train["rows"] == PROMPTS * N and train["acknowledged"] == PROMPTS * N, audit  # all live rows trained
        assert train["ready"] == train["leased"] == train["dead_lettered"] == 0, audit
        live = Counter(audit["live_groups"])
        assert set(live.values()) <= {N}, audit  # whole groups only
        trained_while_lost = {group for _, group, state in audit["lost"] if state == "acknowledged"}
        assert sorted([*live, *trained_while_lost]) == list(range(PROMPTS)), audit  # each prompt group once
    assert audits[1]["rows_lost"] > 0  # the first kill took step 1's prompts with it
    assert summary["groups_put_again"] > 0
