"""The bookkeeping of resuming an RL run's queue (orchestration/queue_resume.py), without Ray: which checkpoints
carry a queue snapshot, which steps a resume reconciles, and what it says it restored and re-launched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestration import queue_resume
from orchestration.queue_resume import QUEUE_DIR, QueueResume, queue_snapshot_of, resume_steps
from trainers.checkpoint import queue_stage
from transfer_queue.errors import CheckpointError


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


def test_a_checkpoint_whose_queue_save_failed_resumes_as_before(tmp_path, caplog) -> None:
    path = checkpoint(tmp_path, {"step": 4, "queue": {"dir": QUEUE_DIR, "steps": [4]}}, with_queue=False)
    (path / QUEUE_DIR).mkdir()  # a save that failed half-way: no CURRENT
    assert queue_snapshot_of(path) is None
    assert "holds no queue snapshot in" in caplog.text


class FakeClient:
    def __init__(self, error: Exception | None = None):
        self.error = error

    def save_checkpoint(self, directory: str) -> str:
        Path(directory, ".staging-ckpt-0").mkdir(parents=True)
        if self.error is not None:
            raise self.error
        Path(directory, "CURRENT").write_text("ckpt-0")
        return str(Path(directory, "ckpt-0"))


def test_the_queue_stage_saves_into_the_staging_directory(tmp_path) -> None:
    seconds = queue_stage(FakeClient(), QUEUE_DIR)(tmp_path)
    assert isinstance(seconds, float) and seconds >= 0
    assert (tmp_path / QUEUE_DIR / "CURRENT").read_text() == "ckpt-0"


def test_a_queue_that_cannot_be_saved_leaves_the_checkpoint_without_it(tmp_path, caplog) -> None:
    stage = queue_stage(FakeClient(CheckpointError("storage unit 1 did not save")), QUEUE_DIR)
    assert stage(tmp_path) is None
    assert not (tmp_path / QUEUE_DIR).exists()
    assert "the queue could not be saved with checkpoint" in caplog.text and "storage unit 1" in caplog.text
    with pytest.raises(ValueError, match="not a queue error"):  # anything else is a bug: the save fails
        queue_stage(FakeClient(ValueError("not a queue error")), QUEUE_DIR)(tmp_path)


def test_the_resume_message_counts_restored_and_relaunched_rows() -> None:
    resume = QueueResume(step=4, rows_per_step=32)
    resume.kept[5] = {"rollout": 8, "reward": 0}
    resume.kept[4] = {"rollout": 32, "reward": 32}
    assert resume.steps == [4, 5]
    assert resume.restored_rows("rollout") == 40 and resume.restored_rows("reward") == 32
    assert resume.message("rollout") == (
        "resumed from step 4: 40 rows of steps [4, 5] restored from the queue checkpoint, 24 re-launched"
    )


def test_the_resume_row_counts_the_rows_of_one_task() -> None:
    resume = QueueResume(step=4, rows_per_step=32, kept={5: {"rollout": 8}, 4: {"rollout": 32}})
    assert resume.relaunched_rows("rollout") == 24 and resume.relaunched_rows("reward") == 64
    assert resume.row("rollout") == {
        "kind": "resume",
        "step": 4,
        "restored_steps": [4, 5],
        "restored_rows": 40,
        "relaunched_rows": 24,
    }


def test_each_step_of_the_record_is_reconciled_with_the_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def reconcile(client: object, step: int, outputs: dict[str, str], timeout: float) -> dict[str, int]:
        seen.append((client, step, outputs, timeout))
        return {"rollout": 8 * step}

    monkeypatch.setattr(queue_resume, "reconcile_step", reconcile)
    record = {"dir": QUEUE_DIR, "steps": [4, 5], "prompt_source": {}, "prompt_states": []}
    resume = resume_steps("client", 4, record, 32, {"rollout": "response_ids"}, 9.0)
    assert seen == [("client", 4, {"rollout": "response_ids"}, 9.0), ("client", 5, {"rollout": "response_ids"}, 9.0)]
    assert resume == QueueResume(step=4, rows_per_step=32, kept={4: {"rollout": 32}, 5: {"rollout": 40}})
