"""Per-step metrics a person can look at: one JSON object per line, and a PNG plot of the main curves."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

PLOTTED = [
    ("reward", "GRPO mean reward"),
    ("accuracy", "accuracy (reward >= 1)"),
    ("success", "episode success rate"),
    ("num_turns", "turns per episode"),
    ("dropped_groups", "dropped groups"),
    ("eval_accuracy", "greedy eval accuracy"),
    ("entropy", "policy entropy (nats / token)"),
    ("grad_norm", "gradient norm (before clipping)"),
    ("kl", "KL to reference"),
    ("staleness_mean", "staleness (versions)"),
    ("samples_per_s", "samples / s"),
]  # not the GRPO loss: ~0 by construction (group-normalised advantages), it says nothing about the run
# where a step's time goes: stacked in the last panel of metrics.png
TIME_PARTS = [("generate_s", "generate"), ("train_s", "train"), ("reward_s", "reward"), ("sync_s", "weight sync")]
# what tells a person the run is healthy: (metric, label, format), on the bar or the plain lines
HEALTH = [
    ("reward", "reward", ".3f"),
    ("kl", "kl", ".4f"),
    ("entropy", "entropy", ".3f"),
    ("grad_norm", "grad_norm", ".3f"),
    ("step_s", "step_s", ".2f"),
]


def health_line(row: dict[str, Any]) -> str:
    """``reward 0.512 | kl 0.0012 | ...`` for the metrics of ``HEALTH`` present in ``row``."""
    return " | ".join(f"{label} {row[key]:{fmt}}" for key, label, fmt in HEALTH if row.get(key) is not None)


class StepReporter:
    """Progress of the GRPO steps: a tqdm bar on a terminal; without one (``ray job logs``, a file) one plain line
    every ``every`` steps, instead of tqdm's carriage-return redraws that become two lines per step.

    >>> import io
    >>> out = io.StringIO()
    >>> r = StepReporter(0, 4, every=2, stream=out, terminal=False)
    >>> for s in range(4): r.update(s, {"reward": 0.5, "step_s": 0.25})
    >>> print(out.getvalue(), end="")
    GRPO step 2/4 | reward 0.500 | step_s 0.25
    GRPO step 4/4 | reward 0.500 | step_s 0.25
    """

    def __init__(
        self, start: int, total: int, every: int = 10, stream: TextIO | None = None, terminal: bool | None = None
    ):
        self.total, self.every, self.stream = total, max(every, 1), stream or sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.bar = None
        if self.terminal:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="GRPO", unit="step", dynamic_ncols=True, file=self.stream)

    def update(self, step: int, row: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(health_line(row), refresh=True)
        elif (step + 1) % self.every == 0 or step + 1 == self.total:
            print(f"GRPO step {step + 1}/{self.total} | {health_line(row)}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class PlotRefresher:
    """Redraw ``metrics.png`` during the run, at most every ``min_interval_s`` seconds (plotting takes ~0.5 s)."""

    def __init__(self, jsonl: str | Path, png: str | Path, title: str, min_interval_s: float = 60.0):
        self.jsonl, self.png, self.title, self.min_interval_s = jsonl, png, title, min_interval_s
        self._last = time.monotonic()

    def maybe_refresh(self) -> bool:
        if time.monotonic() - self._last < self.min_interval_s:
            return False
        self.refresh()
        return True

    def refresh(self) -> Path:
        self._last = time.monotonic()
        return plot_metrics(self.jsonl, self.png, title=self.title)


class MetricsLog:
    """Appends metric rows to ``path`` (JSONL), flushing each row so a crash loses nothing written."""

    def __init__(self, path: str | Path, truncate: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if truncate and self.path.exists():
            self.path.unlink()

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean, sort_keys=True) + "\n")

    def cut_back(self, step: int) -> int:
        """Drop the rows of the steps after a checkpoint at ``step`` (a run resuming from it writes them again);
        returns how many were dropped. A ``grpo`` row's ``step`` is the 0-based step it trained, in the checkpoint
        of ``step + 1``, so rows of steps ``>= step`` go; other rows (checkpoint, resume) go when their ``step`` is
        past it. ``sft`` rows count the warm-up's own steps and stay. The file is rewritten to a temporary file,
        fsynced and renamed over the old one: a crash leaves the old log or the cut one, never a part.

        >>> import tempfile
        >>> log = MetricsLog(Path(tempfile.mkdtemp()) / "metrics.jsonl")
        >>> for s in range(3): log.write({"kind": "grpo", "step": s})
        >>> log.cut_back(1), [r["step"] for r in log.rows()]
        (2, [0])
        """
        if not self.path.exists():
            return 0
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines if not _after(json.loads(line), step)]
        if len(kept) == len(lines):
            return 0
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with tmp.open("w") as f:
            f.write("".join(f"{line}\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        return len(lines) - len(kept)

    def rows(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return [r for r in rows if kind is None or r.get("kind") == kind]


def _after(row: dict[str, Any], step: int) -> bool:
    """Whether ``row`` belongs to a step after a checkpoint at ``step`` (see :meth:`MetricsLog.cut_back`)."""
    kind, row_step = row.get("kind"), row.get("step")
    if kind == "sft" or not isinstance(row_step, int):
        return False
    return row_step >= step if kind == "grpo" else row_step > step


def plotted_panels(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The ``PLOTTED`` curves that say something about these rows: present, and not zero throughout (a sync run's
    staleness, an agent run without dropped groups)."""
    return [(key, label) for key, label in PLOTTED if any(r.get(key) not in (None, 0) for r in rows)]


