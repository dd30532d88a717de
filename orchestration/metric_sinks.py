"""Where a run's per-step metrics go besides ``metrics.jsonl``: the queue's controller (Prometheus gauges
``transfer_queue_rl_*`` and the status page's curves), and, when configured, TensorBoard, Weights & Biases and MLflow.

Each sink takes the same row ``MetricsLog.write`` takes; a sink that fails is logged and dropped, never the run.
TensorBoard, W&B and MLflow are off by default (``tensorboard: true``, ``wandb_project: NAME``,
``mlflow_experiment: NAME`` in the run's config) and none is installed by default: a configured sink whose package is
missing stops the run at its start with :class:`MetricSinkUnavailable`, naming the package to install. W&B runs
offline unless ``wandb_mode: online``, MLflow into ``output_dir/mlflow.db`` unless ``mlflow_tracking_uri`` names a
server, so nothing needs the network.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from transfer_queue.ops.status import numeric_row as numbers

logger = logging.getLogger(__name__)


class MetricSinkUnavailable(ImportError):
    """A configured metric sink's package is not installed."""


def _require(module: str, package: str, setting: str) -> Any:
    """Import ``module``, or raise :class:`MetricSinkUnavailable` naming the ``setting`` that asked for it and the
    ``package`` to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MetricSinkUnavailable(
            f"{setting} asks for a metric sink that needs {module}, which is not installed ({exc}): "
            f"pip install {package}, or turn {setting} off"
        ) from exc


class MetricSink(Protocol):
    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class ControllerSink:
    """Posts each row to the queue's controller (fire and forget, through Ray: the trusted control channel)."""

    def __init__(self, controller: Any):
        self.controller = controller

    def write(self, row: dict[str, Any]) -> None:
        self.controller.record_run_metrics.remote(numbers(row))

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Each row's numbers as scalars ``<kind>/<key>`` at ``step`` (``torch.utils.tensorboard``; needs tensorboard)."""

    def __init__(self, log_dir: str | Path):
        _require("tensorboard", "tensorboard", "tensorboard")  # what torch.utils.tensorboard needs
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, row: dict[str, Any]) -> None:
        kind, values = row.get("kind", "run"), numbers(row)
        step = int(values.pop("step", 0))
        for key, value in values.items():
            self.writer.add_scalar(f"{kind}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Each row's numbers logged to a W&B run (offline by default: files under ``dir``, no network)."""

    def __init__(self, project: str, directory: str | Path, mode: str = "offline", config: dict | None = None):
        wandb = _require("wandb", "wandb", "wandb_project")
        self.run = wandb.init(project=project, dir=str(directory), mode=mode, config=config or {})

    def write(self, row: dict[str, Any]) -> None:
        kind, values = row.get("kind", "run"), numbers(row)
        step = values.pop("step", None)
        self.run.log({f"{kind}/{k}": v for k, v in values.items()}, step=None if step is None else int(step))

    def close(self) -> None:
        self.run.finish()


def _already_exists(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) == "RESOURCE_ALREADY_EXISTS"


class MlflowSink:
    """Each row's numbers as MLflow metrics ``<kind>/<key>`` at ``step``, in a new run of ``experiment`` (created
    if missing) at ``tracking_uri``: a server (``http://...``) or a local store (``sqlite:///PATH``). Through an
    ``MlflowClient``, not the ``mlflow.start_run`` global, so an MLflow run the caller has open is left alone."""

    def __init__(
        self, experiment: str, tracking_uri: str, run_name: str | None = None, artifact_location: str | None = None
    ):
        mlflow = _require("mlflow", "mlflow", "mlflow_experiment")
        self._metric = importlib.import_module("mlflow.entities").Metric
        self.client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        experiment_id = self._experiment_id(experiment, artifact_location)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def _experiment_id(self, name: str, artifact_location: str | None) -> str:
        """The experiment's id, created (artifacts at ``artifact_location``) if missing; one another run created
        between the look-up and the creation is looked up again."""
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(name, artifact_location=artifact_location))
        except Exception as exc:  # MlflowException, error_code RESOURCE_ALREADY_EXISTS: created since the look-up
            raced = self.client.get_experiment_by_name(name) if _already_exists(exc) else None
            if raced is None:
                raise
            return str(raced.experiment_id)

    def write(self, row: dict[str, Any]) -> None:
        kind, values = row.get("kind", "run"), numbers(row)
        step = int(values.pop("step", 0))
        now = int(time.time() * 1000)
        metrics = [self._metric(f"{kind}/{key}", value, now, step) for key, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class MetricSinks:
    """Several sinks as one; a sink that raises is logged and dropped."""

    def __init__(self, sinks: list[Any]):
        self.sinks = list(sinks)

    def write(self, row: dict[str, Any]) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(row)
            except Exception:
                logger.exception("metric sink %s failed; dropping it", type(sink).__name__)
                self.sinks.remove(sink)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:
                logger.exception("metric sink %s failed to close", type(sink).__name__)


def _configured(cfg: Any, out: Path) -> list[tuple[str, Callable[[], Any]]]:
    """The optional sinks ``cfg`` turns on, each as its name and how to build it."""
    wanted: list[tuple[str, Callable[[], Any]]] = []
    if cfg.tensorboard:
        wanted.append(("TensorBoardSink", lambda: TensorBoardSink(out / "tensorboard")))
    if cfg.wandb_project:
        wanted.append(("WandbSink", lambda: WandbSink(cfg.wandb_project, out, cfg.wandb_mode)))
    if cfg.mlflow_experiment:
        # a local store keeps its artifacts beside it (MLflow's default, ./mlruns, is the current directory's)
        local = cfg.mlflow_tracking_uri is None
        uri = cfg.mlflow_tracking_uri or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        artifacts = (out / "mlruns").resolve().as_uri() if local else None
        wanted.append(("MlflowSink", lambda: MlflowSink(cfg.mlflow_experiment, uri, out.name, artifacts)))
    return wanted


def run_sinks(cfg: Any, controller: Any | None, out: Path) -> MetricSinks:
    """The sinks an RLConfig asks for: the controller (when there is one), TensorBoard, W&B, MLflow.

    A sink whose package is missing raises :class:`MetricSinkUnavailable` (the sinks built before it are closed);
    one that fails otherwise at its start is logged and dropped, as one that fails later is.

    Raises:
        MetricSinkUnavailable: a configured sink's package is not installed.
    """
    sinks = MetricSinks([] if controller is None else [ControllerSink(controller)])
    for name, build in _configured(cfg, out):
        try:
            sinks.sinks.append(build())
        except MetricSinkUnavailable:
            sinks.close()
            raise
        except Exception:
            logger.exception("metric sink %s failed to start; going on without it", name)
    return sinks
