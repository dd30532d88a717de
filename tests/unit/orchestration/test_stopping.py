"""A Ctrl-C during a recipe run: the run's actors and queue are stopped, Ray is shut down, and one line says where
the run stopped and how to go on; the recipe exits with 130 (issue 25, section 3)."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest

from orchestration import grpo_run
from orchestration.stopping import RunStopped, stopped_line
from trainers.checkpoint import checkpoint_path
from trainers.config import load_config

DEMO_YAML = "recipe/configs/demo.yaml"


def _checkpoint(out, step):
    path = checkpoint_path(out / "checkpoints", step)
    (path / "dcp").mkdir(parents=True)
    (path / "dcp" / ".metadata").touch()
    (path / "checkpoint.json").write_text(json.dumps({"extra_state": {"step": step}}))


def test_the_line_names_the_step_the_last_checkpoint_and_the_way_on(tmp_path):
    config = load_config(DEMO_YAML, {"output_dir": str(tmp_path)})
    _checkpoint(tmp_path, 5)
    assert stopped_line(config, RunStopped(7)) == (
        "stopped at step 7; last checkpoint at step 5; run the same command to resume"
    )
    # a Ctrl-C before the GRPO loop began (start-up, SFT): the run stands at its checkpoint
    assert stopped_line(config, KeyboardInterrupt()) == (
        "stopped at step 5; last checkpoint at step 5; run the same command to resume"
    )


def test_without_a_checkpoint_the_line_says_the_run_starts_again(tmp_path):
    config = load_config(DEMO_YAML, {"output_dir": str(tmp_path)})
    assert stopped_line(config, RunStopped(3)) == (
        "stopped at step 3; no checkpoint yet; run the same command to start again"
    )


def test_after_new_the_line_says_to_resume_without_it(tmp_path):
    # the same command with --new would move the stopped run aside and start over
    config = load_config(DEMO_YAML, {"output_dir": str(tmp_path), "resume": False})
    _checkpoint(tmp_path, 4)
    assert stopped_line(config, RunStopped(6)) == (
        "stopped at step 6; last checkpoint at step 4; run the same command without --new to resume"
    )


class _InterruptedRun:
    instances: ClassVar[list[_InterruptedRun]] = []

    def __init__(self, config):
        self.step, self.stopped = 0, False
        self.instances.append(self)

    def run(self):
        self.step = 3
        raise KeyboardInterrupt

    def shutdown(self):
        self.stopped = True


def test_train_and_report_stops_the_run_and_says_how_far_it_got(monkeypatch, tmp_path):
    monkeypatch.setattr(grpo_run, "GRPORun", _InterruptedRun)
    with pytest.raises(RunStopped) as stopped:
        grpo_run.train_and_report(load_config(DEMO_YAML, {"output_dir": str(tmp_path)}))
    assert stopped.value.step == 3
    assert _InterruptedRun.instances[-1].stopped  # actors killed, queue stopped


def test_a_ctrl_c_in_the_demo_prints_one_line_shuts_ray_down_and_exits_130(monkeypatch, tmp_path, capsys):
    import recipe.demo as demo

    shut_down = []

    def interrupted(config):
        raise RunStopped(2)

    monkeypatch.setattr(grpo_run, "connect_ray", lambda env_vars=None: None)
    monkeypatch.setattr(grpo_run, "train_and_report", interrupted)
    monkeypatch.setattr(grpo_run.ray, "shutdown", lambda: shut_down.append(True))
    assert demo.main([f"output_dir={tmp_path / 'run'}"]) == 130
    err = capsys.readouterr().err
    assert err == "stopped at step 2; no checkpoint yet; run the same command to start again\n"
    assert shut_down == [True]
