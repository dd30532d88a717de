"""The trainer-inference mismatch: which policy sampled a token, and how the loss corrects for it.

The inference engine samples with its own kernels (and dtype); the trainer recomputes the log-probs of the same
tokens with the training model (``train.recompute_old_logprobs``). The two disagree a little, or a lot when the
engine is stale (async). ``rollout_correction`` turns the gap into per-token importance weights for any loss in
``trainers.losses`` (``token_weights``) and into metrics that show how large it is. See docs/rl-conventions.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainers.losses import _check_shape, _log_ratio

ROLLOUT_CORRECTIONS = ("none", "tis", "mis")


def rollout_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    mode: str = "tis",
    *,
    high: float = 2.0,
    low: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Importance weights for the gap between the trainer's and the inference engine's policy, and its metrics.

    ``rho_t = exp(old_logprobs - rollout_logprobs)`` per sampled token (trainer over engine), as verl's
    ``rollout_is`` and slime's TIS / MIS:

    - ``"tis"``: truncated IS, ``min(rho_t, high)``;
    - ``"mis"``: masked IS, ``rho_t`` inside ``[low, high]`` and 0 outside (the token leaves the loss);
    - ``"none"``: weights 1, metrics only.

    In async training the engine's policy is also stale, so ``rho`` is AReaL's behaviour-policy weight of decoupled
    PPO (``old_logprobs`` then being the proximal policy that the loss's clip is anchored to).

    Args:
        old_logprobs: ``[B, T]`` the trainer's log-probs of the sampled tokens (recomputed before the update).
        rollout_logprobs: ``[B, T]`` the engine's log-probs of the same tokens.
        response_mask: ``[B, T]``, nonzero on response tokens.
        mode: one of ``ROLLOUT_CORRECTIONS``.
        high: upper threshold, ``> 0``.
        low: lower threshold of ``"mis"``, in ``[0, high)``; None means ``1 / high``.

    Returns:
        ``(weights, metrics)``: ``[B, T]`` detached weights (1 outside the mask) to pass as ``token_weights``;
        ``mismatch_abs_dlogp`` (mean ``|old - rollout|``), ``mismatch_kl`` (k3 estimate of
        KL(engine || trainer) from the engine's samples), ``is_weight_mean`` (before truncation),
        ``is_truncated_frac`` and ``is_masked_frac`` over response tokens.

    Raises:
        ValueError: on an unknown ``mode``, bad thresholds or mismatched shapes.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction mode={mode!r}, expected one of {list(ROLLOUT_CORRECTIONS)}")
    if not high > 0:
        raise ValueError(f"the IS threshold high must be > 0, got {high}")
    low = 1.0 / high if low is None else low
    if mode == "mis" and not 0 <= low < high:
        raise ValueError(f"the MIS band needs 0 <= low < high, got low={low} high={high}")
    _check_shape("rollout_logprobs", rollout_logprobs, old_logprobs)
    _check_shape("response_mask", response_mask, old_logprobs)
    mask = response_mask > 0
    log_rho = _log_ratio(old_logprobs, rollout_logprobs, mask)
    rho = torch.exp(log_rho).detach()
    truncated = mask & (rho > high)
    masked = mask & ((rho > high) | (rho < low))
    if mode == "tis":
        weights = rho.clamp(max=high)
    elif mode == "mis":
        weights = torch.where(masked, torch.zeros_like(rho), rho)
    else:
        weights = torch.ones_like(rho)
    weights = torch.where(mask, weights, torch.ones_like(weights))
    count = mask.sum().clamp(min=1)

    def mean(x: Tensor) -> float:
        return float(torch.where(mask, x.float(), torch.zeros_like(x, dtype=torch.float)).sum() / count)

    metrics = {
        "mismatch_abs_dlogp": mean(log_rho.abs()),
        "mismatch_kl": mean(torch.expm1(log_rho) - log_rho),
        "is_weight_mean": mean(rho),
        "is_truncated_frac": mean(truncated) if mode == "tis" else 0.0,
        "is_masked_frac": mean(masked) if mode == "mis" else 0.0,
    }
    return weights.detach(), metrics
