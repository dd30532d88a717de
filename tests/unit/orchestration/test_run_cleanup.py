"""The weight channel belongs to the run's cleanup from the moment it is created: a start-up that fails (an error, a
Ctrl-C, a SIGTERM) after it stops what it had started and removes it, and a shutdown that fails part way still
removes it (issue 25, §3). No Ray: the queue and the actors are stood in for. The e2e tier kills whole demo runs
(tests/e2e/test_run_cleanup.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from orchestration import grpo_run
from orchestration.config import load_config
from orchestration.grpo_run import GRPORun
from rl_contracts.weight_channel import WeightChannel

CONFIG = Path(__file__).resolve().parents[3] / "recipe" / "configs" / "demo.yaml"


@pytest.fixture
def channels(monkeypatch) -> list[WeightChannel]:
    """The weight channels the runs of the test create (real ones, in /dev/shm)."""
    made: list[WeightChannel] = []

    class Recorded(WeightChannel):
        @classmethod
        def create(cls, prefix: str = "tq-weights-", root: str | None = None) -> WeightChannel:
            channel = super().create(prefix, root)
            made.append(channel)
            return channel

    monkeypatch.setattr(grpo_run, "WeightChannel", Recorded)
    yield made
    for channel in made:  # whatever the test's outcome, leave /dev/shm as it was
        channel.close()


def _fail(error: BaseException) -> Any:
    def raise_it(*args: Any, **kwargs: Any) -> Any:
        raise error

    return raise_it


@pytest.mark.parametrize(
    "error", [RuntimeError("the queue did not start"), KeyboardInterrupt()], ids=["error", "ctrl-c-or-sigterm"]
)
def test_a_start_up_that_fails_after_the_channel_was_made_removes_it(monkeypatch, tmp_path, channels, error):
    monkeypatch.setattr(grpo_run.transfer_queue, "init", _fail(error))
    config = load_config(CONFIG, {"output_dir": str(tmp_path), "weight_sync": "shm"})
    with pytest.raises(type(error)):
        GRPORun(config)
    assert len(channels) == 1 and not channels[0].path.exists()


def test_a_start_up_that_fails_with_the_queue_up_stops_the_queue_and_removes_the_channel(
    monkeypatch, tmp_path, channels
):
    stopped: list[str] = []
    monkeypatch.setattr(grpo_run.transfer_queue, "init", lambda **kwargs: SimpleNamespace(controller_info=None))
    monkeypatch.setattr(grpo_run.transfer_queue, "shutdown", lambda: stopped.append("queue"))
    monkeypatch.setattr(GRPORun, "start_workers", _fail(RuntimeError("an actor did not start")))
    config = load_config(CONFIG, {"output_dir": str(tmp_path), "weight_sync": "shm"})
    with pytest.raises(RuntimeError, match="an actor did not start"):
        GRPORun(config)
    assert stopped == ["queue"]
    assert len(channels) == 1 and not channels[0].path.exists()


def test_a_shutdown_that_fails_part_way_still_removes_the_channel(monkeypatch):
    run = GRPORun.__new__(GRPORun)  # a started run, its sinks failing to close
    channel = run.channel = WeightChannel.create()
    run.sinks = SimpleNamespace(close=_fail(OSError("the TensorBoard directory is gone")))
    run.client, run.rollout, run.engines, run.reward, run.trainer = None, [], [], [], []
    with pytest.raises(OSError, match="TensorBoard"):
        run.shutdown()
    assert not channel.path.exists()


def test_the_gpus_held_for_the_inference_servers_are_given_back_after_the_servers_stop_even_if_stopping_fails(
    monkeypatch,
):
    run = GRPORun.__new__(GRPORun)  # a started run whose servers Ray reserved GPUs for
    events: list[str] = []

    def stop() -> None:
        events.append("servers")
        raise OSError("a server hung")

    run.inference = SimpleNamespace(stop=stop)
    run.gpu_holder = "holder"
    run.client, run.rollout, run.engines, run.reward, run.trainer = None, [], [], [], []
    run.sinks, run.channel = None, None
    monkeypatch.setattr(grpo_run.ray, "kill", lambda actor: events.append(f"kill {actor}"))
    with pytest.raises(OSError, match="a server hung"):
        run.shutdown()
    assert events == ["servers", "kill holder"] and run.gpu_holder is None
    run.shutdown()  # a second call does nothing
    assert events == ["servers", "kill holder"]
