"""A dead trainer rank restarts the trainer group from the run's last checkpoint (issue 28, section 3).

A trainer rank is a Ray actor without restarts: its FSDP2 process group cannot take a new member, and its optimizer
state lives only in its process and in the checkpoints. When a trainer rank dies (its process killed, its node gone),
the call the driver made on it fails with a ``RayActorError``; the run raises :class:`TrainerRankDied` (the rank and
the step), stops what it started (the actors, the queue, the weight channel, the inference servers), and
:func:`run_with_trainer_restarts` starts it again in the same process: the new run resumes from its latest checkpoint
(the queue from that checkpoint's snapshot) through the same path a second launch of the same command takes
(orchestration/run_resume.py), the metrics rows past the checkpoint cut back and written again. Without a checkpoint
yet, it starts from the start of GRPO (or of the run: the SFT warm-up saves checkpoint 0).

With ``train.restart_keeps_rows`` (the default; with ``max_restarts`` > 0 and periodic checkpoints) a restart
generates (almost) nothing again: each step's rows stay in the queue until a checkpoint covers the step
(:func:`keeps_rows`), and a dying run leaves its queue running (:func:`write_kept_queue`: the steps from its last
checkpoint on, launched or trained; before its first checkpoint, from its start, which the restart repeats: the
same weights, fresh or ``init_from``; an SFT warm-up saves checkpoint 0). The next start attaches to it
(:func:`take_kept_queue`) instead of starting one: the trainer ranks, back at the checkpoint, train the steps since
it again from their kept rows (none of those trainings is in the final model's lineage: it goes on from the
checkpoint), and the steps launched ahead go on from the rows already generated; the rollout workers write the
batches they were generating before they are stopped (:func:`finish_writes`), so only rows taken and not yet
generating at the death are generated again. The versions stay numbered
by step, so a kept row is trained by the version that would have trained it, within ``max_staleness`` of its
sampler (that the trainer checks); a kept row sampled after the checkpoint was sampled by a policy the rolled back
run computed from the same checkpoint and the same kept rows as the restarted run computes it again.

Up to ``train.max_restarts`` restarts (0: a rank's death ends the run, as before); once they are spent a death ends
the run with :class:`TrainerRestartsSpent`. Every other failure ends the run as before.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

import transfer_queue
from orchestration.config import RLConfig
from orchestration.run_resume import resume_checkpoint
from transfer_queue.errors import QueueNotFound

#: on a failed train step, the longest the driver waits for the other ranks' calls to end before it looks for a
#: dead rank among them (a surviving rank's collective fails once its peer's connection closes)
RANK_DEATH_WAIT_S = 10.0

logger = logging.getLogger(__name__)
T = TypeVar("T")
ACTOR_ID = re.compile(r"actor_id=([0-9a-f]+)")
#: in output_dir: what a run a trainer rank's death ended left in the queue it left running (:func:`write_kept_queue`)
KEPT_QUEUE = "queue_kept.json"


class TrainerRankDied(RuntimeError):
    """A trainer rank's call failed with the rank's death (``RayActorError``): the trainer group restarts."""

    def __init__(self, rank: int, step: int, cause: BaseException | None = None):
        self.rank, self.step = rank, step
        self.unreported = 0  # the run's trainer-group restarts no step row had counted yet (GRPORun sets it)
        self.saved = False  # whether the run had saved a checkpoint (GRPORun sets it): the restart resumes from it
        self.kept_queue = False  # whether the run left its queue running for the restart (GRPORun sets it)
        why = f": {type(cause).__name__}" if cause is not None else ""
        super().__init__(f"trainer rank {rank} died at step {step}{why}")


class TrainerRestartsSpent(RuntimeError):
    """A trainer rank died after the run had restarted its trainer group ``train.max_restarts`` times."""


def rank_of_actor(trainer: list[Any], exc: BaseException | None) -> int | None:
    """The index in ``trainer`` of the rank ``exc`` came from (a ``RayActorError`` or ``RayTaskError`` naming its
    actor), or None: another actor's failure, or not an actor's."""
    if not isinstance(exc, RayActorError | RayTaskError):
        return None
    actor_id = getattr(exc, "actor_id", None) if isinstance(exc, RayActorError) else None
    if actor_id is None:  # a task's error: Ray names its actor in the message's first line ("actor_id=...")
        named = ACTOR_ID.search(str(exc))
        actor_id = named[1] if named else None
    ids = [rank._actor_id.hex() for rank in trainer]
    return ids.index(actor_id) if actor_id in ids else None


def rank_died(trainer: list[Any], exc: BaseException | None) -> int | None:
    """The rank of ``trainer`` whose death ``exc`` reports, or None: another failure, which ends the run.

    A ``RayActorError`` names the dead rank. A rank's ``RayTaskError`` (e.g. its collective failed: a peer's
    connection closed) may come from another rank's death: every rank is asked its ``pid()``, and one that fails with
    ``RayActorError`` within ``RANK_DEATH_WAIT_S`` is dead."""
    rank = rank_of_actor(trainer, exc)
    if rank is None or isinstance(exc, RayActorError):
        return rank
    died = dead_rank([r.pid.remote() for r in trainer], RANK_DEATH_WAIT_S)
    return died[0] if died is not None else None


def dead_rank(refs: list[Any], wait_s: float = 0.0) -> tuple[int, RayActorError] | None:
    """The first rank whose call (``refs[rank]``) failed with its death, and the error; None if none did among the
    calls ended within ``wait_s`` seconds."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    ended = set(done)
    for rank, ref in enumerate(refs):
        if ref not in ended:
            continue
        try:
            ray.get(ref)
        except RayActorError as exc:
            return rank, exc
        except Exception:  # another failure (a surviving rank's collective): not a death
            continue
    return None


