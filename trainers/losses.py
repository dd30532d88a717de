"""Policy-gradient losses for GRPO-style training: pure functions over ``[B, T]`` tensors.

Every loss takes ``logprobs`` (current policy, with grad), ``old_logprobs`` (the policy that sampled),
``advantages`` and ``response_mask`` aligned with ``input_ids`` as in ``docs/rl-conventions.md``, and returns
``(loss, metrics)``: a scalar to minimise and plain floats to log (``pg_loss``, ``clip_frac``, ``approx_kl``,
``ratio_mean``). Positions outside ``response_mask`` never reach the loss, even when they hold ``-inf``.

Aggregation modes (``loss_agg``):
    - ``"token-mean"``: sum over all response tokens of the batch / their count (DAPO).
    - ``"seq-mean-token-mean"``: mean over each sequence's tokens, then over sequences (GRPO, GSPO).
    - ``"seq-mean-token-sum"``: sum over each sequence's tokens, then mean over sequences.
Sequences without response tokens are left out of the sequence mean; a batch without any response token gives
a zero loss that is still attached to the graph, never NaN.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable

import torch
from torch import Tensor

LossOutput = tuple[Tensor, dict[str, float]]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# exp() of a log-ratio beyond this overflows float32 gradients long before it means anything; verl clamps too.
_MAX_LOG_RATIO = 20.0


def aggregate(loss_mat: Tensor, response_mask: Tensor, loss_agg: str = "token-mean") -> Tensor:
    """Reduce a per-token ``[B, T]`` loss to a scalar over the response tokens.

    Args:
        loss_mat: ``[B, T]`` per-token loss; values outside the mask are ignored (even inf/NaN).
        response_mask: ``[B, T]``, nonzero on response tokens.
        loss_agg: one of ``LOSS_AGG_MODES``.

    Returns:
        Scalar tensor; 0 (with grad) when the mask is empty.
    """
    _check_loss_agg(loss_agg)
    mask = response_mask > 0
    masked = torch.where(mask, loss_mat, torch.zeros_like(loss_mat))
    if loss_agg == "token-mean":
        return masked.sum() / mask.sum().clamp(min=1)
    lengths = mask.sum(dim=-1)
    per_seq = masked.sum(dim=-1)
    if loss_agg == "seq-mean-token-mean":
        per_seq = per_seq / lengths.clamp(min=1)
    return per_seq.sum() / (lengths > 0).sum().clamp(min=1)


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg: str = "token-mean",
    token_weights: Tensor | None = None,
) -> LossOutput:
    """PPO clipped surrogate per token: ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``.

    ``r = exp(logprobs - old_logprobs)``. A ``clip_high`` above ``clip_low`` is DAPO's "clip-higher".

    Args:
        logprobs: ``[B, T]`` log-probs of ``input_ids`` under the current policy.
        old_logprobs: ``[B, T]`` log-probs under the sampling policy (no grad needed).
        advantages: ``[B]`` (broadcast over the response) or ``[B, T]`` per token.
        response_mask: ``[B, T]``, nonzero on response tokens.
        clip_low: lower clip range ``eps_low`` in ``[0, 1)``.
        clip_high: upper clip range ``eps_high`` ``>= 0``.
        loss_agg: one of ``LOSS_AGG_MODES``.
        token_weights: optional ``[B, T]`` per-token multiplier, detached (e.g. ``truncated_is_weights``).

    Returns:
        ``(loss, metrics)``; ``clip_frac`` is the fraction of response tokens whose gradient the clip zeroed.

    Raises:
        ValueError: on mismatched shapes or out-of-range knobs.
    """
    mask, adv = _check_inputs(logprobs, old_logprobs, advantages, response_mask, loss_agg, token_weights)
    _check_clip(clip_low, clip_high)
    log_ratio = _log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(log_ratio)
    loss_mat, clipped = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    return _finish(loss_mat, mask, loss_agg, token_weights, log_ratio, ratio, clipped)


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg: str = "seq-mean-token-mean",
    token_weights: Tensor | None = None,
) -> LossOutput:
    """GRPO (DeepSeekMath): the PPO clipped surrogate on group advantages, mean per sequence then over sequences.

    Pass ``loss_agg="token-mean"`` for DAPO's token-level aggregation. Arguments as in ``ppo_clip_loss``; the
    KL term of GRPO is added by ``policy_loss(..., ref_logprobs=..., kl_coef=beta)``.
    """
    return ppo_clip_loss(
        logprobs,
        old_logprobs,
        advantages,
        response_mask,
        clip_low=clip_low,
        clip_high=clip_high,
        loss_agg=loss_agg,
        token_weights=token_weights,
    )


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    loss_agg: str = "seq-mean-token-mean",
    token_weights: Tensor | None = None,
) -> LossOutput:
    """GSPO (Qwen): clip a sequence-level ratio ``s_i = exp(mean_t(logprobs - old_logprobs))``.

    Per sequence ``-min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i)``. It is computed in the
    token-level stop-gradient form ``s_i,t = sg(s_i) * exp(logprob_t - sg(logprob_t))``: every token carries
    the value ``s_i``, and with the default ``"seq-mean-token-mean"`` the gradient is exactly the paper's
    ``-A_i * s_i * mean_t grad(logprob_t)``.

    Args:
        logprobs, old_logprobs, response_mask, loss_agg, token_weights: as in ``ppo_clip_loss``.
        advantages: ``[B]``, one per sequence.
        clip_low: lower clip range on ``s_i`` (paper: 3e-4).
        clip_high: upper clip range on ``s_i`` (paper: 4e-4).

    Returns:
        ``(loss, metrics)``; ``clip_frac`` counts response tokens of clipped sequences.
    """
    mask, adv = _check_inputs(logprobs, old_logprobs, advantages, response_mask, loss_agg, token_weights)
    if advantages.dim() != 1:
        raise ValueError(
            f"gspo_loss needs one advantage per sequence: expected shape [B], got {tuple(advantages.shape)}"
        )
    _check_clip(clip_low, clip_high)
    log_ratio = _log_ratio(logprobs, old_logprobs, mask)
    seq_log_ratio = log_ratio.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    token_logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    log_seq_ratio = seq_log_ratio.detach()[:, None] + token_logprobs - token_logprobs.detach()
    seq_ratio = torch.exp(log_seq_ratio.clamp(max=_MAX_LOG_RATIO))
    loss_mat, clipped = _clipped_surrogate(seq_ratio, adv, clip_low, clip_high)
    return _finish(loss_mat, mask, loss_agg, token_weights, log_ratio, seq_ratio, clipped)


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float = 0.28,
    loss_agg: str = "token-mean",
    token_weights: Tensor | None = None,
) -> LossOutput:
    """CISPO (MiniMax-M1): ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logprob`` per token.

    The clipped importance weight only scales the REINFORCE term, so no token loses its gradient; the weight
    itself gets none. MiniMax-M1 sets no lower bound (``clip_low=None``) and tunes only ``clip_high``.

    Args:
        logprobs, old_logprobs, advantages, response_mask, loss_agg, token_weights: as in ``ppo_clip_loss``.
        clip_low: lower clip range on the weight, or None for no lower bound.
        clip_high: upper clip range on the weight, ``>= 0``.

    Returns:
        ``(loss, metrics)``; ``clip_frac`` is the fraction of response tokens whose weight was truncated.
    """
    mask, adv = _check_inputs(logprobs, old_logprobs, advantages, response_mask, loss_agg, token_weights)
    _check_clip(0.0 if clip_low is None else clip_low, clip_high)
    log_ratio = _log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(log_ratio)
    low = None if clip_low is None else 1 - clip_low
    weight = ratio.clamp(min=low, max=1 + clip_high).detach()
    token_logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    loss_mat = -weight * adv * token_logprobs
    clipped = ratio > 1 + clip_high
    if low is not None:
        clipped = clipped | (ratio < low)
    return _finish(loss_mat, mask, loss_agg, token_weights, log_ratio, ratio, clipped)


def minirl_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    loss_agg: str = "token-mean",
    token_weights: Tensor | None = None,
) -> LossOutput:
    """MiniRL (Qwen, "Stabilizing Reinforcement Learning with LLMs: Formulation and Practices", arXiv 2512.01374).

    Token-level policy gradient ``-w_t * M_t * A * r_t`` with ``r_t = exp(logprobs - old_logprobs)`` (the current
    policy over the trainer's old/proximal policy), where

    - ``w_t`` is the rollout-trainer importance weight ``pi_old / mu_old`` (the trainer's over the inference
      engine's probability of the sampled token), passed as ``token_weights`` (``rollout_correction``); 1 when
      the trainer did not recompute the old log-probs;
    - ``M_t`` masks the tokens PPO's clip would stop: ``A > 0`` and ``r_t > 1 + clip_high``, or ``A < 0`` and
      ``r_t < 1 - clip_low``. Unlike PPO's ``min``, a masked token contributes neither value nor gradient.

    On-policy (``r = 1``) the gradient is ``-w_t * A * grad(logprob_t)``, REINFORCE with the IS correction.

    Args:
        logprobs, old_logprobs, advantages, response_mask, loss_agg, token_weights: as in ``ppo_clip_loss``.
        clip_low, clip_high: the masking band ``[1 - clip_low, 1 + clip_high]`` on ``r_t``.

    Returns:
        ``(loss, metrics)``; ``clip_frac`` is the fraction of response tokens masked.
    """
    mask, adv = _check_inputs(logprobs, old_logprobs, advantages, response_mask, loss_agg, token_weights)
    _check_clip(clip_low, clip_high)
    log_ratio = _log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(log_ratio)
    masked = ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))
    loss_mat = torch.where(masked, torch.zeros_like(ratio), -adv * ratio)
    return _finish(loss_mat, mask, loss_agg, token_weights, log_ratio, ratio, masked)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy (Schulman's k1/k2/k3).

    With ``d = ref_logprobs - logprobs``: ``k1 = -d`` (unbiased, can be negative), ``k2 = d**2 / 2``,
    ``k3 = exp(d) - d - 1`` (unbiased, always ``>= 0``, low variance; GRPO's choice).

    Args:
        logprobs: ``[B, T]`` log-probs under the current policy.
        ref_logprobs: ``[B, T]`` log-probs under the reference policy.
        response_mask: ``[B, T]``, nonzero on response tokens.
        kind: one of ``"k1"``, ``"k2"``, ``"k3"``.

    Returns:
        ``[B, T]`` per-token KL, 0 outside the mask; reduce it with ``aggregate``.

    Raises:
        ValueError: on an unknown ``kind`` or mismatched shapes.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator kind={kind!r}, expected one of {sorted(KL_ESTIMATORS)}")
    _check_shape("ref_logprobs", ref_logprobs, logprobs)
    _check_shape("response_mask", response_mask, logprobs)
    d = _log_ratio(ref_logprobs, logprobs, response_mask > 0)
    return KL_ESTIMATORS[kind](d)


def truncated_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor, cap: float) -> Tensor:
    """Truncated importance weights ``min(exp(old_logprobs - rollout_logprobs), cap)``, detached.

    Corrects for the mismatch between the trainer's and the inference engine's probabilities of the same
    sampled tokens; pass the result as ``token_weights`` to any loss.

    Returns:
        ``[B, T]`` weights, 1 outside the mask.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    _check_shape("rollout_logprobs", rollout_logprobs, old_logprobs)
    _check_shape("response_mask", response_mask, old_logprobs)
    return torch.exp(_log_ratio(old_logprobs, rollout_logprobs, response_mask > 0)).clamp(max=cap).detach()


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda d: -d,
    "k2": lambda d: 0.5 * d * d,
    "k3": lambda d: torch.expm1(d) - d,
}

LOSSES: dict[str, Callable[..., LossOutput]] = {
    "ppo": ppo_clip_loss,
    "grpo": grpo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "minirl": minirl_loss,
}
_DEFAULT_LOSS_AGG = {name: inspect.signature(fn).parameters["loss_agg"].default for name, fn in LOSSES.items()}


def loss_named(name: str) -> str:
    """The key of ``LOSSES`` that ``name`` names, in any case (AgentRL's guide writes ``--loss_calculater GRPO``).

    Raises:
        ValueError: ``name`` is no key of ``LOSSES`` in any case; the message lists them and the closest.

    >>> loss_named("GRPO")
    'grpo'
    """
    by_lower = {key.lower(): key for key in LOSSES}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    close = [by_lower[m] for m in difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.6)]
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown policy loss name={name!r}, expected one of {sorted(LOSSES)} (in any case){hint}")


