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
    ("eval_reward", "eval reward (held-out tasks)"),  # the ledger flow's eval rows (recipe/agentrl_demo.py)
    ("eval_accuracy", "eval accuracy (held-out problems)"),  # a GRPO run's greedy one, or the ledger flow's
    ("entropy", "policy entropy (nats / token)"),
    ("grad_norm", "gradient norm (before clipping)"),
    ("kl", "KL to reference"),
    ("staleness_mean", "staleness (versions)"),
    ("staleness", "staleness (versions)"),  # recipe/agentrl_demo.py's (LedgerGRPOTrainer)
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


# the figure: panels of PANEL_INCHES at PLOT_DPI, 3 a row (4 past 9 panels); the whole scaled down to SCREEN_PX
PANEL_INCHES = (3.2, 2.8)
PLOT_DPI = 120
SCREEN_PX = (1920, 1080)
SFT_PANEL = "SFT warm-up"


def plotted_panels(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The ``PLOTTED`` curves that say something about these rows: present, and not zero throughout (a sync run's
    staleness, an agent run without dropped groups). A curve equal to an earlier one at every step (reward,
    accuracy and success on 0/1 rewards) is not drawn again: the earlier panel's label names it, ``(= accuracy)``.

    >>> plotted_panels([{"step": 0, "reward": 1.0, "accuracy": 1.0}, {"step": 1, "reward": 0.0, "accuracy": 0.0}])
    [('reward', 'GRPO mean reward (= accuracy)')]
    """
    present = [(key, label) for key, label in PLOTTED if any(r.get(key) not in (None, 0) for r in rows)]
    groups: list[tuple[str, str, list[tuple[Any, float]], list[str]]] = []
    for key, label in present:
        points = _points(rows, key)
        same = next((g for g in groups if _same_curve(g[2], points)), None)
        if same is None:
            groups.append((key, label, points, []))
        else:
            same[3].append(key)
    return [(key, f"{label} (= {', '.join(also)})" if also else label) for key, label, _, also in groups]


def _points(rows: list[dict[str, Any]], key: str) -> list[tuple[Any, float]]:
    return [(r.get("step"), r[key]) for r in rows if r.get(key) is not None]


def _same_curve(a: list[tuple[Any, float]], b: list[tuple[Any, float]]) -> bool:
    """Whether two curves have the same steps and, at each, the same value (up to float rounding)."""
    return len(a) == len(b) and all(
        sa == sb and math.isclose(va, vb, rel_tol=1e-9, abs_tol=1e-12) for (sa, va), (sb, vb) in zip(a, b, strict=True)
    )


def grid_shape(count: int) -> tuple[int, int, tuple[float, float]]:
    """``(rows, columns, figsize)`` for ``count`` panels: 3 a row (4 past 9 panels, the width a screen has), panels
    of ``PANEL_INCHES``, scaled down (keeping the aspect) where the figure would not fit a ``SCREEN_PX`` screen.

    >>> grid_shape(2), grid_shape(7)[:2], grid_shape(12)
    ((1, 2, (6.4, 2.8)), (3, 3), (3, 4, (12.8, 8.4)))
    """
    count = max(count, 1)
    columns = min(count, 3 if count <= 9 else 4)
    lines = -(-count // columns)
    width, height = PANEL_INCHES[0] * columns, PANEL_INCHES[1] * lines
    scale = min(1.0, SCREEN_PX[0] / PLOT_DPI / width, SCREEN_PX[1] / PLOT_DPI / height)
    return lines, columns, (round(width * scale, 4), round(height * scale, 4))


def metrics_figure(rows: list[dict[str, Any]], kind: str = "grpo", title: str = "GRPO run") -> Any:
    """The matplotlib figure of ``plot_metrics`` for these rows: the ``sft`` warm-up first (its own panel, its own
    steps), then the ``PLOTTED`` curves of the ``kind`` rows and the ``eval`` rows (an evaluation's, at its step; one
    panel per distinct curve), then the seconds per step. The caller closes it (``matplotlib.pyplot.close``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sft = [r for r in rows if r.get("kind") == "sft"]
    rows = [r for r in rows if r.get("kind") in (kind, "eval")]
    panels = plotted_panels(rows)
    parts = [(key, label) for key, label in TIME_PARTS if any(r.get(key) is not None for r in rows)]
    count = bool(sft) + len(panels) + bool(parts)
    lines, columns, figsize = grid_shape(count)
    fig, grid = plt.subplots(lines, columns, figsize=figsize, squeeze=False)
    axes = list(grid.flat)
    for ax in axes[max(count, 1) :]:
        ax.set_visible(False)
    if sft:
        _plot_sft(axes.pop(0), sft)
    for ax, (key, label) in zip(axes, panels, strict=False):
        _plot_curve(ax, _points(rows, key), label)
    if parts:
        _plot_time_breakdown(axes[len(panels)], rows, parts)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_metrics(jsonl: str | Path, png: str | Path, kind: str = "grpo", title: str = "GRPO run") -> Path:
    """Draw :func:`metrics_figure` of the rows of ``jsonl`` into ``png`` (a grid that fits a 1920x1080 screen)."""
    import matplotlib.pyplot as plt

    fig = metrics_figure(MetricsLog(jsonl).rows(), kind, title)
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=PLOT_DPI)
    plt.close(fig)
    return png


def _plot_curve(ax: Any, points: list[tuple[Any, float]], label: str) -> None:
    """The raw curve, and its running mean once there are 10 points."""
    xs, ys = zip(*points, strict=True) if points else ((), ())
    ax.plot(xs, ys, lw=0.8, alpha=0.5, label=label)
    if len(ys) >= 10:
        width = max(len(ys) // 20, 3)
        smooth = [sum(ys[max(0, i - width) : i + 1]) / len(ys[max(0, i - width) : i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, lw=1.8, label=f"{label}, running mean")
    _style(ax, label)


def _plot_sft(ax: Any, rows: list[dict[str, Any]]) -> None:
    """The warm-up's loss (left axis) and accuracy (right axis, 0..1) against its own steps."""
    handles = []
    loss = _points(rows, "sft_loss")
    if loss:
        handles += ax.plot(*zip(*loss, strict=True), color="C0", lw=1.2, label="SFT loss")
    accuracy = _points(rows, "accuracy")
    if accuracy:
        right = ax.twinx()
        handles += right.plot(*zip(*accuracy, strict=True), color="C1", lw=1.2, marker=".", label="SFT accuracy")
        right.set_ylim(0, 1)
        right.tick_params(labelsize=7)
    if handles:
        ax.legend(handles=handles, fontsize=6, loc="center right")
    _style(ax, SFT_PANEL)


def _style(ax: Any, title: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def _plot_time_breakdown(ax: Any, rows: list[dict[str, Any]], parts: list[tuple[str, str]]) -> None:
    """Stacked seconds per step by part, and the step's wall time (the parts can overlap in async mode)."""
    steps = [r["step"] for r in rows]
    ax.stackplot(steps, *[[r.get(key) or 0.0 for r in rows] for key, _ in parts], labels=[lb for _, lb in parts])
    if any(r.get("step_s") is not None for r in rows):
        ax.plot(steps, [r.get("step_s") or 0.0 for r in rows], color="black", lw=0.8, label="step wall time")
    ax.legend(fontsize=6, loc="upper right")
    _style(ax, "seconds per step")


def fifth_means(values: list[float]) -> tuple[float, float]:
    """Mean over the first fifth and the last fifth of ``values`` (the demo's learning criterion)."""
    if not values:
        return float("nan"), float("nan")
    k = max(len(values) // 5, 1)
    return sum(values[:k]) / k, sum(values[-k:]) / k
