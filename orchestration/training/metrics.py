"""``JSONLLogger``: metrics to ``<dir>/metrics.jsonl`` (one JSON object per ``log`` call) and, at ``finish()``, a PNG
of every numeric series (``<dir>/metrics.png``).

Each line holds the logged metrics plus ``step`` (the ``step`` argument) and ``timestamp`` (Unix seconds). Values are
made JSON-safe: one-element tensors and numpy scalars become numbers, larger tensors and arrays lists, non-finite
floats (NaN, inf) ``null``, anything else its ``str``. Lines are appended and flushed one by one
(``orchestration.metrics.MetricsLog``), so a crash loses nothing logged.

>>> import tempfile
>>> with JSONLLogger(Path(tempfile.mkdtemp()) / "run", plot=False) as logger:
...     logger.log({"loss": 0.5}, step=0)
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from orchestration.metrics import MetricsLog
from orchestration.training.types import LibraryError

_NOT_PLOTTED = {"step", "timestamp"}
_MAX_PANELS = 16


def to_json_value(value: Any) -> Any:
    """``value`` as plain JSON (module docstring: what becomes what)."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # torch tensors, numpy arrays and scalars
        if hasattr(value, "detach"):
            value = value.detach().cpu()
        return to_json_value(value.tolist())
    if hasattr(value, "item"):
        return to_json_value(value.item())
    return str(value)


class JSONLLogger:
    """Writes metrics under the directory ``path`` (created): ``metrics.jsonl`` now, ``metrics.png`` at ``finish``.

    Args:
        path: the run's log directory.
        plot: draw ``metrics.png`` at ``finish()`` (needs matplotlib; skipped without it).
        title: the plot's title (default: the directory's name).
    """

    def __init__(self, path: str | Path, plot: bool = True, title: str | None = None):
        self.dir = Path(path)
        if self.dir.exists() and not self.dir.is_dir():
            raise LibraryError(
                f"JSONLLogger needs a directory to write metrics.jsonl into, {str(self.dir)!r} is a file"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.png = self.dir / "metrics.png"
        self.plot, self.title = plot, title or self.dir.name
        self._log = MetricsLog(self.path)
        self._finished = False

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Append one line: ``metrics`` with ``step`` and ``timestamp`` (the ``step`` argument wins over a key)."""
        if self._finished:
            raise LibraryError("JSONLLogger.log after finish(): make a new logger to write more")
        if not isinstance(metrics, Mapping):
            raise LibraryError(f"JSONLLogger.log needs a dict of metrics, got {type(metrics).__name__}")
        if isinstance(step, bool) or not isinstance(step, int):
            raise LibraryError(f"JSONLLogger.log needs an int step, got {step!r}")
        row = {str(key): to_json_value(value) for key, value in metrics.items()}
        row.update(step=step, timestamp=time.time())
        self._log.write(row)

    def rows(self) -> list[dict[str, Any]]:
        """Every line written so far."""
        return self._log.rows()

    def finish(self) -> Path | None:
        """End the log; draw ``metrics.png`` (returns its path, or None when not drawn). Idempotent."""
        if self._finished:
            return self.png if self.png.exists() else None
        self._finished = True
        if not self.plot:
            return None
        try:
            return plot_series(self.rows(), self.png, title=self.title)
        except ImportError:  # matplotlib is optional
            return None

    def __enter__(self) -> JSONLLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish()


def numeric_series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """``{metric: [(step, value), ...]}`` for every key with at least one number (``step`` and ``timestamp`` aside)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key in _NOT_PLOTTED or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            series.setdefault(key, []).append((float(row.get("step", 0)), float(value)))
    return series


def plot_series(rows: list[dict[str, Any]], png: Path, title: str = "metrics") -> Path | None:
    """One panel per numeric metric of ``rows`` against ``step`` (the first ``_MAX_PANELS`` in order of
    appearance) into ``png``; None when there is nothing to plot."""
    series = numeric_series(rows)
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(series)[:_MAX_PANELS]
    columns = min(len(keys), 4)
    lines = math.ceil(len(keys) / columns)
    fig, axes = plt.subplots(lines, columns, figsize=(3.2 * columns, 2.6 * lines), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        xs, ys = zip(*series[key], strict=True)
        ax.plot(xs, ys, lw=1.0, marker="." if len(xs) < 30 else None)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
