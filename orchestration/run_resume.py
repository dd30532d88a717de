"""Where an RL run starts and what its checkpoints hold (GRPORun's, orchestration/grpo_run.py).

A run starts (:func:`start_point`) from the latest checkpoint under ``output_dir/checkpoints`` (``resume``, the
default), else from the weights of ``init_from``, else from an SFT warm-up (``sft.enabled``,
orchestration/sft_warm_up.py), else from the task's starting policy. A checkpoint (:func:`save_checkpoint`) holds the
trainer's state (model, optimizer, RNG, trainers/checkpoint.py) and the driver's: the step, the prompt position, the
policy version and, with steps in flight, the queue's snapshot (:func:`queue_record`, orchestration/queue_resume.py).
The KL reference (:func:`init_reference`) is the run's first policy, saved once and restored on resume.

These functions take what they need (the config, the output directory, the trainer ranks' handles); the run keeps
its own state (prompt source, policy version, metrics log) and applies what they return.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from orchestration.config import RLConfig
from orchestration.metrics import MetricsLog
from orchestration.queue_resume import QUEUE_DIR, queue_snapshot_of
from rl_contracts.stages import REWARD_TASK, ROLLOUT_TASK
from trainers.checkpoint import checkpoint_path, is_complete_checkpoint, latest_checkpoint, prune_checkpoints

logger = logging.getLogger(__name__)


class Start(enum.Enum):
    """Where a run's first GRPO step starts from."""

    RESUME = "resume"  # the run's latest checkpoint
    INIT_FROM = "init_from"  # the weights of another run's checkpoint (``init_from``), at step 0
    SFT = "sft"  # an SFT warm-up from the task's starting policy, then step 0
    FRESH = "fresh"  # the task's starting policy, at step 0


@dataclass(frozen=True)
class StartPoint:
    kind: Start
    checkpoint: Path | None = None  # RESUME: the run's checkpoint; INIT_FROM: the one whose weights it starts from


def checkpoints_dir(out: Path) -> Path:
    return out / "checkpoints"


def resume_checkpoint(cfg: RLConfig, out: Path) -> Path | None:
    """The checkpoint the run in ``out`` goes on from: its latest complete one (None: none, or ``resume`` is off)."""
    return latest_checkpoint(checkpoints_dir(out)) if cfg.resume else None


def start_point(cfg: RLConfig, out: Path) -> StartPoint:
    """Go on from the run's latest checkpoint; or start from ``init_from``; or warm up with SFT; or start fresh."""
    latest = resume_checkpoint(cfg, out)
    if latest is not None:
        return StartPoint(Start.RESUME, latest)
    if cfg.init_from:
        return StartPoint(Start.INIT_FROM, Path(cfg.init_from))
    return StartPoint(Start.SFT if cfg.sft.enabled else Start.FRESH)


def restorable_queue(cfg: RLConfig, out: Path) -> tuple[Path, Path] | None:
    """The checkpoint the run will resume from and its queue snapshot, if it has one (and ``checkpoint_queue`` is
    on): the queue starts from that snapshot. None: the queue starts empty."""
    latest = resume_checkpoint(cfg, out)
    snapshot = queue_snapshot_of(latest) if latest is not None and cfg.checkpoint_queue else None
    return (latest, snapshot[0]) if latest is not None and snapshot is not None else None


@dataclass(frozen=True)
class Resumed:
    """The driver's state a checkpoint gives back (its ``extra_state``)."""

    step: int  # the first step to train
    prompt_source: dict[str, Any]  # the prompt source's state before that step drew
    version: int  # the policy version the engines get first
    queue: dict[str, Any] | None  # the queue record (:func:`queue_record`), if a snapshot was taken


def resumed_state(extra: dict[str, Any]) -> Resumed:
    """A checkpoint's ``extra_state`` read back (a checkpoint from before ``version`` has ``policy_version``)."""
    version = int(extra.get("version", extra.get("policy_version", 0)))
    return Resumed(int(extra["step"]), extra["prompt_source"], version, extra.get("queue"))


def load_checkpoint(trainer: list[Any], checkpoint: Path) -> Resumed:
    """Every trainer rank loads ``checkpoint``; the driver's state saved with it."""
    return resumed_state(ray.get([r.load_checkpoint.remote(str(checkpoint)) for r in trainer])[0])


