"""Per-step metrics a person can look at: one JSON object per line, and a PNG plot of the main curves."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PLOTTED = [
    ("reward", "GRPO mean reward"),
    ("accuracy", "accuracy (reward >= 1)"),
    ("success", "episode success rate"),
    ("num_turns", "turns per episode"),
    ("dropped_groups", "dropped groups"),
    ("eval_accuracy", "greedy eval accuracy"),
    ("loss", "loss"),
    ("kl", "KL to reference"),
    ("staleness_mean", "staleness (versions)"),
    ("samples_per_s", "samples / s"),
]


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

    def rows(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return [r for r in rows if kind is None or r.get("kind") == kind]


def plot_metrics(jsonl: str | Path, png: str | Path, kind: str = "grpo", title: str = "GRPO run") -> Path:
    """Plot the curves of ``PLOTTED`` present in the ``kind`` rows of ``jsonl`` against ``step`` into ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = MetricsLog(jsonl).rows(kind)
    panels = [(key, label) for key, label in PLOTTED if any(r.get(key) is not None for r in rows)]
    png = Path(png)
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(3.2 * max(len(panels), 1), 2.8), squeeze=False)
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


def fifth_means(values: list[float]) -> tuple[float, float]:
    """Mean over the first fifth and the last fifth of ``values`` (the demo's learning criterion)."""
    if not values:
        return float("nan"), float("nan")
    k = max(len(values) // 5, 1)
    return sum(values[:k]) / k, sum(values[-k:]) / k