def any_failed(refs: list[Any]) -> bool:
    """Whether a call of ``refs`` has ended with an error (a death or another failure)."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    for ref in done:
        try:
            ray.get(ref)
        except Exception:  # any failure counts
            return True
    return False


def raise_if_rank_died(refs: list[Any], step: int, wait_s: float = 0.0) -> None:
    """Raise :class:`TrainerRankDied` if a rank's call of ``refs`` (one per rank) failed with its death (waiting up to
    ``wait_s`` for the calls still running only when none has yet)."""
    died = dead_rank(refs) or (dead_rank(refs, wait_s) if wait_s else None)
    if died is not None:
        raise TrainerRankDied(died[0], step, died[1]) from died[1]


def keeps_rows(config: RLConfig) -> bool:
    """Whether the run keeps each step's rows in the queue until a checkpoint covers the step, and its queue across
    a trainer-group restart: ``train.restart_keeps_rows``, with restarts allowed and periodic checkpoints."""
    return config.train.restart_keeps_rows and config.train.max_restarts > 0 and config.checkpoint_interval > 0


def queue_steps(config: RLConfig, lookahead: int) -> int:
    """The steps the run's queue holds at once (its ``num_global_batch``): the step in training and the ``lookahead``
    launched ahead of it; keeping rows (:func:`keeps_rows`), the steps trained since the last checkpoint too (at most
    ``checkpoint_interval - 1``: the checkpoint after a step's row clears them)."""
    return lookahead + (config.checkpoint_interval if keeps_rows(config) else 1)


def covered_steps(partitions: list[Any], step: int) -> list[int]:
    """The steps among the queue's ``partitions`` (ints: steps; strs: other partitions) that a checkpoint of ``step``
    covers (those before it), in order."""
    return sorted(p for p in partitions if isinstance(p, int) and p < step)


def finish_writes(rollout: list[Any], timeout_s: float, engines: Sequence[Any] = ()) -> int:
    """Let the rollout workers of a run a trainer rank's death ended write the generations they have in flight, up
    to ``timeout_s`` (``train.restart_drain_s``), before they are stopped: the queue kept for the restart holds them
    (``RolloutWorker.finish_writes``); and let the run's ``engines`` end the checkpointed generation a dead worker
    left running (``EngineActor.finish_generating``: its chunks in the queue, the next start resumes them whole).
    Returns the batches still in flight then (a worker dead meanwhile, or that did not answer in time, counts one,
    as does an engine still generating): those rows are generated again, less what their checkpoints kept."""
    refs = [worker.finish_writes.remote(timeout_s) for worker in rollout]
    refs += [engine.finish_generating.remote(timeout_s) for engine in engines]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s + 10.0)
    left = len(refs) - len(done)
    for ref in done:
        try:
            answer = ray.get(ref)
            left += int(not answer) if isinstance(answer, bool) else int(answer)
        except RayError:  # the worker died (or was being restarted): what it held goes back to the queue
            left += 1
    if left:
        logger.warning(
            "%d rollout batches were still in flight after %.0f s: they are generated again", left, timeout_s
        )
    return left