def plot_metrics(jsonl: str | Path, png: str | Path, kind: str = "grpo", title: str = "GRPO run") -> Path:
    """Plot the curves of ``PLOTTED`` present in the ``kind`` rows of ``jsonl`` against ``step`` into ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = MetricsLog(jsonl).rows(kind)
    panels = plotted_panels(rows)
    parts = [(key, label) for key, label in TIME_PARTS if any(r.get(key) is not None for r in rows)]
    png = Path(png)
    count = max(len(panels) + bool(parts), 1)
    fig, axes = plt.subplots(1, count, figsize=(3.2 * count, 2.8), squeeze=False)
    if parts:
        _plot_time_breakdown(axes[0][-1], rows, parts)
    for ax, (key, label) in zip(axes[0], panels, strict=False):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        xs, ys = zip(*points, strict=True) if points else ((), ())
        ax.plot(xs, ys, lw=0.8, alpha=0.5)
        if len(ys) >= 10:
            width = max(len(ys) // 20, 3)
            smooth = [sum(ys[max(0, i - width) : i + 1]) / len(ys[max(0, i - width) : i + 1]) for i in range(len(ys))]
            ax.plot(xs, smooth, lw=1.8)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def _plot_time_breakdown(ax: Any, rows: list[dict[str, Any]], parts: list[tuple[str, str]]) -> None:
    """Stacked seconds per step by part, and the step's wall time (the parts can overlap in async mode)."""
    steps = [r["step"] for r in rows]
    ax.stackplot(steps, *[[r.get(key) or 0.0 for r in rows] for key, _ in parts], labels=[lb for _, lb in parts])
    if any(r.get("step_s") is not None for r in rows):
        ax.plot(steps, [r.get("step_s") or 0.0 for r in rows], color="black", lw=0.8, label="step wall time")
    ax.set_title("seconds per step", fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6, loc="upper right")
    ax.grid(alpha=0.3)


def fifth_means(values: list[float]) -> tuple[float, float]:
    """Mean over the first fifth and the last fifth of ``values`` (the demo's learning criterion)."""
    if not values:
        return float("nan"), float("nan")
    k = max(len(values) // 5, 1)
    return sum(values[:k]) / k, sum(values[-k:]) / k
