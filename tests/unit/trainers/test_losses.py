"""Unit tests for trainers.losses: expected values are worked out by hand in the comments.

Layout used throughout (docs/rl-conventions.md): position 0 is the prompt (mask 0); row 0 has response tokens at
positions 1 and 2, row 1 a single response token at position 1 followed by padding.
"""

import math

import pytest
import torch

from trainers.losses import (
    LOSSES,
    aggregate,
    cispo_loss,
    gspo_loss,
    kl_penalty,
    loss_named,
    minirl_loss,
    policy_loss,
    ppo_clip_loss,
    truncated_is_weights,
)
from trainers.rollout_correction import rollout_correction

MASK = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
LOGPROBS = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]])


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, requires_grad=True)


def test_aggregate_modes():
    # response tokens: row 0 -> [1, 2], row 1 -> [3]; the 9s sit on masked positions and must be ignored
    loss_mat = torch.tensor([[9.0, 1.0, 2.0], [9.0, 3.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.cat([MASK, torch.zeros(1, 3)])  # row 2 has no response token: left out of sequence means
    assert aggregate(loss_mat, mask, "token-mean").item() == pytest.approx(2.0)  # (1+2+3)/3
    assert aggregate(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx(2.25)  # (1.5+3)/2
    assert aggregate(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx(3.0)  # (3+3)/2


def test_ratio_one_gives_minus_mean_advantage():
    # ratio=1 everywhere, A=[2, -1]: per-token loss -A -> row 0 [-2, -2], row 1 [1]
    advantages = torch.tensor([2.0, -1.0])
    for name in ("grpo", "gspo"):  # seq-mean-token-mean: (-2 + 1)/2 = -0.5 = -mean(A)
        loss, metrics = LOSSES[name](leaf(LOGPROBS.tolist()), LOGPROBS, advantages, MASK)
        assert loss.item() == pytest.approx(-0.5)
        assert metrics["ratio_mean"] == pytest.approx(1.0)
        assert metrics["clip_frac"] == 0.0
        assert metrics["approx_kl"] == pytest.approx(0.0)
    loss, _ = ppo_clip_loss(LOGPROBS, LOGPROBS, advantages, MASK)  # token-mean: (-2 - 2 + 1)/3 = -1
    assert loss.item() == pytest.approx(-1.0)
    loss, _ = ppo_clip_loss(LOGPROBS, LOGPROBS, advantages, MASK, loss_agg="seq-mean-token-sum")  # (-4 + 1)/2
    assert loss.item() == pytest.approx(-1.5)


def test_ppo_clips_on_the_right_side_for_each_sign():
    # one response token per row (position 1), old logprob 0, ratio r = exp(logprob):
    #   row 0: A=+1, r=1.5 -> max(-1.5, -1.2) = -1.2  clipped  (grad 0)
    #   row 1: A=+1, r=0.5 -> max(-0.5, -0.8) = -0.5  kept     (grad -A*r/4 = -0.125)
    #   row 2: A=-1, r=1.5 -> max(+1.5, +1.2) = +1.5  kept     (grad -A*r/4 = +0.375)
    #   row 3: A=-1, r=0.5 -> max(+0.5, +0.8) = +0.8  clipped  (grad 0)
    # token-mean: (-1.2 - 0.5 + 1.5 + 0.8)/4 = 0.15; clip_frac 2/4
    logprobs = leaf([[0.0, math.log(r)] for r in (1.5, 0.5, 1.5, 0.5)])
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mask = torch.tensor([[0.0, 1.0]] * 4)
    loss, metrics = ppo_clip_loss(logprobs, torch.zeros(4, 2), advantages, mask)
    loss.backward()
    assert loss.item() == pytest.approx(0.15)
    assert metrics["clip_frac"] == pytest.approx(0.5)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0], [0.0, -0.125], [0.0, 0.375], [0.0, 0.0]]))


def test_clip_higher_moves_only_the_upper_bound():
    # row 0: A=+1, r=1.5 -> clipped at 1 + clip_high; row 1: A=-1, r=0.5 -> clipped at 1 - clip_low = 0.8
    #   clip_high=0.2:  (-1.2  + 0.8)/2 = -0.2
    #   clip_high=0.28: (-1.28 + 0.8)/2 = -0.24  (the lower side is unchanged)
    logprobs = torch.tensor([[0.0, math.log(1.5)], [0.0, math.log(0.5)]])
    mask = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    advantages = torch.tensor([1.0, -1.0])
    loss, _ = ppo_clip_loss(logprobs, torch.zeros(2, 2), advantages, mask)
    assert loss.item() == pytest.approx(-0.2)
    loss, _ = ppo_clip_loss(logprobs, torch.zeros(2, 2), advantages, mask, clip_high=0.28)
    assert loss.item() == pytest.approx(-0.24)


def test_gspo_gradient_matches_the_sequence_level_formula():
    # d/d logprob_t of -A * s with s = exp(mean_t(logprob_t - old_t)) is -A * s / |y| for every response token.
    # diffs (0.1, -0.1): s = exp(0) = 1, A=2 -> loss -2, grad -2*1/2 = -1 on both tokens
    logprobs = leaf([[0.0, -1.0, -2.0]])
    loss, _ = gspo_loss(logprobs, torch.tensor([[0.0, -1.1, -1.9]]), torch.tensor([2.0]), MASK[:1])
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -1.0, -1.0]]))

    # diffs (0.2, 0.0): s = exp(0.1) = 1.10517092. A=-1: max(+1.10517, +1.0004) keeps s (no clip);
    # loss 1.10517092, grad -A*s/2 = 0.55258546 on BOTH tokens (token-level PPO would give 1.2214/2 and 1/2)
    logprobs = leaf([[0.0, -0.8, -2.0]])
    loss, metrics = gspo_loss(logprobs, torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([-1.0]), MASK[:1])
    loss.backward()
    assert loss.item() == pytest.approx(1.10517092)
    assert metrics["clip_frac"] == 0.0
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.55258546, 0.55258546]]))

    # same ratio, A=+1: max(-1.10517, -1.0004) = -1.0004 -> clipped at 1 + 4e-4, no gradient
    logprobs = leaf([[0.0, -0.8, -2.0]])
    loss, metrics = gspo_loss(logprobs, torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([1.0]), MASK[:1])
    loss.backward()
    assert loss.item() == pytest.approx(-1.0004)
    assert metrics["clip_frac"] == 1.0
    torch.testing.assert_close(logprobs.grad, torch.zeros(1, 3))


