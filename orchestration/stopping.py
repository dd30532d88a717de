"""A run stopped by its user (Ctrl-C) or its scheduler (SIGTERM): the actors, the queue and the weight channel are
stopped, and one line says where it stood.

``train_and_report`` turns the KeyboardInterrupt into :class:`RunStopped` (the GRPO steps done) once the run's actors
and queue are stopped; a recipe prints :func:`stopped_line` instead of a traceback, shuts Ray down and exits with
130 (128 + SIGINT, what a shell reports for a Ctrl-C)::

    stopped at step 37; last checkpoint at step 30; run the same command to resume

A SIGTERM (``kill``, a job scheduler, ``docker stop``) takes the same way while :class:`SigtermStops` is entered
(after Ray's start, which installs its own handler: exit at once, the run's cleanup skipped): it raises
KeyboardInterrupt in the main thread, and the recipe exits with 143 (128 + SIGTERM).
"""

from __future__ import annotations

import json
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

from orchestration.config import RLConfig
from trainers.checkpoint import latest_checkpoint

#: the exit code of a recipe stopped by Ctrl-C
EXIT_INTERRUPTED = 130
#: the exit code of a recipe stopped by SIGTERM
EXIT_TERMINATED = 128 + signal.SIGTERM


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


class SigtermStops:
    """While entered, a SIGTERM stops the run as a Ctrl-C does: KeyboardInterrupt in the main thread, so every
    ``finally`` on the way out runs (actors and queue stopped, the weight channel removed). Further SIGTERMs while
    that stop runs are ignored (SIGKILL remains). The handler in place before is put back on exit. Outside the main
    thread (where Python runs no signal handler) it does nothing.

    >>> with SigtermStops() as sigterm:  # doctest: +SKIP
    ...     train_and_report(config)
    """

    def __init__(self) -> None:
        self.received = False  # a SIGTERM began the stop
        self.stopping = False  # a stop is under way (a SIGTERM's or a Ctrl-C's)
        self._previous: Any = None
        self._previous_int: Any = None
        self._installed = False

    def __enter__(self) -> SigtermStops:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._previous_int = signal.signal(signal.SIGINT, self._interrupt)
            self._installed = True
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            signal.signal(signal.SIGINT, self._previous_int)
            self._installed = False

    def exit_code(self) -> int:
        """The exit code of a run this stopped: :data:`EXIT_TERMINATED`, else :data:`EXIT_INTERRUPTED` (a Ctrl-C)."""
        return EXIT_TERMINATED if self.received else EXIT_INTERRUPTED

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:  # the cleanup of a stop (a Ctrl-C's too) runs to its end
            return
        self.stopping = self.received = True
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        """A Ctrl-C: what the handler before does (Python's: KeyboardInterrupt), noting that a stop is under way."""
        previous = self._previous_int
        if previous == signal.SIG_IGN:
            return
        self.stopping = True
        if callable(previous):
            previous(signum, frame)
        raise KeyboardInterrupt
