"""End to end: prepare SmolLM2-135M-Instruct (once, into the model cache) and run 2 GRPO steps of its recipe.

Slow (minutes on 2 CPU cores: model preparation the first time, actor start-up, then ~1 min a step); run with
``pytest -m slow tests/e2e/test_smollm2.py``. The run is a subprocess, so its Ray cluster is its own.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import requirement

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_smollm2_grpo_two_steps(tmp_path):
    for module in ("gguf", "accelerate"):
        pytest.importorskip(module, reason=requirement(f"{module} (the smollm2 extra)", "pip install -e .[test]"))
    from workers.hf_models import is_prepared, prepare_smollm2

    path = prepare_smollm2()
    assert is_prepared(path)
    assert json.loads((path / "prepared.json").read_text())["num_parameters"] == 134_515_008

    out = tmp_path / "run"
    command = [
        sys.executable,
        str(ROOT / "recipe" / "smollm2" / "run.py"),
        "steps=2",
        "prompts_per_step=2",
        "n_samples=4",
        "rollout.max_new_tokens=6",
        f"output_dir={out}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, f"run.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in rows if r["kind"] == "grpo"]
    assert [r["step"] for r in grpo] == [0, 1]
    for row in grpo:
        assert row["rows"] == 8
        assert 0.0 <= row["reward"] <= 1.0
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
        assert row["policy_version"] == row["step"] + 1
        assert row["failed_rows"] == 0
        assert 0 < row["response_len"] <= 6
    assert (out / "metrics.png").is_file()
    assert "GRPO mean reward" in done.stdout
