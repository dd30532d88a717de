"""Calling a backend's ``loss_fn`` with what it asks for (and the model's logits, and the batch check).

A loss takes ``logits`` and any keys of the batch by name, e.g. the RL signature
``loss_fn(logits=, labels=, loss_mask=, advantages=)`` (``grpo_loss``) or the SFT one ``loss_fn(logits=, labels=,
loss_mask=)`` (``next_token_loss``): the backend reads the loss's signature once and passes exactly the batch keys it
names (all of them when it takes ``**kwargs``). A loss returns a scalar tensor, or ``(loss, metrics)`` with a dict of
scalars that the backend reports next to ``loss``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from orchestration.training.types import LibraryError


class LossCall:
    """``loss_fn`` bound to the keys it accepts; ``call(logits, batch) -> (loss, metrics)``.

    Raises:
        LibraryError: (at construction) if ``loss_fn`` is not callable or takes no ``logits``.
    """

    def __init__(self, loss_fn: Callable[..., Any]):
        if not callable(loss_fn):
            raise LibraryError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        params = inspect.signature(loss_fn).parameters
        self.loss_fn = loss_fn
        self.name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        self.takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        named = {
            name: p
            for name, p in params.items()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        }
        if "logits" not in named and not self.takes_all:
            raise LibraryError(f"loss_fn {self.name} must take a logits= argument, its parameters are {list(params)}")
        self.keys = [name for name in named if name != "logits"]
        self.required = {name for name in self.keys if named[name].default is inspect.Parameter.empty}

    def check(self, batch: Mapping[str, Any]) -> None:
        """Raise ``LibraryError`` if ``batch`` lacks a key the loss requires (e.g. ``advantages`` for an RL loss)."""
        missing = sorted(self.required - set(batch))
        if missing:
            raise LibraryError(f"loss_fn {self.name} needs batch keys {missing}; the batch has {sorted(batch)}")

    def call(self, logits: Tensor, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        if self.takes_all:
            kwargs = {name: value for name, value in batch.items() if name != "logits"}
        else:
            kwargs = {name: batch[name] for name in self.keys if name in batch}
        out = self.loss_fn(logits=logits, **kwargs)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise LibraryError(
                f"loss_fn {self.name} must return a scalar tensor (or (loss, metrics)), got {loss!r:.80}"
            )
        return loss.reshape(()), {name: float(value) for name, value in dict(metrics).items()}


def model_logits(model: torch.nn.Module, batch: Mapping[str, Tensor], device: torch.device) -> Tensor:
    """``model``'s logits ``[B, T, V]`` for ``batch``'s ``input_ids`` (and ``attention_mask``) on ``device``."""
    kwargs: dict[str, Any] = {"input_ids": batch["input_ids"].to(device)}
    if "attention_mask" in batch:
        kwargs["attention_mask"] = batch["attention_mask"].to(device)
    if hasattr(model, "config"):  # a Hugging Face model: no KV cache to build during training
        kwargs["use_cache"] = False
    out = model(**kwargs)
    return out if isinstance(out, Tensor) else out.logits


def check_batch(batch: Any) -> None:
    """Raise ``LibraryError`` unless ``batch`` is a dict with a ``[B, T]`` ``input_ids`` tensor."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), Tensor):
        got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise LibraryError(f"a batch is a dict of tensors with input_ids [B, T] (samples_to_batch); got {got}")
    if batch["input_ids"].dim() != 2:
        raise LibraryError(f"batch['input_ids'] must be [B, T], got shape {tuple(batch['input_ids'].shape)}")