def test_cispo_weight_is_clipped_and_gets_no_gradient():
    # ratios: token 1 exp(0.1) = 1.10517092 (< 1.28, kept), token 2 exp(0.5) = 1.64872127 -> clipped to 1.28
    # A=2: loss per token -w*A*logprob = [-1.10517*2*(-1), -1.28*2*(-0.5)] = [2.21034184, 1.28], mean 1.74517092
    # grad = -w*A/2 = [-1.10517092, -1.28]. Were w differentiated, token 1 would get -A*(w + w*logprob)/2 = 0.
    logprobs = leaf([[0.0, -1.0, -0.5]])
    loss, metrics = cispo_loss(logprobs, torch.tensor([[0.0, -1.1, -1.0]]), torch.tensor([2.0]), MASK[:1])
    loss.backward()
    assert loss.item() == pytest.approx(1.74517092)
    assert metrics["clip_frac"] == pytest.approx(0.5)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -1.10517092, -1.28]]))


def test_cispo_optional_lower_bound():
    # ratio exp(-0.5) = 0.60653066; A=1, one token: grad -w. No lower bound: w = 0.60653066; clip_low=0.1: w = 0.9
    for clip_low, weight in ((None, 0.60653066), (0.1, 0.9)):
        logprobs = leaf([[0.0, -1.5]])
        loss, _ = cispo_loss(
            logprobs, torch.tensor([[0.0, -1.0]]), torch.tensor([1.0]), MASK[:1, :2], clip_low=clip_low
        )
        loss.backward()
        torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -weight]]))


def test_approx_kl_metric():
    # one token with ratio 2: k3 of KL(old || new) = r - 1 - ln r = 1 - 0.69314718 = 0.30685282
    _, metrics = ppo_clip_loss(
        torch.tensor([[math.log(2.0)]]), torch.zeros(1, 1), torch.tensor([0.0]), torch.ones(1, 1)
    )
    assert metrics["approx_kl"] == pytest.approx(0.30685282)
    assert metrics["ratio_mean"] == pytest.approx(2.0)


def test_kl_estimators_by_hand():
    # d = ref - logprob on response tokens = [-1, +1]
    ref = torch.tensor([[0.0, -2.0, -1.0]])
    logprobs = torch.tensor([[0.0, -1.0, -2.0]])
    torch.testing.assert_close(kl_penalty(logprobs, ref, MASK[:1], "k1"), torch.tensor([[0.0, 1.0, -1.0]]))  # -d
    torch.testing.assert_close(kl_penalty(logprobs, ref, MASK[:1], "k2"), torch.tensor([[0.0, 0.5, 0.5]]))  # d²/2
    # k3 = e^d - d - 1: e^-1 + 1 - 1 = 0.36787944; e - 1 - 1 = 0.71828183
    torch.testing.assert_close(kl_penalty(logprobs, ref, MASK[:1]), torch.tensor([[0.0, 0.36787944, 0.71828183]]))


