"""A GRPO run on a task whose prompts carry images, end to end as a user runs it: ``python recipe/demo.py`` with the
colours task (``workers.tasks.colors``: a tiny random LLaVA names the colour of a picture). The driver's prompt rows
carry their pictures' blob keys (``image_refs``), the rollout worker hands them to its in-process hf engine, the
trainer resolves the same keys to the same pixels: its log-probs of the sampled tokens are the engine's, step after
step (the weights published to the engine through the shared-memory channel included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_demo import rows, run_demo

pytestmark = pytest.mark.timeout(900)  # a whole demo run: start-up of the processes dominates on a cold machine
VISION = [
    "task.name=workers.tasks.colors:ColorsTask",
    "sft.enabled=false",  # the SFT warm-up feeds no images (check_run_task refuses it)
    "steps=3",
    "prompts_per_step=4",
    "n_samples=4",
    "rollout.groups_per_request=2",  # two engine calls a step: images travel with each batch of groups
    "rollout.reward_groups_per_request=4",
    "task.num_train_prompts=16",
    "task.num_eval_prompts=4",
    "train.world_size=1",
    "train.micro_batch_size=16",
    "train.recompute_old_logprobs=true",  # the trainer re-scores the engine's tokens: the mismatch metrics
    "eval_every=1",  # the evaluation samples the eval prompts with their pictures too
]


@pytest.mark.parametrize(
    "extra",
    [
        # one picture a prompt: the mixed case below covers it too; slow tier (make test's 10-minute budget)
        pytest.param([], marks=pytest.mark.slow),
        # prompts with one and with two pictures, mixed in the trainer's batches: slow tier too (a whole run, ~1 min
        # on a loaded 2-core machine); the default tier covers its parts (test_vision_fsdp_ranks.py, the unit tier)
        pytest.param(["task.kwargs.two_pictures=0.5"], marks=pytest.mark.slow),
    ],
    ids=["one-picture", "one-or-two-pictures"],
)
def test_a_grpo_run_on_a_task_with_images_trains_on_the_engines_tokens_and_pixels(
    tmp_path: Path, extra: list[str]
) -> None:
    out = tmp_path / "vision"
    result = run_demo(out, *VISION, *extra, short=False)
    assert "yields images" not in result.stderr

    grpo = rows(out, "grpo")
    assert [r["step"] for r in grpo] == [0, 1, 2]
    assert [r["policy_version"] for r in grpo] == [1.0, 2.0, 3.0]
    for r in grpo:
        assert r["rows"] == 16 and r["generated_rows"] == 16 and r["trained_rows"] == 16, r
        assert 0.0 <= r["reward"] <= 1.0 and 0.0 <= r["eval_accuracy"] <= 1.0, r
        # the trainer's log-probs of the sampled tokens (prompt pixels included) are the engine's: a prompt sampled
        # without its picture, with other pixels or with stale weights would be off by far more
        assert r["mismatch_abs_dlogp"] < 1e-4 and r["mismatch_kl"] < 1e-6, r
        assert abs(r["ratio_mean"] - 1.0) < 1e-3, r
    assert rows(out, "summary") and (out / "checkpoints" / "step_00000003").is_dir()