def write_kept_queue(out: Path, checkpoint: Path | None, record: dict[str, Any]) -> None:
    """Note in ``out`` that this run's queue is left running for the restart from ``checkpoint`` (None: from the
    run's start, no checkpoint saved yet): ``record`` (``run_resume.queue_record`` of its step) names the steps it
    holds from there, where each drew its prompts, and the prompt position after the last draw."""
    kept = {"checkpoint": None if checkpoint is None else str(checkpoint), "record": record}
    (out / KEPT_QUEUE).write_text(json.dumps(kept))


def take_kept_queue(out: Path, running: bool) -> dict[str, Any] | None:
    """The note :func:`write_kept_queue` left in ``out`` (removed: it serves one start), if a queue is ``running``
    (a queue a trainer-group restart kept; after a crash of the process, or a second launch, none runs and the note
    is stale); None otherwise."""
    path = out / KEPT_QUEUE
    if not path.is_file():
        return None
    kept = json.loads(path.read_text())
    path.unlink()
    return kept if running else None


def queue_running() -> bool:
    """Whether a queue runs on this Ray cluster (the one a trainer-group restart kept)."""
    try:
        transfer_queue.get_controller()
    except QueueNotFound:
        return False
    return True


def stop_kept_queue(out: Path) -> None:
    """Stop the queue a run left running for a restart that will not come, and remove its note."""
    (out / KEPT_QUEUE).unlink(missing_ok=True)
    transfer_queue.shutdown()


def restart_line(died: TrainerRankDied, checkpoint: Any, restart: int, budget: int) -> str:
    """What the run prints when it restarts its trainer group."""
    where = f"from checkpoint {checkpoint}" if checkpoint is not None else "from the start of GRPO (no checkpoint yet)"
    return (
        f"trainer rank {died.rank} died at step {died.step}; restarting the trainer group {where} "
        f"(restart {restart} of {budget})"
    )


def joined_rows(attempts: list[tuple[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """The metric rows of a run its trainer-group restarts started again: ``attempts`` are each start's ``(first
    step, rows)`` in order; an attempt's rows of the steps from the next one's first step on (trained again after the
    checkpoint it resumed from) are left out, as ``MetricsLog.cut_back`` leaves them out of the run's JSONL."""
    rows: list[dict[str, Any]] = []
    for start, attempt_rows in attempts:
        rows = [r for r in rows if int(r["step"]) < start] + list(attempt_rows)
    return rows


def run_with_trainer_restarts(config: RLConfig, attempt: Callable[[RLConfig, int], T]) -> T:
    """``attempt(config, restarts)``: one start of the run (it stops what it started however it ends), told the
    trainer-group restarts not yet reported in a step row; started again after a :class:`TrainerRankDied`, up to
    ``config.train.max_restarts`` times, resuming from the run's latest checkpoint.

    Raises:
        TrainerRestartsSpent: a trainer rank died once the restarts were spent (its cause chained).
    """
    budget = config.train.max_restarts
    restarts, unreported, cfg = 0, 0, config
    while True:
        try:
            return attempt(cfg, unreported)
        except TrainerRankDied as died:
            if restarts >= budget:
                if died.kept_queue:
                    stop_kept_queue(config.output_path)
                raise TrainerRestartsSpent(
                    f"{died}; expected at most train.max_restarts={budget} trainer-group restarts, this death would "
                    f"be restart {restarts + 1}"
                ) from died
            restarts += 1
            unreported = died.unreported + 1
            if died.saved:  # go on from the run's own checkpoint, even with resume=false
                cfg = dataclasses.replace(config, resume=True)
            checkpoint = resume_checkpoint(cfg, config.output_path)
            print(restart_line(died, checkpoint, restarts, budget), flush=True)
