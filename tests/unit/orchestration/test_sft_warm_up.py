"""The SFT warm-up (orchestration/sft_warm_up.py), without Ray: supervised steps in chunks of ``eval_every`` until the
accuracy reaches the target or ``max_steps`` is spent, each chunk published and evaluated as configured and logged;
the optimizer reset at the end. ``run_sft``: the warm-up alone, its fresh metrics and plot, its checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import ray

from orchestration.config import SFTConfig
from orchestration.metrics import MetricsLog
from orchestration.sft_warm_up import run_sft, sft_warm_up


class _Remote:
    def __init__(self, fn: Any):
        self.remote = fn


class SFTRank:
    """A trainer rank's SFT calls, in process: each ``sft_steps(done, k, lr, batch_size)`` is recorded (its loss:
    ``done``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.sft_steps = _Remote(self._sft_steps)
        self.reset_optimizer = _Remote(lambda: self.calls.append(("reset_optimizer",)))

    def _sft_steps(self, done: int, k: int, lr: float, batch_size: int) -> dict[str, float]:
        self.calls.append(("sft_steps", done, k, lr, batch_size))
        return {"sft_loss": float(done)}


class Engines:
    """``publish`` and ``evaluate`` of a run: each evaluation answers the next of ``accuracies``."""

    def __init__(self, accuracies: list[float]) -> None:
        self.accuracies = iter(accuracies)
        self.published: list[int] = []
        self.evaluated: list[tuple[bool, int]] = []

    def publish(self, version: int) -> float:
        self.published.append(version)
        return 0.0

    def evaluate(self, sampled: bool = False, samples: int = 1) -> float:
        self.evaluated.append((sampled, samples))
        return next(self.accuracies)


@pytest.fixture(autouse=True)
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "get", lambda refs, **_: refs)


def test_the_warm_up_stops_once_the_accuracy_reaches_the_target(tmp_path: Path) -> None:
    cfg = SFTConfig(lr=0.5, batch_size=4, max_steps=100, target_accuracy=0.5, eval_every=10, eval_samples=3)
    ranks, engines = [SFTRank(), SFTRank()], Engines([0.1, 0.4, 0.6, 0.9])
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    assert sft_warm_up(cfg, ranks, engines.publish, engines.evaluate, metrics) == 0.6
    for rank in ranks:
        steps = [("sft_steps", done, 10, 0.5, 4) for done in (0, 10, 20)]
        assert rank.calls == [*steps, ("reset_optimizer",)]
    assert engines.published == [0, 0, 0]  # the warm-up's weights are version 0
    assert engines.evaluated == [(True, 3)] * 3  # sampled accuracy (the default), eval_samples each
    rows = metrics.rows("sft")
    assert [(r["step"], r["accuracy"], r["sft_loss"]) for r in rows] == [
        (10, 0.1, 0.0),
        (20, 0.4, 10.0),
        (30, 0.6, 20.0),
    ]


def test_the_warm_up_stops_at_max_steps_with_a_last_shorter_chunk(tmp_path: Path) -> None:
    cfg = SFTConfig(max_steps=25, target_accuracy=0.9, target_metric="greedy", eval_every=10)
    rank, engines = SFTRank(), Engines([0.1, 0.2, 0.3, 0.99])
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    assert sft_warm_up(cfg, [rank], engines.publish, engines.evaluate, metrics) == 0.3
    assert [(c[1], c[2]) for c in rank.calls if c[0] == "sft_steps"] == [(0, 10), (10, 10), (20, 5)]
    assert rank.calls[-1] == ("reset_optimizer",)
    assert engines.evaluated == [(False, cfg.eval_samples)] * 3
    assert [r["step"] for r in metrics.rows("sft")] == [10, 20, 25]


class SFTOnlyRun:
    """What ``run_sft`` uses of a GRPORun: its output dir, metrics, warm-up, checkpoint and task label."""

    task_label = "AdditionTask"

    def __init__(self, out: Path) -> None:
        self.out = out
        self.cfg = type("RunConfig", (), {"sft": SFTConfig(target_metric="sampled")})()
        self.metrics = MetricsLog(out / "metrics.jsonl")
        self.saved: list[int] = []

    def warm_up(self) -> float:
        self.metrics.write({"kind": "sft", "step": 10, "accuracy": 0.5, "sft_loss": 0.7})
        return 0.5

    def save(self, step: int) -> Path:
        self.saved.append(step)
        return self.out / "checkpoints" / f"step_{step:08d}"


def test_sft_alone_starts_its_metrics_over_plots_them_and_checkpoints_step_0(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    MetricsLog(tmp_path / "metrics.jsonl").write({"kind": "grpo", "step": 3})  # a previous run in the same dir
    run = SFTOnlyRun(tmp_path)
    with caplog.at_level(logging.INFO, logger="orchestration.sft_warm_up"):
        assert run_sft(run) == tmp_path / "checkpoints" / "step_00000000"  # type: ignore[arg-type]
    assert "SFT reached sampled accuracy 0.500" in caplog.text  # the metric the run stops on, not always greedy
    assert run.saved == [0]
    assert [r["kind"] for r in MetricsLog(tmp_path / "metrics.jsonl").rows()] == ["sft"]
    assert (tmp_path / "metrics.png").stat().st_size > 0
