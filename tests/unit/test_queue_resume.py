"""The bookkeeping of resuming an RL run's queue (orchestration/queue_resume.py), without Ray: which checkpoints
carry a queue snapshot, and what the resume says it restored and re-launched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestration.queue_resume import QUEUE_DIR, QueueResume, QueueResumeError, queue_snapshot_of


def checkpoint(tmp_path: Path, extra: dict, with_queue: bool) -> Path:
    path = tmp_path / "step_00000004"
    path.mkdir()
    (path / "checkpoint.json").write_text(json.dumps({"extra_state": extra, "world_size": 1}))
    if with_queue:
        (path / QUEUE_DIR).mkdir()
        (path / QUEUE_DIR / "CURRENT").write_text("ckpt-0")
    return path


def test_a_checkpoint_without_a_queue_record_resumes_as_before(tmp_path) -> None:
    assert queue_snapshot_of(checkpoint(tmp_path, {"step": 4, "prompt_source": {}}, with_queue=False)) is None


def test_the_queue_snapshot_named_by_a_checkpoint_is_found(tmp_path) -> None:
    record = {"dir": QUEUE_DIR, "steps": [4, 5], "prompt_source": {"position": 48}, "prompt_states": []}
    path = checkpoint(tmp_path, {"step": 4, "queue": record}, with_queue=True)
    assert queue_snapshot_of(path) == (path / QUEUE_DIR, record)


def test_a_recorded_queue_snapshot_that_is_missing_is_an_error(tmp_path) -> None:
    path = checkpoint(tmp_path, {"step": 4, "queue": {"dir": QUEUE_DIR, "steps": [4]}}, with_queue=False)
    with pytest.raises(QueueResumeError, match=r"step_00000004 records a queue snapshot in .*queue, which holds none"):
        queue_snapshot_of(path)


def test_the_resume_message_counts_restored_and_relaunched_rows() -> None:
    resume = QueueResume(step=4, rows_per_step=32)
    resume.kept[5] = {"rollout": 8, "reward": 0}
    resume.kept[4] = {"rollout": 32, "reward": 32}
    assert resume.steps == [4, 5]
    assert resume.restored_rows("rollout") == 40 and resume.restored_rows("reward") == 32
    assert resume.message("rollout") == (
        "resumed from step 4: 40 rows of steps [4, 5] restored from the queue checkpoint, 24 re-launched"
    )
