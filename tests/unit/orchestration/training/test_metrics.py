"""JSONLLogger: one JSON line per log call in <dir>/metrics.jsonl, values made JSON-safe, a PNG at finish."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from orchestration.training import JSONLLogger, LibraryError


def test_each_log_call_is_one_line_with_step_and_timestamp(tmp_path: Path) -> None:
    logger = JSONLLogger(tmp_path / "logs" / "experiment_001")
    logger.log({"loss": 0.5, "reward": 1.0, "step": 42}, step=42)
    logger.log({"loss": torch.tensor(0.25), "reward": np.float32(0.5), "grad": float("nan")}, step=43)
    png = logger.finish()

    lines = (tmp_path / "logs" / "experiment_001" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [row["step"] for row in rows] == [42, 43]
    assert rows[1]["loss"] == 0.25 and rows[1]["reward"] == 0.5 and rows[1]["grad"] is None
    assert all(isinstance(row["timestamp"], float) and math.isfinite(row["timestamp"]) for row in rows)
    assert png == tmp_path / "logs" / "experiment_001" / "metrics.png" and png.stat().st_size > 0


def test_tensors_arrays_and_odd_objects_become_plain_json(tmp_path: Path) -> None:
    with JSONLLogger(tmp_path, plot=False) as logger:
        logger.log({"vec": torch.tensor([1.0, float("inf")]), "arr": np.arange(2), "path": Path("x"), "n": {"a": 1}}, 0)

    (row,) = logger.rows()
    assert (row["vec"], row["arr"], row["path"], row["n"]) == ([1.0, None], [0, 1], "x", {"a": 1})
    assert not (tmp_path / "metrics.png").exists()


def test_bad_use_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(LibraryError, match=r"needs a directory to write metrics\.jsonl into"):
        JSONLLogger(tmp_path / "file")
    logger = JSONLLogger(tmp_path / "run", plot=False)
    with pytest.raises(LibraryError, match="needs an int step, got '1'"):
        logger.log({"loss": 1.0}, step="1")  # type: ignore[arg-type]
    logger.finish()
    with pytest.raises(LibraryError, match="log after finish"):
        logger.log({"loss": 1.0}, step=1)