def start_from_weights(trainer: list[Any], checkpoint: str) -> None:
    """The trainer ranks take the weights of ``checkpoint`` (``init_from``) with a fresh optimizer, at version 0."""
    ray.get([r.load_checkpoint.remote(checkpoint) for r in trainer])
    ray.get([r.reset_optimizer.remote() for r in trainer])
    ray.get([r.set_version.remote(0) for r in trainer])
    logger.info("starting RL from the weights of %s", checkpoint)


def queue_record(
    step: int,
    prompt_states: dict[int, dict[str, Any]],
    prompt_source: dict[str, Any],
    put_again: dict[int, set[int]] | None = None,
) -> dict[str, Any] | None:
    """What a checkpoint of ``step`` records about the queue saved with it: the steps in flight (launched, not
    trained: those of ``prompt_states`` from ``step`` on), the prompt position after their draws
    (``prompt_source``), where each of them drew, and the lost rows of each whose groups were already put again
    (``put_again``: orchestration/regenerate.py). None: nothing is in flight, no snapshot is taken."""
    queued = sorted(s for s in prompt_states if s >= step)
    if not queued:
        return None
    again = put_again or {}
    return {
        "dir": QUEUE_DIR,
        "steps": queued,
        "prompt_source": prompt_source,
        "prompt_states": [[s, prompt_states[s]] for s in queued],
        "lost_put_again": [[s, sorted(again[s])] for s in queued if again.get(s)],
    }


def checkpoint_row(step: int, seconds: float, queue_s: float | None, queue: dict[str, Any] | None) -> dict[str, Any]:
    """The metrics row of a checkpoint: its seconds, the queue snapshot's (``queue_s`` None: it failed, the
    checkpoint was written without it) and the steps the snapshot holds."""
    row = {"kind": "checkpoint", "step": step, "checkpoint_s": seconds, "queue_s": queue_s or 0.0}
    return {**row, "queue_steps": queue["steps"] if queue and queue_s is not None else []}


def save_checkpoint(
    trainer: list[Any],
    out: Path,
    extra: dict[str, Any],
    queue: dict[str, Any] | None,
    keep: int,
    metrics: MetricsLog,
) -> Path:
    """Checkpoint the trainer (model, optimizer, RNG) with the driver's ``extra`` state (``step``, ``prompt_source``,
    ``version``) and, given a ``queue`` record, the queue's snapshot (written into the same directory before it is
    committed); log it and keep the newest ``keep``. An existing checkpoint of the step is replaced only once the new
    one is complete and on disk."""
    step = int(extra["step"])
    root = checkpoints_dir(out)
    path = checkpoint_path(root, step)
    extra = {**extra, "queue": queue} if queue else extra
    t0 = time.perf_counter()
    queue_dir = QUEUE_DIR if queue else None
    saved = ray.get([r.save_checkpoint.remote(str(path), extra, True, queue_dir) for r in trainer])
    metrics.write(checkpoint_row(step, time.perf_counter() - t0, saved[0], queue))
    prune_checkpoints(root, keep)
    return path


def restored_outputs(cfg: RLConfig, with_reward_workers: bool) -> dict[str, str]:
    """Worker task -> the field it writes into a step's rows (a restored row that has it is done for it)."""
    outputs = {ROLLOUT_TASK: "tokens" if cfg.rollout.generate_fn else "response_ids"}
    return {**outputs, REWARD_TASK: "reward"} if with_reward_workers else outputs


def init_reference(trainer: list[Any], out: Path, resumed: bool) -> None:
    """The frozen KL reference: the run's original one (saved in ``output_dir/reference`` when the run began)
    on resume, never the resumed weights; else the current weights, saved for later resumes."""
    path = out / "reference"
    if resumed and is_complete_checkpoint(path):
        ray.get([r.init_reference.remote(str(path)) for r in trainer])
        print(f"KL reference restored from {path}", flush=True)
        return
    if resumed:
        logger.warning("no saved KL reference in %s: the resumed weights become the reference", path)
    ray.get([r.init_reference.remote() for r in trainer])
    ray.get([r.save_reference.remote(str(path)) for r in trainer])
