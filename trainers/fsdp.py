"""The FSDP2 training engine: a causal LM sharded with ``fully_shard``, its AdamW optimizer, and one train step.

Independent of the queue and of Ray: every rank builds an :class:`FSDPPolicy` after :func:`init_process_group`,
feeds it its share of the training batch (shapes and alignment as in ``docs/rl-conventions.md``) and calls the
same methods in the same order, since most of them are collectives. The same code runs on CPU with gloo and on
GPU with NCCL; the device follows the process-group backend.

>>> device = init_process_group(rank, world_size, "127.0.0.1", 29500)  # doctest: +SKIP
>>> policy = FSDPPolicy(model, device=device, optimizer=AdamWConfig(lr=1e-6))  # doctest: +SKIP
>>> metrics = policy.train_step(batch, loss_fn)  # doctest: +SKIP
>>> weights = policy.full_state_dict()  # rank 0 only  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from trainers.checkpoint import load_checkpoint, save_checkpoint


class LossFn(Protocol):
    """``loss, metrics = loss_fn(logprobs=[b, T] with grad, batch=micro-batch dict)``.

    ``loss`` is a scalar tensor; ``metrics`` maps names to scalars (floats or 0-d tensors), with the same names on
    every call and every rank, since they are all-reduced together.
    """

    def __call__(
        self, *, logprobs: Tensor, batch: dict[str, Tensor]
    ) -> tuple[Tensor, Mapping[str, float | Tensor]]: ...


@dataclass
class AdamWConfig:
    """``torch.optim.AdamW`` hyperparameters."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    eps: float = 1e-8
    # one multi-tensor kernel per update op instead of one op per parameter (also for the gradient clip): on
    # sharded (DTensor) parameters each op is a Python-level dispatch, and a per-parameter loop cost the demo's
    # ~20-tensor model more than its forward pass (benchmarks/trainer_step.py)
    foreach: bool = True


