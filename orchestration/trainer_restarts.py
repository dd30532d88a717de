"""A dead trainer rank restarts the trainer group from the run's last checkpoint (issue 28, section 3).

A trainer rank is a Ray actor without restarts: its FSDP2 process group cannot take a new member, and its optimizer
state lives only in its process and in the checkpoints. When a trainer rank dies (its process killed, its node gone),
the call the driver made on it fails with a ``RayActorError``; the run raises :class:`TrainerRankDied` (the rank and
the step), stops what it started (the actors, the queue, the weight channel, the inference servers), and
:func:`run_with_trainer_restarts` starts it again in the same process: the new run resumes from its latest checkpoint
(the queue from that checkpoint's snapshot) through the same path a second launch of the same command takes
(orchestration/run_resume.py), the metrics rows past the checkpoint cut back and written again. Without a checkpoint
yet, it starts from the start of GRPO (or of the run: the SFT warm-up saves checkpoint 0).

Up to ``train.max_restarts`` restarts (0: a rank's death ends the run, as before); once they are spent a death ends
the run with :class:`TrainerRestartsSpent`. Every other failure ends the run as before.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError, RayTaskError

from orchestration.config import RLConfig
from orchestration.run_resume import resume_checkpoint

#: on a failed train step, the longest the driver waits for the other ranks' calls to end before it looks for a
#: dead rank among them (a surviving rank's collective fails once its peer's connection closes)
RANK_DEATH_WAIT_S = 10.0

T = TypeVar("T")
ACTOR_ID = re.compile(r"actor_id=([0-9a-f]+)")


class TrainerRankDied(RuntimeError):
    """A trainer rank's call failed with the rank's death (``RayActorError``): the trainer group restarts."""

    def __init__(self, rank: int, step: int, cause: BaseException | None = None):
        self.rank, self.step = rank, step
        self.unreported = 0  # the run's trainer-group restarts no step row had counted yet (GRPORun sets it)
        self.saved = False  # whether the run had saved a checkpoint (GRPORun sets it): the restart resumes from it
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
