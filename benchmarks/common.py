"""What every benchmark shares: timing, results with same-run baselines, the table, the JSONL file.

A :class:`Result` is one line of the table: the median over repetitions of one metric, the baseline it is
compared with (measured in the same run, so a loaded machine slows both), the ratio and the target.
``ratio`` is always *our time / baseline time* (for a throughput, ``baseline rate / our rate``): 1.0 means as
fast as the baseline, 2.0 twice as slow.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    """One measured metric: ``value`` is the median of ``reps`` (one number per repetition)."""

    name: str
    group: str
    unit: str  # "ms" (lower is better), "ops/s" or "GB/s" (higher is better), "x" (a ratio)
    reps: list[float]
    baseline: str | None = None
    baseline_value: float | None = None
    target: str | None = None
    met: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def value(self) -> float:
        return statistics.median(self.reps)

    @property
    def ratio(self) -> float | None:
        if self.baseline_value is None or not self.value or not self.baseline_value:
            return None
        if self.unit in ("ops/s", "GB/s"):
            return self.baseline_value / self.value
        return self.value / self.baseline_value

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(type="result", value=self.value, ratio=self.ratio)
        return d


class Results:
    """The results of one run, in order; looked up by name to compute ratios between them."""

    def __init__(self) -> None:
        self.items: list[Result] = []

    def add(self, result: Result) -> Result:
        self.items.append(result)
        print(f"  {format_row(result)}", flush=True)
        return result

    def get(self, name: str) -> Result | None:
        return next((r for r in self.items if r.name == name), None)

    def value(self, name: str) -> float | None:
        r = self.get(name)
        return None if r is None else r.value


# ---- timing -------------------------------------------------------------------------------------------------
def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def p50_ms(seconds: Iterable[float]) -> float:
    return float(np.median(np.asarray(list(seconds)))) * 1e3


def p99_ms(seconds: Iterable[float]) -> float:
    return float(np.percentile(np.asarray(list(seconds)), 99)) * 1e3


def settle() -> None:
    """Between repetitions: collect garbage now rather than inside a timed call."""
    gc.collect()


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        time.sleep(interval)


def demo_rows(steps: int, *overrides: str) -> list[dict[str, Any]]:
    """The ``metrics.jsonl`` rows of one ``recipe/demo.py`` run of ``steps`` GRPO steps without the SFT warm-up, on a
    local Ray cluster of its own, in a temporary output directory; ``overrides`` are more ``key=value`` settings."""
    with tempfile.TemporaryDirectory(prefix="tq-bench-demo") as out:
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        env.pop("RAY_ADDRESS", None)
        cmd = [sys.executable, str(ROOT / "recipe" / "demo.py"), f"output_dir={out}", f"steps={steps}"]
        cmd += ["sft.enabled=false", *overrides]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"the demo failed:\n{done.stderr[-3000:]}")
        return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


# ---- the table ----------------------------------------------------------------------------------------------
COLUMNS = ("benchmark", "median", "spread", "baseline", "base", "ratio", "target", "met")


def _num(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    if unit == "ms":
        return f"{x:.3f} ms" if x < 10 else f"{x:.1f} ms"
    if unit == "ops/s":
        return f"{x:,.0f}/s"
    if unit == "GB/s":
        return f"{x:.2f} GB/s"
    if unit == "x":
        return f"{x:.2f}x"
    return f"{x:.3g} {unit}".strip()


def _cells(r: Result) -> list[str]:
    lo, hi = min(r.reps), max(r.reps)
    spread = f"{_num(lo, r.unit).split()[0]}..{_num(hi, r.unit)}" if len(r.reps) > 1 else ""
    met = {None: "", True: "yes", False: "NO"}[r.met]
    return [
        r.name,
        _num(r.value, r.unit),
        spread,
        r.baseline or "",
        _num(r.baseline_value, r.unit) if r.baseline_value is not None else "",
        "" if r.ratio is None else f"{r.ratio:.2f}",
        r.target or "",
        met,
    ]


def format_row(r: Result) -> str:
    return " | ".join(_cells(r))


def table(results: list[Result], markdown: bool = False) -> str:
    rows = [list(COLUMNS)] + [_cells(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = []
    for k, row in enumerate(rows):
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=True)]
        lines.append(("| " + " | ".join(cells) + " |") if markdown else "  ".join(cells).rstrip())
        if k == 0:
            sep = ["-" * w for w in widths]
            lines.append(("| " + " | ".join(sep) + " |") if markdown else "  ".join(sep))
    return "\n".join(lines)


# ---- the record ---------------------------------------------------------------------------------------------
def run_metadata(args: dict[str, Any]) -> dict[str, Any]:
    import ray
    import torch
    import zmq

    return {
        "type": "run",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg_start": loadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "args": args,
    }


def write_jsonl(path: str, meta: dict[str, Any], results: list[Result]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps(meta) + "\n")
        for r in results:
            f.write(json.dumps(r.to_json()) + "\n")


def read_jsonl(path: str) -> tuple[dict[str, Any], list[Result]]:
    """The run metadata and the results of a JSONL file written by :func:`write_jsonl`."""
    meta: dict[str, Any] = {}
    results = []
    fields = set(Result.__dataclass_fields__)
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            if d.get("type") == "run":
                meta = d
            elif d.get("type") == "result":
                results.append(Result(**{k: v for k, v in d.items() if k in fields}))
    return meta, results
