"""Unit tests for trainers.filters: keep-masks checked against hand-picked rows."""

import pytest
import torch

from trainers.advantages import group_advantages
from trainers.filters import (
    FilterConfig,
    apply_filters,
    drop_zero_advantage,
    max_trained_count,
    minimal_advantage,
    nonzero_std_groups,
    skip_non_positive_advantage,
)


def mask(*bits: int) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.bool)


def test_drop_zero_advantage():
    # |A| > 1e-8: 0.5 yes, 0 no, 1e-9 no, -0.3 yes
    assert torch.equal(drop_zero_advantage(torch.tensor([0.5, 0.0, 1e-9, -0.3])), mask(1, 0, 0, 1))


def test_skip_non_positive_advantage():
    assert torch.equal(skip_non_positive_advantage(torch.tensor([0.5, 0.0, -0.3])), mask(1, 0, 0))


def test_minimal_advantage_is_inclusive_on_magnitude():
    # |A| >= 0.25: 0.5 yes, -0.25 yes (boundary), 0.125 no, -0.0625 no
    keep = minimal_advantage(torch.tensor([0.5, -0.25, 0.125, -0.0625]), threshold=0.25)
    assert torch.equal(keep, mask(1, 1, 0, 0))


def test_max_trained_count():
    # trained fewer than 2 times: counts 0, 1 kept; 2, 3 dropped
    assert torch.equal(max_trained_count(torch.tensor([0, 1, 2, 3]), max_count=2), mask(1, 1, 0, 0))


def test_nonzero_std_groups_drops_constant_groups():
    # groups of 3: [1, 1, 1] constant, [0, 1, 0] varies, [0.5, 0.5, 0.5] constant
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5])
    assert torch.equal(nonzero_std_groups(rewards, group_size=3), mask(0, 0, 0, 1, 1, 1, 0, 0, 0))


@pytest.mark.parametrize("seed", range(5))
def test_nonzero_std_groups_never_splits_a_group(seed):
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (64,), generator=generator).float()
    keep = nonzero_std_groups(rewards, group_size=4).view(16, 4)
    assert torch.equal(keep.all(dim=1), keep.any(dim=1))


def test_apply_filters_combines_with_and():
    # rewards [1, 0 | 1, 1] -> A = [0.707, -0.707 | 0, 0]; zero-std drops group 1, skip-non-positive drops row 1
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    advantages = group_advantages(rewards, group_size=2)
    config = FilterConfig(nonzero_std_groups=True, skip_non_positive_advantage=True)
    keep = apply_filters(config, advantages=advantages, rewards=rewards, group_size=2)
    assert torch.equal(keep, mask(1, 0, 0, 0))


def test_apply_filters_all_off_keeps_everything():
    assert torch.equal(apply_filters(FilterConfig(), advantages=torch.zeros(3)), mask(1, 1, 1))


def test_apply_filters_replay_and_minimal_advantage():
    # |A| >= 0.5 keeps rows 0, 2, 3; trained < 1 time keeps rows 0, 1, 3 -> rows 0, 3
    config = FilterConfig(minimal_advantage=0.5, max_trained_count=1)
    keep = apply_filters(
        config, advantages=torch.tensor([1.0, 0.25, -0.5, 0.75]), trained_counts=torch.tensor([0, 0, 1, 0])
    )
    assert torch.equal(keep, mask(1, 0, 0, 1))


def test_apply_filters_missing_input_raises():
    with pytest.raises(ValueError, match=r"enables max_trained_count, which needs trained_counts \[N\], got None"):
        apply_filters(FilterConfig(max_trained_count=2), advantages=torch.zeros(2))
    with pytest.raises(ValueError, match=r"nonzero_std_groups needs group_size, got None"):
        apply_filters(FilterConfig(nonzero_std_groups=True), rewards=torch.zeros(2))
    with pytest.raises(ValueError, match=r"must have the same N, got \[2, 3\]"):
        apply_filters(FilterConfig(drop_zero_advantage=True), advantages=torch.ones(2), rewards=torch.ones(3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"minimal_advantage": -0.5}, r"minimal_advantage must be >= 0 or None, got -0.5"),
        ({"max_trained_count": 0}, r"max_trained_count must be >= 1 or None, got 0"),
        ({"zero_std_eps": -1.0}, r"zero_std_eps must be >= 0, got -1.0"),
    ],
)
def test_filter_config_validates(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FilterConfig(**kwargs)


def test_bad_filter_inputs_raise():
    with pytest.raises(ValueError, match=r"advantages must be 1-D \[N\] \(one per row\), got shape \(2, 2\)"):
        drop_zero_advantage(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"trained_counts must be a 1-D integer tensor \[N\], got shape \(2,\) dtype"):
        max_trained_count(torch.zeros(2), max_count=1)
    with pytest.raises(ValueError, match=r"max_count must be an int >= 1, got 0"):
        max_trained_count(torch.zeros(2, dtype=torch.long), max_count=0)
    with pytest.raises(ValueError, match=r"rewards has N=3 rows, expected a multiple of group_size=2"):
        nonzero_std_groups(torch.zeros(3), group_size=2)
    with pytest.raises(ValueError, match=r"threshold must be >= 0, got -1"):
        minimal_advantage(torch.zeros(2), threshold=-1)


def test_nonzero_std_groups_leaves_invalid_rows_out_of_the_statistics():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, float("nan")])
    valid = torch.tensor([True, False, True, True, True, False])
    # group 0: only one valid row -> constant; group 1: 1 vs 0 -> kept; group 2: one valid row (the NaN is invalid)
    assert nonzero_std_groups(rewards, 2, valid=valid).tolist() == [False, False, True, True, False, False]
    with pytest.raises(ValueError, match=r"valid must be a bool tensor of the rewards' shape \(6,\)"):
        nonzero_std_groups(rewards, 2, valid=torch.ones(3, dtype=torch.bool))
