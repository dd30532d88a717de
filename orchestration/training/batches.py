"""Samples to the batch dict every training backend takes, and the loss convention that goes with it.

The batch (``samples_to_batch``), for ``B`` samples padded on the right to the longest, ``T`` tokens:

    input_ids       [B, T] int64    the sample's ``tokens``, then ``pad_token_id``
    attention_mask  [B, T] int64    1 on real tokens, 0 on padding
    labels          [B, T] int64    a copy of ``input_ids`` (NOT shifted; padding holds ``pad_token_id``)
    loss_mask       [B, T] float32  the sample's ``loss_mask`` (weight of token t), 0 on padding
    advantages      [B]    float32  only when ``advantages`` are given (RL)

Label convention (the Hugging Face one): ``labels`` are aligned with ``input_ids`` and the loss shifts: the logits at
position ``t - 1`` score the label at ``t``, weighted by ``loss_mask[:, t]``; position 0 is never scored (nothing
predicts it). :func:`next_token_loss` is the reference implementation (and the SFT default of the backends); a
loss written for this library (``rl_losses``) shifts the same way. Labels are never ``-100``: what is not trained
on has ``loss_mask`` 0, so a loss can ``gather`` labels without masking them first.

>>> from orchestration.training import Sample
>>> batch = samples_to_batch([Sample(tokens=[5, 6, 7], loss_mask=[0, 1, 1]), Sample(tokens=[5, 8], loss_mask=[0, 1])])
>>> batch["input_ids"].tolist(), batch["loss_mask"].tolist()
([[5, 6, 7], [5, 8, 0]], [[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from orchestration.training.types import LibraryError, Sample


def samples_to_batch(
    samples: Sequence[Sample], pad_token_id: int = 0, advantages: Sequence[float] | Tensor | None = None
) -> dict[str, Tensor]:
    """The backend batch of ``samples`` (see the module docstring), rows in order.

    Args:
        samples: at least one sample, each with at least one token.
        pad_token_id: the id padding positions hold (in ``input_ids`` and ``labels``).
        advantages: one advantage per sample (RL), or None (SFT: no ``advantages`` key).

    Raises:
        LibraryError: on no samples, an empty sample, or a number of advantages other than one per sample.
    """
    if not samples:
        raise LibraryError("samples_to_batch needs at least one sample, got none")
    for i, sample in enumerate(samples):
        if not sample.tokens:
            raise LibraryError(f"sample {i} has no tokens; every sample of a batch needs at least one")
    length = max(len(sample.tokens) for sample in samples)
    input_ids = torch.full((len(samples), length), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.int64)
    loss_mask = torch.zeros((len(samples), length), dtype=torch.float32)
    for row, sample in enumerate(samples):
        n = len(sample.tokens)
        input_ids[row, :n] = torch.tensor(sample.tokens, dtype=torch.int64)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.float32)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": input_ids.clone(),
        "loss_mask": loss_mask,
    }
    if advantages is not None:
        values = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
        if values.numel() != len(samples):
            raise LibraryError(
                f"advantages needs one value per sample: {len(samples)} samples, {values.numel()} values"
            )
        batch["advantages"] = values
    return batch


def next_token_loss(logits: Tensor, labels: Tensor, loss_mask: Tensor) -> Tensor:
    """The ``loss_mask``-weighted mean negative log-likelihood of ``labels`` under ``logits`` (SFT).

    ``logits[:, t - 1]`` scores ``labels[:, t]`` with weight ``loss_mask[:, t]`` (the module's convention); the
    mean is over the weights' sum (clamped to at least 1e-8, so a batch with nothing to train on gives 0).
    """
    logits = logits[:, :-1].float()
    targets = labels[:, 1:].unsqueeze(-1)
    weights = loss_mask[:, 1:].to(logits.dtype)
    nll = logits.logsumexp(-1) - logits.gather(-1, targets).squeeze(-1)
    return (nll * weights).sum() / weights.sum().clamp(min=1e-8)
