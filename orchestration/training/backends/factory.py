"""create_pytorch_backend: a ``PyTorchTrainingBackend`` over a model loaded from a LOCAL Hugging Face directory.

Nothing is ever downloaded: ``model_name`` is a directory on this machine, or the name of a model the project
prepares into its local cache (SmolLM2-135M-Instruct, see ``workers/hf_models.py``; prepare it once with
``python recipe/smollm2/prepare.py``).

>>> backend = create_pytorch_backend(model_name="/models/tiny-llama", checkpoint_dir=Path("ckpts"))  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orchestration.training.backends.pytorch import PyTorchTrainingBackend
from orchestration.training.batches import next_token_loss
from orchestration.training.types import LibraryError

# names that resolve to a model the project prepares locally (workers.hf_models), never to a download
SMOLLM2_NAMES = ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", "smollm2-135m-instruct")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_model_dir(model_name: str | os.PathLike[str]) -> Path:
    """The local directory of ``model_name``: itself when it is a directory, the prepared SmolLM2 cache for its names.

    Raises:
        LibraryError: if ``model_name`` is neither (a hub name: pass a local path), or SmolLM2 is not prepared yet.
    """
    path = Path(model_name).expanduser()
    if path.is_dir():
        return path
    if str(model_name) in SMOLLM2_NAMES:
        from workers.hf_models import ModelNotPrepared, require_prepared, smollm2_path

        try:
            return require_prepared(smollm2_path())
        except ModelNotPrepared as exc:
            raise LibraryError(str(exc)) from exc
    raise LibraryError(
        f"model_name={str(model_name)!r} is not a local directory; models are never downloaded: pass the path of a "
        "Hugging Face model directory (save_pretrained), or one of the locally prepared names "
        f"{list(SMOLLM2_NAMES)}"
    )


def create_pytorch_backend(
    model_name: str | os.PathLike[str],
    checkpoint_dir: str | os.PathLike[str],
    device_type: str = "cpu",
    learning_rate: float = 1e-4,
    loss_fn: Callable[..., Any] | None = None,
    tokenizer: Any = None,
    *,
    max_grad_norm: float | None = 1.0,
    weight_decay: float = 0.0,
    dtype: torch.dtype = torch.float32,
) -> PyTorchTrainingBackend:
    """Load ``model_name`` (a local directory) with ``AutoModelForCausalLM`` and wrap it with AdamW.

    Args:
        model_name: a local Hugging Face model directory, or a locally prepared name (see :func:`resolve_model_dir`).
        checkpoint_dir: where the backend's checkpoints go.
        device_type: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        learning_rate: AdamW's learning rate.
        loss_fn: the loss (default: ``next_token_loss``, SFT).
        tokenizer: the tokenizer to export with the model; by default the directory's own when it has one.
        max_grad_norm: gradient clipping in ``optim_step`` (None: none).
        weight_decay: AdamW's weight decay.
        dtype: the model's parameter dtype.

    Raises:
        LibraryError: if ``model_name`` is not a local directory nor a prepared name (no download is tried).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = resolve_model_dir(model_name)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    if tokenizer is None and any((directory / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    device = torch.device(device_type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)
    return PyTorchTrainingBackend(
        model,
        optimizer,
        loss_fn or next_token_loss,
        checkpoint_dir,
        device,
        max_grad_norm=max_grad_norm,
        tokenizer=tokenizer,
    )
