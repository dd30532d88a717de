"""grpo_loss and ppo_loss over logits: the shift (logits[t - 1] score labels[t]), a hand computation, the gradient's
sign, and masked positions kept out even when their logits are -inf or NaN."""

from __future__ import annotations

import math

import pytest
import torch

from orchestration.training import LibraryError, grpo_loss, ppo_loss, token_log_probs


def tiny() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5, requires_grad=True)
    labels = torch.tensor([[1, 2, 3, 4], [0, 4, 4, 1]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    return logits, labels, mask


def test_grpo_loss_matches_a_hand_computation() -> None:
    logits, labels, mask = tiny()
    advantages = torch.tensor([1.0, -0.5])

    loss = grpo_loss(logits, labels, mask, advantages)

    def logp(b: int, t: int) -> float:  # logits of position t - 1 score the label at t
        return float(torch.log_softmax(logits[b, t - 1].detach(), -1)[labels[b, t]])

    seq = [logp(0, 2) + logp(0, 3), logp(1, 1) + logp(1, 2)]
    expected = -(1.0 * seq[0] + -0.5 * seq[1]) / 2
    assert loss.dim() == 0 and loss.item() == pytest.approx(expected, rel=1e-5)
    assert token_log_probs(logits, labels, mask)[0, 2].item() == pytest.approx(logp(0, 2), rel=1e-5)


def test_a_positive_advantage_raises_the_response_tokens_probability() -> None:
    logits, labels, mask = tiny()
    grpo_loss(logits, labels, mask, torch.tensor([1.0, -1.0])).backward()
    assert logits.grad is not None
    # the logit of the label at t = 2 sits at position 1: descent raises it (advantage > 0), lowers it (< 0)
    assert logits.grad[0, 1, labels[0, 2]] < 0 and logits.grad[1, 0, labels[1, 1]] > 0
    assert torch.all(logits.grad[0, 3] == 0) and torch.all(logits.grad[1, 2:] == 0)  # nothing scores from there


def test_masked_positions_are_ignored_even_with_nan_or_inf_logits() -> None:
    logits, labels, mask = tiny()
    clean = grpo_loss(logits, labels, mask, torch.tensor([1.0, 1.0]))
    poisoned = logits.detach().clone()
    poisoned[0, 0] = float("nan")  # scores labels[0, 1], masked
    poisoned[1, 2:] = float("-inf")  # score labels[1, 3] (masked) and nothing
    poisoned[0, 3] = float("nan")  # scores nothing
    poisoned.requires_grad_(True)
    labels = labels.clone()
    labels[1, 3] = -100  # Hugging Face's ignore index is not scored either
    old_log_probs = torch.where(mask > 0, -1.0, float("nan"))  # garbage off the response, as padding may hold

    for loss in (
        grpo_loss(poisoned, labels, mask, torch.tensor([1.0, 1.0])),
        ppo_loss(poisoned, labels, mask, torch.tensor([1.0, 1.0]), old_log_probs),
    ):
        poisoned.grad = None
        loss.backward()
        assert math.isfinite(loss.item()) and poisoned.grad is not None and torch.isfinite(poisoned.grad).all()
    assert grpo_loss(poisoned, labels, mask, torch.tensor([1.0, 1.0])).item() == pytest.approx(clean.item())


def test_ppo_loss_is_the_clipped_surrogate() -> None:
    logits, labels, mask = tiny()
    current = token_log_probs(logits, labels, mask).detach()
    advantages = torch.tensor([1.0, -1.0])

    on_policy = ppo_loss(logits, labels, mask, advantages, old_log_probs=current)
    # ratio 1 everywhere: the loss is -mean over response tokens of A = -(2 * 1 + 2 * -1) / 4
    assert on_policy.item() == pytest.approx(0.0, abs=1e-6)
    # old policy far less likely: ratio e^1 clipped at 1.2 for A > 0, unclipped (max picks -A r) for A < 0
    far = ppo_loss(logits, labels, mask, advantages, old_log_probs=current - 1.0, clip_range=0.2)
    assert far.item() == pytest.approx((-1.2 * 2 + math.e * 2) / 4, rel=1e-5)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ({"logits": (2, 4)}, r"logits must be \[batch, seq_len, vocab_size\], got shape \(2, 4\)"),
        ({"labels": (2, 3)}, r"labels must be \[batch, seq_len\] = \(2, 4\) like the logits, got \(2, 3\)"),
        ({"advantages": (2, 1)}, r"advantages must be \[batch\] = \(2,\), one per sequence, got \(2, 1\)"),
    ],
)
def test_shapes_are_checked(shape: dict, message: str) -> None:
    sizes = {"logits": (2, 4, 5), "labels": (2, 4), "advantages": (2,), **shape}
    with pytest.raises(LibraryError, match=message):
        grpo_loss(
            torch.zeros(sizes["logits"]),
            torch.zeros(sizes["labels"], dtype=torch.long),
            torch.ones(2, 4),
            torch.zeros(sizes["advantages"]),
        )


def test_ppo_refuses_a_bad_clip_range() -> None:
    logits, labels, mask = tiny()
    with pytest.raises(LibraryError, match=r"ppo_loss: clip_low must be in \[0, 1\), got 1.5"):
        ppo_loss(logits, labels, mask, torch.ones(2), torch.zeros(2, 4), clip_range=1.5)