def test_k3_is_nonnegative_and_zero_when_equal():
    generator = torch.Generator().manual_seed(0)
    logprobs, ref = -torch.rand(2, 4, 16, generator=generator) * 5
    mask = torch.ones(4, 16)
    assert (kl_penalty(logprobs, ref, mask) >= 0).all()
    assert torch.equal(kl_penalty(logprobs, logprobs, mask), torch.zeros(4, 16))


def test_policy_loss_adds_beta_times_kl():
    # ratio 1, A=1 -> grpo loss -1; k3 on tokens [0.36787944, 0.71828183], seq-mean-token-mean 0.54308064
    # total = -1 + 0.1 * 0.54308064 = -0.94569194
    logprobs = torch.tensor([[0.0, -1.0, -2.0]])
    ref = torch.tensor([[0.0, -2.0, -1.0]])
    loss, metrics = policy_loss(
        "grpo", logprobs, logprobs, torch.tensor([1.0]), MASK[:1], ref_logprobs=ref, kl_coef=0.1
    )
    assert loss.item() == pytest.approx(-0.94569194)
    assert metrics["kl"] == pytest.approx(0.54308064)
    assert metrics["pg_loss"] == pytest.approx(-1.0)


def test_truncated_is_weights_scale_the_loss():
    # exp(old - rollout) = exp(1) = 2.718 capped at 2; ratio 1, A=1 -> loss -1 * 2 = -2
    old = torch.tensor([[0.0, -1.0]])
    weights = truncated_is_weights(old, torch.tensor([[0.0, -2.0]]), MASK[:1, :2], cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 2.0]]))
    loss, _ = ppo_clip_loss(old, old, torch.tensor([1.0]), MASK[:1, :2], token_weights=weights)
    assert loss.item() == pytest.approx(-2.0)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_empty_mask_gives_zero_loss_with_grad_not_nan(name):
    # -inf on masked positions (e.g. padding) must not leak into the loss or its gradient
    logprobs = leaf([[float("-inf"), -1.0], [-2.0, float("-inf")]])
    loss, metrics = LOSSES[name](logprobs, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.zeros(2, 2))
    assert loss.item() == 0.0
    assert loss.requires_grad
    loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(2, 2))
    assert all(math.isfinite(value) for value in metrics.values())


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_masked_inf_does_not_leak(name):
    logprobs = leaf([[float("-inf"), -1.0, float("-inf")]])
    loss, _ = LOSSES[name](logprobs, torch.tensor([[0.0, -1.0, 0.0]]), torch.tensor([1.0]), torch.tensor([[0, 1, 0]]))
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(logprobs.grad).all()


def test_bad_inputs_raise():
    adv = torch.tensor([1.0, 1.0])
    with pytest.raises(ValueError, match=r"old_logprobs must match logprobs \[B, T\]: expected \(2, 3\), got \(2, 4\)"):
        ppo_clip_loss(LOGPROBS, torch.zeros(2, 4), adv, MASK)
    with pytest.raises(
        ValueError, match=r"advantages must be \[B\] or \[B, T\]: expected \(2,\) or \(2, 3\), got \(3,\)"
    ):
        ppo_clip_loss(LOGPROBS, LOGPROBS, torch.zeros(3), MASK)
    with pytest.raises(ValueError, match=r"unknown loss_agg='mean', expected one of \['token-mean', "):
        ppo_clip_loss(LOGPROBS, LOGPROBS, adv, MASK, loss_agg="mean")
    with pytest.raises(ValueError, match=r"clip_low must be in \[0, 1\), got 1.0"):
        ppo_clip_loss(LOGPROBS, LOGPROBS, adv, MASK, clip_low=1.0)
    with pytest.raises(
        ValueError, match=r"gspo_loss needs one advantage per sequence: expected shape \[B\], got \(2, 3\)"
    ):
        gspo_loss(LOGPROBS, LOGPROBS, torch.zeros(2, 3), MASK)
    with pytest.raises(ValueError, match=r"unknown KL estimator kind='k4', expected one of \['k1', 'k2', 'k3'\]"):
        kl_penalty(LOGPROBS, LOGPROBS, MASK, kind="k4")


def test_policy_loss_validates_name_and_kl():
    with pytest.raises(ValueError, match=r"unknown policy loss name='dpo', expected one of \['cispo', 'grpo', 'gspo'"):
        policy_loss("dpo", LOGPROBS, LOGPROBS, torch.zeros(2), MASK)
    with pytest.raises(ValueError, match=r"kl_coef=0.1 needs ref_logprobs \[B, T\], got None"):
        policy_loss("grpo", LOGPROBS, LOGPROBS, torch.zeros(2), MASK, kl_coef=0.1)


