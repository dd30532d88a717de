"""A step resumed from a queue (a checkpoint's snapshot, or the queue a trainer-group restart kept) has its lost groups
put again like a step the run drew itself (orchestration/regenerate.py ``LostPrompts.restore``): before, its prompts
were unknown to the new run, a group lost to a dead storage unit was never put again and the step waited forever."""

from __future__ import annotations

from typing import Any

from orchestration.regenerate import LostPrompts


class _Queue:
    def __init__(self, lost: list[dict[str, Any]]):
        self.lost = lost

    def lost_rows(self, global_step: int) -> list[dict[str, Any]]:
        return self.lost


def _lost(group: int, indexes: range) -> list[dict[str, Any]]:
    return [{"global_index": i, "group_id": group, "tasks": {"train": "ready"}} for i in indexes]


def test_a_restored_steps_lost_groups_are_put_again_except_those_the_run_before_had_put_again() -> None:
    put: list[tuple[int, int, dict[str, Any]]] = []
    lost = LostPrompts(
        _Queue(_lost(1, range(4, 8)) + _lost(3, range(12, 16))), "train", lambda *args: put.append(args), None
    )  # type: ignore[arg-type]
    assert lost.put_lost(5) == 0  # a step it knows nothing of: nothing it could put
    prompts = [{"prompt_ids": [g]} for g in range(4)]
    lost.restore(5, prompts, put_again=[12, 13, 14, 15])  # group 3 was put again before the restart

    assert lost.put_lost(5) == 1
    assert put == [(5, 1, {"prompt_ids": [1]})]
    assert lost.put_lost(5) == 0  # each lost group once


def test_the_groups_put_again_are_remembered_until_the_step_is_cleared_and_only_those() -> None:
    """A trained step whose rows a trainer-group restart keeps still knows which lost groups were put again (the
    restart must not put them a second time); a group the trainer had trained before it was lost is not among them
    (a restart that trains the step again needs it put again)."""
    trained = [{"global_index": i, "group_id": 2, "tasks": {"train": "acknowledged"}} for i in range(8, 12)]
    queue = _Queue(_lost(1, range(4, 8)) + trained)
    lost = LostPrompts(queue, "train", lambda *args: None, None)  # type: ignore[arg-type]
    lost.remember(4, [{"prompt_ids": [g]} for g in range(4)])
    assert lost.put_lost(4) == 1
    assert lost.put_again == {4: {4, 5, 6, 7}}

    lost.forget(4, cleared=False)  # trained; its rows kept until a checkpoint covers it
    assert lost.put_again == {4: {4, 5, 6, 7}} and lost.put_lost(4) == 0
    lost.forget(4)  # cleared
    assert lost.put_again == {}
