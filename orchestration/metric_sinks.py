"""Where a run's per-step metrics go besides ``metrics.jsonl``: the queue's controller (Prometheus gauges
``transfer_queue_rl_*`` and the status page's curves), and, when configured, TensorBoard and Weights & Biases.

Each sink takes the same row ``MetricsLog.write`` takes; a sink that fails is logged and dropped, never the run.
TensorBoard and W&B are off by default (``tensorboard: true``, ``wandb_project: NAME`` in the run's config); W&B
runs offline unless ``wandb_mode: online``, so nothing needs the network.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from transfer_queue.ops.status import numeric_row as numbers

logger = logging.getLogger(__name__)


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
        import wandb

        self.run = wandb.init(project=project, dir=str(directory), mode=mode, config=config or {})

    def write(self, row: dict[str, Any]) -> None:
        kind, values = row.get("kind", "run"), numbers(row)
        step = values.pop("step", None)
        self.run.log({f"{kind}/{k}": v for k, v in values.items()}, step=None if step is None else int(step))

    def close(self) -> None:
        self.run.finish()


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


def run_sinks(cfg: Any, controller: Any | None, out: Path) -> MetricSinks:
    """The sinks an RLConfig asks for: the controller (when there is one), TensorBoard, W&B."""
    sinks: list[Any] = [] if controller is None else [ControllerSink(controller)]
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(out / "tensorboard"))
    if cfg.wandb_project:
        sinks.append(WandbSink(cfg.wandb_project, out, cfg.wandb_mode))
    return MetricSinks(sinks)
