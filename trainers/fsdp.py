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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

from rl_contracts.images import rows_images
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
    the same order, with the same number of rows (micro-batches must line up across ranks; with
    ``dynamic_batching`` the row counts may differ, see below).

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
        dynamic_batching: pack micro-batches to a token budget instead of ``micro_batch_size`` rows (which is then
            unused), in ``train_step`` and ``compute_logprobs``: see "Dynamic batching" below.
        max_tokens_per_micro_batch: the budget of a dynamic micro-batch, in padded tokens (rows x its longest row).
        loss_seq_chunk_size: ``None``, or score at most this many positions at a time: the output head (an
            ``nn.Linear``: Hugging Face's ``get_output_embeddings()``, else the model's ``lm_head``) and the
            tempered log-softmax run chunk by chunk over the sequence, each chunk recomputed in the backward, so the
            ``[B, T, V]`` float32 logits are never held whole, nor kept for the backward; the same log-probs and
            gradients (see :func:`chunked_token_logprobs`). The model's logits must be the head's output as it is.
        activation_offloading: run the training forward and backward under
            ``torch.autograd.graph.save_on_cpu`` (pinned host memory on CUDA): every tensor autograd keeps for the
            backward (the gathered weights a matmul keeps too) is copied to host memory in the forward and back to
            the device in the backward, so the GPU holds no activations between the two, for those copies' PCIe
            traffic; the same gradients. On a CPU device the activations are in host memory already: a no-op
            (``save_on_cpu`` keeps a CPU tensor as it is), the same update.
        tp_size: tensor-parallel degree, dividing the world size: see "Tensor parallelism" below. 1 (the default):
            FSDP2 over every rank, no tensor parallelism.

    Tensor parallelism (``tp_size > 1``):
        The ranks form a 2-D mesh ``(dp, tp)`` of ``world_size // tp_size`` x ``tp_size``, consecutive ranks in one
        TP group (this rank's DP rank is ``rank // tp_size``). The decoder layers of a Llama-style Hugging Face
        model (``model.model.layers``, each with ``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj``) are
        split over ``tp`` with ``torch.distributed.tensor.parallel`` (q/k/v/gate/up column-wise, o/down row-wise:
        each TP rank computes ``num_attention_heads / tp_size`` query heads and ``num_key_value_heads / tp_size``
        key/value heads, and the row-wise layers all-reduce their outputs), then FSDP2 shards everything over
        ``dp``; embeddings, norms and the output head are replicated over ``tp``. The ranks of one TP group must
        be given the same rows (their DP rank's share); the loss weights count each DP share once. The weights,
        log-probs and update are those of ``world_size // tp_size`` data-parallel ranks (up to float rounding).

    Dynamic batching (``dynamic_batching=True``):
        This rank's rows are planned by :func:`plan_micro_batches` from their lengths (a row's length is the
        position after its last ``attention_mask`` 1): longest first, so rows of similar length share a
        micro-batch, each micro-batch within ``max_tokens_per_micro_batch`` padded tokens. A row longer than the
        budget gets a micro-batch of its own (it is neither cut nor refused). Each micro-batch's ``[B, T]`` tensors
        (every tensor of two or more dimensions whose second one is ``input_ids``' ``T``) are trimmed to its longest
        row: only trailing all-padding columns go, so right padding (the trainer's) saves compute and left padding
        is handled too, without saving any. Ranks may so have different micro-batch counts; the ranks with fewer
        run filler passes (one token, no loss, zero gradient) until every rank has run as many as the rank with
        the most, so FSDP's collectives line up. The accumulation weights are those above, so the update is the
        fixed-count one's (up to float rounding).

    Vision-language models (LLaVA-style, see :data:`PIXEL_VALUES`): every forward pass runs the vision tower, on a
    blank image whose features are multiplied by 0 when the micro-batch holds no images (and in filler passes), so
    ranks whose micro-batches differ in holding images run the same collectives; the update is unchanged (see
    :class:`_VisionInEveryPass`).

    Gradient synchronisation: over the micro-batches of one ``train_step`` gradients accumulate unsharded on each
    rank (``set_requires_gradient_sync(False)``), and are reduce-scattered once, in the last micro-batch's
    backward, as DDP's ``no_sync`` does.

    Raises:
        ValueError: on a non-positive ``micro_batch_size``, ``max_tokens_per_micro_batch``, ``grad_clip`` or
            ``loss_seq_chunk_size``, an unknown ``loss_weighting``, ``gradient_checkpointing`` on a model that is not
            a Hugging Face one, or ``loss_seq_chunk_size`` on a model without an ``nn.Linear`` output head (or one
            whose logits are transformed after it: a final logit soft-cap); a ``tp_size`` that does not divide the
            world size, or ``tp_size > 1`` on a model that is not Llama-like (see above) or whose head counts do not
            divide by it.
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
        dynamic_batching: bool = False,
        max_tokens_per_micro_batch: int = 4096,
        loss_seq_chunk_size: int | None = None,
        activation_offloading: bool = False,
        tp_size: int = 1,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("no default process group; call init_process_group first")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        if max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch={max_tokens_per_micro_batch} must be >= 1")
        if grad_clip is not None and grad_clip <= 0:
            raise ValueError(f"grad_clip={grad_clip} must be > 0 or None")
        if loss_weighting not in ("tokens", "rows"):
            raise ValueError(f"loss_weighting={loss_weighting!r} is not one of 'tokens', 'rows'")
        if loss_seq_chunk_size is not None and loss_seq_chunk_size < 1:
            raise ValueError(f"loss_seq_chunk_size={loss_seq_chunk_size} must be >= 1 or None")
        self.device = device or default_device()
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        if not isinstance(tp_size, int) or tp_size < 1 or self.world_size % tp_size:
            raise ValueError(f"tp_size={tp_size!r} must be an int >= 1 that divides the world size {self.world_size}")
        #: tensor-parallel degree; data-parallel degree and this rank's DP rank (its TP group's place)
        self.tp_size = tp_size
        self.dp_size = self.world_size // tp_size
        self.dp_rank = self.rank // tp_size
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.dynamic_batching = dynamic_batching
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        #: every rank's number of micro-batches in the last ``train_step`` or ``compute_logprobs``, in rank order,
        #: before any filler passes (they differ across ranks only with dynamic batching)
        self.micro_batch_counts: list[int] = []
        self.loss_weighting = loss_weighting
        self.optimizer_config = optimizer or AdamWConfig()
        self.activation_offloading = activation_offloading

        module = model if isinstance(model, nn.Module) else model()
        if tp_size > 1:
            _check_tensor_parallel(module, tp_size)
        self._model_class = type(module)  # fully_shard swaps in a subclass; keep the original for HF export
        self._is_hf = _is_pretrained_model(module)
        self.loss_seq_chunk_size = loss_seq_chunk_size
        # the head the chunked path calls chunk by chunk (a submodule of the root: sharded with it)
        self._head = _output_head(module) if loss_seq_chunk_size is not None else None
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
        if tp_size == 1:
            mesh = init_device_mesh(self.device.type, (self.world_size,))
        else:  # the 2-D recipe: tensor parallel within each TP group first, then FSDP2 over the DP dimension
            mesh_2d = init_device_mesh(self.device.type, (self.dp_size, tp_size), mesh_dim_names=("dp", "tp"))
            for layer in decoder_layers(module):
                parallelize_module(layer, mesh_2d["tp"], _llama_layer_plan())
            mesh = mesh_2d["dp"]
        # a vision-language model runs its vision tower in every pass, so every rank's collectives match
        self._vision_every_pass = _VisionInEveryPass.attach(module) if self._is_hf else None
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
    def compute_logprobs(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        temperature: float = 1.0,
        pixel_values: Tensor | None = None,
        image_counts: Tensor | None = None,
    ) -> Tensor:
        """Log-probabilities of the given tokens, aligned with ``input_ids``, without gradients.

        Args:
            input_ids: ``[B, T]`` int64, this rank's rows.
            attention_mask: ``[B, T]``, 1 on real tokens.
            temperature: logits are divided by it before the softmax, as in sampling.
            pixel_values, image_counts: a vision-language model's images and each row's number of them (see
                :data:`PIXEL_VALUES`, :data:`IMAGE_COUNTS`); every micro-batch gets its own rows' images.

        Returns:
            ``[B, T]`` float32 on ``input_ids.device``: ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])``
            for ``t >= 1``; position 0 and padding hold 0. With dynamic batching too: rows in their order, at
            their width (0 beyond the columns a row's micro-batch was trimmed to).
        """
        _check_rows(input_ids, attention_mask)
        self.model.eval()
        if pixel_values is not None and pixel_values.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, expected {input_ids.shape[0]} rows like input_ids"
            )
        if self.dynamic_batching:
            return self._dynamic_logprobs(input_ids, attention_mask, temperature, pixel_values, image_counts)
        self._check_micro_batch_count(input_ids.shape[0])
        chunks = []
        for start in range(0, input_ids.shape[0], self.micro_batch_size):
            rows = slice(start, start + self.micro_batch_size)
            ids, mask = input_ids[rows].to(self.device), attention_mask[rows].to(self.device)
            pixels = None if pixel_values is None else pixel_values[rows].to(self.device)
            counts = None if image_counts is None else image_counts[rows]
            chunks.append(self._logprobs(ids, mask, temperature, pixels, counts))
        return torch.cat(chunks).to(input_ids.device)

    def train_step(self, batch: dict[str, Tensor], loss_fn: LossFn, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step on this rank's rows of the global batch, accumulated over micro-batches.

        Args:
            batch: ``[B, ...]`` tensors with at least ``input_ids``, ``attention_mask`` and ``response_mask``
                (``[B, T]``); every tensor is split by rows (with dynamic batching, those of ``[B, T, ...]`` also
                trimmed to the micro-batch's longest row) and handed to ``loss_fn`` on the device.
            loss_fn: ``loss, metrics = loss_fn(logprobs=..., batch=micro_batch)``, see :class:`LossFn`.
            temperature: divides the logits, as in :meth:`compute_logprobs`.

        Returns:
            ``loss`` and ``loss_fn``'s metrics, averaged over micro-batches and ranks with the accumulation
            weights; ``grad_norm`` (before clipping); ``lr``; ``skipped`` (1.0 when the gradient norm was not
            finite and the update was dropped, else 0.0). The same on every rank.

        Raises:
            ValueError: on missing keys, tensors with different row counts, ranks whose row counts give
                different numbers of micro-batches (without dynamic batching), a rank without rows (with it), or a
                global batch with nothing to train on.
        """
        optimizer = self.require_optimizer("train_step")
        micro_batches = self._split(batch, check_count=False)
        weights = [self._weight(mb) for mb in micro_batches]
        # one collective for both: every rank's micro-batch count (they must agree, or with dynamic batching be
        # evened out with filler passes) and the global weight
        counts, rank_weights = _all_gather_pairs(len(micro_batches), sum(weights), self.device, self.world_size)
        rank_weights = rank_weights[:: self.tp_size]  # the ranks of a TP group hold the same rows: count them once
        self.micro_batch_counts = counts
        if not self.dynamic_batching:
            self._raise_on_uneven_counts(counts, batch["input_ids"].shape[0])
        elif min(counts) == 0:  # its metrics' names come from loss_fn: a rank that never calls it has none
            raise ValueError(
                f"with dynamic batching every rank needs at least one row to train on; micro-batches per rank: {counts}"
            )
        total_weight = sum(rank_weights)
        if total_weight == 0:
            what = "response tokens" if self.loss_weighting == "tokens" else "rows"
            raise ValueError(f"the global batch has no {what} to train on")

        self.model.train()
        sums: dict[str, Tensor] = {}
        last = max(counts) - 1
        for i, (mb, weight) in enumerate(zip(micro_batches, weights, strict=True)):
            # reduce-scatter the accumulated gradients once, in the last micro-batch's backward
            self._fsdp.set_requires_gradient_sync(i == last)
            mb = {name: value.to(self.device, non_blocking=True) for name, value in mb.items()}
            with self._saved_for_backward():
                logprobs = self._logprobs(
                    mb["input_ids"], mb["attention_mask"], temperature, mb.get(PIXEL_VALUES), mb.get(IMAGE_COUNTS)
                )
                loss, metrics = loss_fn(logprobs=logprobs, batch=mb)
                (loss * (weight * self.dp_size / total_weight)).backward()
            for name, value in {"loss": loss, **metrics}.items():
                value = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach()
                if value.numel() != 1:
                    raise ValueError(f"loss_fn metric {name!r} has shape {tuple(value.shape)}, expected a scalar")
                sums[name] = sums.get(name, 0) + value.reshape(()) * weight
        for i in range(len(micro_batches), last + 1):  # only with dynamic batching: even the ranks' counts out
            self._fsdp.set_requires_gradient_sync(i == last)
            self._filler_pass(backward=True)
        grad_norm = self._clip_grad_norm()
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        names = sorted(sums)
        reduced = _all_reduce_sum(torch.stack([sums[name] for name in names])) / (total_weight * self.tp_size)
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
            return _unaliased({name: value for name, value in full.items() if isinstance(value, Tensor)}, state)
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

    def _logprobs(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        temperature: float,
        pixel_values: Tensor | None = None,
        image_counts: Tensor | None = None,
    ) -> Tensor:
        if self._head is None or self.loss_seq_chunk_size is None:
            return model_token_logprobs(
                self.model,
                input_ids,
                attention_mask,
                temperature,
                pixel_values=pixel_values,
                image_counts=image_counts,
                hf=self._is_hf,
            )
        _check_temperature(temperature)
        kwargs = _forward_kwargs(attention_mask, pixel_values, self._is_hf, image_counts)
        with _head_scores_tokens(self._head, input_ids, temperature, self.loss_seq_chunk_size):
            out = self.model(input_ids=input_ids, **kwargs)
        logprobs = out if isinstance(out, Tensor) else out.logits
        if logprobs.shape != input_ids.shape:
            raise RuntimeError(
                f"loss_seq_chunk_size: the model's output is {tuple(logprobs.shape)}, expected the head's log-probs "
                f"{tuple(input_ids.shape)}: its forward must return its output head's result as the logits"
            )
        return logprobs * attention_mask.to(logprobs.dtype)

    def _split(self, batch: dict[str, Tensor], check_count: bool = True) -> list[dict[str, Tensor]]:
        missing = {"input_ids", "attention_mask", "response_mask"} - batch.keys()
        if missing:
            raise ValueError(f"batch is missing {sorted(missing)}; has {sorted(batch)}")
        rows = batch["input_ids"].shape[0]
        for name, value in batch.items():
            if value.dim() == 0 or value.shape[0] != rows:
                raise ValueError(f"batch[{name!r}] has shape {tuple(value.shape)}, expected {rows} rows like input_ids")
        if self.dynamic_batching:
            return self._dynamic_split(batch)
        if check_count:
            self._check_micro_batch_count(rows)
        return [
            {name: value[start : start + self.micro_batch_size] for name, value in batch.items()}
            for start in range(0, rows, self.micro_batch_size)
        ]

    def _dynamic_split(self, batch: dict[str, Tensor]) -> list[dict[str, Tensor]]:
        """This rank's rows in the micro-batches :func:`plan_micro_batches` plans, each trimmed to its longest row."""
        lengths = row_lengths(batch["attention_mask"])
        width = batch["input_ids"].shape[1]
        out = []
        for rows in plan_micro_batches(lengths.tolist(), self.max_tokens_per_micro_batch):
            index = torch.tensor(rows, device=lengths.device)
            trim = max(1, int(lengths[index].max()))
            out.append(
                {
                    name: value[index.to(value.device)]
                    if name == PIXEL_VALUES
                    else _trim(value[index.to(value.device)], width, trim)
                    for name, value in batch.items()
                }
            )
        return out

    def _dynamic_logprobs(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        temperature: float,
        pixel_values: Tensor | None = None,
        image_counts: Tensor | None = None,
    ) -> Tensor:
        lengths = row_lengths(attention_mask)
        plan = plan_micro_batches(lengths.tolist(), self.max_tokens_per_micro_batch)
        counts = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        all_gather_single(counts, torch.tensor([len(plan)], dtype=torch.int64, device=self.device))
        self.micro_batch_counts = counts.tolist()
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        for rows in plan:
            index = torch.tensor(rows, device=input_ids.device)
            trim = max(1, int(lengths[index].max()))
            ids = input_ids[index, :trim].to(self.device)
            mask = attention_mask[index, :trim].to(self.device)
            pixels = None if pixel_values is None else pixel_values[index.to(pixel_values.device)].to(self.device)
            per_row = None if image_counts is None else image_counts[index.to(image_counts.device)]
            out[index, :trim] = self._logprobs(ids, mask, temperature, pixels, per_row).to(out.device)
        for _ in range(len(plan), max(self.micro_batch_counts)):
            self._filler_pass(backward=False)
        return out

    def _filler_pass(self, backward: bool) -> None:
        """A forward (and backward) pass of one real token that changes nothing: the FSDP collectives of one
        micro-batch, for a rank with fewer micro-batches than another. The token is attended (a row with no attended
        token can give NaN logits, and NaN times 0 is NaN); its gradient is exactly 0."""
        ids = torch.zeros((1, 1), dtype=torch.int64, device=self.device)
        mask = torch.ones((1, 1), dtype=torch.int64, device=self.device)
        kwargs = {"use_cache": False} if self._is_hf else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=torch.zeros_like(ids), **kwargs)
        logits = out if isinstance(out, Tensor) else out.logits
        if backward:
            (logits.float().sum() * 0.0).backward()

    def _check_micro_batch_count(self, rows: int) -> None:
        # Each micro-batch runs FSDP collectives: ranks with different counts would wait on each other forever.
        count = math.ceil(rows / self.micro_batch_size)
        counts = torch.tensor([count, -count], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        self._raise_on_uneven_counts([-int(counts[1].item()), int(counts[0].item())], rows)
        self.micro_batch_counts = [count] * self.world_size

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
        if self.tp_size > 1:
            return _clip_grad_norm_across_meshes(self.model.parameters(), max_norm, self.optimizer_config.foreach)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=self.optimizer_config.foreach)
        if isinstance(norm, DTensor):  # sharded grads: the local norm is a partial, reduce it
            norm = norm.full_tensor()
        return float(norm.item())


def _clip_grad_norm_across_meshes(parameters: Iterable[nn.Parameter], max_norm: float, foreach: bool) -> float:
    """``clip_grad_norm_`` over DTensor gradients on different meshes (with tensor parallelism: the TP layers' on
    the 2-D ``(dp, tp)`` mesh, the rest on ``dp``), which torch's refuses (its one ``stack`` of every norm mixes
    meshes): the norm of each mesh's gradients in full, then the norm of those, then every gradient scaled by the
    one clip coefficient."""
    groups: dict[Any, list[nn.Parameter]] = {}
    grads: dict[Any, list[Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p)
            grads.setdefault(mesh, []).append(p.grad)
    norms = []
    for mesh in groups:
        norm = torch.nn.utils.get_total_norm(grads[mesh], foreach=foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return 0.0
    total = torch.linalg.vector_norm(torch.stack(norms))
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return float(total.item())


#: the Llama-style decoder layer's linear layers and how tensor parallelism splits them
_LLAMA_TP_LAYERS = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def _llama_layer_plan() -> dict[str, ParallelStyle]:
    return {
        name: ColwiseParallel() if kind == "colwise" else RowwiseParallel() for name, kind in _LLAMA_TP_LAYERS.items()
    }


def _check_tensor_parallel(module: nn.Module, tp_size: int) -> None:
    """Refuse a model :func:`_llama_layer_plan` cannot split over ``tp_size`` ranks, naming what it needs.

    The attention of Hugging Face's Llama-style layers reshapes its projections to ``(-1, head_dim)`` heads, so a
    column-wise q/k/v shard of whole heads runs on its ``num_attention_heads / tp_size`` and
    ``num_key_value_heads / tp_size`` heads as they are (the GQA ratio unchanged); the MLP splits its
    ``intermediate_size`` the same way.
    """
    layers = getattr(getattr(module, "model", None), "layers", None)
    needed = "a Llama-style Hugging Face model (model.model.layers, each with " + ", ".join(_LLAMA_TP_LAYERS) + ")"
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"tp_size={tp_size} needs {needed}; got {type(module).__name__} without model.model.layers")
    for i, layer in enumerate(layers):
        missing = [name for name in _LLAMA_TP_LAYERS if not isinstance(_submodule(layer, name), nn.Linear)]
        if missing:
            raise ValueError(
                f"tp_size={tp_size} needs {needed}; layer {i} of {type(module).__name__} has no nn.Linear "
                + ", ".join(missing)
            )
    config = getattr(module, "config", None)
    sizes = {
        name: getattr(config, name, None)
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    }
    bad = {name: value for name, value in sizes.items() if not isinstance(value, int) or value % tp_size}
    if bad:
        raise ValueError(
            f"tp_size={tp_size} must divide the model's num_attention_heads, num_key_value_heads and "
            f"intermediate_size (each TP rank takes an equal share of them); got "
            + ", ".join(f"{name}={value}" for name, value in sizes.items())
        )


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Rows packed into micro-batches of at most ``max_tokens`` padded tokens: a micro-batch's rows times its
    longest row's length.

    Rows are taken longest first (ties in index order), so rows of similar length share a micro-batch; each
    micro-batch takes the next rows while its padded size stays within ``max_tokens``. A row longer than
    ``max_tokens`` gets a micro-batch of its own: it is neither cut nor refused. A length of 0 counts as 1 (a
    pass computes at least one column).

    Args:
        lengths: each row's length in tokens (see :func:`row_lengths`).
        max_tokens: the budget, >= 1.

    Returns:
        The micro-batches as lists of row indices (longest row first); every row in exactly one; ``[]`` for no rows.

    Raises:
        ValueError: on ``max_tokens < 1`` or a negative length.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if any(length < 0 for length in lengths):
        raise ValueError(f"lengths must be >= 0, got {min(lengths)}")
    plan: list[list[int]] = []
    width = 0  # the current micro-batch's longest (first) row
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if plan and (len(plan[-1]) + 1) * width <= max_tokens:
            plan[-1].append(row)
        else:
            plan.append([row])
            width = max(1, lengths[row])
    return plan


def row_lengths(attention_mask: Tensor) -> Tensor:
    """``[B]`` int64: each row's position after its last attended token (its length when right-padded, the full
    width when left-padded; 0 for a row with none), so trimming a micro-batch to its longest row cuts only
    trailing all-padding columns."""
    if attention_mask.shape[-1] == 0:
        return torch.zeros(attention_mask.shape[0], dtype=torch.int64, device=attention_mask.device)
    positions = torch.arange(1, attention_mask.shape[-1] + 1, device=attention_mask.device)
    return ((attention_mask != 0) * positions).amax(-1)


def _trim(value: Tensor, width: int, trim: int) -> Tensor:
    """``value``'s first ``trim`` columns if it is token-aligned (two or more dims, the second ``width``)."""
    return value[:, :trim] if value.dim() >= 2 and value.shape[1] == width else value


#: the batch key of a vision-language model's images (``train_step``, ``compute_logprobs``): ``[B, K, 3, H, W]``, the
#: images of each row in the order of its image placeholder tokens, padded to the batch's most images per row ``K``
#: (:data:`IMAGE_COUNTS` says how many are real; without it every row has ``K``), or ``[B, 3, H, W]`` for one image
#: per row; split by rows with the other tensors, never trimmed
PIXEL_VALUES = "pixel_values"
#: the batch key of each row's number of images (``[B]`` int64, 0 to ``K``): the first ``IMAGE_COUNTS[b]`` of row
#: ``b``'s :data:`PIXEL_VALUES` go to the model, the rest is padding (``rl_contracts.images.rows_images``)
IMAGE_COUNTS = "image_counts"


def model_token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    temperature: float = 1.0,
    *,
    pixel_values: Tensor | None = None,
    image_counts: Tensor | None = None,
    hf: bool = True,
) -> Tensor:
    """The trainer's log-prob pass: :func:`token_logprobs` of ``model``'s logits for ``input_ids``, positions counting
    real tokens (left padding does not shift them), no KV cache (``hf``: a Hugging Face model's ``use_cache=False``).

    ``pixel_values`` (see :data:`PIXEL_VALUES`) go to a vision-language model (LLaVA-style: its forward takes
    ``pixel_values`` ``[N, 3, H, W]`` for the ``N`` images of the batch, row by row): row ``b``'s first
    ``image_counts[b]`` (see :data:`IMAGE_COUNTS`; all ``K`` without it), none for a batch whose rows hold none.
    The engines feed the same images to the prompt's forward pass, so the log-probs are the sampler's for the same
    weights.
    """
    out = model(input_ids=input_ids, **_forward_kwargs(attention_mask, pixel_values, hf, image_counts))
    logits = out if isinstance(out, Tensor) else out.logits
    return token_logprobs(logits, input_ids, attention_mask, temperature)


class _VisionInEveryPass:
    """Runs a vision-language model's vision tower and projector on one blank image in every forward pass that is
    given no images (a micro-batch of text rows, a dynamic-batching filler pass), its features multiplied by 0 and
    added to the token embeddings: the pass's values are unchanged and the vision weights get an exactly zero
    gradient, but every rank runs the same FSDP collectives in the same order whatever its micro-batches hold.

    Why: with several ranks, the vision tower's layers (``decoder_layers``: ``CLIPEncoderLayer``,
    ``CLIPVisionEmbeddings``) are FSDP units of their own, each gathered in its forward and reduce-scattered in its
    backward. A rank whose micro-batch has images runs those collectives and a rank whose has none does not: the
    ranks' collectives fall out of step (a hang, or one unit's shards gathered into another's). Sharding the vision
    tower with the root unit instead would gather it on every rank in every pass, but not fix the backward: FSDP2
    reduce-scatters only the parameters that have a gradient, and a rank that never ran the vision tower has none
    for it, so the ranks' reduce-scatters would still differ in size. Here every rank's vision parameters have a
    gradient, the true one or an exact 0 (``0 * features`` back-propagates zeros), so the reduced gradient is that
    of the ranks with images alone, the single-rank gradient up to float rounding; this costs one small image's
    vision-tower pass per image-less micro-batch. The blank image's features must be finite (``0 * inf`` is NaN).

    The dummy runs right after the token embedding, where the model runs the real images (LLaVA-style models: a
    ``get_image_features(pixel_values=...)`` and a ``config.vision_config`` with ``image_size``), so the collectives
    come in the same order as a pass with images.
    """

    def __init__(self, model: nn.Module) -> None:
        config: Any = getattr(model, "config")  # noqa: B009 (checked by attach)
        size = config.vision_config.image_size
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        channels = getattr(config.vision_config, "num_channels", 3)
        self.image_shape = (1, channels, height, width)
        self.feature_kwargs = {
            name: getattr(config, name)
            for name in ("vision_feature_layer", "vision_feature_select_strategy")
            if hasattr(config, name)
        }
        self.model = model
        #: set by the model's forward pre-hook when the pass has no images; the embedding's hook consumes it
        self.pending = False
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        embeddings: Any = getattr(model, "get_input_embeddings")()  # noqa: B009 (checked by attach)
        embeddings.register_forward_hook(self._after_embedding)

    @classmethod
    def attach(cls, model: nn.Module) -> _VisionInEveryPass | None:
        """Hook ``model`` if it is a vision-language model (see above); ``None`` for any other model."""
        config = getattr(model, "config", None)
        vision = getattr(config, "vision_config", None)
        if not callable(getattr(model, "get_image_features", None)) or getattr(vision, "image_size", None) is None:
            return None
        return cls(model)

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.pending = kwargs.get("pixel_values") is None

    def _after_embedding(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        if not self.pending:
            return None
        self.pending = False  # once per pass (a model that embeds twice runs one dummy)
        images = torch.zeros(self.image_shape, dtype=torch.float32, device=output.device)
        features: Any = getattr(self.model, "get_image_features")(pixel_values=images, **self.feature_kwargs)  # noqa: B009
        return output + _features_sum(features).to(output.dtype) * 0.0


def _features_sum(features: Any) -> Tensor:
    """The sum of a ``get_image_features`` result: a tensor, a list of them, or an output whose ``pooler_output``
    (Hugging Face 5) or ``image_embeds`` holds them."""
    if not isinstance(features, (Tensor, list, tuple)):
        pooled = getattr(features, "pooler_output", None)
        features = pooled if pooled is not None else getattr(features, "image_embeds", None)
    if isinstance(features, Tensor):
        return features.sum()
    if isinstance(features, (list, tuple)) and features and all(isinstance(f, Tensor) for f in features):
        return torch.stack([f.sum() for f in features]).sum()
    raise TypeError(f"get_image_features returned {type(features).__name__}, expected tensors of image features")


def _forward_kwargs(
    attention_mask: Tensor, pixel_values: Tensor | None, hf: bool, image_counts: Tensor | None = None
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0),
    }
    if hf:
        kwargs["use_cache"] = False  # no KV cache to build during training
    if pixel_values is not None:
        if pixel_values.dim() not in (4, 5):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, expected [B, K, 3, H, W] or [B, 3, H, W]"
            )
        images = rows_images(pixel_values, image_counts)
        if images.shape[0]:  # a micro-batch of text rows only: no images (LLaVA wants none for no placeholders)
            kwargs["pixel_values"] = images
    return kwargs


def token_logprobs(logits: Tensor, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0) -> Tensor:
    """``out[b, t] = log_softmax(logits[b, t - 1] / temperature)[input_ids[b, t]]``, 0 at t = 0 and on padding.

    The full (untruncated) tempered distribution, the one the engines report for sampled tokens whatever their
    top-k / top-p (docs/rl-conventions.md).

    Raises:
        ValueError: if ``temperature`` is not > 0 (greedy decoding reports log-probs at temperature 1).
    """
    _check_temperature(temperature)
    logprobs = torch.nn.functional.pad(_target_logprobs(logits[:, :-1], input_ids[:, 1:], temperature), (1, 0))
    return logprobs * attention_mask.to(logprobs.dtype)


def chunked_token_logprobs(
    hidden: Tensor, head: nn.Linear, input_ids: Tensor, temperature: float, chunk_size: int
) -> Tensor:
    """:func:`token_logprobs` of ``head(hidden)`` (without the padding mask), ``chunk_size`` positions at a time.

    Only one chunk's ``[B, chunk_size, V]`` logits exist at a time; with gradients enabled each chunk runs under a
    non-reentrant :func:`torch.utils.checkpoint.checkpoint`, so the backward recomputes them from the chunk's hidden
    states instead of keeping them: one more head matmul for at most ``B * chunk_size * V`` floats held.

    Args:
        hidden: ``[B, T, H]``, the final hidden states (the head's input).
        head: the output head; its ``weight`` (and ``bias``) are read when this is called (inside the model's
            forward under FSDP, where they are unsharded).
        input_ids: ``[B, T]``.
        temperature: > 0, see :func:`token_logprobs`.
        chunk_size: positions per chunk, >= 1.

    Returns:
        ``[B, T]`` float32: ``out[b, t] = log_softmax(head(hidden[b, t - 1]) / temperature)[input_ids[b, t]]``,
        0 at ``t = 0``.
    """
    _check_temperature(temperature)
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    hidden, targets = hidden[:, :-1], input_ids[:, 1:]  # position t - 1 predicts token t
    chunks = []
    # one empty chunk when there is no position to score (T = 1), on the graph as token_logprobs' empty slice is
    for start in range(0, max(targets.shape[1], 1), chunk_size):
        args = (hidden[:, start : start + chunk_size], head.weight, head.bias, targets[:, start : start + chunk_size])
        if torch.is_grad_enabled():
            chunks.append(checkpoint(_head_logprobs, *args, temperature, use_reentrant=False))
        else:
            chunks.append(_head_logprobs(*args, temperature))
    return torch.nn.functional.pad(torch.cat(chunks, dim=1), (1, 0))


def _head_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float) -> Tensor:
    return _target_logprobs(torch.nn.functional.linear(hidden, weight, bias), targets, temperature)


def _target_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """``log_softmax(logits / temperature)`` at ``targets`` (``[B, n, V]`` and ``[B, n]``), in float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    # gather - logsumexp instead of log_softmax: never materialises a second [B, T, V] tensor.
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:  # also NaN
        raise ValueError(
            f"temperature must be > 0 to score tokens, got {temperature} "
            "(greedy decoding reports log-probs at temperature 1: pass 1.0)"
        )


@contextlib.contextmanager
def _head_scores_tokens(head: nn.Linear, input_ids: Tensor, temperature: float, chunk_size: int) -> Iterator[None]:
    """Within the block, ``head(hidden)`` returns :func:`chunked_token_logprobs` of ``hidden`` instead of logits.

    Why the head's ``forward`` is swapped rather than the head applied after the model's forward to its hidden
    states: FSDP2 unshards the root unit's parameters (the head's, tied to the embedding or not) only inside the
    root module's forward (and again for its backward). FSDPPolicy passes ``reshard_after_forward`` to the root
    too, which turns off FSDP2's keep-the-root-unsharded heuristic (``FSDPState._lazy_init`` applies it only when
    the argument is left out): with ``True``, the default, the root's post-forward hook reshards them, so after the
    forward ``head.weight`` is a sharded DTensor again, and a gradient reaching it from outside the forward would
    bypass FSDP's gradient accumulation and reduce-scatter. Called by the model's own forward, the chunks use the
    unsharded weight as the whole head would: the log-probs leave as the root's output, on which FSDP hooks its
    pre-backward (gathering the weight again before the chunks are recomputed), and the weight's gradient
    accumulates into the unsharded parameter and is reduced as any other. The module tree, the parameters and
    every hook stay as they are.
    """

    def score(hidden: Tensor) -> Tensor:
        return chunked_token_logprobs(hidden, head, input_ids, temperature, chunk_size)

    head.forward = score  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        del head.forward  # the class's forward again


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


def _output_head(module: nn.Module) -> nn.Linear:
    """The head that turns a model's final hidden states into its logits, for ``loss_seq_chunk_size``: Hugging
    Face's ``get_output_embeddings()``, else an ``lm_head`` attribute; an ``nn.Linear`` whose output the model
    returns as its logits unchanged."""
    get_head = getattr(module, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else getattr(module, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(
            "loss_seq_chunk_size needs a model whose logits are an nn.Linear output head applied to its final "
            "hidden states (Hugging Face's get_output_embeddings(), or an lm_head attribute), got "
            f"{type(module).__name__} with head {type(head).__name__}"
        )
    softcap = getattr(getattr(module, "config", None), "final_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"loss_seq_chunk_size needs the logits to be the output head's result as it is; {type(module).__name__} "
            f"soft-caps them (final_logit_softcapping={softcap})"
        )
    return head


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


def _unaliased(full: dict[str, Tensor], state: Mapping[str, Any]) -> dict[str, Tensor]:
    """``full`` with a copy of every tensor that shares storage with the model's own (a DTensor's ``full_tensor``
    over a mesh of one rank is its local shard as it is, e.g. the weights outside the TP layers when ``dp`` is 1; on
    CPU ``cpu_offload`` copies nothing either): a snapshot the next optimizer step leaves alone."""
    live = set()
    for value in state.values():
        if isinstance(value, Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            live.add(local.untyped_storage().data_ptr())
    return {
        name: value.clone() if value.untyped_storage().data_ptr() in live else value for name, value in full.items()
    }


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
