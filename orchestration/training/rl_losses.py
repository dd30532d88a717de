"""RL losses over a model's logits: ``grpo_loss`` (the seed's policy gradient) and ``ppo_loss`` (clipped surrogate).

Alignment (the project's, docs/rl-conventions.md): ``labels`` and ``loss_mask`` are aligned with ``input_ids``, as a
Hugging Face causal LM takes ``labels=input_ids`` and shifts inside. Token ``t`` of a sequence is scored by the logits
of position ``t - 1``::

    log p[b, t] = log_softmax(logits[b, t - 1])[labels[b, t]]      for t >= 1

so a ``Sample``'s ``tokens`` and ``loss_mask`` go in as they are (``labels = input_ids = tokens``). Position 0 is
never scored (nothing predicts it), and neither is a label < 0 (Hugging Face's ``-100``, padding). Positions outside
``loss_mask > 0`` never reach the loss or its gradient, even when their logits are ``-inf`` or NaN. ``old_log_probs``
(PPO) follow the same alignment: ``old_log_probs[b, t]`` scores ``labels[b, t]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from orchestration.training.types import LibraryError
from trainers.losses import ppo_clip_loss


def _check(logits: Tensor, labels: Tensor, loss_mask: Tensor, advantages: Tensor, name: str) -> None:
    if logits.dim() != 3:
        raise LibraryError(f"{name}: logits must be [batch, seq_len, vocab_size], got shape {tuple(logits.shape)}")
    batch, length = logits.shape[:2]
    for what, tensor in (("labels", labels), ("loss_mask", loss_mask)):
        if tuple(tensor.shape) != (batch, length):
            raise LibraryError(
                f"{name}: {what} must be [batch, seq_len] = {(batch, length)} like the logits, "
                f"got {tuple(tensor.shape)}"
            )
    if tuple(advantages.shape) != (batch,):
        raise LibraryError(
            f"{name}: advantages must be [batch] = {(batch,)}, one per sequence, got {tuple(advantages.shape)}"
        )


def trained_weights(labels: Tensor, loss_mask: Tensor) -> Tensor:
    """``[B, T]`` float per-token weights the losses use: ``loss_mask`` where ``t >= 1`` and ``labels >= 0``, else 0."""
    weights = torch.where(labels >= 0, loss_mask.float(), torch.zeros_like(loss_mask, dtype=torch.float32))
    weights = weights.clone()
    weights[:, 0] = 0.0
    return torch.where(weights > 0, weights, torch.zeros_like(weights))


def token_log_probs(logits: Tensor, labels: Tensor, loss_mask: Tensor | None = None) -> Tensor:
    """``[B, T]`` float32 ``log p(labels[b, t] | labels[b, :t])`` from ``logits[b, t - 1]``; 0 at ``t = 0``, on
    labels < 0 and outside ``loss_mask > 0`` (whose logits are not even read: NaN there stays out of the gradient)."""
    if loss_mask is None:
        loss_mask = torch.ones_like(labels, dtype=torch.float32)
    scored = (trained_weights(labels, loss_mask) > 0)[:, 1:]
    shifted = logits[:, :-1].float()
    shifted = torch.where(scored.unsqueeze(-1), shifted, torch.zeros_like(shifted))
    targets = labels[:, 1:].clamp(min=0).long().unsqueeze(-1)
    # gather - logsumexp instead of log_softmax: no second [B, T, V] tensor.
    logp = shifted.gather(-1, targets).squeeze(-1) - shifted.logsumexp(-1)
    logp = torch.where(scored, logp, torch.zeros_like(logp))
    return torch.nn.functional.pad(logp, (1, 0))


def grpo_loss(logits: Tensor, labels: Tensor, loss_mask: Tensor, advantages: Tensor) -> Tensor:
    """The seed's GRPO policy gradient: ``-mean_b(A_b * sum_t w[b, t] * log p[b, t])``.

    ``w`` is ``loss_mask`` on scored positions (module docstring), so ``sum_t w log p`` is the log-probability of
    the response; the mean is over the ``B`` sequences (one with no response token adds 0). No ratio and no clip:
    on-policy REINFORCE with the given advantages (detached).

    Args:
        logits: ``[B, T, V]`` the model's output on ``input_ids``.
        labels: ``[B, T]`` token ids aligned with ``input_ids`` (normally ``input_ids`` itself).
        loss_mask: ``[B, T]`` 0 on prompt and padding, 1 (or a weight) on response tokens.
        advantages: ``[B]`` one per sequence.

    Returns:
        A scalar tensor to ``backward()``.
    """
    _check(logits, labels, loss_mask, advantages, "grpo_loss")
    weights = trained_weights(labels, loss_mask)
    sequence_log_prob = (token_log_probs(logits, labels, loss_mask) * weights).sum(dim=-1)
    return -(sequence_log_prob * advantages.detach().to(sequence_log_prob.dtype)).mean()


def ppo_loss(
    logits: Tensor,
    labels: Tensor,
    loss_mask: Tensor,
    advantages: Tensor,
    old_log_probs: Tensor,
    clip_range: float = 0.2,
    loss_agg: str = "token-mean",
) -> Tensor:
    """PPO's clipped surrogate, ``max(-A r, -A clip(r, 1 - clip_range, 1 + clip_range))`` per response token with
    ``r = exp(log p - old_log_probs)`` (``trainers.losses.ppo_clip_loss``), aggregated by ``loss_agg``
    (``"token-mean"``, ``"seq-mean-token-mean"`` or ``"seq-mean-token-sum"``); fractional ``loss_mask`` values
    weight their tokens.

    Args:
        logits, labels, loss_mask, advantages: as in ``grpo_loss``.
        old_log_probs: ``[B, T]`` log-probs of ``labels`` under the policy that sampled them, same alignment.
        clip_range: ``eps`` of the clip, in ``[0, 1)``.
        loss_agg: how per-token losses become a scalar.

    Returns:
        A scalar tensor to ``backward()``.
    """
    _check(logits, labels, loss_mask, advantages, "ppo_loss")
    if tuple(old_log_probs.shape) != tuple(labels.shape):
        raise LibraryError(
            f"ppo_loss: old_log_probs must be [batch, seq_len] = {tuple(labels.shape)} like the labels, "
            f"got {tuple(old_log_probs.shape)}"
        )
    weights = trained_weights(labels, loss_mask)
    try:
        loss, _ = ppo_clip_loss(
            token_log_probs(logits, labels, loss_mask),
            old_log_probs.detach().float(),
            advantages.detach().float(),
            weights,
            clip_low=clip_range,
            clip_high=clip_range,
            loss_agg=loss_agg,
            token_weights=weights,
        )
    except LibraryError:
        raise
    except ValueError as error:
        raise LibraryError(f"ppo_loss: {error}") from None
    return loss
