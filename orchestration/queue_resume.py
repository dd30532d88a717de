"""An RL run resumed with its queue: rows produced before the crash are trained, rows in flight are produced again.

``GRPORun.save`` (orchestration/run_resume.py's ``save_checkpoint``) puts the queue's snapshot into each checkpoint
that has steps in flight (launched, not trained: in async mode up to ``max_staleness`` steps, with the shm weight
channel one more). After ``transfer_queue.init(...,
restore_from=...)`` those steps' partitions are back with every row that had been put, and leased rows are ready
again. One case the queue cannot know about: a worker that had taken rows (workers that acknowledge them when they
read them) but had not written its output yet when the checkpoint was taken. Those rows are acknowledged in the
snapshot, and nobody would ever produce them: the step would never complete. :func:`reconcile_step` makes each
worker task's consumption agree with what was produced: a row is done for a task exactly when the field that task
writes is there (acknowledged, never handed out again), and ready for it otherwise (handed out again, first come first
served).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
QUEUE_DIR = "queue"  # the queue's snapshot inside a checkpoint directory (``step_XXXXXXXX/queue``)


class QueueResumeError(RuntimeError):
    """The restored queue does not hold what the checkpoint says it should."""


@dataclass
class QueueResume:
    """What resuming the queue of a checkpoint found: per restored step, rows whose output each task had written."""

    step: int  # the checkpoint's step: the first step to train
    rows_per_step: int
    kept: dict[int, dict[str, int]] = field(default_factory=dict)  # step -> task -> rows already produced
    source: str = "the queue checkpoint"  # where the rows came from (a trainer-group restart: the queue it kept)

    @property
    def steps(self) -> list[int]:
        return sorted(self.kept)

    def restored_rows(self, task: str) -> int:
        """Rows of the restored steps whose ``task`` output came back from the checkpoint (not produced again)."""
        return sum(kept.get(task, 0) for kept in self.kept.values())

    def relaunched_rows(self, task: str) -> int:
        """Rows of the restored steps whose ``task`` output is produced again (it was not in the checkpoint)."""
        return self.rows_per_step * len(self.kept) - self.restored_rows(task)

    def message(self, task: str) -> str:
        return (
            f"resumed from step {self.step}: {self.restored_rows(task)} rows of steps {self.steps} restored from "
            f"{self.source}, {self.relaunched_rows(task)} re-launched"
        )

    def row(self, task: str) -> dict[str, Any]:
        """The run's metrics row of this resume: the steps restored, and their rows restored and re-launched for
        ``task``."""
        return {
            "kind": "resume",
            "step": self.step,
            "restored_steps": self.steps,
            "restored_rows": self.restored_rows(task),
            "relaunched_rows": self.relaunched_rows(task),
        }


def queue_snapshot_of(checkpoint: Path) -> tuple[Path, dict[str, Any]] | None:
    """The queue snapshot inside a trainer checkpoint and its record (``extra_state["queue"]``), or None for a
    checkpoint without one (nothing was in flight when it was taken, it predates queue snapshots, or the queue's
    save failed and the checkpoint was written without it): such a checkpoint resumes as before."""
    extra = json.loads((checkpoint / "checkpoint.json").read_text())["extra_state"]
    record = extra.get("queue")
    if not record:
        return None
    directory = checkpoint / record["dir"]
    if not (directory / "CURRENT").is_file():  # the queue's save failed: the checkpoint was written without it
        logger.warning("%s holds no queue snapshot in %s: the steps in flight are drawn again", checkpoint, directory)
        return None
    return directory, record


def resume_steps(
    client: Any,
    step: int,
    record: dict[str, Any],
    rows_per_step: int,
    outputs: dict[str, str],
    timeout: float,
    retrain: str | None = None,
) -> QueueResume:
    """Go on with the steps a queue restored from the checkpoint of ``step`` holds (``record["steps"]``): each
    one reconciled (:func:`reconcile_step`, ``outputs`` and ``timeout`` as there).

    ``retrain``: the trainer's task, for a queue a trainer-group restart kept (orchestration/trainer_restarts.py):
    its consumption of each step is reset first, so the trainer, back at the checkpoint of ``step``, is served every
    row of the steps it had trained (or was training) since, which the run it rolled back trained on (none of them
    is in the restarted run's lineage)."""
    resume = QueueResume(step, rows_per_step, source="the queue kept" if retrain else "the queue checkpoint")
    for queued in record["steps"]:
        if retrain is not None:
            client.reset_consumption(task_name=retrain, global_step=int(queued))
        resume.kept[int(queued)] = reconcile_step(client, int(queued), outputs, timeout)
    return resume


def reconcile_step(client: Any, step: int, outputs: dict[str, str], timeout: float) -> dict[str, int]:
    """Make each task's consumption of restored step ``step`` agree with what was produced.

    Args:
        client: a TransferQueueClient of the restored queue (no worker of ``step`` may run yet).
        outputs: task name -> the field its workers write into the step's rows (rollout: the responses, reward:
            the reward). A row that has the field is acknowledged for the task; every other row is ready for it.
        timeout: how long the read of the produced rows may wait (they are there: it does not wait).

    Returns:
        task name -> rows that already had its output (kept, not produced again).
    """
    status = client.get_production_status(global_step=step)
    kept: dict[str, int] = {}
    for task, output in outputs.items():
        client.reset_consumption(task_name=task, global_step=step)
        produced = int(status["fields"].get(output, {}).get("produced", 0))
        if produced:
            # a request for the output field is served exactly the rows that have it (whole groups: workers write
            # whole groups); they are acknowledged for the task (whether it acknowledges by get_data or explicitly)
            meta = client.get_meta(
                [output], produced, global_step=step, task_name=task, get_n_samples=True, timeout=timeout
            )
            if len(meta) != produced:
                raise QueueResumeError(
                    f"step {step}: {produced} rows have {output!r}, but the queue handed {len(meta)} of them to "
                    f"task {task!r}"
                )
            client.ack(meta)
        kept[task] = produced
    return kept
