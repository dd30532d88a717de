"""A run stopped by its user (Ctrl-C): the actors and the queue are stopped, and one line says where it stood.

``train_and_report`` turns the KeyboardInterrupt into :class:`RunStopped` (the GRPO steps done) once the run's actors
and queue are stopped; a recipe prints :func:`stopped_line` instead of a traceback, shuts Ray down and exits with
130 (128 + SIGINT, what a shell reports for a Ctrl-C)::

    stopped at step 37; last checkpoint at step 30; run the same command to resume
"""

from __future__ import annotations

import json

from trainers.checkpoint import latest_checkpoint
from trainers.config import RLConfig

#: the exit code of a recipe stopped by Ctrl-C
EXIT_INTERRUPTED = 130


class RunStopped(KeyboardInterrupt):
    """A Ctrl-C stopped a run after ``step`` GRPO steps; its actors and queue are already stopped."""

    def __init__(self, step: int):
        super().__init__(f"stopped at step {step}")
        self.step = step


def checkpoint_step(config: RLConfig) -> int | None:
    """The step of the newest complete checkpoint in ``config``'s output_dir, or None."""
    latest = latest_checkpoint(config.output_path / "checkpoints")
    if latest is None:
        return None
    return int(json.loads((latest / "checkpoint.json").read_text())["extra_state"].get("step", 0))


def stopped_line(config: RLConfig, interrupt: BaseException) -> str:
    """The one line a recipe prints for a Ctrl-C: the step reached (a :class:`RunStopped`'s, else that of the
    checkpoint the run stands at), the last checkpoint, and how to go on."""
    saved = checkpoint_step(config)
    step = interrupt.step if isinstance(interrupt, RunStopped) else (saved or 0)
    if saved is None:
        return f"stopped at step {step}; no checkpoint yet; run the same command to start again"
    again = "run the same command" if config.resume else "run the same command without --new"
    return f"stopped at step {step}; last checkpoint at step {saved}; {again} to resume"