def init_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str | None = None,
    timeout: timedelta = timedelta(minutes=10),
) -> torch.device:
    """Join the default process group and return the device this rank computes on.

    Args:
        rank: this process's global rank.
        world_size: number of processes.
        master_addr: address of rank 0's TCP store, e.g. ``"127.0.0.1"``.
        master_port: its port.
        backend: ``"nccl"`` or ``"gloo"``; defaults to ``"nccl"`` when CUDA is available, else ``"gloo"``.
        timeout: collective timeout.

    Returns:
        ``cuda:<local rank>`` under NCCL (also made the current CUDA device), ``cpu`` otherwise. The local rank is
        ``LOCAL_RANK`` when set (torchrun), else ``rank % torch.cuda.device_count()``.

    Raises:
        ValueError: on a rank outside ``[0, world_size)``.
        RuntimeError: if a default process group already exists with a different rank, world size or backend.
            Calling again with the same arguments returns the device and changes nothing.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is not in [0, world_size={world_size})")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        have = (dist.get_rank(), dist.get_world_size(), dist.get_backend())
        if have != (rank, world_size, backend):
            raise RuntimeError(
                f"process group already initialised with (rank, world_size, backend)={have}, "
                f"asked for {(rank, world_size, backend)}"
            )
        return _device_for_backend(backend, rank)
    device = _device_for_backend(backend, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    return device


def _device_for_backend(backend: str, rank: int) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    return torch.device("cuda", local_rank)


def default_device() -> torch.device:
    """The device that matches the initialised default process group's backend."""
    if not dist.is_initialized():
        raise RuntimeError("no default process group; call init_process_group first")
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class FSDPPolicy:
    """A causal LM sharded with FSDP2 across the default process group, with its AdamW optimizer.

    Every public method except :meth:`save_hf_pretrained`'s file writing is a collective: all ranks call it, in
    the same order, with the same number of rows (micro-batches must line up across ranks).

    Gradient accumulation (``loss_weighting``):
        Each micro-batch loss is multiplied by ``w_mb * world_size / W`` before ``backward``, where ``w_mb`` is the
        micro-batch's number of response tokens (``"tokens"``) or of rows with at least one response token
        (``"rows"``), and ``W`` the sum of ``w_mb`` over all micro-batches of all ranks (FSDP then averages
        gradients over ranks). If ``loss_fn`` is a mean over the micro-batch's response tokens (``token-mean``
        in ``trainers.losses``) with ``"tokens"``, or a mean over its non-empty rows (``seq-mean-token-mean``,
        ``seq-mean-token-sum``) with ``"rows"``, the gradient equals that of the same loss over the whole global
        batch in one pass, whatever ``micro_batch_size`` and however tokens are spread over ranks. ``loss_fn``
        must return a finite loss for a micro-batch with no response tokens (clamp the denominator); it gets
        weight 0. Metrics are averaged with the same weights, so token-mean metrics come out exact too.

    Args:
        model: an ``nn.Module`` or a zero-argument factory returning one, built on CPU or on ``device``. Its
            ``forward(input_ids=, attention_mask=, position_ids=)`` returns logits ``[B, T, V]`` or an object
            with ``.logits`` (every Hugging Face causal LM does). Dropout should be 0: train and logprob passes
            must see the same function.
        device: where to compute; defaults to the process-group backend's device (see :func:`default_device`).
        optimizer: AdamW hyperparameters.
        grad_clip: max global L2 norm of the gradient, or ``None`` for no clipping (the norm is still reported).
        micro_batch_size: rows per forward/backward pass, in ``train_step`` and ``compute_logprobs``.
        loss_weighting: ``"tokens"`` or ``"rows"``, see above.
        mixed_precision: compute in bfloat16 with float32 master weights and gradient reduction; ``None`` means
            on for CUDA, off on CPU.
        sync_module_states: broadcast rank 0's weights before sharding, so ranks that built different random
            weights agree. Skip it (``False``) when every rank loaded the same checkpoint.
        trainable: ``False`` for a frozen model (a KL reference): no optimizer, no gradients; only
            :meth:`compute_logprobs` and the state-dict methods apply.
        min_layer_params: a decoder layer (see :func:`decoder_layers`) becomes an FSDP unit of its own only if it
            has at least this many parameters; smaller ones are sharded with the root module, so their weights are
            gathered and their gradients reduced in one collective with it. Per-layer units bound the memory of a
            large model's unsharded weights; for a small one they only add collectives (each a rendezvous of every
            rank). 0: every layer is its own unit.
        reshard_after_forward: free each unit's gathered weights after the forward and gather them again for the
            backward (FSDP2's default), or keep them until the backward (one all-gather fewer per unit and step,
            more memory).
        gradient_checkpointing: keep only each decoder layer's inputs during the training forward and recompute
            the layer in the backward (Hugging Face's ``gradient_checkpointing_enable``, non-reentrant): far less
            activation memory for one more forward's compute, the same gradients. Hugging Face models only.
        activation_offloading: run the training forward and backward under
            ``torch.autograd.graph.save_on_cpu`` (pinned host memory on CUDA): every tensor autograd keeps for the
            backward (the gathered weights a matmul keeps too) is copied to host memory in the forward and back to
            the device in the backward, so the GPU holds no activations between the two, for those copies' PCIe
            traffic; the same gradients. On a CPU device the activations are in host memory already: a no-op
            (``save_on_cpu`` keeps a CPU tensor as it is), the same update.

    Gradient synchronisation: over the micro-batches of one ``train_step`` gradients accumulate unsharded on each
    rank (``set_requires_gradient_sync(False)``), and are reduce-scattered once, in the last micro-batch's
    backward, as DDP's ``no_sync`` does.

    Raises:
        ValueError: on a non-positive ``micro_batch_size`` or ``grad_clip``, an unknown ``loss_weighting``, or
            ``gradient_checkpointing`` on a model that is not a Hugging Face one.
        RuntimeError: if no default process group exists.
    """

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        *,
        device: torch.device | None = None,
        optimizer: AdamWConfig | None = None,
        grad_clip: float | None = 1.0,
        micro_batch_size: int = 1,
        loss_weighting: Literal["tokens", "rows"] = "tokens",
        mixed_precision: bool | None = None,
        sync_module_states: bool = True,
        trainable: bool = True,
        min_layer_params: int = 0,
        reshard_after_forward: bool = True,
        gradient_checkpointing: bool = False,
        activation_offloading: bool = False,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("no default process group; call init_process_group first")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        if grad_clip is not None and grad_clip <= 0:
            raise ValueError(f"grad_clip={grad_clip} must be > 0 or None")
        if loss_weighting not in ("tokens", "rows"):
            raise ValueError(f"loss_weighting={loss_weighting!r} is not one of 'tokens', 'rows'")
        self.device = device or default_device()
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.loss_weighting = loss_weighting
        self.optimizer_config = optimizer or AdamWConfig()
        self.activation_offloading = activation_offloading

        module = model if isinstance(model, nn.Module) else model()
        self._model_class = type(module)  # fully_shard swaps in a subclass; keep the original for HF export
        self._is_hf = _is_pretrained_model(module)
        if gradient_checkpointing:
            if not self._is_hf:
                raise ValueError(
                    "gradient_checkpointing needs a Hugging Face model (its gradient_checkpointing_enable), got "
                    f"{type(module).__name__}"
                )
            hf_model: Any = module  # a PreTrainedModel (checked above)
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if sync_module_states:
            _broadcast_from_rank0(module, self.device)
        if mixed_precision is None:
            mixed_precision = self.device.type == "cuda"
        mp_policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if mixed_precision
            else MixedPrecisionPolicy()
        )
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        self.units = [m for m in decoder_layers(module) if _num_params(m) >= min_layer_params]
        for layer in self.units:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
        # the same object as ``module``, its class swapped for an FSDP subclass: the FSDP view of the model
        self._fsdp: FSDPModule = fully_shard(
            module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
        )
        self.model = module
        self.trainable = trainable
        self.optimizer: torch.optim.Optimizer | None = None
        if trainable:
            cfg = self.optimizer_config
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=cfg.lr,
                betas=cfg.betas,
                weight_decay=cfg.weight_decay,
                eps=cfg.eps,
                foreach=cfg.foreach,
            )
        else:
            self.model.requires_grad_(False)

    @torch.no_grad()
    def compute_logprobs(self, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0) -> Tensor:
        """Log-probabilities of the given tokens, aligned with ``input_ids``, without gradients.

        Args:
            input_ids: ``[B, T]`` int64, this rank's rows.
            attention_mask: ``[B, T]``, 1 on real tokens.
            temperature: logits are divided by it before the softmax, as in sampling.

        Returns:
            ``[B, T]`` float32 on ``input_ids.device``: ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])``
            for ``t >= 1``; position 0 and padding hold 0.
        """
        _check_rows(input_ids, attention_mask)
        self._check_micro_batch_count(input_ids.shape[0])
        self.model.eval()
        chunks = []
        for start in range(0, input_ids.shape[0], self.micro_batch_size):
            rows = slice(start, start + self.micro_batch_size)
            ids, mask = input_ids[rows].to(self.device), attention_mask[rows].to(self.device)
            chunks.append(self._logprobs(ids, mask, temperature))
        return torch.cat(chunks).to(input_ids.device)

    def train_step(self, batch: dict[str, Tensor], loss_fn: LossFn, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step on this rank's rows of the global batch, accumulated over micro-batches.

        Args:
            batch: ``[B, ...]`` tensors with at least ``input_ids``, ``attention_mask`` and ``response_mask``
                (``[B, T]``); every tensor is split by rows and handed to ``loss_fn`` on the device.
            loss_fn: ``loss, metrics = loss_fn(logprobs=..., batch=micro_batch)``, see :class:`LossFn`.
            temperature: divides the logits, as in :meth:`compute_logprobs`.

        Returns:
            ``loss`` and ``loss_fn``'s metrics, averaged over micro-batches and ranks with the accumulation
            weights; ``grad_norm`` (before clipping); ``lr``; ``skipped`` (1.0 when the gradient norm was not
            finite and the update was dropped, else 0.0). The same on every rank.

        Raises:
            ValueError: on missing keys, tensors with different row counts, ranks whose row counts give
                different numbers of micro-batches, or a global batch with nothing to train on.
        """
        optimizer = self.require_optimizer("train_step")
        micro_batches = self._split(batch, check_count=False)
        weights = [self._weight(mb) for mb in micro_batches]
        # one collective for both: every rank's micro-batch count (they must agree) and the global weight
        counts, rank_weights = _all_gather_pairs(len(micro_batches), sum(weights), self.device, self.world_size)
        self._raise_on_uneven_counts(counts, batch["input_ids"].shape[0])
        total_weight = sum(rank_weights)
        if total_weight == 0:
            what = "response tokens" if self.loss_weighting == "tokens" else "rows"
            raise ValueError(f"the global batch has no {what} to train on")

        self.model.train()
        sums: dict[str, Tensor] = {}
        last = len(micro_batches) - 1
        for i, (mb, weight) in enumerate(zip(micro_batches, weights, strict=True)):
            # reduce-scatter the accumulated gradients once, in the last micro-batch's backward
            self._fsdp.set_requires_gradient_sync(i == last)
            mb = {name: value.to(self.device, non_blocking=True) for name, value in mb.items()}
            with self._saved_for_backward():
                logprobs = self._logprobs(mb["input_ids"], mb["attention_mask"], temperature)
                loss, metrics = loss_fn(logprobs=logprobs, batch=mb)
                (loss * (weight * self.world_size / total_weight)).backward()
            for name, value in {"loss": loss, **metrics}.items():
                value = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach()
                if value.numel() != 1:
                    raise ValueError(f"loss_fn metric {name!r} has shape {tuple(value.shape)}, expected a scalar")
                sums[name] = sums.get(name, 0) + value.reshape(()) * weight
        grad_norm = self._clip_grad_norm()
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        names = sorted(sums)
        reduced = _all_reduce_sum(torch.stack([sums[name] for name in names])) / total_weight
        result = dict(zip(names, reduced.tolist(), strict=True))
        result.update(grad_norm=grad_norm, lr=float(optimizer.param_groups[0]["lr"]), skipped=float(skipped))
        return result

    def full_state_dict(self) -> dict[str, Tensor]:
        """The unsharded weights on CPU, under the model's own (Hugging Face) parameter names.

        A collective: every rank must call it. Only **rank 0** receives the tensors; other ranks get ``{}``.
        Tied weights appear under each of their names, so an unsharded model of the same architecture can
        ``load_state_dict`` the result directly.
        """
        state = self.model.state_dict()
        if not _all_row_sharded(state.values(), self.world_size):
            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return {name: value for name, value in full.items() if isinstance(value, Tensor)}
        return _gather_row_shards(state, self.rank, self.world_size)

    def save_hf_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Write the full weights as a Hugging Face model directory (config + safetensors), from rank 0.

        A collective (it gathers the weights); only rank 0 writes. The directory appears atomically: it is
        written under a temporary name and renamed. Needs a ``transformers.PreTrainedModel``.

        Raises:
            TypeError: if the model is not a ``transformers.PreTrainedModel``.
            FileExistsError: if ``path`` exists.
        """
        if not self._is_hf:
            raise TypeError(f"save_hf_pretrained needs a transformers PreTrainedModel, got {self._model_class}")
        path = Path(path)
        if path.exists():
            raise FileExistsError(f"{path} already exists")
        state_dict = self.full_state_dict()
        if self.rank == 0:
            with torch.device("meta"):
                unsharded = self._model_class(self.model.config)
            unsharded.load_state_dict(state_dict, assign=True)
            tmp = path.with_name(f".{path.name}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            save_pretrained: Callable[[Path], None] = getattr(unsharded, "save_pretrained")  # noqa: B009 (checked _is_hf)
            save_pretrained(tmp)
            tmp.rename(path)
        dist.barrier()

    def save_checkpoint(
        self, path: str | os.PathLike[str], extra_state: dict, *, overwrite: bool = False, stage: Any = None
    ) -> Any:
        """Save model, optimizer (if trainable), RNG states and ``extra_state`` (and what ``stage`` writes into the
        staging directory on rank 0); see :func:`trainers.checkpoint.save_checkpoint`."""
        return save_checkpoint(path, self.model, self.optimizer, extra_state, overwrite=overwrite, stage=stage)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict:
        """Restore what :meth:`save_checkpoint` saved and return its ``extra_state``."""
        return load_checkpoint(path, self.model, self.optimizer)

    def load_weights(self, path: str | os.PathLike[str]) -> dict:
        """Load only the model weights of a :meth:`save_checkpoint` checkpoint (no optimizer, no RNG); a collective.

        Works for frozen models too: this is how a KL reference is restored. Returns the checkpoint's
        ``extra_state``.
        """
        return load_checkpoint(path, self.model, None)

    def require_optimizer(self, what: str) -> torch.optim.Optimizer:
        """The optimizer of a trainable policy; raises naming ``what`` needed it on a frozen one."""
        if self.optimizer is None:
            raise RuntimeError(f"{what} needs a trainable policy; this one was built with trainable=False")
        return self.optimizer

    def _saved_for_backward(self) -> contextlib.AbstractContextManager[Any]:
        """Where the training forward keeps the tensors its backward needs: host memory with
        ``activation_offloading`` (pinned on CUDA, for asynchronous copies), else autograd's default (the device)."""
        if not self.activation_offloading:
            return contextlib.nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")

    def _logprobs(self, input_ids: Tensor, attention_mask: Tensor, temperature: float) -> Tensor:
        # Positions count real tokens, so left padding (if any) does not shift them.
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        kwargs = {"use_cache": False} if self._is_hf else {}  # no KV cache to build during training
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        logits = out if isinstance(out, Tensor) else out.logits
        return token_logprobs(logits, input_ids, attention_mask, temperature)

    def _split(self, batch: dict[str, Tensor], check_count: bool = True) -> list[dict[str, Tensor]]:
        missing = {"input_ids", "attention_mask", "response_mask"} - batch.keys()
        if missing:
            raise ValueError(f"batch is missing {sorted(missing)}; has {sorted(batch)}")
        rows = batch["input_ids"].shape[0]
        for name, value in batch.items():
            if value.dim() == 0 or value.shape[0] != rows:
                raise ValueError(f"batch[{name!r}] has shape {tuple(value.shape)}, expected {rows} rows like input_ids")
        if check_count:
            self._check_micro_batch_count(rows)
        return [
            {name: value[start : start + self.micro_batch_size] for name, value in batch.items()}
            for start in range(0, rows, self.micro_batch_size)
        ]

    def _check_micro_batch_count(self, rows: int) -> None:
        # Each micro-batch runs FSDP collectives: ranks with different counts would wait on each other forever.
        count = math.ceil(rows / self.micro_batch_size)
        counts = torch.tensor([count, -count], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        self._raise_on_uneven_counts([-int(counts[1].item()), int(counts[0].item())], rows)

    def _raise_on_uneven_counts(self, counts: list[int], rows: int) -> None:
        if min(counts) != max(counts):
            raise ValueError(
                f"ranks disagree on the number of micro-batches (between {min(counts)} and {max(counts)}; "
                f"this rank has {rows} rows at micro_batch_size={self.micro_batch_size}): "
                "give every rank the same number of rows"
            )

    def _weight(self, micro_batch: dict[str, Tensor]) -> float:
        tokens_per_row = (micro_batch["response_mask"] > 0).sum(-1)
        if self.loss_weighting == "rows":
            return float((tokens_per_row > 0).sum().item())
        return float(tokens_per_row.sum().item())

    def _clip_grad_norm(self) -> float:
        max_norm = self.grad_clip if self.grad_clip is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=self.optimizer_config.foreach)
        if isinstance(norm, DTensor):  # sharded grads: the local norm is a partial, reduce it
            norm = norm.full_tensor()
        return float(norm.item())


def token_logprobs(logits: Tensor, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0) -> Tensor:
    """``out[b, t] = log_softmax(logits[b, t - 1] / temperature)[input_ids[b, t]]``, 0 at t = 0 and on padding.

    The full (untruncated) tempered distribution, the one the engines report for sampled tokens whatever their
    top-k / top-p (docs/rl-conventions.md).

    Raises:
        ValueError: if ``temperature`` is not > 0 (greedy decoding reports log-probs at temperature 1).
    """
    if not temperature > 0:  # also NaN
        raise ValueError(
            f"temperature must be > 0 to score tokens, got {temperature} "
            "(greedy decoding reports log-probs at temperature 1: pass 1.0)"
        )
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    # gather - logsumexp instead of log_softmax: never materialises a second [B, T, V] tensor.
    shifted = logits.gather(-1, targets).squeeze(-1) - logits.logsumexp(-1)
    logprobs = torch.nn.functional.pad(shifted, (1, 0))
    return logprobs * attention_mask.to(logprobs.dtype)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks to shard one by one: ``model.model.layers`` (HF Llama, Qwen, Mistral), else every module whose
    class is named in the model's ``_no_split_modules`` (HF's list of blocks not to cut), innermost first.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    names = set(getattr(model, "_no_split_modules", None) or ())
    # Reversed pre-order puts nested blocks before their parents, as fully_shard requires.
    return [m for m in reversed(list(model.modules())) if type(m).__name__ in names and m is not model]


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _is_pretrained_model(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(module, PreTrainedModel)


def _broadcast_from_rank0(module: nn.Module, device: torch.device) -> None:
    tensors = [*module.parameters(), *module.buffers()]
    with torch.no_grad():
        for tensor in tensors:
            staged = tensor.detach().to(device)  # NCCL needs device tensors; a no-op on CPU
            dist.broadcast(staged, src=0)
            if staged.data_ptr() != tensor.data_ptr():
                tensor.copy_(staged)


def _all_row_sharded(values: Iterable[Tensor], world_size: int) -> bool:
    """Whether every DTensor is sharded by rows over one mesh dimension of ``world_size``, all of one dtype."""
    dtensors = [v for v in values if isinstance(v, DTensor)]
    return len({v.dtype for v in dtensors}) <= 1 and all(
        v.placements == (Shard(0),) and v.device_mesh.size() == world_size for v in dtensors
    )


def _shard_rows(rows: int, world_size: int) -> list[int]:
    """Rows each rank holds of a tensor sharded on dim 0 (``torch.chunk``: ceil-sized chunks, the last ones short
    or empty)."""
    chunk = -(-rows // world_size)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world_size)]


def _gather_row_shards(state: dict[str, Tensor], rank: int, world_size: int) -> dict[str, Tensor]:
    """The full tensors of a row-sharded state dict on rank 0 (``{}`` elsewhere), on CPU, in ONE all-gather of
    every rank's shards laid end to end (one collective per parameter costs ~1 ms each on gloo)."""
    unique = list({id(v): v for v in state.values() if isinstance(v, DTensor)}.values())
    if not unique:
        return {name: v.detach().cpu() for name, v in state.items()} if rank == 0 else {}
    rows = [_shard_rows(v.shape[0], world_size) for v in unique]
    row_numel = [math.prod(v.shape[1:]) for v in unique]
    lengths = [sum(r[k] * n for r, n in zip(rows, row_numel, strict=True)) for k in range(world_size)]
    local = torch.cat([v.to_local().reshape(-1) for v in unique])
    padded = torch.zeros(max(lengths), dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded)
    if rank != 0:
        return {}
    parts = [g.cpu() for g in gathered]
    offsets, full = [0] * world_size, {}
    for v, r, n in zip(unique, rows, row_numel, strict=True):
        pieces = []
        for k in range(world_size):
            pieces.append(parts[k][offsets[k] : offsets[k] + r[k] * n].view(r[k], *v.shape[1:]))
            offsets[k] += r[k] * n
        full[id(v)] = torch.cat(pieces)
    return {name: full[id(v)] if id(v) in full else v.detach().cpu() for name, v in state.items()}


def all_gather_single(out: torch.Tensor, mine: torch.Tensor) -> None:
    """Every rank's ``mine`` into ``out``, concatenated in rank order: ``dist.all_gather_single`` (torch >= 2.13),
    else ``dist.all_gather_into_tensor``, the same collective under its old name (2.13 warns on every call of it)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine)


def _all_gather_pairs(a: float, b: float, device: torch.device, world_size: int) -> tuple[list[int], list[float]]:
    """Every rank's ``(a, b)`` in one all-gather: ``a`` as ints, ``b`` as floats, in rank order."""
    mine = torch.tensor([a, b], dtype=torch.float64, device=device)
    out = torch.empty(world_size * 2, dtype=torch.float64, device=device)
    all_gather_single(out, mine)
    pairs = out.view(world_size, 2).tolist()
    return [int(p[0]) for p in pairs], [p[1] for p in pairs]


def _all_reduce_sum(tensor: Tensor) -> Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def _check_rows(input_ids: Tensor, attention_mask: Tensor) -> None:
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both be [B, T]"
        )
