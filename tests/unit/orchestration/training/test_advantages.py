"""compute_advantages (reward - baseline, also from loops.rl_loop) and compute_group_advantages (GRPO)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from orchestration.training import LibraryError, compute_group_advantages
from orchestration.training.loops.rl_loop import compute_advantages


def test_advantages_are_rewards_minus_the_baseline() -> None:
    assert compute_advantages([1.0, 0.0, 0.5], baseline=0.5) == [0.5, -0.5, 0.0]
    assert compute_advantages(torch.tensor([2.0, 1.0])) == [2.0, 1.0]
    assert compute_advantages([]) == []


def test_group_advantages_normalise_within_each_group() -> None:
    advantages = compute_group_advantages([1.0, 0.0, 1.0, 1.0], group_size=2)

    assert advantages[0] == pytest.approx(0.7071, abs=1e-4) and advantages[1] == pytest.approx(-0.7071, abs=1e-4)
    assert advantages[2:] == [0.0, 0.0]  # a constant group teaches nothing
    assert compute_group_advantages([3.0, 1.0], group_size=2, normalize_std=False) == [1.0, -1.0]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: compute_advantages([1.0, float("nan")]), "reward 1 is nan"),
        (lambda: compute_advantages([1.0], baseline=float("inf")), "finite number baseline, got inf"),
        (lambda: compute_advantages("1"), "a list of rewards, got str"),
        (
            lambda: compute_group_advantages([1.0, 0.0, 1.0], group_size=2),
            "3 rewards is not a multiple of group_size=2",
        ),
        (lambda: compute_group_advantages([1.0], group_size=0), "group_size >= 1, got 0"),
    ],
)
def test_bad_rewards_are_refused(call: Any, message: str) -> None:
    with pytest.raises(LibraryError, match=message):
        call()
