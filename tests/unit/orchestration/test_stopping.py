"""A Ctrl-C during a recipe run: the run's actors and queue are stopped, Ray is shut down, and one line says where
the run stopped and how to go on; the recipe exits with 130. A SIGTERM takes the same way and exits with 143 (issue
25, section 3)."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import ClassVar

import pytest

from orchestration import grpo_run
from orchestration.config import load_config
from orchestration.stopping import EXIT_TERMINATED, RunStopped, SigtermStops, stopped_line
from trainers.checkpoint import checkpoint_path

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


class _InterruptedRun(grpo_run.GRPORun):
    """A GRPORun without actors (its own start-up and shutdown), interrupted mid-run."""

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

    def interrupted(config, loop=None):
        raise RunStopped(2)

    monkeypatch.setattr(grpo_run, "connect_ray", lambda env_vars=None: None)
    monkeypatch.setattr(grpo_run, "train_and_report", interrupted)
    monkeypatch.setattr(grpo_run.ray, "shutdown", lambda: shut_down.append(True))
    assert demo.main([f"output_dir={tmp_path / 'run'}"]) == 130
    err = capsys.readouterr().err
    assert err == "stopped at step 2; no checkpoint yet; run the same command to start again\n"
    assert shut_down == [True]


@pytest.fixture
def sigterm_recorded():
    """A SIGTERM handler that only records (in place of the default, which would end the test process); put back
    after the test. A handler that fails to take over SIGTERM shows as a recorded signal, not a dead pytest."""
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    yield received
    signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_stops_like_a_ctrl_c_once_and_the_handler_before_comes_back(sigterm_recorded):
    with pytest.raises(KeyboardInterrupt, match="signal SIGTERM"), SigtermStops() as sigterm:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs at the next bytecode; never reached
    assert sigterm.received and sigterm.exit_code() == EXIT_TERMINATED == 143
    with SigtermStops() as sigterm:
        sigterm.stopping = True  # a stop under way: a second SIGTERM does not break into its cleanup
        os.kill(os.getpid(), signal.SIGTERM)
    assert sigterm_recorded == []
    os.kill(os.getpid(), signal.SIGTERM)  # after the block: the handler in place before
    assert sigterm_recorded == [signal.SIGTERM]
    assert SigtermStops().exit_code() == 130  # a Ctrl-C's


def test_a_sigterm_during_a_ctrl_c_s_cleanup_does_not_break_into_it(sigterm_recorded):
    with SigtermStops() as sigterm:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # never reached
        os.kill(os.getpid(), signal.SIGTERM)  # the cleanup runs on (a scheduler's kill after the user's Ctrl-C)
        cleaned_up = True
    assert cleaned_up and sigterm.exit_code() == 130 and sigterm_recorded == []


def test_a_sigterm_in_the_demo_stops_the_run_prints_one_line_and_exits_143(
    monkeypatch, tmp_path, capsys, sigterm_recorded
):
    import recipe.demo as demo

    shut_down, stopped = [], []

    class _RunUntilSigterm(grpo_run.GRPORun):  # no actors: the recipe's loop stopped in its first call
        def __init__(self, config):
            self.step = 0

        def begin(self):
            self.step = 4
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's kill, mid-run
            time.sleep(5)
            return 4

        def shutdown(self):
            stopped.append(self.step)

    monkeypatch.setattr(grpo_run, "connect_ray", lambda env_vars=None: None)
    monkeypatch.setattr(grpo_run, "GRPORun", _RunUntilSigterm)
    monkeypatch.setattr(grpo_run.ray, "shutdown", lambda: shut_down.append(True))
    assert demo.main([f"output_dir={tmp_path / 'run'}"]) == 143
    assert capsys.readouterr().err == "stopped at step 4; no checkpoint yet; run the same command to start again\n"
    assert stopped == [4] and shut_down == [True] and sigterm_recorded == []


def test_a_run_is_stopped_once_however_often_shutdown_is_called(monkeypatch):
    killed, queues_stopped, closed = [], [], []
    monkeypatch.setattr(grpo_run.ray, "kill", killed.append)
    monkeypatch.setattr(grpo_run.transfer_queue, "shutdown", lambda: queues_stopped.append(True))
    run = grpo_run.GRPORun.__new__(grpo_run.GRPORun)  # no actors started: only what shutdown stops
    run.sinks = type("Sinks", (), {"close": lambda self: closed.append("sinks")})()
    run.channel = type("Channel", (), {"close": lambda self: closed.append("channel")})()
    run.rollout, run.reward, run.trainer, run.client = ["rollout"], ["reward"], ["rank0", "rank1"], object()
    run.engines = ["engine"]  # the rollout workers' engines are the run's: stopped after their workers
    # a with block stops the run as it ends; a Ctrl-C in it says how far the run got
    with pytest.raises(RunStopped, match="stopped at step 3") as stopped, run:
        run.step = 3
        raise KeyboardInterrupt
    assert stopped.value.step == 3
    run.shutdown()  # again (a recipe's finally after the with): nothing is stopped twice
    assert killed == ["rollout", "engine", "reward", "rank0", "rank1"]
    assert queues_stopped == [True] and closed == ["sinks", "channel"]


def test_a_loop_left_early_has_its_steps_closed_before_the_actors_stop(monkeypatch):
    events = []

    class _Run(grpo_run.GRPORun):  # no actors: steps() hands out a loop whose end is recorded
        def __init__(self, config=None):
            self.step = 0

        def _steps(self):
            try:
                yield 0
                yield 1
            finally:
                events.append("steps closed")  # the progress line closed, the trace written

        def shutdown(self):
            events.append("actors stopped")

    with pytest.raises(ValueError, match="a bad reward"), _Run() as run:
        for step in run.steps():
            run.step = step
            raise ValueError("a bad reward")
    assert events == ["steps closed", "actors stopped"]  # not at some later garbage collection, after the actors
