"""TaskNames: which task names a queue knows, so that a typo fails fast instead of starting a new consumer.

Plain Python, no Ray. Every task name starts a consumer of its own that is served every row once, so a typo
(``"rolout"``) silently reads every row again. A queue that declares its ``task_names`` (QueueConfig) refuses any
other name with :class:`~transfer_queue.errors.UnknownTask`. Without a declaration any name is served, and a name
never seen before is warned about once when it starts a new consumer of a partition that *established* tasks already
consume: tasks that were first seen on an earlier partition (on the first partition every task is new, and stages
that start one after another are not typos).
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable

import numpy as np

from transfer_queue.config import QueueConfig
from transfer_queue.errors import UnknownTask
from transfer_queue.state.partition import PartitionState
from transfer_queue.state.ready_index import AVAILABLE

logger = logging.getLogger(__name__)

# Task names remembered without a declaration (the oldest is forgotten first): a run of unique names stays bounded.
TASK_NAMES_REMEMBERED = 4096


def _suggestion(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class TaskNames:
    """The declared task names, or the names seen so far (with the partition uid each was first asked on)."""

    def __init__(self, config: QueueConfig):
        self.declared = config.task_names
        self.seen: dict[str, int | None] = {}  # name -> uid of the partition of its first get_meta (None: none yet)

    def announce(self, task_name: str) -> None:
        """``task_name`` is named on purpose (its options or sampler are set): refused if undeclared, never warned
        about."""
        self._check(task_name)
        if task_name not in self.seen:
            self._remember(task_name, None)

    def on_get_meta(self, task_name: str, part: PartitionState | None) -> str:
        """Check a get_meta's task on ``part`` (None: not opened yet); returns a warning for the caller, or ``""``."""
        self._check(task_name)
        if self.declared:
            return ""
        if task_name in self.seen:
            if self.seen[task_name] is None and part is not None:
                self.seen[task_name] = part.uid
            return ""
        warning = "" if part is None else self._warning(task_name, part)
        self._remember(task_name, None if part is None else part.uid)
        if warning:
            logger.warning("%s", warning)
        return warning

    def _check(self, task_name: str) -> None:
        if self.declared and task_name not in self.declared:
            raise UnknownTask(
                f"task_name={task_name!r} is not one of the queue's task_names {list(self.declared)}"
                f"{_suggestion(task_name, self.declared)}"
            )

    def _warning(self, task_name: str, part: PartitionState) -> str:
        n = part.num_rows
        established = sorted(
            name
            for name, task in part.tasks.items()
            if name != task_name
            and (first := self.seen.get(name)) is not None
            and first < part.uid
            and np.any(task.consumption[:n] != AVAILABLE)
        )
        if not established:
            return ""
        return (
            f"task_name={task_name!r} was never seen before and starts a new consumer of {part.name}, which the tasks "
            f"{established} already consume: it will be served every row again{_suggestion(task_name, self.seen)}. "
            "Declare the queue's task_names to refuse unknown names"
        )

    def _remember(self, task_name: str, uid: int | None) -> None:
        self.seen[task_name] = uid
        while len(self.seen) > TASK_NAMES_REMEMBERED:
            del self.seen[next(iter(self.seen))]
