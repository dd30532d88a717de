"""Where a run's per-step metrics go besides metrics.jsonl: the controller, TensorBoard, W&B, MLflow (off by
default)."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from orchestration.config import RLConfig
from orchestration.metric_sinks import (
    ControllerSink,
    MetricSinks,
    MetricSinkUnavailable,
    MlflowSink,
    TensorBoardSink,
    WandbSink,
    run_sinks,
)
from tests.conftest import requirement

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
    assert not cfg.tensorboard and cfg.wandb_project is None and cfg.mlflow_experiment is None
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


class AlreadyExists(Exception):
    """What ``MlflowException`` carries when an experiment of that name was created since it was looked up."""

    error_code = "RESOURCE_ALREADY_EXISTS"


class FakeMlflow(ModuleType):
    """Stands in for the ``mlflow`` package (not installed by default): an ``MlflowClient`` that records its calls."""

    def __init__(self) -> None:
        super().__init__("mlflow")
        self.calls: list[tuple[Any, ...]] = []
        self.experiments: dict[str, str] = {"existing": "7"}
        self.created_elsewhere: dict[str, str] = {}  # by another run, between this one's look-up and its creation
        self.fail_create_run: Exception | None = None
        fake = self

        class MlflowClient:
            def __init__(self, tracking_uri: str) -> None:
                fake.calls.append(("client", tracking_uri))

            def get_experiment_by_name(self, name: str) -> Any:
                found = fake.experiments.get(name)
                return None if found is None else SimpleNamespace(experiment_id=found)

            def create_experiment(self, name: str, artifact_location: str | None = None) -> str:
                fake.calls.append(("create_experiment", name, artifact_location))
                if name in fake.created_elsewhere:
                    fake.experiments[name] = fake.created_elsewhere[name]
                    raise AlreadyExists(f"Experiment(name={name}) already exists.")
                fake.experiments[name] = "8"
                return "8"

            def create_run(self, experiment_id: str, run_name: str | None = None) -> Any:
                fake.calls.append(("create_run", experiment_id, run_name))
                if fake.fail_create_run is not None:
                    raise fake.fail_create_run
                return SimpleNamespace(info=SimpleNamespace(run_id="run-1"))

            def log_batch(self, run_id: str, metrics: list[Any]) -> None:
                fake.calls.append(("log_batch", run_id, sorted((m.key, m.value, m.step) for m in metrics)))

            def set_terminated(self, run_id: str) -> None:
                fake.calls.append(("set_terminated", run_id))

        self.MlflowClient = MlflowClient
        entities = ModuleType("mlflow.entities")
        vars(entities).update(
            Metric=lambda key, value, timestamp, step: SimpleNamespace(key=key, value=value, step=step)
        )
        self.entities = entities


@pytest.fixture
def fake_mlflow(monkeypatch):
    fake = FakeMlflow()
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    monkeypatch.setitem(sys.modules, "mlflow.entities", fake.entities)
    return fake


def test_the_mlflow_sink_logs_each_rows_numbers_at_its_step_in_a_run_of_the_experiment(fake_mlflow, tmp_path):
    cfg = RLConfig(mlflow_experiment="tq-runs")
    sinks = run_sinks(cfg, None, tmp_path / "demo")
    [sink] = sinks.sinks
    assert isinstance(sink, MlflowSink)
    sinks.write(ROW)
    sinks.close()
    assert fake_mlflow.calls == [
        ("client", f"sqlite:///{(tmp_path / 'demo' / 'mlflow.db').resolve()}"),  # a local store: no network
        ("create_experiment", "tq-runs", (tmp_path / "demo" / "mlruns").resolve().as_uri()),  # not ./mlruns
        ("create_run", "8", "demo"),
        ("log_batch", "run-1", [("grpo/reward", 0.25, 3)]),  # the finite numbers, as TensorBoard gets them
        ("set_terminated", "run-1"),
    ]


def test_the_mlflow_sink_goes_to_the_tracking_uri_given_and_an_existing_experiment(fake_mlflow, tmp_path):
    cfg = RLConfig(mlflow_experiment="existing", mlflow_tracking_uri="http://mlflow.internal:5000")
    run_sinks(cfg, None, tmp_path)
    assert fake_mlflow.calls == [("client", "http://mlflow.internal:5000"), ("create_run", "7", tmp_path.name)]


def test_a_configured_sink_without_its_package_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # an import of it raises ImportError
    with pytest.raises(MetricSinkUnavailable, match=r"mlflow_experiment asks for .* pip install mlflow, or turn"):
        run_sinks(RLConfig(mlflow_experiment="tq-runs"), None, tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MetricSinkUnavailable, match=r"wandb_project asks for .* pip install wandb"):
        run_sinks(RLConfig(wandb_project="tq"), None, tmp_path)


def test_an_experiment_another_run_created_meanwhile_is_looked_up_again(fake_mlflow, tmp_path):
    fake_mlflow.created_elsewhere["tq-runs"] = "9"
    [sink] = run_sinks(RLConfig(mlflow_experiment="tq-runs"), None, tmp_path).sinks
    assert isinstance(sink, MlflowSink) and fake_mlflow.calls[-1] == ("create_run", "9", tmp_path.name)


def test_an_mlflow_sink_failing_at_its_start_is_logged_and_dropped_not_the_run(fake_mlflow, tmp_path, caplog):
    fake_mlflow.fail_create_run = OSError("database is locked")
    handle = RecordingHandle()
    sinks = run_sinks(RLConfig(mlflow_experiment="tq-runs"), handle, tmp_path)
    assert [type(sink) for sink in sinks.sinks] == [ControllerSink]
    assert "metric sink MlflowSink failed to start; going on without it" in caplog.text
    assert "database is locked" in caplog.text


def test_a_missing_package_closes_the_sinks_already_started(monkeypatch, tmp_path):
    from orchestration import metric_sinks

    closed: list[str] = []

    class StartedSink:
        def __init__(self, log_dir: Any) -> None:
            pass

        def write(self, row: dict[str, Any]) -> None:
            pass

        def close(self) -> None:
            closed.append("tensorboard")

    monkeypatch.setattr(metric_sinks, "TensorBoardSink", StartedSink)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(MetricSinkUnavailable, match=r"mlflow_experiment asks for"):
        run_sinks(RLConfig(tensorboard=True, mlflow_experiment="tq-runs"), None, tmp_path)
    assert closed == ["tensorboard"]
