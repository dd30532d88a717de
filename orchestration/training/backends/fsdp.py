"""FSDPTrainingBackend: the ``TrainingBackend`` protocol over a model sharded with FSDP2 (``fully_shard``) across
the default process group (``torchrun``; NCCL on GPUs, gloo on CPU).

Every rank builds the backend and makes the same calls in the same order (they are collectives), each with its own
share of the batch. The model is sharded as ``trainers/fsdp.py`` shards the RL trainer's policy: each decoder layer
(``trainers.fsdp.decoder_layers``) is an FSDP unit, then the root. Checkpoints are ``trainers/checkpoint.py``'s
sharded DCP checkpoints (model, optimizer, every rank's RNG), at ``checkpoint_dir/step_{N}/`` with the same
``metadata.json`` as the PyTorch backend, committed atomically with them (so ``latest_checkpoint`` finds them), and
reshardable: a checkpoint saved by N ranks loads on M.

>>> dist.init_process_group("gloo")  # doctest: +SKIP
>>> adamw = lambda m: torch.optim.AdamW(m.parameters())  # doctest: +SKIP
>>> backend = FSDPTrainingBackend(model, adamw, loss_fn, Path("ckpts"))  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from orchestration.training.backends.checkpoints import METADATA, metadata_record, read_metadata, step_dir
from orchestration.training.backends.pytorch import PyTorchTrainingBackend
from orchestration.training.types import LibraryError
from trainers.checkpoint import load_checkpoint, save_checkpoint
from trainers.fsdp import decoder_layers, default_device

# FULL_SHARD frees each unit's gathered weights after the forward; SHARD_GRAD_OP keeps them until the backward
RESHARD_AFTER_FORWARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}


@dataclass
class FSDPConfig:
    """How the model is sharded."""

    sharding_strategy: str = "FULL_SHARD"  # FULL_SHARD or SHARD_GRAD_OP (see RESHARD_AFTER_FORWARD)
    mixed_precision: bool = False  # compute in bfloat16, keep float32 weights and reduce gradients in float32
    gradient_checkpointing: bool = False  # recompute activations in the backward (a Hugging Face model's own)

    def __post_init__(self) -> None:
        if self.sharding_strategy not in RESHARD_AFTER_FORWARD:
            raise LibraryError(
                f"FSDPConfig.sharding_strategy={self.sharding_strategy!r} is not one of {sorted(RESHARD_AFTER_FORWARD)}"
            )


class FSDPTrainingBackend(PyTorchTrainingBackend):
    """A model sharded over the default process group, with the optimizer ``optimizer_fn`` builds for it.

    Args:
        model: the model, built on CPU (or ``device``), the same architecture on every rank; rank 0's weights are
            broadcast before sharding (``sync_module_states``).
        optimizer_fn: ``optimizer_fn(sharded_model) -> optimizer``, called after sharding.
        loss_fn: as ``PyTorchTrainingBackend``'s. Gradients are averaged over ranks, so give each rank an equal
            share.
        checkpoint_dir: where ``save_checkpoint`` writes ``step_{step}/`` (a filesystem every rank sees).
        config: sharding, mixed precision, gradient checkpointing.
        device: defaults to the process group's (``cuda:<local rank>`` under NCCL, else CPU).
        max_grad_norm: clip the global gradient norm (None: no clipping).
        sync_module_states: broadcast rank 0's weights first; skip when every rank loaded the same weights.

    ``forward_backward`` reports ``loss`` averaged over ranks and ``num_tokens`` summed over them (the same on
    every rank).

    Raises:
        LibraryError: if no default process group is initialised, or gradient checkpointing is asked of a model
            without ``gradient_checkpointing_enable``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer_fn: Callable[[torch.nn.Module], torch.optim.Optimizer],
        loss_fn: Callable[..., Any],
        checkpoint_dir: str | os.PathLike[str],
        config: FSDPConfig | None = None,
        *,
        device: torch.device | None = None,
        max_grad_norm: float | None = None,
        sync_module_states: bool = True,
        tokenizer: Any = None,
    ):
        if not dist.is_initialized():
            raise LibraryError(
                "FSDPTrainingBackend needs an initialised torch.distributed world: call "
                "torch.distributed.init_process_group() first (launch with torchrun)"
            )
        self.fsdp_config = config or FSDPConfig()
        device = device or default_device()
        if self.fsdp_config.gradient_checkpointing:
            enable = getattr(model, "gradient_checkpointing_enable", None)
            if not callable(enable):
                raise LibraryError(
                    "FSDPConfig.gradient_checkpointing needs a model with gradient_checkpointing_enable, "
                    f"got {type(model).__name__}"
                )
            enable()
        model = model.to(device)
        if sync_module_states:
            with torch.no_grad():
                for tensor in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(tensor.data, src=0)
        mp_policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.fsdp_config.mixed_precision
            else MixedPrecisionPolicy()
        )
        reshard = RESHARD_AFTER_FORWARD[self.fsdp_config.sharding_strategy]
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
        super().__init__(
            model,
            optimizer_fn(model),
            loss_fn,
            checkpoint_dir,
            device,
            max_grad_norm=max_grad_norm,
            tokenizer=tokenizer,
        )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    @property
    def config(self) -> dict[str, Any]:
        return {**super().config, "backend": "fsdp", "world_size": dist.get_world_size(), **asdict(self.fsdp_config)}

    async def export_hf(self, path: str | os.PathLike[str]) -> Path:
        """Not available on a sharded model: ``trainers.fsdp.FSDPPolicy.save_hf_pretrained`` gathers and writes one.

        Raises:
            LibraryError: always.
        """
        raise LibraryError("FSDPTrainingBackend.export_hf is not supported; load a checkpoint into one process")

    def _forward_backward(self, batch: dict[str, Any]) -> dict[str, float]:
        local = super()._forward_backward(batch)
        totals = torch.tensor([local["loss"], float(local["num_tokens"])], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return {**local, "loss": totals[0].item() / self.world_size, "num_tokens": int(totals[1].item())}

    def _clip_grad_norm(self) -> float:
        max_norm = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if isinstance(norm, DTensor):  # sharded gradients: the local norm is a partial
            norm = norm.full_tensor()
        return float(norm.item())

    def _save(self, step: int, metrics: dict[str, Any]) -> Path:
        path = step_dir(self.checkpoint_dir, step)
        record = metadata_record(step, metrics, self.config, optimizer_step=self.step)
        if self.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)

        def stage(staging: Path) -> None:  # rank 0, before the commit: metadata.json commits with the shards
            (staging / METADATA).write_text(record)

        extra = {"step": step, "optimizer_step": self.step}
        save_checkpoint(path, self.model, self.optimizer, extra, overwrite=True, stage=stage)
        return path

    def _load(self, path: Path) -> dict[str, Any]:
        metadata = read_metadata(path)
        extra = load_checkpoint(path, self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.step = int(extra.get("optimizer_step", metadata["step"]))
        return metadata
