"""The run as its user drives it: what a run does with an output_dir that already holds one (resume, extend, refuse,
--new), decided before any actor starts. The config's keys, --help and --print-config: test_config.py."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from orchestration.config import ConfigError, config_from_cli, config_to_dict, load_config
from orchestration.run_plan import plan_run
from trainers.checkpoint import checkpoint_path

DEMO_YAML = "recipe/configs/demo.yaml"


def _finished_run(out, steps: int, **overrides):
    """What a run leaves in its output_dir: config.yaml and a complete checkpoint at ``steps``."""
    config = load_config(DEMO_YAML, {"output_dir": str(out), "steps": steps, **overrides})
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    path = checkpoint_path(out / "checkpoints", steps)
    (path / "dcp").mkdir(parents=True)
    (path / "dcp" / ".metadata").touch()
    (path / "checkpoint.json").write_text(json.dumps({"extra_state": {"step": steps}}))
    return config


def test_a_fresh_output_dir_starts_a_new_run(tmp_path):
    plan = plan_run(load_config(DEMO_YAML, {"output_dir": str(tmp_path / "x")}))
    assert (plan.kind, plan.start_step) == ("fresh", 0)


def test_the_same_steps_again_is_refused_not_a_silent_no_op(tmp_path):
    out = tmp_path / "demo"
    _finished_run(out, 5)
    with pytest.raises(ConfigError, match=r"already finished 5 steps; steps=5 would train nothing\. Pass steps="):
        plan_run(load_config(DEMO_YAML, {"output_dir": str(out), "steps": 5}))


def test_more_steps_extend_the_run_and_say_so(tmp_path):
    out = tmp_path / "demo"
    _finished_run(out, 5)
    plan = plan_run(load_config(DEMO_YAML, {"output_dir": str(out), "steps": 8, "eval_every": 2}))
    assert (plan.kind, plan.start_step) == ("resume", 5)
    assert plan.message == f"resuming {out} from its checkpoint at step 5, on to step 8"


def test_a_changed_training_setting_is_refused_naming_it(tmp_path):
    out = tmp_path / "demo"
    _finished_run(out, 5)
    # README's follow-up after `make demo`: more steps at another learning rate
    with pytest.raises(
        ConfigError, match=r"other settings \(train.lr: 0.0003 -> 0.0005\), which cannot apply on resume"
    ):
        plan_run(load_config(DEMO_YAML, {"output_dir": str(out), "steps": 200, "train.lr": 5e-4}))


def test_new_moves_the_old_run_aside_and_starts_over(tmp_path):
    out = tmp_path / "demo"
    _finished_run(out, 5)
    config = config_from_cli("demo", DEMO_YAML, ["--new", f"output_dir={out}", "train.lr=5e-4"])
    plan = plan_run(config)
    assert (plan.kind, plan.moved_to) == ("new", tmp_path / "demo.prev-1")
    assert not out.exists() and (tmp_path / "demo.prev-1" / "config.yaml").exists()


def test_the_run_resolves_the_task_name_and_the_trainer_gets_the_task_object():
    from orchestration.grpo_run import DEFAULT_TASK, load_run_task, run_task_name
    from workers.tasks.addition import AdditionTask
    from workers.tasks.guess_number import GuessNumberTask

    # a config naming no task: the run's default, resolved by the orchestration (trainers/ names no workers module)
    unnamed = load_config(None, {})
    assert unnamed.task.name is None
    assert run_task_name(unnamed) == DEFAULT_TASK == "workers.tasks.addition:AdditionTask"
    assert isinstance(load_run_task(unnamed), AdditionTask)
    # a YAML naming the task by "module:Class", as run configs always did, still works
    assert load_config(DEMO_YAML).task.name == "workers.tasks.addition:AdditionTask"
    assert isinstance(load_run_task(load_config(DEMO_YAML)), AdditionTask)
    named = load_config(None, {"task.name": "workers.tasks.guess_number:GuessNumberTask"})
    assert isinstance(load_run_task(named), GuessNumberTask)


def test_a_run_trains_a_task_with_images_on_the_hf_engine_and_refuses_what_takes_no_images():
    """A vision task's rows carry image_refs, which the rollout workers hand to the in-process hf engine; the other
    engines, partial rollouts, a generate_fn and the SFT warm-up take no images: without the check such a run would
    sample prompts without their pictures (or wait for rows that never come)."""
    from orchestration.grpo_run import check_run_task
    from workers.tasks.addition import AdditionTask
    from workers.tasks.colors import ColorsTask

    vision = {"task.name": "workers.tasks.colors:ColorsTask", "sft.enabled": False}
    check_run_task(ColorsTask(), load_config(None, vision))  # the hf engine: trained
    check_run_task(AdditionTask(), load_config(None, {"rollout.engine": "sglang"}))  # a text task: no image source
    clashes = {
        "rollout.engine": ("vllm-server", r"rollout.engine='vllm-server' \(its engine takes no images\)"),
        "rollout.partial_rollout": (True, r"rollout.partial_rollout=true"),
        "rollout.generate_fn": ("workers.agents.rollout_fns:single_turn_generate", r"rollout.generate_fn='workers"),
        "sft.enabled": (True, r"sft.enabled=true \(the SFT warm-up feeds no images\)"),
    }
    for key, (value, says) in clashes.items():
        with pytest.raises(
            ConfigError,
            match=r"task 'workers.tasks.colors:ColorsTask' yields images .* which a run trains with "
            rf"rollout.engine='hf', without partial rollouts, a generate_fn or the SFT warm-up; got {says}",
        ):
            check_run_task(ColorsTask(), load_config(None, {**vision, key: value}))
    for engine in ("vllm", "sglang"):
        with pytest.raises(ConfigError, match=rf"got rollout.engine='{engine}'"):
            check_run_task(ColorsTask(), load_config(None, {**vision, "rollout.engine": engine}))


def test_a_vision_tasks_prompt_without_image_refs_is_refused_naming_the_task_the_prompt_and_the_key():
    """Put into the queue, such a prompt failed with a bare KeyError('image_refs'); the run checks the task's prompts
    before it puts any."""
    from orchestration.grpo_run import check_task_prompts
    from workers.tasks.addition import AdditionTask
    from workers.tasks.colors import ColorsTask

    class NoPictures(ColorsTask):
        def prompts(self, split, num, seed):
            prompts = super().prompts(split, num, seed)
            del prompts[2]["image_refs"]
            return prompts

    name = "workers.tasks.colors:ColorsTask"
    good = ColorsTask().prompts("train", 4, seed=0)
    assert check_task_prompts(ColorsTask(), name, good, "train") is good
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"task {name!r}: eval prompt 2 lacks ['image_refs']: expected keys ['prompt_ids', 'answer', 'image_refs'] "
            "('image_refs': the task yields images, its image_source() is not None), got keys ['answer', 'prompt_ids']"
        ),
    ):
        check_task_prompts(NoPictures(), name, NoPictures().prompts("eval", 4, seed=0), "eval")
    text = [{"prompt_ids": [1, 2]}]  # a text task's prompt without its reward field
    with pytest.raises(
        ConfigError, match=re.escape("task 'addition': train prompt 0 lacks ['answer']: expected keys ['prompt_ids', "
                                     "'answer'], got keys ['prompt_ids']")
    ):  # fmt: skip
        check_task_prompts(AdditionTask(), "addition", text, "train")


def test_the_idle_timeout_of_the_task_servers_a_run_starts_is_a_config_key_above_the_slowest_turn():
    config = load_config("recipe/configs/agent_demo.yaml")
    assert config.rollout.task_server_idle_timeout == 1800.0  # the server's own default (300 s) is not a run's
    assert load_config(None, {"rollout.task_server_idle_timeout": 60}).rollout.task_server_idle_timeout == 60.0
    with pytest.raises(ConfigError, match=r"rollout.task_server_idle_timeout must be a float > 0, got 0.0"):
        load_config(None, {"rollout.task_server_idle_timeout": 0.0})


def test_new_with_a_bad_value_leaves_the_old_run_where_it_is(tmp_path, capsys):
    from recipe.demo import main

    out = tmp_path / "demo"
    _finished_run(out, 5)
    assert main(["--new", f"output_dir={out}", "train.lr=-1"]) == 2
    error = capsys.readouterr().err
    assert "demo.py: error: train.lr must be a float > 0, got -1 (from the override train.lr=-1)" in error
    assert (out / "config.yaml").exists() and not (tmp_path / "demo.prev-1").exists()


def test_a_key_added_since_a_run_was_saved_counts_as_its_default_on_resume():
    from orchestration.config import RLConfig
    from orchestration.run_plan import changed_settings

    saved = config_to_dict(RLConfig())  # every key, written out
    del saved["data"], saved["reward"]["batch"]  # as a config.yaml written before these keys existed
    assert changed_settings(saved, config_to_dict(RLConfig())) == []
    assert changed_settings(config_to_dict(RLConfig()), {}) == []  # every key written out, or only those set
    assert changed_settings(saved, config_to_dict(load_config(None, {"data.prompt_key": "question"}))) == [
        ("data.prompt_key", "prompt", "question")
    ]
