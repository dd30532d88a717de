"""The run's config (orchestration/config.py). Every key of RLConfig has a type and a range, checked when the config
is parsed: a bad value is a ConfigError naming the key, the allowed values and the value given, before anything starts
(issue 25, section 3); unknown keys are refused by name; --help and --print-config show every key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestration.config import (
    KEY_RANGES,
    UNRANGED_KEYS,
    ConfigError,
    RLConfig,
    config_from_cli,
    config_keys,
    config_to_dict,
    load_config,
)
from trainers.config import TrainConfig

DEMO_YAML = "recipe/configs/demo.yaml"


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
        ("train.max_tokens_per_micro_batch", 0, "train.max_tokens_per_micro_batch must be an int >= 1, got 0"),
        ("train.world_size", 0, "train.world_size must be an int >= 1, got 0"),
        ("train.loss_seq_chunk_size", 0, "train.loss_seq_chunk_size must be an int >= 1 or None, got 0"),
        ("train.ppo_epochs", 0, "train.ppo_epochs must be an int >= 1, got 0"),
        ("train.ppo_epochs", 1.5, "train.ppo_epochs must be an int >= 1, got 1.5"),
        ("train.beta1", 1.0, "train.beta1 must be a float in [0, 1), got 1.0"),
        ("train.beta1", -0.1, "train.beta1 must be a float in [0, 1), got -0.1"),
        ("train.beta2", 1, "train.beta2 must be a float in [0, 1), got 1"),
        ("train.filters.max_trained_count", 0, "train.filters.max_trained_count must be an int >= 1 or None, got 0"),
        ("train.filters.zero_std_eps", -1.0, "train.filters.zero_std_eps must be a float >= 0, got -1.0"),
        ("rollout.top_p", 1.5, "rollout.top_p must be a float in (0, 1], got 1.5"),
        ("rollout.top_p", 0, "rollout.top_p must be a float in (0, 1], got 0"),
        ("rollout.temperature", -1, "rollout.temperature must be a float >= 0, got -1"),
        ("rollout.num_task_servers", 0, "rollout.num_task_servers must be an int >= 1, got 0"),
        ("rollout.inf_tp_size", 0, "rollout.inf_tp_size must be an int >= 1, got 0"),
        ("rollout.inf_ep_size", 1.5, "rollout.inf_ep_size must be an int >= 1, got 1.5"),
        ("rollout.inf_mem_ratio", 0, "rollout.inf_mem_ratio must be a float in (0, 1] or None, got 0"),
        ("rollout.inf_mem_ratio", 1.2, "rollout.inf_mem_ratio must be a float in (0, 1] or None, got 1.2"),
        ("rollout.task_server_max_episodes", 0, "rollout.task_server_max_episodes must be an int >= 1 or None, got 0"),
        ("rollout.max_worker_restarts", -2, "rollout.max_worker_restarts must be an int >= -1, got -2"),
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
            "train.beta1": 0,
            "train.beta2": 0.9999,
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


OWN_FILES = {"model.path": "m", "data.train_files": "t.jsonl", "reward.fn": "rw:score", "sft.enabled": False}


def test_own_files_keys_load_and_select_the_file_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestration.grpo_run import FILE_TASK, run_task_kwargs, run_task_name

    monkeypatch.chdir(tmp_path)
    config = load_config(None, {**OWN_FILES, "data.val_files": ["v1.parquet", "v2.parquet"], "reward.batch": True})
    assert config.trains_on_files and run_task_name(config) == FILE_TASK
    assert run_task_kwargs(config) == {  # paths made absolute in the driver: actors have other working directories
        "model_path": f"{tmp_path}/m", "train_files": f"{tmp_path}/t.jsonl",
        "val_files": [f"{tmp_path}/v1.parquet", f"{tmp_path}/v2.parquet"], "prompt_key": "prompt",
        "reward_fn": "rw:score", "reward_batch": True,
    }  # fmt: skip
    in_file = load_config(None, {**OWN_FILES, "reward.fn": "lib/my_reward.py:score"})
    assert run_task_kwargs(in_file)["reward_fn"] == f"{tmp_path}/lib/my_reward.py:score"
    plain = load_config(None, {"task.kwargs": {"a": 1}})
    assert not plain.trains_on_files and run_task_kwargs(plain) == {"a": 1}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model.path": "m"}, "training on your own files needs model.path, data.train_files and reward.fn together; "
         "missing data.train_files, reward.fn"),
        ({**OWN_FILES, "task.name": "pkg.mod:MyTask"}, "task.name='pkg.mod:MyTask' conflicts with "
         "model.path/data.train_files, which train on your own files with reward.fn: drop the task.* keys, or drop "
         "model/data/reward to train a Task class"),
        ({**OWN_FILES, "task.reward_fn": "a:b"}, "task.reward_fn='a:b' conflicts with model.path/data.train_files"),
        ({**OWN_FILES, "sft.enabled": True}, "sft.enabled=True needs reference responses, which data.train_files has "
         "none of: set sft.enabled=false"),
        ({**OWN_FILES, "reward.fn": "score"}, "reward.fn must be 'module:function' or "
         "'path/to/file.py:function' or None, got 'score'"),
        ({**OWN_FILES, "data.prompt_key": ""}, "data.prompt_key must be a column name, got ''"),
    ],
)  # fmt: skip
def test_own_files_keys_refuse_what_cannot_work(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value)


def test_the_class_variable_of_the_ranges_is_not_a_config_key() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'KEY_RANGES' in the override KEY_RANGES=\{\}"):
        load_config(None, {"KEY_RANGES": {}})
    assert "KEY_RANGES" not in config_keys() and RLConfig.KEY_RANGES is KEY_RANGES


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"stepz": 3}, r"unknown config key 'stepz' in the override stepz=3; did you mean steps\?"),
        ({"train.lrr": 1}, r"unknown config key 'train.lrr' in the override train.lrr=1; did you mean train.lr,"),
        ({"train.filters.nonzero_std": True}, r"did you mean train.filters.nonzero_std_groups"),
        ({"train": 3}, r"train is a section: expected a mapping of its keys in the override train=3, got 3"),
    ],
)
def test_unknown_keys_are_refused_naming_the_closest_valid_ones(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_unknown_keys_in_a_yaml_file_name_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  temprature: 0.5\n")
    with pytest.raises(ConfigError, match=rf"unknown config key 'rollout.temprature' in {path}; did you mean"):
        load_config(path)


def test_a_bad_value_names_the_override_that_carried_it(tmp_path):
    with pytest.raises(
        ConfigError, match=r"Expected `float`, got `str` - at `\$.train.lr` \(from the override train.lr='x'\)"
    ):
        load_config(DEMO_YAML, {"train.lr": "x"})
    with pytest.raises(ConfigError, match=r"steps must be an int >= 1, got 0 \(from the override steps=0\)"):
        load_config(DEMO_YAML, {"steps": 0})
    path = tmp_path / "bad.yaml"
    path.write_text("steps: 0\n")
    with pytest.raises(ConfigError, match=rf"steps must be an int >= 1, got 0 \(from {path}\)"):
        load_config(path)


def test_help_lists_every_key_with_default_and_meaning(capsys):
    keys = config_keys()
    assert all(meaning for _, meaning in keys.values()), [k for k, (_, m) in keys.items() if not m]
    with pytest.raises(SystemExit):
        config_from_cli("demo", DEMO_YAML, ["--help"])
    out = capsys.readouterr().out
    for key in keys:
        assert f"  {key} = " in out, key
    assert "  output_dir = 'outputs/demo'" in out  # the recipe's YAML value, not the dataclass default


def test_print_config_prints_the_resolved_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        config_from_cli("demo", DEMO_YAML, ["--print-config", "steps=7", "train.lr=0.01"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["steps"] == 7 and printed["train"]["lr"] == 0.01
    assert printed == config_to_dict(load_config(DEMO_YAML, {"steps": 7, "train.lr": 0.01}))


def test_a_loss_is_named_in_any_case_and_an_unknown_one_refused() -> None:
    assert load_config(None, {"train.loss": "GRPO"}).train.loss == "grpo"  # AgentRL's guide writes GRPO
    assert load_config(None, {"train.loss": "Cispo"}).train.loss == "cispo"
    with pytest.raises(
        ConfigError, match=r"train.loss='GRPX' is not one of \['cispo', 'grpo', 'gspo', 'minirl', 'ppo'\]"
    ):
        load_config(None, {"train.loss": "GRPX"})


SUPPORTED = "supported: train.world_size (FSDP2 data parallel) and train.tp_size (tensor parallel within a node)"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"train.pp_size": 2}, f"train.pp_size=2: pipeline parallelism is not supported; {SUPPORTED}"),
        ({"train.ep_size": 4}, f"train.ep_size=4: expert parallelism is not supported; {SUPPORTED}"),
        ({"train.cp_size": 2}, f"train.cp_size=2: context (sequence) parallelism is not supported; {SUPPORTED}"),
        ({"train.world_size": 4, "train.tp_size": 3}, "train.tp_size=3 must divide train.world_size=4: the ranks "
         "form world_size / tp_size tensor-parallel groups of tp_size ranks, one data-parallel rank each"),
        ({"train.tp_size": 0}, "train.tp_size must be an int >= 1, got 0"),
        # each TP group reads one DP share: the step's groups split over world_size / tp_size DP ranks
        ({"train.world_size": 4, "train.tp_size": 2, "prompts_per_step": 3}, "prompts_per_step=3 groups must split "
         "evenly over train.world_size=4 / train.tp_size=2 = 2 DP ranks x train.minibatches_per_step=1; use a "
         "multiple of 2"),
        ({"train.world_size": 4, "train.tp_size": 2, "train.max_train_groups": 3}, "train.max_train_groups must be a "
         "multiple of train.world_size / train.tp_size x train.minibatches_per_step = 2 (each rank's share of a "
         "round), got 3"),
    ],
)  # fmt: skip
def test_parallelism_other_than_fsdp_and_tensor_parallel_is_refused_naming_what_is_supported(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert f"{message} (from the override" in str(error.value)


def test_tensor_parallel_groups_take_one_dp_share_each():
    # 2 DP ranks of 2 TP ranks: 6 groups split over 2 DP ranks (over 4 ranks they would not)
    config = load_config(None, {"train.world_size": 4, "train.tp_size": 2, "prompts_per_step": 6})
    assert (config.train.tp_size, config.train.pp_size, config.train.ep_size, config.train.cp_size) == (2, 1, 1, 1)
    with pytest.raises(ConfigError, match=r"over train\.world_size=4 ranks x"):
        load_config(None, {"train.world_size": 4, "prompts_per_step": 6})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"queue_replicas": 3}, r"^queue_replicas must be an int in \[1, 2\], got 3"),
        ({"queue_replicas": 2}, r"queue_replicas=2 needs num_storage_units >= 3, got 2: a put goes to a unit and"),
        ({"queue_journal": True}, r"queue_journal=true cannot go with checkpoint_queue=true"),
    ],
)
def test_queue_keys_refuse_what_the_queue_cannot_do(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_queue_replicas_and_journal_go_together_without_a_queue_checkpoint() -> None:
    overrides = {"queue_replicas": 2, "num_storage_units": 3, "queue_journal": True, "checkpoint_queue": False}
    cfg = load_config(None, overrides)
    assert (cfg.queue_replicas, cfg.queue_journal) == (2, True)
    assert (load_config(None).queue_replicas, load_config(None).queue_journal) == (1, False)