def policy_loss(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    **loss_kwargs: object,
) -> LossOutput:
    """Look up loss ``name`` in ``LOSSES``, compute it, and add ``kl_coef * KL(policy || reference)``.

    The KL term is aggregated with the same ``loss_agg`` as the policy loss.

    Args:
        name: a key of ``LOSSES``, in any case (``loss_named``).
        logprobs, old_logprobs, advantages, response_mask: as in ``ppo_clip_loss``.
        ref_logprobs: ``[B, T]`` reference log-probs; when given the KL is logged even if ``kl_coef`` is 0.
        kl_coef: ``beta >= 0``; needs ``ref_logprobs`` when > 0.
        kl_kind: estimator, see ``kl_penalty``.
        **loss_kwargs: the chosen loss's keyword knobs (``clip_low``, ``clip_high``, ``loss_agg``, ...).

    Returns:
        ``(loss, metrics)``: the loss's metrics plus ``kl`` (when ``ref_logprobs`` is given) and ``loss``.
    """
    name = loss_named(name)
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs [B, T], got None")
    loss, metrics = LOSSES[name](logprobs, old_logprobs, advantages, response_mask, **loss_kwargs)
    if ref_logprobs is not None:
        loss_agg = str(loss_kwargs.get("loss_agg", _DEFAULT_LOSS_AGG[name]))
        kl = aggregate(kl_penalty(logprobs, ref_logprobs, response_mask, kl_kind), response_mask, loss_agg)
        loss = loss + kl_coef * kl
        metrics["kl"] = kl.item()
    metrics["loss"] = loss.item()
    return loss, metrics


