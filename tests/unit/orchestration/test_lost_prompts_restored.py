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
    lost.restore(5, prompts, handled=[12, 13, 14, 15])  # group 3 was put again before the restart

    assert lost.put_lost(5) == 1
    assert put == [(5, 1, {"prompt_ids": [1]})]
    assert lost.put_lost(5) == 0  # each lost group once
