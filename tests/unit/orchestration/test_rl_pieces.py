"""The RL loop's pure pieces: prompt source, reward scoring, training-batch building, config checks, metrics."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from orchestration.config import ConfigError, RLConfig, load_config, parse_overrides
from orchestration.metrics import (
    PLOTTED,
    MetricsLog,
    StepReporter,
    fifth_means,
    metrics_figure,
    plot_metrics,
    plotted_panels,
)
from rl_contracts.prompts import PromptSource, sft_step_batch
from rl_contracts.rows import jagged, rows_of
from rl_contracts.task import import_object, load_reward_fn, load_task
from trainers.config import TrainConfig, TrainerConfig
from trainers.filters import FilterConfig
from trainers.fsdp import AdamWConfig
from trainers.grpo import (
    build_train_batch,
    pad_rows,
    pad_sequences,
    rl_adamw,
    rl_optimizer_step,
    take_groups,
    warmup_factor,
)
from workers.reward import NonFiniteReward, score_responses
from workers.tasks.addition import AdditionTask


# ---- prompt source ------------------------------------------------------------------------------------------
def test_prompt_source_serves_every_prompt_once_per_epoch_in_a_seeded_order():
    source = PromptSource(list(range(10)), seed=3)
    first, second = source.next_batch(10), source.next_batch(10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second  # reshuffled per epoch
    assert source.epoch == 1
    assert PromptSource(list(range(10)), seed=3).next_batch(10) == first


def test_prompt_source_resumes_where_it_stopped():
    uninterrupted = PromptSource(list(range(7)), seed=1)
    expected = [uninterrupted.next_batch(3) for _ in range(6)]
    source = PromptSource(list(range(7)), seed=1)
    got = [source.next_batch(3) for _ in range(2)]
    state = source.state_dict()
    resumed = PromptSource(list(range(7)), seed=1)
    resumed.load_state_dict(state)
    got += [resumed.next_batch(3) for _ in range(4)]
    assert got == expected


def test_prompt_source_refuses_a_state_of_another_dataset():
    state = PromptSource(list(range(7)), seed=1).state_dict()
    with pytest.raises(ValueError, match="has 5 prompts and seed 1; the state is for 7 prompts"):
        PromptSource(list(range(5)), seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptSource([], seed=0)


def test_an_sft_step_batch_depends_on_seed_and_step_alone_and_the_single_process_reference_draws_the_same():
    prompts = list(range(100))
    batch = sft_step_batch(prompts, seed=3, step=7, size=8)
    assert batch == sft_step_batch(prompts, 3, 7, 8) and len(set(batch)) == 8  # no replay, no repeats
    assert batch != sft_step_batch(prompts, 3, 8, 8) and batch != sft_step_batch(prompts, 4, 7, 8)
    # recipe/experiments/addition_single_process.py --data demo draws the trainer's SFT batches (make bench-demo)
    from recipe.experiments.addition_single_process import Problems

    args = type("Args", (), {"data": "demo", "num_train_prompts": 64, "task_seed": 0, "probe_size": 4})()
    problems = Problems(args, seed=3)
    assert problems.sft(7, 8) == sft_step_batch(AdditionTask().prompts("train", 64, 0), 3, 7, 8)


# ---- reward scoring -----------------------------------------------------------------------------------------
def test_a_failing_reward_function_marks_the_sample_and_the_rest_are_scored():
    def reward(text: str, answer: str) -> float:
        if text == "boom":
            raise RuntimeError("parser exploded")
        return float(text == answer)

    scores = score_responses(reward, ["1", "boom", "3"], {"answer": ["1", "2", "4"]})
    assert scores.rewards == [1.0, 0.0, 0.0]
    assert scores.failed == [False, True, False]
    assert scores.errors == ["RuntimeError: parser exploded"]
    assert scores.non_finite == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_reward_is_rejected_naming_the_sample_and_counted(bad):
    scores = score_responses(lambda text: bad if text == "x" else 1.0, ["ok", "x"], {}, sample_ids=[40, 41])
    assert (scores.rewards, scores.failed, scores.non_finite) == ([1.0, 0.0], [False, True], 1)
    assert scores.errors == [f"NonFiniteReward: sample global_index=41: the reward function returned {bad}"]
    assert issubclass(NonFiniteReward, ValueError)


def test_reward_functions_and_tasks_load_by_dotted_name():
    assert load_reward_fn("workers.tasks.addition:addition_reward")("042", "042") == 1.0
    assert isinstance(load_task("workers.tasks.addition:AdditionTask"), AdditionTask)
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        import_object("no_such_module:f")
    with pytest.raises(ValueError, match="has no 'nope'"):
        import_object("workers.tasks.addition:nope")
    with pytest.raises(ValueError, match=r"expected a rl_contracts\.task\.Task"):
        load_task("rl_contracts.prompts:PromptSource", {"prompts": [1]})


# ---- training batch -----------------------------------------------------------------------------------------
def _rollout_data(rewards, versions, failed=None, prompt_len=2, response_lens=None):
    rows = len(rewards)
    response_lens = response_lens or [3] * rows
    prompts = [[1] * prompt_len for _ in range(rows)]
    responses = [[5 + i] * n for i, n in enumerate(response_lens)]
    logprobs = [[-0.5 - i] * n for i, n in enumerate(response_lens)]
    return TensorDict(
        {
            "prompt_ids": jagged(prompts, torch.int64),
            "response_ids": jagged(responses, torch.int64),
            "response_logprobs": jagged(logprobs, torch.float32),
            "policy_version": torch.tensor(versions, dtype=torch.int64),
            "reward": torch.tensor(rewards, dtype=torch.float32),
            "reward_failed": torch.tensor(failed or [False] * rows),
        },
        batch_size=[rows],
    )


def _config(**train):
    return RLConfig(prompts_per_step=2, n_samples=2, train=TrainConfig(world_size=1, **train))


def _trainer_config(**train):
    """The trainer's part of :func:`_config` (what build_train_batch takes)."""
    return TrainerConfig.from_run(_config(**train))


