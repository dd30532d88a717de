"""PyTorchTrainingBackend: one model and its optimizer in this process (CPU or one GPU), behind the
``TrainingBackend`` protocol.

Every call runs on ONE worker thread, in the order it was made, so ``forward_backward`` returns at once and the
caller prepares the next batch while the pass runs; ``optim_step``, ``save_checkpoint``, ``load_checkpoint`` and
``export_hf`` queue behind what was started before them.

A checkpoint is ``checkpoint_dir/step_{step}/`` with ``pytorch_model.bin`` (the model's state dict),
``optimizer.bin`` (the optimizer's, and ``scheduler.bin`` with a scheduler), ``metadata.json`` (step, metrics, time,
config, optimizer_step) and, for a Hugging Face model, its ``config.json``: such a directory is also a Hugging Face
model directory (``from_pretrained`` and the engines load ``pytorch_model.bin``), so it can be handed to
``sync_weights_to_engines`` as it is. It is written under ``.step_{step}.tmp`` and renamed when complete.

>>> backend = PyTorchTrainingBackend(model, optimizer, next_token_loss, Path("ckpts"))  # doctest: +SKIP
>>> fut = backend.forward_backward(batch)  # doctest: +SKIP
>>> metrics = await fut.result()  # {"loss": ..., "num_tokens": ...}  # doctest: +SKIP
>>> await backend.optim_step().result()  # {"lr": ..., "step": 1, "grad_norm": ...}  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from orchestration.training.backends.base import TrainFuture
from orchestration.training.backends.checkpoints import commit_dir, metadata_record, read_metadata, step_dir
from orchestration.training.backends.loss_call import LossCall, check_batch, model_logits
from orchestration.training.types import LibraryError

T = TypeVar("T")


class PyTorchTrainingBackend:
    """A model, its optimizer and a loss, trained on one device.

    Args:
        model: the causal LM (``model(input_ids=, attention_mask=)`` gives logits or an object with ``.logits``).
        optimizer: the optimizer over ``model``'s parameters.
        loss_fn: ``loss_fn(logits=, <batch keys it names>)`` -> loss or ``(loss, metrics)``: the RL signature
            (``logits, labels, loss_mask, advantages``) or the SFT one (without ``advantages``); the backend passes
            the batch keys the loss's signature names (see ``backends/loss_call.py``).
        checkpoint_dir: where ``save_checkpoint`` writes ``step_{step}/``.
        device: where the model is moved and the batches computed.
        max_grad_norm: clip the gradient's global L2 norm in ``optim_step`` (None: no clipping; the norm is
            reported either way).
        tokenizer: saved with ``export_hf`` when it has ``save_pretrained``.
        scheduler: an LR scheduler stepped after each optimizer step (saved with the checkpoint).

    Raises:
        LibraryError: if ``loss_fn`` takes no ``logits`` or ``max_grad_norm`` is not positive.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., Any],
        checkpoint_dir: str | os.PathLike[str],
        device: torch.device = torch.device("cpu"),  # noqa: B008 (an immutable default)
        *,
        max_grad_norm: float | None = None,
        tokenizer: Any = None,
        scheduler: Any = None,
    ):
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise LibraryError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self.loss = LossCall(loss_fn)
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.optimizer = optimizer
        self.checkpoint_dir = Path(checkpoint_dir)
        self.max_grad_norm = max_grad_norm
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.step = 0  # optimizer steps taken (restored by load_checkpoint)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pytorch-backend")

    @property
    def config(self) -> dict[str, Any]:
        """What ``metadata.json`` records of this backend."""
        return {
            "backend": "pytorch",
            "model": type(self.model).__name__,
            "optimizer": type(self.optimizer).__name__,
            "loss_fn": self.loss.name,
            "device": str(self.device),
            "max_grad_norm": self.max_grad_norm,
        }

    def forward_backward(self, batch: dict[str, Any]) -> TrainFuture[dict[str, float]]:
        """Start the forward and backward pass of ``batch`` (gradients accumulate until ``optim_step``).

        Returns:
            A future of ``{"loss", "num_tokens"}`` (tokens with ``loss_mask`` > 0, or every token without a mask)
            and the loss's own metrics.

        Raises:
            LibraryError: (at once) if ``batch`` is not a batch dict or lacks a key the loss requires.
        """
        check_batch(batch)
        self.loss.check(batch)
        return self._submit(self._forward_backward, batch)

    def optim_step(self) -> TrainFuture[dict[str, float]]:
        """Start an optimizer step on the accumulated gradients (clipped to ``max_grad_norm``), then zero them.

        Returns:
            A future of ``{"lr"`` (the step's), ``"step"`` (optimizer steps so far), ``"grad_norm"`` (before
            clipping)``}``.
        """
        return self._submit(self._optim_step)

    async def save_checkpoint(self, step: int, metrics: dict[str, Any]) -> Path:
        """Write ``checkpoint_dir/step_{step}/`` (replacing one there) once the work started before is done."""
        return await self._run(self._save, step, dict(metrics))

    async def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore model, optimizer (scheduler) and ``step`` from a ``save_checkpoint`` directory; returns its
        ``metadata.json``.

        Raises:
            LibraryError: if ``path`` is not a complete checkpoint.
        """
        read_metadata(path)  # fail here, not on the worker
        return await self._run(self._load, Path(path))

    async def export_hf(self, path: str | os.PathLike[str]) -> Path:
        """Write the model (and tokenizer) as a Hugging Face directory (``save_pretrained``: config, safetensors)
        at ``path``, atomically; returns it.

        Raises:
            LibraryError: if the model has no ``save_pretrained`` (not a Hugging Face model).
        """
        if not hasattr(self.model, "save_pretrained"):
            raise LibraryError(
                f"export_hf needs a Hugging Face model (save_pretrained), got {type(self.model).__name__}"
            )
        return await self._run(self._export_hf, Path(path))

    def close(self) -> None:
        """Wait for the queued work, then stop the worker thread."""
        self._worker.shutdown(wait=True)

    def _submit(self, fn: Callable[..., T], *args: Any) -> TrainFuture[T]:
        return TrainFuture(self._worker.submit(fn, *args))

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._worker.submit(fn, *args))

    def _forward_backward(self, batch: dict[str, Any]) -> dict[str, float]:
        self.model.train()
        batch = {
            name: value.to(self.device) if isinstance(value, torch.Tensor) else value for name, value in batch.items()
        }
        logits = model_logits(self.model, batch, self.device)
        loss, metrics = self.loss.call(logits, batch)
        loss.backward()
        mask = batch.get("loss_mask")
        num_tokens = int((mask > 0).sum().item()) if isinstance(mask, torch.Tensor) else batch["input_ids"].numel()
        return {**metrics, "loss": float(loss.detach().item()), "num_tokens": num_tokens}

    def _optim_step(self) -> dict[str, float]:
        grad_norm = self._clip_grad_norm()
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"lr": lr, "step": self.step, "grad_norm": grad_norm}

    def _clip_grad_norm(self) -> float:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = self.max_grad_norm if self.max_grad_norm is not None else math.inf
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def _save(self, step: int, metrics: dict[str, Any]) -> Path:
        path = step_dir(self.checkpoint_dir, step)
        tmp = path.with_name(f".{path.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save
        tmp.mkdir(parents=True)
        torch.save(self.model.state_dict(), tmp / "pytorch_model.bin")
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.bin")
        if self.scheduler is not None:
            torch.save(self.scheduler.state_dict(), tmp / "scheduler.bin")
        save_config = getattr(getattr(self.model, "config", None), "save_pretrained", None)
        if callable(save_config):
            save_config(tmp)  # config.json: the directory loads as a Hugging Face model
        record = metadata_record(step, metrics, self.config, optimizer_step=self.step)
        (tmp / "metadata.json").write_text(record)  # written last: its presence marks a complete checkpoint
        commit_dir(tmp, path)
        return path

    def _load(self, path: Path) -> dict[str, Any]:
        metadata = read_metadata(path)
        state = torch.load(path / "pytorch_model.bin", map_location=self.device, weights_only=True)
        self.model.load_state_dict(state)
        self.optimizer.load_state_dict(torch.load(path / "optimizer.bin", map_location=self.device, weights_only=True))
        if self.scheduler is not None and (path / "scheduler.bin").is_file():
            self.scheduler.load_state_dict(torch.load(path / "scheduler.bin", weights_only=True))
        self.optimizer.zero_grad(set_to_none=True)
        self.step = int(metadata.get("optimizer_step", metadata["step"]))
        return metadata

    def _export_hf(self, path: Path) -> Path:
        tmp = path.with_name(f".{path.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(tmp)  # type: ignore[operator]
        if hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(tmp)
        commit_dir(tmp, path)
        return path
