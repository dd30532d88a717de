"""Kill anything, lose nothing (issue 28, section 4), the short soak: one demo run in async mode (``max_staleness=1``)
during which benchmarks/kill_anything.py kills each kind once at moments drawn from its seed: a rollout worker and a
reward worker (SIGKILL; Ray restarts them, the run's supervisor makes their calls again), a storage unit
(``queue_replicas=2``: the second copies serve, the unit is restarted and refilled), the controller
(``ray.kill(no_restart=False)`` with ``queue_journal=true``: it replays its journal, leases included), a trainer rank
(SIGKILL: the trainer group restarts from the run's last checkpoint, orchestration/trainer_restarts.py) and an engine
server the run started (``rollout.engine=sglang`` served by tests/engine_fakes.py's SGLang stand-in over the run's HF
policy; SIGKILL: its EngineServer restarts it, the rollout worker's generation in flight waits for it, loads the
newest weights into it and is made again). Every step trains all its rows, none is lost, none trained twice, every
trained row within the staleness bound, every kill restarted.
The full-size figures (with an uninterrupted run to compare the reward against) are in benchmarks/README.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import kill_anything as ka

ROOT = Path(__file__).resolve().parents[2]
# seed 1: the reward worker then the engine server at step 1, the controller then the rollout worker at step 2, a
# trainer rank then a storage unit at step 4
STEPS, SEED = 6, 1
KINDS = ["rollout", "reward", "unit", "controller", "trainer", "engine"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SHORT = [
    "task.num_train_prompts=64", "task.num_eval_prompts=16", "sft.max_steps=4", "sft.eval_every=2",
    "sft.batch_size=16",
]  # fmt: skip


def test_a_run_that_loses_each_kind_of_actor_once_trains_every_row_once_within_the_staleness_bound(
    tmp_path: Path,
) -> None:
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "kill_anything.py"), "--child", "killed", "--output-dir",
        str(tmp_path), "--steps", str(STEPS), "--seed", str(SEED), "--kills", "1", "--kinds", ",".join(KINDS),
        *(f"--set={o}" for o in SHORT),
    ]  # fmt: skip
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, f"run failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    out = ka.killed_figures(tmp_path, STEPS, KINDS)
    planned = ka.schedule(SEED, KINDS, 1, STEPS)
    assert out["kill_errors"] == [], out["kill_log"]
    assert out["kills"] == dict.fromkeys(KINDS, 1), out["kill_log"]
    assert sorted((k["kind"], k["step"]) for k in out["kill_log"]) == sorted((k["kind"], k["step"]) for k in planned)
    assert out["restarts"] == {"rollout": 1, "reward": 1, "unit": 1, "trainer": 1, "engine": 1}, out
    assert out["steps_finished"] == STEPS
    assert out["rows_per_step"] == [ka.PROMPTS * ka.N] * STEPS
    assert out["rows_lost_silently"] == out["rows_reported_lost"] == 0, out
    assert out["samples_trained_twice"] == 0, out
    assert out["rows_version_checked"] == STEPS * ka.PROMPTS * ka.N
    assert out["rows_beyond_max_staleness"] == out["rows_left_out_as_stale"] == 0, out
    assert 0 <= out["staleness_max"] <= 1, out
