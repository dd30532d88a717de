"""Sharded, atomic training checkpoints for an FSDP2 model and its optimizer.

A checkpoint is a directory::

    step_00000012/
        dcp/                  model + optimizer, sharded, via torch.distributed.checkpoint (.metadata, *.distcp)
        rng/rank_00000.pt     torch (and CUDA), numpy and python ``random`` states of each rank
        checkpoint.json       {"extra_state": ..., "world_size": ..., "has_optimizer_state": ...}

It is written under ``.step_00000012.tmp``, fsynced (files and directories) and renamed when every rank has
finished, so a crash never leaves a directory that :func:`latest_checkpoint` would take for a complete one.
Replacing an existing checkpoint (``overwrite=True``) writes the new one completely first, then swaps: the old one
is renamed to ``.step_00000012.old``, the new one into place, and only then is the old one deleted; a crash between
the two renames is repaired by :func:`latest_checkpoint`. :func:`prune_checkpoints` keeps the newest K.

DCP reshards on load: a checkpoint saved by N ranks loads on M ranks (RNG states then come back only for ranks that
existed, with a warning). All ranks must see the same filesystem.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable
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
logger = logging.getLogger(__name__)


def checkpoint_path(root: str | os.PathLike[str], step: int) -> Path:
    """The conventional directory for the checkpoint of ``step``: ``root/step_00000012``."""
    return Path(root) / f"step_{step:08d}"


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra_state: dict[str, Any],
    *,
    overwrite: bool = False,
    stage: Callable[[Path], Any] | None = None,
) -> Any:
    """Save a sharded model + optimizer, every rank's RNG states and ``extra_state``; a collective.

    Args:
        path: the checkpoint directory to create, e.g. ``checkpoint_path(root, step)``.
        model: the (FSDP-sharded or plain) model.
        optimizer: its optimizer, or None for a frozen model; an optimizer that has not stepped yet is not saved
            (saving it would make DCP take a zero-learning-rate step that advances Adam's step counter).
        extra_state: JSON-serialisable caller state (policy version, prompt-source position, step, ...).
        overwrite: replace an existing checkpoint at ``path``, only once the new one is complete and on disk.
        stage: called on rank 0 with the staging directory once every rank wrote its files, before the fsync and
            the rename: files it writes there commit with the checkpoint, as one unit (the RL loop's queue
            snapshot). If it raises, nothing is committed (the previous checkpoint stays).

    Returns:
        What ``stage`` returned on rank 0 (None elsewhere, and without ``stage``).

    Raises:
        TypeError: if ``extra_state`` is not JSON-serialisable (before anything is written).
        FileExistsError: if ``path`` exists and not ``overwrite``.
    """
    path = Path(path)
    has_optimizer_state = optimizer is not None and bool(optimizer.state)
    manifest = json.dumps(
        {"extra_state": extra_state, "world_size": dist.get_world_size(), "has_optimizer_state": has_optimizer_state},
        indent=2,
    )
    if path.exists() and not overwrite:
        raise FileExistsError(f"checkpoint {path} already exists (pass overwrite=True to replace it)")
    tmp = path.with_name(f".{path.name}.tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save
        (tmp / "rng").mkdir(parents=True)
    dist.barrier()

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None and has_optimizer_state:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=tmp / "dcp")
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    if rank == 0:
        (tmp / _MANIFEST).write_text(manifest)
    dist.barrier()
    staged, failure = None, list[str | None]([None])
    if rank == 0:
        try:
            staged = stage(tmp) if stage is not None else None
            _fsync_tree(tmp)
            swap_into_place(tmp, path)
        except Exception as exc:  # every rank raises (instead of waiting for rank 0 forever)
            failure = [f"{type(exc).__name__}: {exc}"]
            dist.broadcast_object_list(failure, src=0)
            raise
    dist.broadcast_object_list(failure, src=0)  # also the barrier: the checkpoint is committed (or not) for all
    if failure[0] is not None:
        raise RuntimeError(f"saving checkpoint {path} failed on rank 0: {failure[0]}")
    return staged


def load_checkpoint(
    path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_checkpoint` into ``model`` and ``optimizer``; a collective.

    With ``optimizer=None`` only the model weights are loaded (a frozen reference model); RNG states are left as
    they are.

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
    with_optimizer = optimizer is not None and manifest["has_optimizer_state"]
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None and with_optimizer:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=path / "dcp")
    set_model_state_dict(model, state["model"])
    if optimizer is not None and with_optimizer:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if optimizer is None:
        dist.barrier()
        return manifest["extra_state"]

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
    return max(complete_checkpoints(root), key=_step_key, default=None)


def complete_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints under ``root``, oldest step first.

    A checkpoint left as ``.NAME.old`` by a crash in the middle of an overwrite's swap, with no ``NAME`` beside
    it, is renamed back first.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    for old in root.glob(".*.old"):
        name = old.name[1 : -len(".old")]
        if not (root / name).exists() and _is_complete(old):
            old.rename(root / name)
    return sorted((p for p in root.iterdir() if not p.name.startswith(".") and _is_complete(p)), key=_step_key)


def prune_checkpoints(root: str | os.PathLike[str], keep_last: int, *, pattern: str = "step_*") -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints named like ``pattern``; return the deleted.

    Incomplete leftovers of crashed saves (``.NAME.tmp``, ``.NAME.old`` whose ``NAME`` is complete) go too.
    Checkpoints with other names (an SFT or reference checkpoint) are never touched.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    kept = [p for p in complete_checkpoints(root) if p.match(pattern)]
    doomed = kept[:-keep_last]
    root = Path(root)
    doomed += [p for p in root.glob(".*.tmp")]
    doomed += [p for p in root.glob(".*.old") if _is_complete(root / p.name[1 : -len(".old")])]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def queue_stage(client: Any, subdir: str) -> Callable[[Path], float | None]:
    """A ``stage`` for :func:`save_checkpoint` that saves a transfer_queue (``client.save_checkpoint``) into
    ``subdir`` of the staging directory, so the queue commits with the model. It returns the seconds the queue took,
    or None when the queue could not be saved (e.g. a storage unit down): the checkpoint is then written without it
    (no ``subdir/CURRENT``), and a run resumed from it draws and generates its steps in flight again."""
    from transfer_queue.errors import TransferQueueError

    def stage(staging: Path) -> float | None:
        t0 = time.perf_counter()
        try:
            client.save_checkpoint(str(staging / subdir))
        except TransferQueueError as exc:
            shutil.rmtree(staging / subdir, ignore_errors=True)
            logger.warning("the queue could not be saved with checkpoint %s (%s); saved without it", staging, exc)
            return None
        return time.perf_counter() - t0

    return stage


def swap_into_place(new: Path, path: Path) -> None:
    """Rename the complete, synced ``new`` to ``path``; an existing ``path`` is deleted only afterwards."""
    old = path.with_name(f".{path.name}.old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    new.rename(path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (data first, then the directory entries naming it)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))
    _fsync_dir(root.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a complete checkpoint (manifest and DCP metadata written, i.e. the save finished)."""
    return _is_complete(Path(path))


def _is_complete(path: Path) -> bool:
    return (path / _MANIFEST).is_file() and (path / "dcp" / ".metadata").is_file()


def _step_key(path: Path) -> tuple[int, str]:
    match = re.search(r"(\d+)$", path.name)
    return (int(match.group(1)) if match else -1, path.name)


def _rng_state() -> dict[str, Any]:
    # Only tensors, tuples and plain scalars, so the file loads with torch.load(weights_only=True).
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    assert not isinstance(keys, str)  # the legacy state is a tuple whose second item is the key array
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