def _clipped_surrogate(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """Per-token ``max(-A * r, -A * clip(r))`` and where the clipped branch won (its gradient is 0)."""
    surrogate = -adv * ratio
    clipped_surrogate = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(surrogate, clipped_surrogate), clipped_surrogate > surrogate


def _log_ratio(numerator: Tensor, denominator: Tensor, mask: Tensor) -> Tensor:
    """``numerator - denominator`` on the mask (0 elsewhere, so inf padding cannot leak), clamped for exp()."""
    diff = torch.where(mask, numerator - denominator, torch.zeros_like(numerator))
    return diff.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _finish(
    loss_mat: Tensor,
    mask: Tensor,
    loss_agg: str,
    token_weights: Tensor | None,
    log_ratio: Tensor,
    ratio: Tensor,
    clipped: Tensor,
) -> LossOutput:
    """Weight and aggregate the per-token loss; compute the shared metrics over response tokens."""
    if token_weights is not None:
        loss_mat = loss_mat * token_weights.detach()
    loss = aggregate(loss_mat, mask, loss_agg)
    with torch.no_grad():
        count = mask.sum().clamp(min=1)

        def masked_mean(x: Tensor) -> float:
            return float(torch.where(mask, x.float(), torch.zeros_like(x, dtype=torch.float)).sum() / count)

        metrics = {
            "pg_loss": loss.item(),
            "clip_frac": masked_mean(clipped),
            # k3 estimate of KL(old || new) from tokens sampled by the old policy: r - 1 - log r >= 0.
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio),
            "ratio_mean": masked_mean(ratio),
        }
    return loss, metrics


def _check_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg: str,
    token_weights: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Validate shapes and ``loss_agg``; return the boolean mask and advantages broadcastable to ``[B, T]``."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    _check_shape("old_logprobs", old_logprobs, logprobs)
    _check_shape("response_mask", response_mask, logprobs)
    if token_weights is not None:
        _check_shape("token_weights", token_weights, logprobs)
    _check_loss_agg(loss_agg)
    batch = logprobs.shape[0]
    if advantages.shape == (batch,):
        return response_mask > 0, advantages[:, None]
    if advantages.shape == logprobs.shape:
        return response_mask > 0, advantages
    raise ValueError(
        f"advantages must be [B] or [B, T]: expected {(batch,)} or {tuple(logprobs.shape)}, "
        f"got {tuple(advantages.shape)}"
    )


def _check_shape(name: str, tensor: Tensor, like: Tensor) -> None:
    if tensor.shape != like.shape:
        raise ValueError(f"{name} must match logprobs [B, T]: expected {tuple(like.shape)}, got {tuple(tensor.shape)}")


def _check_loss_agg(loss_agg: str) -> None:
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg={loss_agg!r}, expected one of {list(LOSS_AGG_MODES)}")


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
