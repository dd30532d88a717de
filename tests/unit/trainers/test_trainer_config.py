"""The trainer takes its own config (issue 24): ``TrainerConfig``, the trainer's part of a run's ``RLConfig``, built by
``TrainerConfig.from_run``; ``trainers/grpo.py`` never sees the whole run config, and refuses one by type. The run's
config lives in ``orchestration/config.py``; ``trainers/config.py`` knows only the shape it reads of it."""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from orchestration.config import RLConfig, RolloutConfig, TaskConfig
from tests.unit.orchestration.test_rl_pieces import _rollout_data
from trainers import grpo
from trainers.config import RunConfigView, TrainConfig, TrainerConfig
from trainers.filters import FilterConfig

GRPO_SOURCE = Path(grpo.__file__).read_text(encoding="utf-8")


def _run_config() -> RLConfig:
    """A run whose every value the trainer takes differs from its default and from each other."""
    return RLConfig(
        task=TaskConfig(num_train_prompts=15, seed=16),
        rollout=RolloutConfig(temperature=0.7, partial_rollout=True, generate_fn="my_rollouts:generate"),
        train=TrainConfig(world_size=2, lr=0.0123, kl_coef=0.25, filters=FilterConfig(nonzero_std_groups=True)),
        seed=11,
        prompts_per_step=12,
        n_samples=13,
        mode="async",  # recompute_old_logprobs resolves to True (train.recompute_old_logprobs stays None)
        max_staleness=3,
        queue_timeout=14.5,
    )


def test_from_run_takes_each_field_from_its_place_in_the_run_config() -> None:
    run = _run_config()
    config = TrainerConfig.from_run(run)
    expected = {
        "train": run.train,
        "seed": 11,
        "prompts_per_step": 12,
        "n_samples": 13,
        "max_staleness": 3,
        "queue_timeout": 14.5,
        "recompute_old_logprobs": True,
        "temperature": 0.7,
        "partial_rollout": True,
        "trajectories": True,
        "num_train_prompts": 15,
        "task_seed": 16,
    }
    assert {f.name: getattr(config, f.name) for f in dataclasses.fields(TrainerConfig)} == expected
    assert config.train is not run.train  # a copy: the run's section stays its own
    assert run.train.recompute_old_logprobs is None  # the resolved value came from the run, not the section


def test_from_run_reads_any_config_of_a_run_s_shape_not_only_the_orchestration_s_class() -> None:
    """trainers/ cannot import orchestration.config (tests/unit/test_layering.py): from_run reads the shape it names
    (RunConfigView), so a run config of another class, with only those values, gives the same TrainerConfig."""
    run = _run_config()
    shaped = SimpleNamespace(
        train=run.train,
        rollout=SimpleNamespace(temperature=0.7, partial_rollout=True, generate_fn="my_rollouts:generate"),
        task=SimpleNamespace(num_train_prompts=15, seed=16),
        seed=11,
        prompts_per_step=12,
        n_samples=13,
        max_staleness=3,
        queue_timeout=14.5,
        recompute_old_logprobs=True,
    )
    assert TrainerConfig.from_run(shaped) == TrainerConfig.from_run(run)
    assert {name for name in dir(RunConfigView) if not name.startswith("_")} == set(vars(shaped))


def test_the_defaults_of_a_run_map_to_the_trainer_defaults_of_a_plain_run() -> None:
    config = TrainerConfig.from_run(RLConfig(prompts_per_step=2, train=TrainConfig(world_size=1)))
    assert (config.recompute_old_logprobs, config.partial_rollout, config.trajectories) == (False, False, False)


def test_the_trainer_config_is_frozen_and_crosses_ray_by_pickle() -> None:
    config = TrainerConfig.from_run(_run_config())
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1  # type: ignore[misc]


def test_the_trainer_module_never_names_the_run_config() -> None:
    assert "RLConfig" not in GRPO_SOURCE
    imported = {
        alias.name
        for node in ast.walk(ast.parse(GRPO_SOURCE))
        if isinstance(node, ast.ImportFrom) and node.module == "trainers.config"
        for alias in node.names
    }
    assert imported == {"TrainerConfig"}


def _is_the_config(node: ast.expr) -> bool:
    """``cfg``, ``config`` or ``self.config``: the trainer's config in trainers/grpo.py."""
    if isinstance(node, ast.Name):
        return node.id in {"cfg", "config"}
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "config"
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def test_the_trainer_reads_exactly_the_fields_of_its_config() -> None:
    """Every ``cfg.X`` / ``config.X`` / ``self.config.X`` of trainers/grpo.py is a TrainerConfig field, and every field
    is read there (no field that nothing uses)."""
    tree = ast.parse(GRPO_SOURCE)
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and _is_the_config(node.value)}
    assert read == {f.name for f in dataclasses.fields(TrainerConfig)}


def test_a_run_config_given_to_the_trainer_is_a_type_error_naming_both() -> None:
    message = (
        r"the trainer takes a trainers\.config\.TrainerConfig \(TrainerConfig\.from_run\(config\) builds one from a "
        r"run's config\), got orchestration\.config\.RLConfig"
    )
    with pytest.raises(TypeError, match=message):
        grpo.expect_trainer_config(RLConfig())
    rank_class = grpo.GRPOTrainerRank.__ray_metadata__.modified_class  # the plain class behind the Ray actor
    with pytest.raises(TypeError, match=message):  # refused before the rank connects to anything
        rank_class(0, 1, None, RLConfig(), None)
    with pytest.raises(TypeError, match=r"got builtins\.dict"):
        grpo.build_train_batch(
            _rollout_data([1.0, 0.0], [0, 0]),
            np.array([0, 0]),
            pad_token_id=0,
            trainer_version=0,
            max_staleness=0,
            config={"n_samples": 2},  # type: ignore[arg-type]
        )


def test_a_trainer_config_passes_the_check_unchanged() -> None:
    config = TrainerConfig.from_run(_run_config())
    assert grpo.expect_trainer_config(config) is config


def test_the_dynamic_batching_keys_reach_the_policy_and_the_kl_reference(monkeypatch) -> None:
    built: list[dict] = []

    class RecordedPolicy:
        def __init__(self, model: object, **kwargs: object) -> None:
            built.append(kwargs)
            self.device = "cpu"

        def full_state_dict(self) -> dict:
            return {}

    monkeypatch.setattr(grpo, "FSDPPolicy", RecordedPolicy)
    monkeypatch.setattr(grpo, "init_process_group", lambda *args: "cpu")
    rank = object.__new__(grpo.GRPOTrainerRank.__ray_metadata__.modified_class)  # no queue client, no Ray
    train = TrainConfig(dynamic_batching=True, max_tokens_per_micro_batch=321)
    rank.rank, rank.world_size, rank.policy = 1, 2, None
    rank.config = dataclasses.replace(TrainerConfig.from_run(_run_config()), train=train)
    rank.task = SimpleNamespace(build_policy=lambda: object())
    rank.setup("127.0.0.1", 1)
    rank.init_reference()
    assert [(kw["dynamic_batching"], kw["max_tokens_per_micro_batch"]) for kw in built] == [(True, 321)] * 2
    assert TrainConfig().dynamic_batching is False  # off by default: micro_batch_size rows, as before
