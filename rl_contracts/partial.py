"""Partial rollouts' contract between workers and trainers: each response token carries the policy version that
sampled it (``response_versions``, jagged int64, aligned with ``response_ids``); the trainer may leave out of the
loss the tokens older than ``max_staleness`` versions (``train.mask_offpolicy_in_partial_rollout``)."""

from __future__ import annotations

import torch


def mask_offpolicy_tokens(
    response_mask: torch.Tensor, token_versions: torch.Tensor, train_version: int, max_staleness: int
) -> torch.Tensor:
    """``response_mask`` with tokens sampled more than ``max_staleness`` versions before ``train_version`` set to 0
    (slime's ``mask_offpolicy_in_partial_rollout``). ``token_versions`` aligns with ``response_mask``; entries
    outside the mask are ignored."""
    if token_versions.shape != response_mask.shape:
        raise ValueError(
            f"token_versions has shape {tuple(token_versions.shape)}, expected response_mask's "
            f"{tuple(response_mask.shape)}"
        )
    fresh = (train_version - token_versions) <= max_staleness
    return response_mask * fresh.to(response_mask.dtype)