@pytest.mark.parametrize(
    ("given", "name"), [("GRPO", "grpo"), ("Gspo", "gspo"), ("MINIRL", "minirl"), ("cispo", "cispo")]
)
def test_a_loss_name_is_accepted_in_any_case(given, name):
    """AgentRL's guide writes ``--loss_calculater GRPO``."""
    assert loss_named(given) == name
    loss, _ = policy_loss(given, leaf(LOGPROBS.tolist()), LOGPROBS, torch.ones(2), MASK)
    assert loss.item() == pytest.approx(
        policy_loss(name, leaf(LOGPROBS.tolist()), LOGPROBS, torch.ones(2), MASK)[0].item()
    )


def test_an_unknown_loss_name_is_refused_naming_the_closest():
    with pytest.raises(ValueError) as refused:
        loss_named("GSPOO")

    assert str(refused.value) == (
        "unknown policy loss name='GSPOO', expected one of ['cispo', 'grpo', 'gspo', 'minirl', 'ppo'] (in any case); "
        "did you mean gspo, grpo, cispo?"
    )


def test_minirl_masks_the_tokens_the_clip_would_stop_and_weights_by_the_rollout_gap():
    # one response token per row (position 1), old logprob 0, r = exp(logprob); clip band [0.8, 1.28]:
    #   row 0: A=+1, r=1.5 -> masked (A>0, r>1.28)       loss 0
    #   row 1: A=+1, r=0.5 -> kept, w=2   -> -w*A*r = -1.0, grad d/dlogp = -2*0.5 = -1.0
    #   row 2: A=-1, r=1.5 -> kept, w=1   -> +1.5,          grad +1.5
    #   row 3: A=-1, r=0.5 -> masked (A<0, r<0.8)        loss 0
    # token-mean over 4 tokens: (0 - 1 + 1.5 + 0) / 4 = 0.125; gradients / 4
    logprobs = leaf([[0.0, math.log(1.5)], [0.0, math.log(0.5)], [0.0, math.log(1.5)], [0.0, math.log(0.5)]])
    mask = torch.tensor([[0.0, 1.0]] * 4)
    weights = torch.tensor([[1.0, 1.0], [1.0, 2.0], [1.0, 1.0], [1.0, 1.0]])
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, metrics = minirl_loss(logprobs, torch.zeros(4, 2), advantages, mask, token_weights=weights)
    assert loss.item() == pytest.approx(0.125)
    assert metrics["clip_frac"] == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(logprobs.grad[:, 1], torch.tensor([0.0, -0.25, 0.375, 0.0]))
    # on-policy it is REINFORCE: grad -A / N per token
    on_policy = leaf([[0.0, -1.0], [0.0, -2.0]])
    loss, _ = policy_loss("minirl", on_policy, on_policy.detach(), torch.tensor([2.0, -1.0]), MASK[:, :2])
    loss.backward()
    torch.testing.assert_close(on_policy.grad, torch.tensor([[0.0, -1.0], [0.0, 0.5]]))


def test_rollout_correction_truncates_or_masks_and_measures_the_gap():
    # trainer (old) vs engine (rollout) log-probs on 3 response tokens: rho = exp(old - rollout) = [e, 1, e^-1]
    old = torch.tensor([[0.0, -1.0, -1.0, -2.0]])
    rollout = torch.tensor([[0.0, -2.0, -1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    e = math.e
    weights, metrics = rollout_correction(old, rollout, mask, "tis", high=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 2.0, 1.0, 1 / e]]))
    assert metrics["mismatch_abs_dlogp"] == pytest.approx(2 / 3)
    # k3 of d = log rho: (e - 1 - 1) + 0 + (1/e - 1 + 1) = e - 2 + 1/e, over 3 tokens
    assert metrics["mismatch_kl"] == pytest.approx((e - 2 + 1 / e) / 3)
    assert metrics["is_weight_mean"] == pytest.approx((e + 1 + 1 / e) / 3)
    assert (metrics["is_truncated_frac"], metrics["is_masked_frac"]) == (pytest.approx(1 / 3), 0.0)
    weights, metrics = rollout_correction(old, rollout, mask, "mis", high=2.0, low=0.5)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    assert metrics["is_masked_frac"] == pytest.approx(2 / 3)
    weights, _ = rollout_correction(old, rollout, mask, "none")
    assert torch.equal(weights, torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"unknown rollout correction mode='icepop', expected one of"):
        rollout_correction(old, rollout, mask, "icepop")
    with pytest.raises(ValueError, match=r"the MIS band needs 0 <= low < high, got low=3\.0 high=2\.0"):
        rollout_correction(old, rollout, mask, "mis", high=2.0, low=3.0)
