"""The demo in async mode with partial rollouts: per-token versions reach the queue and the trainer masks tokens
older than max_staleness; with weight_sync memory (updates pushed into a generating engine) and shm (polled)."""

from __future__ import annotations

import pytest

from tests.e2e.test_demo import rows, run_demo

# Each run is ~40-60 s of the demo: the slow tier keeps make test under 10 minutes.
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


@pytest.mark.parametrize("weight_sync", ["memory", "shm"])
def test_the_demo_runs_async_with_partial_rollouts(tmp_path, weight_sync):
    out = tmp_path / weight_sync
    run_demo(
        out,
        "steps=3",
        "mode=async",
        "max_staleness=1",
        f"weight_sync={weight_sync}",
        "rollout.partial_rollout=true",
        "train.mask_offpolicy_in_partial_rollout=true",
    )
    grpo = rows(out, "grpo")
    assert [r["step"] for r in grpo] == [0, 1, 2]
    assert max(r["staleness_max"] for r in grpo) <= 1
    assert all(r["trained_tokens"] > 0 for r in grpo if "trained_tokens" in r)


def test_a_rollout_worker_that_fails_fails_the_async_run_at_once_instead_of_hanging(tmp_path):
    # prompt + max_new_tokens beyond the tiny model's 32 positions: the engine refuses the first generation. The
    # trainer would wait for that step's rows forever; the driver, which watches the workers too, ends the run.
    result = run_demo(
        tmp_path / "run",
        "steps=3",
        "mode=async",
        "max_staleness=1",
        "weight_sync=memory",
        "sft.enabled=false",
        "rollout.max_new_tokens=128",
        timeout=180,
        returncode=1,
    )
    assert "with max_new_tokens=128 that exceeds max_position_embeddings=32" in result.stderr
