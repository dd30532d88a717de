"""Where a run's per-step metrics go besides metrics.jsonl: the controller, TensorBoard, W&B (off by default)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from orchestration.metric_sinks import ControllerSink, MetricSinks, TensorBoardSink, WandbSink, run_sinks
from tests.conftest import requirement
from trainers.config import RLConfig

ROW = {"kind": "grpo", "step": 3, "reward": 0.25, "loss": float("nan"), "note": "text", "ok": True}


class RecordingHandle:
    """Stands in for the controller's actor handle: records what ``record_run_metrics.remote`` was given."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.record_run_metrics = SimpleNamespace(remote=self.rows.append)


def test_controller_sink_posts_the_finite_numbers():
    handle = RecordingHandle()
    ControllerSink(handle).write(ROW)
    assert handle.rows == [{"step": 3.0, "reward": 0.25}]


def test_tensorboard_and_wandb_are_off_by_default(tmp_path):
    cfg = RLConfig()
    assert not cfg.tensorboard and cfg.wandb_project is None
    sinks = run_sinks(cfg, None, tmp_path)
    assert sinks.sinks == []
    assert [type(s) for s in run_sinks(cfg, RecordingHandle(), tmp_path).sinks] == [ControllerSink]


def test_tensorboard_sink_writes_scalars_tensorboard_reads(tmp_path):
    pytest.importorskip("tensorboard", reason=requirement("tensorboard", "pip install -e .[test]"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path)
    for step in range(3):
        sink.write({"kind": "grpo", "step": step, "reward": 0.1 * step})
    sink.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = events.Scalars("grpo/reward")
    assert [(e.step, round(e.value, 6)) for e in scalars] == [(0, 0.0), (1, 0.1), (2, 0.2)]


def test_wandb_sink_runs_offline(tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed (optional: pip install wandb)")
    sink = WandbSink("tq-test", tmp_path, mode="offline")
    sink.write(ROW)
    sink.close()
    assert list(tmp_path.glob("wandb/offline-run-*"))


def test_a_failing_sink_is_dropped_and_the_others_go_on():
    class Broken:
        def write(self, row: dict[str, Any]) -> None:
            raise OSError("disk full")

        def close(self) -> None:
            pass

    handle = RecordingHandle()
    sinks = MetricSinks([Broken(), ControllerSink(handle)])
    sinks.write(ROW)
    sinks.write(ROW)
    assert len(handle.rows) == 2 and len(sinks.sinks) == 1
