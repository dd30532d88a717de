"""Unit tests for trainers.advantages: expected values are worked out by hand in the comments."""

import pytest
import torch

from trainers.advantages import group_advantages, group_advantages_by_id, group_reward_std


def test_two_groups_of_two_unbiased_std():
    # group 0: r=[1, 0], mean=0.5, unbiased var=(0.25+0.25)/(2-1)=0.5, std=sqrt(0.5); A=±0.5/sqrt(0.5)=±0.70710678
    # group 1: r=[1, 1], all equal -> A=0
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([0.70710678, -0.70710678, 0.0, 0.0]))


def test_std_is_unbiased_not_population():
    # r=[0, 1, 2]: mean=1, unbiased var=(1+0+1)/(3-1)=1 -> A=[-1, 0, 1].
    # (The population std sqrt(2/3) would give ±1.2247.)
    adv = group_advantages(torch.tensor([0.0, 1.0, 2.0]), group_size=3, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0]))


def test_eps_is_added_to_std():
    # r=[1, 0]: std=sqrt(0.5)=0.70710678; eps=1-0.70710678=0.29289322 makes the divisor 1 -> A=±0.5
    adv = group_advantages(torch.tensor([1.0, 0.0]), group_size=2, eps=0.29289322)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]))


def test_without_std_normalisation_only_mean_is_subtracted():
    # r=[0, 2, 4]: mean=2 -> A=[-2, 0, 2]; with normalisation std=sqrt((4+0+4)/2)=2 -> [-1, 0, 1]
    rewards = torch.tensor([0.0, 2.0, 4.0])
    torch.testing.assert_close(group_advantages(rewards, 3, normalize_std=False), torch.tensor([-2.0, 0.0, 2.0]))
    torch.testing.assert_close(group_advantages(rewards, 3, eps=0.0), torch.tensor([-1.0, 0.0, 1.0]))


def test_zero_variance_group_gives_exact_zero_not_nan():
    # 0.1 is not exact in binary, so a naive (r - mean) / (0 + eps) could give ±1e-2 noise; we pin 0.
    adv = group_advantages(torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7]), group_size=3, eps=0.0)
    assert torch.equal(adv, torch.zeros(6))


def test_group_of_one_gives_zero():
    assert torch.equal(group_advantages(torch.tensor([3.0, -1.0]), group_size=1), torch.zeros(2))


def test_integer_rewards_come_back_float32():
    adv = group_advantages(torch.tensor([1, 0]), group_size=2, eps=0.0)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([0.70710678, -0.70710678]))


def test_by_id_handles_interleaved_groups():
    # group 7 = rows 0, 2, 4 with r=[0, 2, 4] -> [-1, 0, 1]; group 3 = rows 1, 3, 5 with r=[5, 5, 5] -> 0
    rewards = torch.tensor([0.0, 5.0, 2.0, 5.0, 4.0, 5.0])
    group_ids = torch.tensor([7, 3, 7, 3, 7, 3])
    adv = group_advantages_by_id(rewards, group_ids, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 0.0, 0.0, 1.0, 0.0]))


def test_group_reward_std():
    # group 0: r=[0, 2, 4] -> std 2; group 1: r=[5, 5, 5] -> 0; group 2: r=[1, 0, 0], mean=1/3,
    # var=((2/3)^2 + 2*(1/3)^2)/2 = (4/9 + 2/9)/2 = 1/3 -> std=0.57735027
    std = group_reward_std(torch.tensor([0.0, 2.0, 4.0, 5.0, 5.0, 5.0, 1.0, 0.0, 0.0]), group_size=3)
    torch.testing.assert_close(std, torch.tensor([2.0, 0.0, 0.57735027]))


def test_empty_batch():
    assert group_advantages(torch.zeros(0), group_size=4).shape == (0,)


@pytest.mark.parametrize(
    ("rewards", "group_size", "message"),
    [
        (torch.zeros(5), 2, r"rewards has N=5 rows, expected a multiple of group_size=2"),
        (torch.zeros(2, 2), 2, r"rewards must be 1-D \[N\], got shape \(2, 2\)"),
        (torch.tensor([0.0, float("nan"), 1.0, float("inf")]), 2, r"non-finite values at rows \[1, 3\]"),
        (torch.zeros(4), 0, r"group_size must be an int >= 1, got 0"),
        ([1.0, 0.0], 2, r"rewards must be a torch.Tensor \[N\], got list"),
    ],
)
def test_bad_inputs_raise(rewards, group_size, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, group_size)


def test_bad_group_ids_raise():
    rewards = torch.zeros(3)
    with pytest.raises(ValueError, match=r"group_ids must have the shape of rewards: expected \(3,\), got \(2,\)"):
        group_advantages_by_id(rewards, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"group_ids must be an integer torch.Tensor, got torch.float32"):
        group_advantages_by_id(rewards, torch.zeros(3))
    with pytest.raises(ValueError, match=r"eps must be >= 0, got -1"):
        group_advantages_by_id(rewards, torch.zeros(3, dtype=torch.long), eps=-1)
