"""recipe/verl_ppo_dataflow.py: DataProto-shaped batches through put / get_meta / get_data across a rollout actor
and a trainer actor (two processes), with the trainer asking before the rollout has produced anything."""

from __future__ import annotations

import math
from typing import Any

import pytest


@pytest.mark.slow  # a whole recipe run (~25 s on a loaded 2-core machine): make test's 10-minute budget
@pytest.mark.timeout(300)
def test_the_verl_style_ppo_data_flow_runs(ray_session: Any) -> None:
    from recipe.verl_ppo_dataflow import main

    metrics = main(steps=2, num_prompts=2, n_samples=2)
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(m["rows"] == 4 and m["temperature"] == 1.0 and math.isfinite(m["loss"]) for m in metrics)
    assert all(0.0 <= m["reward"] <= 1.0 for m in metrics)
