"""Group filters: each takes one group's Samples and says whether to keep it; bad groups are refused."""

from __future__ import annotations

from typing import Any

import pytest

from orchestration.training import (
    LibraryError,
    Sample,
    check_min_reward,
    check_quality_and_diversity,
    check_response_diversity,
    check_reward_nonzero_std,
)


def group(*pairs: tuple[str, float]) -> list[Sample]:
    return [Sample(prompt="q", response=text, tokens=[1, 2], loss_mask=[0.0, 1.0], reward=r) for text, r in pairs]


def test_nonzero_std_keeps_groups_whose_rewards_differ() -> None:
    assert check_reward_nonzero_std(group(("a", 1.0), ("b", 0.0)))
    assert not check_reward_nonzero_std(group(("a", 1.0), ("b", 1.0)))
    assert not check_reward_nonzero_std(group(("a", 0.3)))  # one sample: no spread


def test_min_reward_compares_the_mean_reward_with_the_threshold() -> None:
    assert check_min_reward(group(("a", 1.0), ("b", 0.0)), threshold=0.5)  # mean 0.5 >= 0.5
    assert not check_min_reward(group(("a", 1.0), ("b", 0.0), ("c", 0.0)), threshold=0.5)


def test_response_diversity_counts_distinct_texts_or_trained_tokens() -> None:
    assert check_response_diversity(group(("a", 0), ("a", 0), ("b", 0), ("c", 0)), min_unique_ratio=0.75)
    assert not check_response_diversity(group(("a", 0), ("a", 0), ("a", 0), ("b", 0)), min_unique_ratio=0.75)
    untexted = [
        Sample(tokens=[1, 2], loss_mask=[0.0, 1.0]),
        Sample(tokens=[9, 2], loss_mask=[0.0, 1.0]),  # same response token, other prompt token
        Sample(tokens=[1, 3], loss_mask=[0.0, 1.0]),
    ]
    assert not check_response_diversity(untexted, min_unique_ratio=1.0)
    assert check_response_diversity(untexted, min_unique_ratio=0.6)


def test_quality_and_diversity_needs_both() -> None:
    assert check_quality_and_diversity(group(("a", 1.0), ("b", 0.0)))
    assert not check_quality_and_diversity(group(("a", 1.0), ("b", 1.0)))
    assert not check_quality_and_diversity(group(("a", 1.0), ("a", 0.0), ("a", 0.0)))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: check_reward_nonzero_std([]), "at least one Sample, got an empty list"),
        (lambda: check_min_reward(group(("a", 1.0))[0]), "a group's list of Samples, got Sample"),
        (lambda: check_response_diversity(["a"]), "takes Samples, item 0 is a str"),
        (lambda: check_response_diversity(group(("a", 1.0)), min_unique_ratio=2), r"in \[0, 1\], got 2"),
        (lambda: check_min_reward(group(("a", 1.0)), threshold=float("nan")), "finite number threshold, got nan"),
    ],
)
def test_bad_groups_are_refused(call: Any, message: str) -> None:
    with pytest.raises(LibraryError, match=message):
        call()
