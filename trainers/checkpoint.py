"""Sharded, atomic training checkpoints for an FSDP2 model and its optimizer.

A checkpoint is a directory::

    step_00000012/
        dcp/                  model + optimizer, sharded, via torch.distributed.checkpoint (.metadata, *.distcp)
        rng/rank_00000.pt     torch (and CUDA), numpy and python ``random`` states of each rank
        checkpoint.json       {"extra_state": ..., "world_size": ..., "has_optimizer_state": ...}

It is written under ``.step_00000012.tmp`` and renamed when every rank has finished, so a crash never leaves a
directory that :func:`latest_checkpoint` would take for a complete one. DCP reshards on load: a checkpoint saved
by N ranks loads on M ranks (RNG states then come back only for ranks that existed, with a warning). All ranks
must see the same filesystem.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_MANIFEST = "checkpoint.json"


def checkpoint_path(root: str | os.PathLike[str], step: int) -> Path:
    """The conventional directory for the checkpoint of ``step``: ``root/step_00000012``."""
    return Path(root) / f"step_{step:08d}"


def save_checkpoint(
    path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer, extra_state: dict[str, Any]
) -> None:
    """Save a sharded model + optimizer, every rank's RNG states and ``extra_state``; a collective.

    Args:
        path: the checkpoint directory to create, e.g. ``checkpoint_path(root, step)``.
        model: the (FSDP-sharded or plain) model.
        optimizer: its optimizer; an optimizer that has not stepped yet is not saved (saving it would make
            DCP take a zero-learning-rate step that advances Adam's step counter).
        extra_state: JSON-serialisable caller state (policy version, prompt-source position, step, ...).

    Raises:
        TypeError: if ``extra_state`` is not JSON-serialisable (before anything is written).
        FileExistsError: if ``path`` exists.
    """
    path = Path(path)
    has_optimizer_state = bool(optimizer.state)
    manifest = json.dumps(
        {"extra_state": extra_state, "world_size": dist.get_world_size(), "has_optimizer_state": has_optimizer_state},
        indent=2,
    )
    if path.exists():
        raise FileExistsError(f"checkpoint {path} already exists")
    tmp = path.with_name(f".{path.name}.tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save
        (tmp / "rng").mkdir(parents=True)
    dist.barrier()

    state = {"model": get_model_state_dict(model)}
    if has_optimizer_state:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=tmp / "dcp")
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    if rank == 0:
        (tmp / _MANIFEST).write_text(manifest)
    dist.barrier()
    if rank == 0:
        tmp.rename(path)
    dist.barrier()


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_checkpoint` into ``model`` and ``optimizer``; a collective.

    Returns:
        The ``extra_state`` it was saved with.

    Raises:
        FileNotFoundError: if ``path`` is not a complete checkpoint.
    """
    path = Path(path)
    if not _is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {_MANIFEST} or dcp/.metadata)")
    manifest = json.loads((path / _MANIFEST).read_text())

    # DCP loads in place into tensors of the right (sharded) shapes, so ask the live objects for them first.
    state = {"model": get_model_state_dict(model)}
    if manifest["has_optimizer_state"]:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=path / "dcp")
    set_model_state_dict(model, state["model"])
    if manifest["has_optimizer_state"]:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])

    rank = dist.get_rank()
    rng_file = path / "rng" / f"rank_{rank:05d}.pt"
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        warnings.warn(
            f"{path} was saved by {manifest['world_size']} ranks: no RNG state for rank {rank}, left as is",
            stacklevel=2,
        )
    dist.barrier()
    return manifest["extra_state"]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint under ``root`` with the largest trailing step number in its name, or ``None``."""
    root = Path(root)
    if not root.is_dir():
        return None
    complete = [p for p in root.iterdir() if not p.name.startswith(".") and _is_complete(p)]
    return max(complete, key=_step_key, default=None)


def _is_complete(path: Path) -> bool:
    return (path / _MANIFEST).is_file() and (path / "dcp" / ".metadata").is_file()


def _step_key(path: Path) -> tuple[int, str]:
    match = re.search(r"(\d+)$", path.name)
    return (int(match.group(1)) if match else -1, path.name)


def _rng_state() -> dict[str, Any]:
    # Only tensors, tuples and plain scalars, so the file loads with torch.load(weights_only=True).
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached_gaussian),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