def test_the_batch_aligns_old_logprobs_and_masks_with_input_ids():
    data = _rollout_data([1.0, 0.0], [0, 0], response_lens=[3, 1])
    batch = build_train_batch(
        data, np.array([0, 0]), pad_token_id=0, trainer_version=0, max_staleness=0, config=_trainer_config()
    ).tensors
    assert batch["input_ids"].tolist() == [[1, 1, 5, 5, 5], [1, 1, 6, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert batch["old_logprobs"].tolist() == [[0, 0, -0.5, -0.5, -0.5], [0, 0, -1.5, 0, 0]]
    assert torch.equal(batch["rollout_logprobs"], batch["old_logprobs"])  # the engine's, kept beside the old policy


def test_old_logprobs_are_recomputed_where_trainer_and_engine_numerics_differ():
    assert not _config().recompute_old_logprobs  # the demo: HF engine on CPU, trainer on CPU
    assert RLConfig(
        prompts_per_step=2, n_samples=2, train=TrainConfig(world_size=1, num_gpus_per_rank=1)
    ).recompute_old_logprobs
    assert RLConfig(mode="async", max_staleness=1, train=TrainConfig(world_size=1)).recompute_old_logprobs
    assert not RLConfig(
        mode="async", max_staleness=1, train=TrainConfig(recompute_old_logprobs=False)
    ).recompute_old_logprobs
    with pytest.raises(ConfigError, match=r"train.rollout_is_low must be in \[0, train.rollout_is_high=2.0\), got 3"):
        RLConfig(train=TrainConfig(rollout_is_low=3))


def test_fsdp_min_layer_params_must_be_a_non_negative_int():
    assert RLConfig().train.fsdp_min_layer_params == 1_000_000
    assert RLConfig(train=TrainConfig(fsdp_min_layer_params=0)).train.fsdp_min_layer_params == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match=rf"train.fsdp_min_layer_params must be an int >= 0, got {bad!r}"):
            RLConfig(train=TrainConfig(fsdp_min_layer_params=bad))


def test_staleness_is_counted_per_trained_token():
    # rows of 3 tokens at staleness 1, 0, 2 (the last too stale: not trained) -> (3*1 + 3*0) / 6 tokens
    data = _rollout_data([1.0, 0.0, 1.0], [4, 5, 3])
    out = build_train_batch(
        data, np.array([0, 0, 0]), pad_token_id=0, trainer_version=5, max_staleness=1, config=_trainer_config()
    )
    assert out.stats["token_staleness_sum"] / out.stats["trained_tokens"] == pytest.approx(0.5)


def test_advantages_are_normalised_within_each_group():
    # group 0: rewards 1, 0 -> +-0.7071 (unbiased std of [1, 0] is 0.7071); group 1: constant -> 0
    data = _rollout_data([1.0, 0.0, 1.0, 1.0], [0, 0, 0, 0])
    out = build_train_batch(
        data, np.array([0, 0, 1, 1]), pad_token_id=0, trainer_version=0, max_staleness=0, config=_trainer_config()
    )
    assert out.tensors["advantages"].tolist() == pytest.approx([0.7071, -0.7071, 0.0, 0.0], abs=1e-3)
    assert out.stats["reward_sum"] == 3.0 and out.stats["correct_sum"] == 3.0


def test_stale_and_failed_samples_are_left_out_of_advantages_and_loss():
    # row 1 is two versions old (max_staleness=1), row 3 failed its reward
    data = _rollout_data([1.0, 1.0, 0.0, 1.0], [5, 3, 5, 5], failed=[False, False, False, True])
    out = build_train_batch(
        data, np.array([0, 0, 0, 0]), pad_token_id=0, trainer_version=5, max_staleness=1, config=_trainer_config()
    )
    mask = out.tensors["response_mask"].sum(1)
    assert mask.tolist() == [3, 0, 3, 0]
    # the group's statistics come from rows 0 and 2 only: rewards 1 and 0
    assert out.tensors["advantages"][[0, 2]].tolist() == pytest.approx([0.7071, -0.7071], abs=1e-3)
    assert (out.stats["stale_rows"], out.stats["failed_rows"], out.stats["trained_rows"]) == (1.0, 1.0, 2.0)
    assert out.stats["staleness_max"] == 2.0


def test_zero_variance_groups_are_filtered_when_asked():
    data = _rollout_data([1.0, 1.0, 1.0, 0.0], [0, 0, 0, 0])
    config = _trainer_config(filters=FilterConfig(nonzero_std_groups=True))
    out = build_train_batch(
        data, np.array([0, 0, 1, 1]), pad_token_id=0, trainer_version=0, max_staleness=0, config=config
    )
    assert out.tensors["response_mask"].sum(1).tolist() == [0, 0, 3, 3]


def test_failed_rows_do_not_make_a_constant_group_look_informative():
    # group 0: one correct answer and one failed reward (its placeholder 0 is no score) -> constant, dropped;
    # group 1: scored 1 and 0 -> kept
    data = _rollout_data([1.0, 0.0, 1.0, 0.0], [0] * 4, failed=[False, True, False, False])
    config = _trainer_config(filters=FilterConfig(nonzero_std_groups=True))
    out = build_train_batch(
        data, np.array([0, 0, 1, 1]), pad_token_id=0, trainer_version=0, max_staleness=0, config=config
    )
    assert out.tensors["response_mask"].sum(1).tolist() == [0, 0, 3, 3]


def test_a_non_finite_reward_that_slips_through_counts_as_failed():
    data = _rollout_data([float("inf"), 0.0, 1.0, 0.0], [0] * 4)
    out = build_train_batch(
        data, np.array([0, 0, 1, 1]), pad_token_id=0, trainer_version=0, max_staleness=0, config=_trainer_config()
    )
    assert torch.isfinite(out.tensors["advantages"]).all()
    assert out.stats["failed_rows"] == 1.0 and out.tensors["response_mask"][0].sum() == 0


def test_over_sampling_trains_on_the_first_groups_the_filters_keep():
    # four groups of two: group 0 all correct, group 2 all wrong (no signal); 1 and 3 carry signal
    data = _rollout_data([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0], [0] * 8)
    group_ids = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    config = _trainer_config(filters=FilterConfig(nonzero_std_groups=True))
    tensors = build_train_batch(
        data, group_ids, pad_token_id=0, trainer_version=0, max_staleness=0, config=config
    ).tensors
    rows, taken = take_groups(tensors, group_ids, quota=1)
    assert rows.tolist() == [2, 3] and taken == 1
    rows, taken = take_groups(tensors, group_ids, quota=5)  # fewer groups with signal than the quota: all of them
    assert rows.tolist() == [2, 3, 6, 7] and taken == 2
    # another rank kept more: this one runs as many rows, the filler masked out of the loss
    padded = pad_rows(tensors, rows, 6)
    assert padded["input_ids"].shape[0] == 6
    assert padded["response_mask"].sum(1).tolist() == [3, 3, 3, 3, 0, 0]
    assert torch.equal(padded["advantages"][:4], tensors["advantages"][[2, 3, 6, 7]])
    with pytest.raises(ValueError, match="cannot fill 9 rows from a batch of 8"):
        pad_rows(tensors, rows, 9)


def test_pad_sequences_handles_empty_responses():
    out = pad_sequences([[1, 2]], [[]], pad_token_id=9)
    assert out["input_ids"].tolist() == [[1, 2]] and out["response_mask"].tolist() == [[0, 0]]


def test_jagged_rows_round_trip():
    rows = [[1, 2, 3], [], [4]]
    assert rows_of(jagged(rows, torch.int64)) == rows


# ---- config -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mode": "sync", "max_staleness": 1}, "mode='sync' trains on-policy: max_staleness must be 0, got 1"),
        ({"mode": "async"}, "mode='async' needs max_staleness >= 1"),
        ({"prompts_per_step": 3}, "prompts_per_step=3 groups must split evenly over train.world_size=2"),
        ({"train.loss": "dpo"}, "train.loss='dpo' is not one of"),
        ({"sync_every": 3}, "sync_every=3 leaves engines up to 2 versions behind, more than max_staleness=0"),
        ({"steps": 0}, "steps must be an int >= 1, got 0"),
        ({"train.max_train_groups": 3}, "train.max_train_groups must be a multiple of train.world_size x"),
        ({"train.max_train_groups": 64}, "train.max_train_groups=64 is more than the prompts_per_step=32 groups"),
        ({"train.lr_warmup_steps": -1}, "train.lr_warmup_steps must be an int >= 0, got -1"),
        ({"sft.eval_samples": 0}, "sft.eval_samples must be an int >= 1, got 0"),
        ({"sft.eval_every": 0}, "sft.eval_every must be an int >= 1, got 0"),
        (
            {"rollout.generate_fn": "workers.agents.rollout_fns:single_turn_generate", "weight_sync": "shm"},
            "use weight_sync='memory' or 'disk', not 'shm'",
        ),
        ({"weight_delta": True}, "weight_delta=true needs weight_sync='shm' (the shared-memory weight channel), got"),
    ],
)
def test_inconsistent_configs_fail_before_any_actor_starts(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_the_rl_learning_rate_warms_up_linearly_as_the_single_process_scheduler_does():
    # addition_single_process.py: LambdaLR(lambda step: min(1.0, (step + 1) / warmup)), read before each step
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    expected = []
    for _ in range(5):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert [warmup_factor(step, 3) for step in range(5)] == pytest.approx(expected)
    assert expected[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert [warmup_factor(step, 0) for step in range(3)] == [1.0, 1.0, 1.0]


def test_the_warm_up_counts_every_ppo_epoch_of_every_round_as_an_optimizer_step():
    # 3 global steps of 2 DP rounds of 3 epochs: 18 optimizer steps, numbered in the order they are taken
    taken = [rl_optimizer_step(v, k, e, rounds=2, epochs=3) for v in range(3) for k in range(2) for e in range(3)]
    assert taken == list(range(18))
    assert [rl_optimizer_step(v, 0, 0, rounds=1, epochs=1) for v in range(3)] == [0, 1, 2]  # as before the epochs


def test_the_rl_adamw_takes_the_betas_of_the_train_section_and_keeps_adamws_by_default():
    assert rl_adamw(_trainer_config()).betas == AdamWConfig().betas == (0.9, 0.999)
    assert rl_adamw(_trainer_config(beta1=0.8, beta2=0.95, lr=1e-3, weight_decay=0.1)) == AdamWConfig(
        lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1
    )


def test_the_async_window_sets_the_step_ring():
    config = load_config(None, {"mode": "async", "max_staleness": 2})
    assert config.num_global_batch == 3


def test_yaml_configs_and_overrides_load(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 7\ntrain:\n  lr: 0.01\n")
    config = load_config(path, parse_overrides(["train.world_size=1", "rollout.temperature=0.5"]))
    assert (config.steps, config.train.lr, config.train.world_size, config.rollout.temperature) == (7, 0.01, 1, 0.5)
    with pytest.raises(ConfigError, match="invalid config"):
        load_config(None, {"steps": "many"})
    with pytest.raises(ConfigError, match="an override is KEY=VALUE"):
        parse_overrides(["steps"])


def test_the_shipped_configs_are_valid():
    from recipe.agentrl_demo import DEFAULT_CONFIG, AgentRLDemoConfig

    recipe = Path(__file__).resolve().parents[3] / "recipe"
    own_class = {DEFAULT_CONFIG.resolve(): AgentRLDemoConfig}  # the recipes whose config is not an RLConfig
    paths = [*recipe.glob("configs/*.yaml"), *recipe.glob("*/config.yaml")]
    for path in paths:
        load_config(path, cls=own_class.get(path.resolve(), RLConfig))
    assert DEFAULT_CONFIG.resolve() in [path.resolve() for path in paths]


# ---- metrics ------------------------------------------------------------------------------------------------
def test_metrics_are_written_as_jsonl_and_plotted(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    for step in range(12):
        log.write(
            {"kind": "grpo", "step": step, "reward": step / 12, "loss": float("nan"), "generate_s": 0.1, "train_s": 0.2}
        )
    rows = log.rows("grpo")
    assert len(rows) == 12 and rows[0]["loss"] is None  # NaN becomes null: the file stays valid JSON
    json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    png = plot_metrics(tmp_path / "m.jsonl", tmp_path / "m.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    import matplotlib.image

    # reward + the time-breakdown panel: two panels side by side (3.2 inches each at 120 dpi)
    assert matplotlib.image.imread(png).shape[1] == 2 * 384
    assert fifth_means([0, 0, 1, 1, 1, 1, 1, 1, 2, 2]) == (0.0, 2.0)


def test_the_plot_shows_what_tells_a_run_is_healthy_not_the_loss_nor_curves_that_are_zero_throughout():
    rows = [
        {"step": s, "reward": 0.5, "loss": -0.001, "entropy": 0.4, "grad_norm": 0.2, "staleness_mean": 0.0, "kl": None}
        for s in range(3)
    ]
    assert [key for key, _ in plotted_panels(rows)] == ["reward", "entropy", "grad_norm"]
    rows[1]["staleness_mean"] = 1.0  # an async run's staleness is a curve worth a panel
    assert [key for key, _ in plotted_panels(rows)][-1] == "staleness_mean"


def _every_curve(step: int) -> dict[str, Any]:
    """A GRPORun row with every curve it plots, each its own (distinct, non-zero) values (not the agentrl demo's
    ``staleness`` and ``eval_reward``: GRPORun's are ``staleness_mean`` and ``eval_accuracy``)."""
    row: dict[str, Any] = {"kind": "grpo", "step": step, "generate_s": 0.1, "train_s": 0.2, "step_s": 0.35}
    for i, (key, _) in enumerate(PLOTTED):
        if key not in ("staleness", "eval_reward"):
            row[key] = (i + 1) * (step + 1) + 0.5 * (step % 2)
    return row


def test_many_panels_are_a_grid_that_fits_a_screen(tmp_path):
    import matplotlib.image
    import matplotlib.pyplot as plt

    log = MetricsLog(tmp_path / "m.jsonl")
    for step in range(12):
        log.write(_every_curve(step))
    png = plot_metrics(tmp_path / "m.jsonl", tmp_path / "m.png")
    height, width = matplotlib.image.imread(png).shape[:2]
    # 11 curves + the seconds per step: 4 columns x 3 rows of 3.2 x 2.8 inches at 120 dpi (was one 4608 x 336 strip)
    assert (width, height) == (1536, 1008)
    fig = metrics_figure(log.rows())
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 12 and len({round(ax.get_position().y0, 3) for ax in visible}) == 3
    plt.close(fig)
    log.write({"kind": "sft", "step": 25, "sft_loss": 1.0, "accuracy": 0.5})  # 13 panels: 4 rows, scaled down
    height, width = matplotlib.image.imread(plot_metrics(log.path, tmp_path / "m.png")).shape[:2]
    assert (width, height) == (1234, 1080)


def test_a_curve_equal_to_another_is_drawn_once_under_both_names():
    import matplotlib.pyplot as plt

    rows = [{"kind": "grpo", "step": s, "reward": r, "accuracy": r, "success": r} for s, r in enumerate([0.25, 0.5])]
    rows[1]["success"] = 0.75  # success differs at one step: a curve of its own
    assert plotted_panels(rows) == [
        ("reward", "GRPO mean reward (= accuracy)"),
        ("success", "episode success rate"),
    ]
    rows[1]["success"] = 0.5
    fig = metrics_figure(rows)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["GRPO mean reward (= accuracy, success)"]
    [line] = fig.axes[0].get_lines()
    assert list(line.get_ydata()) == [0.25, 0.5]
    plt.close(fig)


def test_eval_rows_are_drawn_at_their_steps_next_to_the_grpo_curves():
    import matplotlib.pyplot as plt

    rows = [{"kind": "grpo", "step": s, "reward": 0.1 * s} for s in range(4)]
    rows += [{"kind": "eval", "step": s, "eval_reward": r, "eval_accuracy": r} for s, r in ((2, 0.25), (4, 0.5))]
    fig = metrics_figure(rows)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["GRPO mean reward", "eval reward (held-out tasks) (= eval_accuracy)"]
    [line] = fig.axes[1].get_lines()
    assert list(line.get_xdata()) == [2, 4] and list(line.get_ydata()) == [0.25, 0.5]
    plt.close(fig)


def test_the_sft_warm_up_has_its_own_panel_before_the_grpo_curves(tmp_path):
    import matplotlib.pyplot as plt

    log = MetricsLog(tmp_path / "m.jsonl")
    for step in (25, 50, 75):
        log.write({"kind": "sft", "step": step, "sft_loss": 3.0 / step, "accuracy": step / 100, "elapsed_s": 1.0})
    for step in range(3):
        log.write({"kind": "grpo", "step": step, "reward": 0.8, "grad_norm": 0.1 * (step + 1)})
    fig = metrics_figure(log.rows())
    sft, *others = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert sft.get_title() == "SFT warm-up" and [ax.get_title() for ax in others] == [
        "GRPO mean reward",
        "gradient norm (before clipping)",
    ]
    loss, accuracy = [line for ax in fig.axes if ax.bbox.bounds == sft.bbox.bounds for line in ax.get_lines()]
    assert list(loss.get_xdata()) == [25, 50, 75] and list(accuracy.get_ydata()) == [0.25, 0.5, 0.75]
    plt.close(fig)
    # an SFT-only run (recipe/sft.py) still gets a plot
    only_sft = MetricsLog(tmp_path / "sft.jsonl")
    only_sft.write({"kind": "sft", "step": 25, "sft_loss": 1.0, "accuracy": 0.5})
    assert plot_metrics(only_sft.path, tmp_path / "sft.png", title="SFT").read_bytes()[:4] == b"\x89PNG"


def test_without_a_terminal_progress_is_one_plain_line_of_health_metrics_every_n_steps():
    out = io.StringIO()
    reporter = StepReporter(0, 5, every=2, stream=out, terminal=False)
    for step in range(5):
        reporter.update(step, {"reward": 0.5, "kl": 0.001, "entropy": 1.25, "grad_norm": 0.5, "step_s": 0.2, "loss": 0})
    reporter.close()
    lines = out.getvalue().splitlines()
    assert lines == [
        f"GRPO step {n}/5 | reward 0.500 | kl 0.0010 | entropy 1.250 | grad_norm 0.500 | step_s 0.20" for n in (2, 4, 5)
    ]
    assert "\r" not in out.getvalue()


def test_the_run_report_names_what_each_time_measures():
    from orchestration.grpo_run import time_line

    line = time_line(1000, 336.0, {"warm_up_s": 52.0, "grpo_s": 216.0})
    assert line == (
        "GRPO: 1000 steps in 216.0 s, 0.216 s a step; the whole run 336.0 s "
        "(start-up and wind-down 68.0 s, SFT warm-up or resume 52.0 s, GRPO 216.0 s)"
    )
    assert time_line(0, 5.0, {}) == (
        "GRPO: 0 steps in 0.0 s; the whole run 5.0 s "
        "(start-up and wind-down 5.0 s, SFT warm-up or resume 0.0 s, GRPO 0.0 s)"
    )


def test_several_ppo_epochs_recompute_the_old_logprobs_unless_told_not_to():
    # the demo's sync run on CPU keeps the engine's log-probs with one epoch, recomputes them with two
    assert not _config().recompute_old_logprobs
    assert _config(ppo_epochs=2).recompute_old_logprobs
    # an explicit choice wins, as it does with several minibatches or in async mode
    assert not _config(ppo_epochs=2, recompute_old_logprobs=False).recompute_old_logprobs
    assert not RLConfig(
        mode="async", max_staleness=1, train=TrainConfig(ppo_epochs=2, recompute_old_logprobs=False)
    ).recompute_old_logprobs
