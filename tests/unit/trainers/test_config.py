"""Every key of RLConfig has a type and a range, checked when the config is parsed: a bad value is a ConfigError
naming the key, the allowed values and the value given, before anything starts (issue 25, section 3)."""

from __future__ import annotations

import pytest

from trainers.config import KEY_RANGES, UNRANGED_KEYS, ConfigError, RLConfig, TrainConfig, config_keys, load_config


def test_every_key_has_a_range_or_is_listed_as_free():
    keys = set(config_keys())
    assert keys - KEY_RANGES.keys() - UNRANGED_KEYS == set(), "give the new key a range in KEY_RANGES"
    assert (KEY_RANGES.keys() | UNRANGED_KEYS) - keys == set(), "a stale key in KEY_RANGES or UNRANGED_KEYS"


def test_every_default_is_in_its_own_range():
    RLConfig().validate()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("train.lr", -1, "train.lr must be a float > 0, got -1"),
        ("train.lr", 0, "train.lr must be a float > 0, got 0"),
        ("train.lr", float("nan"), "train.lr must be a float > 0, got nan"),
        ("sft.lr", 0.0, "sft.lr must be a float > 0, got 0.0"),
        ("train.weight_decay", -0.1, "train.weight_decay must be a float >= 0, got -0.1"),
        ("train.grad_clip", 0, "train.grad_clip must be a float > 0, got 0"),
        ("train.num_gpus_per_rank", -1, "train.num_gpus_per_rank must be a float >= 0, got -1"),
        ("train.kl_coef", -0.5, "train.kl_coef must be a float >= 0, got -0.5"),
        ("train.clip_low", 1.0, "train.clip_low must be a float in [0, 1) or None, got 1.0"),
        ("train.clip_high", -0.2, "train.clip_high must be a float >= 0 or None, got -0.2"),
        ("train.rollout_is_high", 0, "train.rollout_is_high must be a float > 0, got 0"),
        ("train.micro_batch_size", 0, "train.micro_batch_size must be an int >= 1, got 0"),
        ("train.world_size", 0, "train.world_size must be an int >= 1, got 0"),
        ("train.filters.max_trained_count", 0, "train.filters.max_trained_count must be an int >= 1 or None, got 0"),
        ("train.filters.zero_std_eps", -1.0, "train.filters.zero_std_eps must be a float >= 0, got -1.0"),
        ("rollout.top_p", 1.5, "rollout.top_p must be a float in (0, 1], got 1.5"),
        ("rollout.top_p", 0, "rollout.top_p must be a float in (0, 1], got 0"),
        ("rollout.temperature", -1, "rollout.temperature must be a float >= 0, got -1"),
        ("rollout.num_task_servers", 0, "rollout.num_task_servers must be an int >= 1, got 0"),
        ("rollout.task_server_max_episodes", 0, "rollout.task_server_max_episodes must be an int >= 1 or None, got 0"),
        ("sft.batch_size", 0, "sft.batch_size must be an int >= 1, got 0"),
        ("sft.max_steps", 0, "sft.max_steps must be an int >= 1, got 0"),
        ("sft.target_accuracy", 1.2, "sft.target_accuracy must be a float in [0, 1], got 1.2"),
        ("task.num_train_prompts", 0, "task.num_train_prompts must be an int >= 1, got 0"),
        ("task.num_eval_prompts", 0, "task.num_eval_prompts must be an int >= 1, got 0"),
        ("task.seed", -1, "task.seed must be an int >= 0, got -1"),
        ("seed", -3, "seed must be an int >= 0, got -3"),
        ("queue_timeout", 0, "queue_timeout must be a float > 0, got 0"),
        ("checkpoint_every", -1, "checkpoint_every must be an int >= 0 or None, got -1"),
        ("eval_every", -1, "eval_every must be an int >= 0, got -1"),
        ("max_staleness", -1, "max_staleness must be an int >= 0, got -1"),
        ("prompts_per_step", 2.5, "prompts_per_step must be an int >= 1, got 2.5"),
        ("train.kl_kind", "k4", "train.kl_kind must be one of ['k1', 'k2', 'k3'], got 'k4'"),
        (
            "train.loss_agg",
            "mean",
            "train.loss_agg must be one of ['seq-mean-token-mean', 'seq-mean-token-sum', 'token-mean'] or None, "
            "got 'mean'",
        ),
        ("rollout.engine_device", "gpu", "rollout.engine_device must be cpu, cuda or cuda:N, got 'gpu'"),
        ("rollout.generate_fn", "my_fn", "rollout.generate_fn must be 'module:name' or None, got 'my_fn'"),
    ],
)
def test_a_value_out_of_range_names_the_key_the_range_and_the_value(key, value, message):
    escaped = message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ConfigError, match=f"^{escaped} \\(from the override {key}="):
        load_config(None, {key: value})


def test_booleans_are_not_numbers():
    with pytest.raises(ConfigError, match=r"train.micro_batch_size must be an int >= 1, got True"):
        RLConfig(train=TrainConfig(micro_batch_size=True))
    with pytest.raises(ConfigError, match=r"train.lr must be a float > 0, got True"):
        RLConfig(train=TrainConfig(lr=True))


def test_values_at_the_edges_of_their_ranges_are_taken():
    config = load_config(
        None,
        {
            "rollout.top_p": 1,
            "rollout.temperature": 0,
            "sft.target_accuracy": 0,
            "train.clip_low": 0,
            "train.lr": 1e-9,
            "checkpoint_every": 0,
            "rollout.engine_device": "cuda:1",
        },
    )
    assert config.rollout.top_p == 1 and config.train.clip_low == 0


@pytest.mark.parametrize(("steps", "interval"), [(1000, 100), (200, 20), (5000, 100), (25, 3), (3, 1)])
def test_by_default_a_run_checkpoints_about_ten_times_and_at_least_every_100_steps(steps, interval):
    config = load_config(None, {"steps": steps})
    assert config.checkpoint_every is None
    assert config.checkpoint_interval == interval


def test_a_checkpoint_every_given_is_kept_and_0_saves_only_at_the_end():
    assert load_config(None, {"steps": 1000, "checkpoint_every": 7}).checkpoint_interval == 7
    assert load_config(None, {"steps": 1000, "checkpoint_every": 0}).checkpoint_interval == 0
