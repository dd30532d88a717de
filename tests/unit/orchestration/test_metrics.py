"""metrics.jsonl on resume: the rows of the steps after the checkpoint are cut before the resumed run appends its own,
so each step has one row (issue 25, section 3)."""

from __future__ import annotations

import os

import pytest

from orchestration.metrics import MetricsLog


def _crashed_log(path):
    """SFT to step 75, GRPO steps 0..9 with checkpoints at 5 and 10, the run killed after step 12's row."""
    log = MetricsLog(path)
    for step in (25, 50, 75):
        log.write({"kind": "sft", "step": step, "accuracy": 0.1})
    log.write({"kind": "checkpoint", "step": 0})
    for step in range(13):
        log.write({"kind": "grpo", "step": step, "reward": 0.5})
        if (step + 1) % 5 == 0:
            log.write({"kind": "checkpoint", "step": step + 1})
    return log


def test_a_resume_cuts_the_rows_of_the_steps_after_its_checkpoint(tmp_path):
    log = _crashed_log(tmp_path / "metrics.jsonl")
    assert log.cut_back(5) == 9  # grpo rows 5..12, the checkpoint row of 10
    assert [r["step"] for r in log.rows("grpo")] == [0, 1, 2, 3, 4]  # a grpo row's step s is in checkpoint s + 1
    assert [r["step"] for r in log.rows("checkpoint")] == [0, 5]
    assert [r["step"] for r in log.rows("sft")] == [25, 50, 75]  # the warm-up counts its own steps: all kept
    log.write({"kind": "grpo", "step": 5, "reward": 0.6})
    assert [r["step"] for r in log.rows("grpo")] == [0, 1, 2, 3, 4, 5]


def test_cutting_back_replaces_the_file_in_one_rename(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    log = _crashed_log(path)
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        log.cut_back(5)
    assert path.read_bytes() == before  # a crash mid-cut leaves the old file whole
    monkeypatch.undo()
    log.cut_back(5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary file left behind


def test_cutting_back_a_missing_or_clean_log_changes_nothing(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    assert log.cut_back(3) == 0 and not log.path.exists()
    log.write({"kind": "grpo", "step": 0})
    assert log.cut_back(3) == 0 and len(log.rows()) == 1
