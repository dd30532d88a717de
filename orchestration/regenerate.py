"""LostPrompts: the driver puts again the prompts whose rows died with a storage unit, so no prompt is skipped.

When a storage unit dies, Ray restarts it empty and the queue marks the rows it held LOST (with the rest of their
GRPO groups; see docs/architecture.md "Lost rows"). A lost row is never served again; the step it belonged to waits for
as many new rows. While the trainer works on a step, the driver looks at the lost rows of every live step once a
second and, per lost group:

- the trainer acknowledged it (it read the rows before they were lost and trained on them): nothing to do;
- the trainer holds it (a DP round is reading or training it): wait, it ends acknowledged or handed back;
- otherwise (never handed to the trainer, or handed back because a rank could not read it): put the group's prompt
  again, ``n_samples`` rows with the same group id, and start the step's rollout and reward again if their workers had
  already finished the step.

Each lost group is handled once, so every prompt group of a step is trained exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray

from transfer_queue.errors import PartitionCleared, UnknownPartition

logger = logging.getLogger(__name__)
CHECK_EVERY_S = 1.0


class LostPrompts:
    """The prompts of each live step by group id, and the lost groups already handled.

    Args:
        client: the driver's queue client.
        train_task: the trainer's task name (whose acknowledgements say a group was trained).
        put_group: ``put_group(step, group_id, prompt)`` puts one prompt's ``n_samples`` rows into ``step`` with that
            group id.
        relaunch: ``relaunch(step, rollout, reward)`` starts the rollout and/or reward of ``step`` again (their workers
            had finished it); returns the new refs of each.
    """

    def __init__(
        self,
        client: Any,
        train_task: str,
        put_group: Callable[[int, int, dict[str, Any]], None],
        relaunch: Callable[[int, bool, bool], tuple[list[Any], list[Any]]],
    ):
        self.client = client
        self.train_task = train_task
        self.put_group = put_group
        self.relaunch = relaunch
        self.prompts: dict[int, list[dict[str, Any]]] = {}  # step -> its prompts; group g is prompts[g]
        self.handled: dict[int, set[int]] = {}  # step -> lost global indexes dealt with
        # step -> lost global indexes whose groups were put again: kept until the step is cleared (a restart that
        # keeps the queue trains the step again and must not put them a second time: run_resume.queue_record)
        self.put_again: dict[int, set[int]] = {}
        self.groups_put_again = 0

    def remember(self, step: int, prompts: list[dict[str, Any]]) -> None:
        """The prompts ``step`` drew, in put order (its first put gives prompt ``g`` the group id ``g``)."""
        self.prompts[step] = list(prompts)

    def restore(self, step: int, prompts: list[dict[str, Any]], put_again: list[int]) -> None:
        """A step resumed from a queue (a checkpoint's snapshot, or the queue a trainer-group restart kept): its
        prompts, drawn again from where the step drew them, and the lost rows whose groups the run before had put
        again (not put a second time; a group it left out because the trainer had trained it is put again if the
        step is trained again)."""
        self.remember(step, prompts)
        self.handled[step] = set(put_again)
        self.put_again[step] = set(put_again)

    def forget(self, step: int, cleared: bool = True) -> None:
        """``step`` was trained: nothing more to put for it. ``cleared=False``: its rows stay in the queue (kept for
        a trainer-group restart until a checkpoint covers it), and so does the record of the groups put again."""
        self.prompts.pop(step, None)
        self.handled.pop(step, None)
        if cleared:
            self.put_again.pop(step, None)

    def wait(
        self,
        refs: list[Any],
        pending: dict[int, tuple[list[Any], list[Any]]],
        watch: Callable[[dict[int, tuple[list[Any], list[Any]]]], None] | None = None,
    ) -> list[Any]:
        """``ray.get(refs)``, putting lost prompts of the ``pending`` steps again meanwhile. ``watch(pending)``, once a
        second, looks at the workers' ended calls (the run's supervisor: it makes the calls of a dead worker again,
        replacing their refs in ``pending``, and raises other failures); without it a failed call is raised."""
        while True:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=CHECK_EVERY_S)
            if len(done) == len(refs):
                if watch is None:
                    return ray.get(refs)
                # ``refs`` may be a step's calls (a colocated run waits for its rollout): one that ended with its
                # worker's death is made again by ``watch`` (its ref replaced in place), not raised
                watch(pending)
                if _all_done(refs):
                    return ray.get(refs)
                continue
            if watch is not None:
                watch(pending)
            for step, (rollout, reward) in pending.items():
                # a worker that failed fails the run now, instead of the trainer waiting for its rows forever
                # (e.g. prompt + max_new_tokens longer than the model allows: its engine raised ValueError)
                if watch is None:
                    finished, _ = ray.wait(rollout + reward, num_returns=len(rollout + reward), timeout=0)
                    ray.get(finished)
                if self.put_lost(step):  # workers that already left the step are started on it again
                    more_rollout, more_reward = self.relaunch(step, _all_done(rollout), _all_done(reward))
                    rollout.extend(more_rollout)
                    reward.extend(more_reward)

    def put_lost(self, step: int) -> int:
        """Put again the lost groups of ``step`` the trainer neither trained nor holds; returns how many."""
        prompts = self.prompts.get(step)
        if prompts is None:
            return 0
        try:
            lost = self.client.lost_rows(global_step=step)
        except (UnknownPartition, PartitionCleared):  # not opened yet, or done
            return 0
        handled = self.handled.setdefault(step, set())
        groups: dict[int, list[dict[str, Any]]] = {}
        for row in lost:
            if row["global_index"] not in handled:
                groups.setdefault(row["group_id"], []).append(row)
        put = 0
        for group, rows in sorted(groups.items()):
            states = {row["tasks"].get(self.train_task, "ready") for row in rows}
            if "leased" in states:
                continue  # a DP round holds it: it ends acknowledged, or handed back (then it is put again)
            handled.update(row["global_index"] for row in rows)
            if states <= {"acknowledged", "dead_lettered"}:
                continue  # trained before the rows were lost
            self.put_group(step, group, prompts[group])
            self.put_again.setdefault(step, set()).update(row["global_index"] for row in rows)
            put += 1
        if put:
            self.groups_put_again += put
            logger.warning("step %d: put %d prompt groups again (their rows died with a storage unit)", step, put)
        return put


def _all_done(refs: list[Any]) -> bool:
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    return len(done) == len(refs)
