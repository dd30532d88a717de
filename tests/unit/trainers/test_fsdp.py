"""FSDP2 engine on 2 CPU ranks (gloo) against a single-process reference, on a tiny random Llama.

A module-scoped fixture spawns the two ranks once; they write their results to files, then rank 0 alone reloads
the checkpoint in a world of one (DCP resharding). The tests compare the results with a plain (unsharded) model
and ``torch.optim.AdamW`` stepped in this process on the whole global batch.
Rows 0-3 of the global batch go to rank 0 and rows 4-7 to rank 1; rank 0's rows hold far more response tokens
than rank 1's (one of which has none), so any weighting by rows instead of tokens would show.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trainers.checkpoint import checkpoint_path, latest_checkpoint, prune_checkpoints
from trainers.fsdp import (
    AdamWConfig,
    FSDPPolicy,
    _shard_rows,
    chunked_token_logprobs,
    decoder_layers,
    init_process_group,
    plan_micro_batches,
    row_lengths,
    token_logprobs,
)
from trainers.grpo import _reduce_stats, train_epochs
from trainers.losses import policy_loss

WORLD_SIZE = 2
VOCAB = 32
SEQ_LEN = 10
# A large eps makes Adam's first step depend on the gradient's scale, so clipping (grad norm ~1.7) shows too.
OPTIMIZER = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-3)
GRAD_CLIP = 0.5
TEMPERATURE = 0.7
EXTRA_STATE = {"policy_version": 1, "prompt_position": 24, "step": 1}


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )


def tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config())


def token_mean_nll(*, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]):
    mask = batch["response_mask"]
    loss = -(logprobs * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"response_logprob": (logprobs * mask).sum() / mask.sum().clamp(min=1)}


def seq_mean_nll(*, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]):
    """Mean over rows with a response of each row's token-mean NLL (``seq-mean-token-mean``)."""
    mask = batch["response_mask"]
    lengths = mask.sum(-1)
    per_row = -(logprobs * mask).sum(-1) / lengths.clamp(min=1)
    return per_row.sum() / (lengths > 0).sum().clamp(min=1), {}


def make_batch(seed: int) -> dict[str, torch.Tensor]:
    """8 right-padded rows: a 2-token prompt, then responses of these lengths, then padding (id 0)."""
    response_lengths = torch.tensor([8, 7, 8, 6, 1, 2, 0, 1])
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(SEQ_LEN)
    attention_mask = (positions < 2 + response_lengths[:, None]).long()
    response_mask = ((positions >= 2) & (attention_mask == 1)).float()
    input_ids = torch.randint(1, VOCAB, (8, SEQ_LEN), generator=generator) * attention_mask
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}


def rank_rows(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    rows = batch["input_ids"].shape[0] // world_size
    return {name: value[rank * rows : (rank + 1) * rows] for name, value in batch.items()}


def manual_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature=1.0):
    """The rl-conventions alignment, spelled out: out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    out = torch.zeros(input_ids.shape)
    for t in range(1, input_ids.shape[1]):
        out[:, t] = logprobs[:, t - 1].gather(-1, input_ids[:, t : t + 1]).squeeze(-1)
    return out * attention_mask


# ---------------------------------------------------------------- what the ranks run (in spawned processes)


def _spawned(rank: int, world_size: int, ports: tuple[int, int], workdir: str) -> None:
    torch.set_num_threads(1)
    init_process_group(rank, world_size, "127.0.0.1", ports[0], backend="gloo")
    try:
        _two_ranks(rank, world_size, ports[0], Path(workdir))
    finally:
        dist.destroy_process_group()
    if rank == 0:  # reuse this process (spawning costs ~10 s of imports) for a world of one
        init_process_group(0, 1, "127.0.0.1", ports[1], backend="gloo")
        try:
            _one_rank_resume(Path(workdir))
        finally:
            dist.destroy_process_group()


def _policy(workdir: Path, micro_batch_size: int, seed: int | None = None, **kwargs) -> FSDPPolicy:
    """A policy from the shared initial weights, or (``seed``) from other random weights."""

    def build() -> LlamaForCausalLM:
        model = tiny_model(seed or 0)
        if seed is None:
            model.load_state_dict(torch.load(workdir / "init.pt"))
        return model

    return FSDPPolicy(build, optimizer=OPTIMIZER, grad_clip=GRAD_CLIP, micro_batch_size=micro_batch_size, **kwargs)


def _two_ranks(rank: int, world_size: int, port: int, workdir: Path) -> None:
    inputs = torch.load(workdir / "inputs.pt")
    batch1 = rank_rows(inputs["batch1"], rank, world_size)
    batch2 = rank_rows(inputs["batch2"], rank, world_size)
    ids, mask = batch1["input_ids"], batch1["attention_mask"]
    out: dict = {}

    policy = _policy(workdir, micro_batch_size=1)
    with _counting_reduce_scatters() as calls:
        out["metrics1"] = policy.train_step(batch1, token_mean_nll)
    out["reduce_scatters_mb1"] = calls[0]
    out["step1"] = policy.full_state_dict()
    with torch.no_grad():
        out["logits"] = policy.model(input_ids=ids, attention_mask=mask).logits
    out["logprobs"] = policy.compute_logprobs(ids, mask, temperature=TEMPERATURE)
    policy.save_hf_pretrained(workdir / "hf")
    _seed_everything(100 + rank)  # different per rank, to see that each rank gets its own state back
    policy.save_checkpoint(checkpoint_path(workdir / "ckpt", 1), EXTRA_STATE)
    out["rng_after_save"] = _draw_rng()
    out["metrics2"] = policy.train_step(batch2, token_mean_nll)
    out["step2"] = policy.full_state_dict()

    policy_mb4 = _policy(workdir, micro_batch_size=4)
    with _counting_reduce_scatters() as calls, _saved_for_backward() as kept:
        policy_mb4.train_step(batch1, token_mean_nll)
    out["reduce_scatters_mb4"], out["saved_bytes_mb4"] = calls[0], kept[0]
    out["step1_mb4"] = policy_mb4.full_state_dict()

    # gradient checkpointing: the decoder layers recomputed in the backward, the same update
    checkpointed = _policy(workdir, micro_batch_size=4, gradient_checkpointing=True)
    with _saved_for_backward() as kept:
        checkpointed.train_step(batch1, token_mean_nll)
    out["saved_bytes_checkpointed"] = kept[0]
    out["step1_checkpointed"] = checkpointed.full_state_dict()

    # small layers sharded with the root: one FSDP unit, one reduce-scatter, the same update
    one_unit = _policy(workdir, micro_batch_size=1, min_layer_params=10**9, reshard_after_forward=False)
    with _counting_reduce_scatters() as calls:
        out["metrics1_one_unit"] = one_unit.train_step(batch1, token_mean_nll)
    out["reduce_scatters_one_unit"] = calls[0]
    out["units_one_unit"], out["units_per_layer"] = len(one_unit.units), len(policy.units)
    out["step1_one_unit"] = one_unit.full_state_dict()

    # a frozen reference: a copy of step 1's weights, saved and reloaded into other random weights
    reference = FSDPPolicy(lambda: tiny_model(0), micro_batch_size=4, trainable=False)
    reference.load_weights(checkpoint_path(workdir / "ckpt", 1))
    reference.save_checkpoint(workdir / "reference", {"reference": True})
    reference.save_checkpoint(workdir / "reference", {"reference": True}, overwrite=True)
    reloaded = FSDPPolicy(lambda: tiny_model(5), micro_batch_size=4, trainable=False, sync_module_states=False)
    reloaded.load_weights(workdir / "reference")
    out["reference_weights"] = reloaded.full_state_dict()
    out["reference_optimizer"] = reloaded.optimizer
    out["reference_requires_grad"] = any(p.requires_grad for p in reloaded.model.parameters())
    out["reference_logprobs"] = reloaded.compute_logprobs(ids, mask)

    policy_rows = _policy(workdir, micro_batch_size=1, loss_weighting="rows")
    policy_rows.train_step(batch1, seq_mean_nll)
    out["step1_rows"] = policy_rows.full_state_dict()

    resumed = _policy(workdir, micro_batch_size=1, seed=1)  # as the uninterrupted run, to compare bitwise
    out["fresh"] = resumed.full_state_dict()
    _seed_everything(7)
    out["extra_state"] = resumed.load_checkpoint(latest_checkpoint(workdir / "ckpt"))
    out["rng_after_load"] = _draw_rng()
    out["resumed_step1"] = resumed.full_state_dict()
    resumed.train_step(batch2, token_mean_nll)
    out["resumed_step2"] = resumed.full_state_dict()

    out["errors"] = _errors(rank, world_size, port, resumed, batch1)
    before = resumed.full_state_dict()
    out["nan_metrics"] = resumed.train_step(batch1, nan_loss)
    after = resumed.full_state_dict()  # a collective: every rank calls it, only rank 0 gets tensors
    out["nan_unchanged"] = after.keys() == before.keys() and all(torch.equal(v, before[k]) for k, v in after.items())
    out.update(_staged_saves(rank, resumed, workdir / "staged"))

    # dynamic_batching: micro-batches packed to a token budget; rank 0's rows are long, rank 1's short, so the
    # ranks plan different micro-batch counts
    out.update(_dynamic_batching(rank, workdir, batch1))

    # ---- loss_seq_chunk_size: the head and log-softmax run over sequence chunks, recomputed in the backward
    chunked = _policy(workdir, micro_batch_size=4, loss_seq_chunk_size=3)
    chunked.train_step(batch1, token_mean_nll)
    out["seq_chunk_step1"] = chunked.full_state_dict()
    out["seq_chunk_logprobs"] = chunked.compute_logprobs(ids, mask, temperature=TEMPERATURE)
    out["seq_chunk_logprobs_unchunked"] = policy_mb4.compute_logprobs(ids, mask, temperature=TEMPERATURE)
    out.update(_seq_chunk_long_sequence(rank))
    out.update(_seq_chunk_other_models(ids, mask))

    # ---- ppo_epochs (trainers.grpo.train_epochs): two optimizer steps on one batch, both against the old
    # log-probs of the policy before the first (as the GRPO trainer recomputes them), each at its own learning rate
    epochs_policy = _policy(workdir, micro_batch_size=4)
    grpo_batch = {
        **batch1,
        "old_logprobs": epochs_policy.compute_logprobs(ids, mask),
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
    }
    out["ppo_epochs_metrics"] = train_epochs(
        epochs_policy, grpo_batch, grpo_loss, lrs=[OPTIMIZER.lr, OPTIMIZER.lr / 2], temperature=1.0
    )
    optimizer_state = next(iter(epochs_policy.require_optimizer("test").state.values()))
    out["ppo_epochs_adam_steps"] = float(optimizer_state["step"])

    # ---- activation_offloading: the training forward's saved tensors go to save_on_cpu's hooks (on a CPU device,
    # where they stay: nothing moves), the same update
    offloaded = _policy(workdir, micro_batch_size=4, activation_offloading=True)
    with _saved_for_backward() as kept:  # the innermost hooks take the saved tensors: offloading's, if it is on
        offloaded.train_step(batch1, token_mean_nll)
    out["activation_offloading_saved_bytes_outside"] = kept[0]
    out["activation_offloading_step1"] = offloaded.full_state_dict()

    # ---- tp_size=2: the two ranks are one TP group (dp 1), so both train on the whole global batch
    out.update(_tensor_parallel(workdir, inputs, policy_mb4))
    torch.save(out, workdir / f"two_ranks.rank{rank}.pt")


def _tensor_parallel(workdir: Path, inputs: dict, data_parallel: FSDPPolicy) -> dict:
    """Two steps of a ``tp_size=2`` policy on the whole global batches (both ranks the same rows), its log-probs,
    HF export and checkpoint (reloaded into a ``tp_size=1`` policy on the same two ranks, which then takes the second
    step on its DP share), and the refusals (``tp_*`` keys)."""
    out: dict = {}
    batch1, batch2 = inputs["batch1"], inputs["batch2"]
    ids, mask = batch1["input_ids"], batch1["attention_mask"]
    tp = _policy(workdir, micro_batch_size=4, tp_size=2)  # 8 rows: two micro-batches, accumulated
    out["tp_dp_size_rank"] = (tp.dp_size, tp.dp_rank)
    out["tp_metrics1"] = tp.train_step(batch1, token_mean_nll)
    out["tp_step1"] = tp.full_state_dict()
    out["tp_logprobs"] = tp.compute_logprobs(ids, mask, temperature=TEMPERATURE)
    out["tp_placements"] = sorted(
        {str(p.placements) for p in tp.model.parameters() if isinstance(p, torch.distributed.tensor.DTensor)}
    )
    tp.save_hf_pretrained(workdir / "hf_tp")
    tp.save_checkpoint(checkpoint_path(workdir / "ckpt_tp", 1), EXTRA_STATE)
    out["tp_metrics2"] = tp.train_step(batch2, token_mean_nll)
    out["tp_step2"] = tp.full_state_dict()
    resumed = _policy(workdir, micro_batch_size=1, seed=1)  # tp_size=1: 2 DP ranks
    resumed.load_checkpoint(checkpoint_path(workdir / "ckpt_tp", 1))
    resumed.train_step(rank_rows(batch2, dist.get_rank(), WORLD_SIZE), token_mean_nll)
    out["tp_resumed_as_dp_step2"] = resumed.full_state_dict()
    out["dp_logprobs_full_batch"] = data_parallel.compute_logprobs(ids, mask, temperature=TEMPERATURE)

    def heads(n: int) -> LlamaForCausalLM:
        config = tiny_config()
        config.num_attention_heads = config.num_key_value_heads = n
        return LlamaForCausalLM(config)

    # with the other ways of computing the same update: recomputed layers, chunked head, packed micro-batches
    combined = _policy(workdir, micro_batch_size=4, tp_size=2, gradient_checkpointing=True, loss_seq_chunk_size=3)
    combined.train_step(batch1, token_mean_nll)
    out["tp_checkpointed_chunked_step1"] = combined.full_state_dict()
    packed = _policy(workdir, micro_batch_size=1, tp_size=2, dynamic_batching=True, max_tokens_per_micro_batch=20)
    packed.train_step(batch1, token_mean_nll)
    out["tp_dynamic_batching_step1"] = packed.full_state_dict()

    # the GRPO trainer's step counters: both ranks of the TP group read the same 4 rows (3 scored, reward 2)
    counters = {"rows": 4.0, "scored_rows": 3.0, "reward_sum": 2.0, "correct_sum": 1.0, "trained_rows": 4.0}
    counters |= {"failed_rows": 1.0, "stale_rows": 0.0, "staleness_sum": 0.0, "response_len_sum": 8.0}
    out["tp_reduced_stats"] = _reduce_stats(counters, torch.device("cpu"), tp_size=2)
    out["tp_reduced_stats_as_dp"] = _reduce_stats(counters, torch.device("cpu"))

    refused = {
        "tp_3": lambda: _policy(workdir, micro_batch_size=1, tp_size=3),
        "tp_not_llama": lambda: FSDPPolicy(nn.Linear(2, 2), tp_size=2),
        "tp_no_mlp": lambda: FSDPPolicy(_without_mlp(tiny_model(0)), tp_size=2),
        "tp_odd_heads": lambda: FSDPPolicy(lambda: heads(1), tp_size=2),
    }
    for name, build in refused.items():
        try:
            build()
            out[name] = ""
        except ValueError as error:
            out[name] = f"ValueError: {error}"
    return out


def _without_mlp(model: LlamaForCausalLM) -> LlamaForCausalLM:
    for layer in model.model.layers:
        layer.mlp = nn.Identity()
    return model


SEQ_CHUNK_VOCAB, SEQ_CHUNK_LEN, SEQ_CHUNK_SIZE = 4096, 96, 16


def _seq_chunk_long_sequence(rank: int) -> dict:
    """A train step with and without ``loss_seq_chunk_size`` on a larger-vocabulary model and a longer sequence,
    where the ``[B, T, V]`` logits are most of what the backward keeps: the bytes kept, and the weights after."""

    def build() -> LlamaForCausalLM:
        torch.manual_seed(0)
        config = tiny_config()
        config.vocab_size, config.max_position_embeddings = SEQ_CHUNK_VOCAB, SEQ_CHUNK_LEN
        return LlamaForCausalLM(config)

    generator = torch.Generator().manual_seed(20 + rank)
    input_ids = torch.randint(1, SEQ_CHUNK_VOCAB, (4, SEQ_CHUNK_LEN), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, SEQ_CHUNK_LEN // 2 :] = 0  # one right-padded row
    response_mask = attention_mask.float()
    response_mask[:, :4] = 0  # a 4-token prompt
    batch = {"input_ids": input_ids * attention_mask, "attention_mask": attention_mask, "response_mask": response_mask}
    out: dict = {}
    for name, chunk_size in (("unchunked", None), ("chunked", SEQ_CHUNK_SIZE)):
        policy = FSDPPolicy(build, optimizer=OPTIMIZER, micro_batch_size=4, loss_seq_chunk_size=chunk_size)
        with _saved_for_backward() as kept:
            policy.train_step(batch, token_mean_nll, temperature=TEMPERATURE)
        out[f"seq_chunk_long_saved_bytes_{name}"] = kept[0]
        out[f"seq_chunk_long_step1_{name}"] = policy.full_state_dict()
    return out


class _TinyNonHFLM(nn.Module):
    """Not a Hugging Face model, but its logits are its ``lm_head`` applied to its last hidden states."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, attention_mask, position_ids):
        return self.lm_head(torch.tanh(self.mix(self.embed(input_ids))))


def _seq_chunk_other_models(ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """A non-HF model with an ``lm_head`` scores the same tokens chunked; one without is refused up front."""
    out: dict = {}
    for name, chunk_size in (("unchunked", None), ("chunked", 4)):
        policy = FSDPPolicy(_TinyNonHFLM, trainable=False, loss_seq_chunk_size=chunk_size)
        out[f"seq_chunk_non_hf_logprobs_{name}"] = policy.compute_logprobs(ids, mask, temperature=TEMPERATURE)
    try:
        FSDPPolicy(nn.Linear(2, 2), loss_seq_chunk_size=4)
        out["seq_chunk_no_head_error"] = ""
    except ValueError as error:
        out["seq_chunk_no_head_error"] = str(error)
    return out


@contextlib.contextmanager
def _saved_for_backward():
    """Bytes of the tensors autograd keeps for the backward (outside checkpointed regions, which keep none)."""
    kept = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield kept


def _staged_saves(rank: int, policy: FSDPPolicy, root: Path) -> dict:
    """A caller's files staged into a checkpoint (rank 0's ``stage``) commit with it, or not at all."""

    def write(staging: Path) -> str:
        (staging / "queue").mkdir()
        (staging / "queue" / "CURRENT").write_text("ckpt-0")
        return "staged"

    def fail(staging: Path) -> None:
        (staging / "queue").mkdir()
        raise OSError("disk full")

    out = {"staged": policy.save_checkpoint(checkpoint_path(root, 1), {"n": 1}, stage=write if rank == 0 else None)}
    try:
        policy.save_checkpoint(checkpoint_path(root, 1), {"n": 2}, overwrite=True, stage=fail if rank == 0 else None)
        out["failed_save"] = ""
    except Exception as exc:  # every rank raises: none waits for rank 0 forever
        out["failed_save"] = f"{type(exc).__name__}: {exc}"
    return out


def _one_rank_resume(workdir: Path) -> None:
    """Reload the 2-rank checkpoint on 1 rank (DCP reshards model and optimizer) and take step 2."""
    inputs = torch.load(workdir / "inputs.pt")
    policy = _policy(workdir, micro_batch_size=4, seed=1)
    out = {"extra_state": policy.load_checkpoint(checkpoint_path(workdir / "ckpt", 1))}
    out["metrics2"] = policy.train_step(inputs["batch2"], token_mean_nll)
    out["step2"] = policy.full_state_dict()
    torch.save(out, workdir / "one_rank.pt")


def _errors(rank: int, world_size: int, port: int, policy: FSDPPolicy, batch: dict) -> dict[str, str]:
    """Messages of the errors raised on bad input (identically on every rank, so no rank hangs)."""
    calls = {
        "same_init": lambda: init_process_group(rank, world_size, "127.0.0.1", port, backend="gloo"),
        "other_init": lambda: init_process_group(rank, world_size + 1, "127.0.0.1", port, backend="gloo"),
        "missing_key": lambda: policy.train_step({"input_ids": batch["input_ids"]}, token_mean_nll),
        "uneven_ranks": lambda: policy.train_step(rank_rows(batch, 0, 2 + rank), token_mean_nll),
        "temperature_0": lambda: policy.compute_logprobs(batch["input_ids"], batch["attention_mask"], 0.0),
        "checkpointing_not_hf": lambda: FSDPPolicy(nn.Linear(2, 2), gradient_checkpointing=True),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = ""
        except (ValueError, RuntimeError) as error:
            errors[name] = f"{type(error).__name__}: {error}"
    return errors


@contextlib.contextmanager
def _counting_reduce_scatters():
    """Count FSDP2's gradient reduce-scatters (``dist.reduce_scatter_single``) inside the block."""
    calls = [0]
    original = dist.reduce_scatter_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counted
    try:
        yield calls
    finally:
        dist.reduce_scatter_single = original


DYNAMIC_BUDGET = 12  # tokens: rank 0's rows (8-10 tokens) one per micro-batch, rank 1's (2-4 tokens) up to three


def _dynamic_batching(rank: int, workdir: Path, batch: dict[str, torch.Tensor]) -> dict:
    """One step and log-probs with dynamic batching, what each micro-batch held and how many tokens went through
    the model (``dynamic_batching_*`` keys)."""
    out: dict = {}
    ids, mask = batch["input_ids"], batch["attention_mask"]
    seen: list[tuple[list[int], tuple[int, ...], tuple[int, ...]]] = []

    def recording_loss(*, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]):
        seen.append((batch["row_ids"].tolist(), tuple(batch["input_ids"].shape), tuple(batch["response_mask"].shape)))
        return token_mean_nll(logprobs=logprobs, batch=batch)

    policy = _policy(workdir, micro_batch_size=1, dynamic_batching=True, max_tokens_per_micro_batch=DYNAMIC_BUDGET)
    row_ids = torch.arange(ids.shape[0])  # a [B] tensor: split by rows, never trimmed
    with _counting_forward_tokens(policy.model) as tokens:
        out["dynamic_batching_metrics"] = policy.train_step({**batch, "row_ids": row_ids}, recording_loss)
    out["dynamic_batching_train_counts"] = policy.micro_batch_counts
    out["dynamic_batching_train_tokens"] = tokens[0]
    out["dynamic_batching_seen"] = seen
    out["dynamic_batching_step1"] = policy.full_state_dict()
    with _counting_forward_tokens(policy.model) as tokens:
        out["dynamic_batching_logprobs"] = policy.compute_logprobs(ids, mask, temperature=TEMPERATURE)
    out["dynamic_batching_logprob_counts"] = policy.micro_batch_counts
    out["dynamic_batching_logprob_tokens"] = tokens[0]
    policy.dynamic_batching = False  # the same weights, micro-batches of one full-width row
    out["dynamic_batching_fixed_logprobs"] = policy.compute_logprobs(ids, mask, temperature=TEMPERATURE)
    policy.dynamic_batching = True
    mine = slice(None) if rank == 0 else slice(0)  # rank 1 has no rows: filler passes only
    out["dynamic_batching_no_rows"] = policy.compute_logprobs(ids[mine], mask[mine], temperature=TEMPERATURE)
    out["dynamic_batching_no_rows_counts"] = policy.micro_batch_counts
    try:
        policy.train_step({name: value[mine] for name, value in batch.items()}, token_mean_nll)
        out["dynamic_batching_no_rows_train"] = ""
    except ValueError as error:
        out["dynamic_batching_no_rows_train"] = f"ValueError: {error}"
    try:
        _policy(workdir, micro_batch_size=1, dynamic_batching=True, max_tokens_per_micro_batch=0)
        out["dynamic_batching_bad_budget"] = ""
    except ValueError as error:
        out["dynamic_batching_bad_budget"] = f"ValueError: {error}"
    return out


@contextlib.contextmanager
def _counting_forward_tokens(model: nn.Module):
    """Tokens (``input_ids`` elements, padding included) the model's forward computes inside the block."""
    tokens = [0]

    def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
        tokens[0] += kwargs["input_ids"].numel()

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield tokens
    finally:
        handle.remove()


def grpo_loss(*, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]):
    return policy_loss("grpo", logprobs, batch["old_logprobs"], batch["advantages"], batch["response_mask"])


def nan_loss(*, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]):
    loss, metrics = token_mean_nll(logprobs=logprobs, batch=batch)
    return loss * float("nan"), metrics


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _draw_rng() -> tuple:
    return torch.rand(3), np.random.rand(3), random.random()


# ---------------------------------------------------------------- the single-process reference and the fixture


def _free_ports(count: int) -> tuple[int, ...]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:  # all bound at once, so the ports differ
        sock.bind(("127.0.0.1", 0))
    ports = tuple(sock.getsockname()[1] for sock in sockets)
    for sock in sockets:
        sock.close()
    return ports


def _reference_steps(init: dict, batches: list[dict], loss_fn=token_mean_nll) -> list[dict]:
    """Plain model + AdamW, one step per global batch: returns loss, grad norm and weights after each step."""
    model = tiny_model(0)
    model.load_state_dict(init)
    cfg = OPTIMIZER
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=cfg.eps
    )
    steps = []
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        logprobs = torch.nn.functional.pad(logprobs, (1, 0)) * batch["attention_mask"]
        loss, _ = loss_fn(logprobs=logprobs, batch=batch)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad()
        weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
        steps.append({"loss": loss.item(), "grad_norm": grad_norm.item(), "weights": weights})
    return steps


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fsdp")
    init = tiny_model(0).state_dict()
    batches = {"batch1": make_batch(1), "batch2": make_batch(2)}
    torch.save(init, workdir / "init.pt")
    torch.save(batches, workdir / "inputs.pt")
    mp.spawn(_spawned, args=(WORLD_SIZE, _free_ports(2), str(workdir)), nprocs=WORLD_SIZE, join=True)
    ranks = [torch.load(workdir / f"two_ranks.rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]
    return {
        "workdir": workdir,
        "init": init,
        "ranks": ranks,
        "reference": _reference_steps(init, [batches["batch1"], batches["batch2"]]),
        "reference_rows": _reference_steps(init, [batches["batch1"]], loss_fn=seq_mean_nll)[0],
        **batches,
    }


def assert_weights_close(actual: dict, expected: dict, atol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- the tests


def test_train_step_matches_single_process_adamw(run):
    reference, rank0 = run["reference"][0], run["ranks"][0]
    assert_weights_close(rank0["step1"], reference["weights"])
    assert not torch.allclose(rank0["step1"]["model.norm.weight"], run["init"]["model.norm.weight"], atol=1e-3)
    for rank in run["ranks"]:  # metrics are global, and the same on every rank
        assert rank["metrics1"]["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert rank["metrics1"]["response_logprob"] == pytest.approx(-reference["loss"], rel=1e-5)
        assert rank["metrics1"]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
        assert rank["metrics1"]["lr"] == OPTIMIZER.lr
        assert rank["metrics1"]["skipped"] == 0.0
    assert reference["grad_norm"] > GRAD_CLIP  # so clipping took part


def test_micro_batching_gives_the_same_update(run):
    rank0 = run["ranks"][0]
    assert_weights_close(rank0["step1_mb4"], rank0["step1"], atol=1e-6)


def test_gradient_checkpointing_gives_the_same_update_keeping_fewer_activations(run):
    rank0 = run["ranks"][0]
    assert_weights_close(rank0["step1_checkpointed"], rank0["step1_mb4"], atol=1e-6)
    assert rank0["saved_bytes_checkpointed"] < 0.5 * rank0["saved_bytes_mb4"], (
        rank0["saved_bytes_checkpointed"],
        rank0["saved_bytes_mb4"],
    )


def test_rows_weighting_is_exact_for_a_sequence_mean_loss(run):
    assert_weights_close(run["ranks"][0]["step1_rows"], run["reference_rows"]["weights"])


def test_full_state_dict_loads_into_an_unsharded_model(run):
    assert run["ranks"][1]["step1"] == {}  # only rank 0 receives it
    model = tiny_model(3)
    model.load_state_dict(run["ranks"][0]["step1"], strict=True)
    for rank, result in enumerate(run["ranks"]):
        batch = rank_rows(run["batch1"], rank, WORLD_SIZE)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        torch.testing.assert_close(logits, result["logits"], atol=1e-5, rtol=1e-5)


def test_save_hf_pretrained_writes_a_loadable_directory(run):
    model = LlamaForCausalLM.from_pretrained(run["workdir"] / "hf")
    assert_weights_close(model.state_dict(), run["ranks"][0]["step1"], atol=0)


def test_checkpoint_restores_weights_optimizer_rng_and_extra_state(run):
    rank0 = run["ranks"][0]
    assert not torch.equal(rank0["fresh"]["model.norm.weight"], rank0["step1"]["model.norm.weight"])
    assert_weights_close(rank0["resumed_step1"], rank0["step1"], atol=0)
    # The next step matches the uninterrupted run, so Adam's moments and step count came back.
    assert_weights_close(rank0["resumed_step2"], rank0["step2"], atol=0)
    assert_weights_close(rank0["step2"], run["reference"][1]["weights"])
    for result in run["ranks"]:
        assert result["extra_state"] == EXTRA_STATE
        torch.testing.assert_close(result["rng_after_load"][0], result["rng_after_save"][0], atol=0, rtol=0)
        np.testing.assert_array_equal(result["rng_after_load"][1], result["rng_after_save"][1])
        assert result["rng_after_load"][2] == result["rng_after_save"][2]
    assert not torch.equal(run["ranks"][0]["rng_after_save"][0], run["ranks"][1]["rng_after_save"][0])  # per rank


def test_files_staged_by_rank_0_commit_with_the_checkpoint_or_not_at_all(run):
    root = run["workdir"] / "staged"
    assert [r["staged"] for r in run["ranks"]] == ["staged", None]  # what rank 0's stage returned
    assert (checkpoint_path(root, 1) / "queue" / "CURRENT").read_text() == "ckpt-0"
    assert run["ranks"][0]["failed_save"] == "OSError: disk full"
    assert run["ranks"][1]["failed_save"] == (
        f"RuntimeError: saving checkpoint {checkpoint_path(root, 1)} failed on rank 0: OSError: disk full"
    )
    # the failed overwrite left the first save as it was
    assert latest_checkpoint(root) == checkpoint_path(root, 1)
    assert json.loads((checkpoint_path(root, 1) / "checkpoint.json").read_text())["extra_state"] == {"n": 1}


def test_checkpoint_reloads_on_another_world_size(run):
    result = torch.load(run["workdir"] / "one_rank.pt", weights_only=False)
    assert result["extra_state"] == EXTRA_STATE
    assert result["metrics2"]["loss"] == pytest.approx(run["reference"][1]["loss"], rel=1e-5)
    assert_weights_close(result["step2"], run["ranks"][0]["step2"])


def test_checkpoint_directory_is_atomic(run):
    root = run["workdir"] / "ckpt"
    assert latest_checkpoint(root) == checkpoint_path(root, 1)
    assert not any(p.name.endswith(".tmp") for p in root.iterdir())
    # A half-written checkpoint (as a crash would leave it) and an unrelated directory are never "latest".
    (root / ".step_00000002.tmp" / "dcp").mkdir(parents=True)
    (root / "step_00000003").mkdir()
    assert latest_checkpoint(root) == checkpoint_path(root, 1)
    assert latest_checkpoint(run["workdir"] / "missing") is None


def test_gradients_are_reduced_once_per_step_not_per_micro_batch(run):
    for result in run["ranks"]:
        # 4 micro-batches of one row accumulate locally: as many reduce-scatters as one micro-batch of four
        assert result["reduce_scatters_mb1"] == result["reduce_scatters_mb4"] > 0
    assert_weights_close(run["ranks"][0]["step1_mb4"], run["ranks"][0]["step1"], atol=1e-6)


def test_layers_below_min_layer_params_share_the_root_unit_and_give_the_same_update(run):
    reference = run["reference"][0]
    assert_weights_close(run["ranks"][0]["step1_one_unit"], reference["weights"])
    for result in run["ranks"]:
        assert result["units_per_layer"] == 2 and result["units_one_unit"] == 0
        # one unit: one reduce-scatter per step instead of one per layer plus the root's
        assert result["reduce_scatters_one_unit"] == 1 < result["reduce_scatters_mb1"] == 3
        assert result["metrics1_one_unit"]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)


def test_a_frozen_reference_has_no_optimizer_and_round_trips_its_weights(run):
    rank0 = run["ranks"][0]
    assert_weights_close(rank0["reference_weights"], rank0["step1"], atol=0)
    for result in run["ranks"]:
        assert result["reference_optimizer"] is None
        assert not result["reference_requires_grad"]
    assert latest_checkpoint(run["workdir"]) == run["workdir"] / "reference"  # the overwrite left one, complete
    assert not [p.name for p in run["workdir"].iterdir() if p.name.startswith(".reference")]
    model = tiny_model(3)
    model.load_state_dict(rank0["step1"])
    batch = rank_rows(run["batch1"], 0, WORLD_SIZE)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = manual_logprobs(logits, batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(rank0["reference_logprobs"], expected, atol=1e-5, rtol=1e-5)


def test_compute_logprobs_is_aligned_with_input_ids(run):
    for rank, result in enumerate(run["ranks"]):
        batch = rank_rows(run["batch1"], rank, WORLD_SIZE)
        expected = manual_logprobs(result["logits"], batch["input_ids"], batch["attention_mask"], TEMPERATURE)
        torch.testing.assert_close(result["logprobs"], expected, atol=1e-5, rtol=1e-5)
        assert result["logprobs"].dtype == torch.float32
        assert (result["logprobs"][:, 0] == 0).all()
        assert (result["logprobs"][batch["attention_mask"] == 0] == 0).all()
        assert (result["logprobs"][batch["attention_mask"][:, 1:].bool().nonzero(as_tuple=True)[0], :] != 0).any()


def test_bad_input_raises_the_same_error_on_every_rank(run):
    for rank, result in enumerate(run["ranks"]):
        errors = result["errors"]
        assert errors["same_init"] == ""  # idempotent
        assert errors["other_init"] == (
            f"RuntimeError: process group already initialised with (rank, world_size, backend)=({rank}, 2, 'gloo'), "
            f"asked for ({rank}, 3, 'gloo')"
        )
        assert errors["missing_key"] == (
            "ValueError: batch is missing ['attention_mask', 'response_mask']; has ['input_ids']"
        )
        assert errors["uneven_ranks"] == (
            "ValueError: ranks disagree on the number of micro-batches (between 1 and 2; "
            f"this rank has {2 - rank} rows at micro_batch_size=1): give every rank the same number of rows"
        )
        assert errors["temperature_0"].startswith("ValueError: temperature must be > 0 to score tokens, got 0.0")
        assert errors["checkpointing_not_hf"] == (
            "ValueError: gradient_checkpointing needs a Hugging Face model (its gradient_checkpointing_enable), "
            "got Linear"
        )


def test_a_non_finite_gradient_skips_the_update(run):
    for result in run["ranks"]:
        assert result["nan_metrics"]["skipped"] == 1.0
        assert not np.isfinite(result["nan_metrics"]["grad_norm"])
        assert result["nan_unchanged"]


def test_loss_seq_chunk_size_gives_the_same_update_and_logprobs(run):
    rank0 = run["ranks"][0]
    assert_weights_close(rank0["seq_chunk_step1"], rank0["step1_mb4"], atol=1e-6)
    for result in run["ranks"]:
        torch.testing.assert_close(
            result["seq_chunk_logprobs"], result["seq_chunk_logprobs_unchunked"], atol=1e-5, rtol=1e-5
        )
        non_hf = result["seq_chunk_non_hf_logprobs_chunked"], result["seq_chunk_non_hf_logprobs_unchunked"]
        torch.testing.assert_close(*non_hf, atol=1e-6, rtol=0)


def test_loss_seq_chunk_size_keeps_far_fewer_bytes_for_a_long_sequence(run):
    rank0 = run["ranks"][0]
    assert_weights_close(rank0["seq_chunk_long_step1_chunked"], rank0["seq_chunk_long_step1_unchunked"], atol=1e-6)
    chunked, unchunked = (rank0[f"seq_chunk_long_saved_bytes_{name}"] for name in ("chunked", "unchunked"))
    logits_bytes = 4 * (SEQ_CHUNK_LEN - 1) * SEQ_CHUNK_VOCAB * 4  # one float32 [B, T - 1, V]
    assert unchunked - chunked >= logits_bytes, (chunked, unchunked)


def test_loss_seq_chunk_size_refuses_a_model_without_an_output_head(run):
    assert run["ranks"][0]["seq_chunk_no_head_error"] == (
        "loss_seq_chunk_size needs a model whose logits are an nn.Linear output head applied to its final hidden "
        "states (Hugging Face's get_output_embeddings(), or an lm_head attribute), got Linear with head NoneType"
    )


@pytest.mark.parametrize("seq_len, chunk_size", [(9, 1), (9, 3), (9, 5), (9, 8), (9, 100), (1, 4)])
def test_chunked_token_logprobs_equal_the_whole_sequences_values_and_gradients(seq_len, chunk_size):
    torch.manual_seed(0)
    hidden = torch.randn(3, seq_len, 8, requires_grad=True)
    head = nn.Linear(8, VOCAB)
    input_ids = torch.randint(0, VOCAB, (3, seq_len))
    expected = token_logprobs(head(hidden), input_ids, torch.ones_like(input_ids), TEMPERATURE)
    actual = chunked_token_logprobs(hidden, head, input_ids, TEMPERATURE, chunk_size)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)
    grads = [torch.autograd.grad(out.sum(), (hidden, head.weight, head.bias)) for out in (actual, expected)]
    for chunked_grad, whole_grad in zip(*grads, strict=True):
        torch.testing.assert_close(chunked_grad, whole_grad, atol=1e-6, rtol=0)
    with torch.no_grad():  # without gradients the chunks run as they are (nothing to recompute): the same values
        unrecorded = chunked_token_logprobs(hidden, head, input_ids, TEMPERATURE, chunk_size)
    torch.testing.assert_close(unrecorded, expected.detach(), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="chunk_size=0 must be >= 1"):
        chunked_token_logprobs(hidden, head, input_ids, TEMPERATURE, 0)


def test_ppo_epochs_take_one_optimizer_step_each_against_the_same_old_logprobs(run):
    for result in run["ranks"]:
        first, second = result["ppo_epochs_metrics"]
        assert result["ppo_epochs_adam_steps"] == 2.0  # AdamW stepped twice on the one batch
        assert [first["lr"], second["lr"]] == [OPTIMIZER.lr, OPTIMIZER.lr / 2]
        # the first epoch's policy is the old one; the second's moved away from it after the first update
        assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and first["approx_kl"] == pytest.approx(0, abs=1e-9)
        assert abs(second["ratio_mean"] - 1.0) > 1e-3 and second["approx_kl"] > 1e-5, second
        assert second["loss"] < first["loss"]  # a second pass on the batch improved its surrogate further


def test_activation_offloading_gives_the_same_update_through_save_on_cpu(run):
    rank0 = run["ranks"][0]
    assert_weights_close(rank0["activation_offloading_step1"], rank0["step1_mb4"], atol=0)
    for result in run["ranks"]:
        # the saved tensors went to save_on_cpu's hooks, none to the hooks around train_step (all of them without)
        assert result["activation_offloading_saved_bytes_outside"] == 0 < result["saved_bytes_mb4"]


# ---------------------------------------------------------------- tp_size (tensor parallel within the two ranks)


def test_tensor_parallel_gives_the_single_process_update_and_logprobs(run):
    reference, rank0 = run["reference"], run["ranks"][0]
    # gloo sums the row-wise layers' partial outputs in another order than one matmul: float rounding only
    assert_weights_close(rank0["tp_step1"], reference[0]["weights"], atol=1e-5)
    assert_weights_close(rank0["tp_step2"], reference[1]["weights"], atol=1e-5)
    for result in run["ranks"]:
        assert result["tp_dp_size_rank"] == (1, 0)  # one TP group: DP rank 0 of 1 on both ranks
        # metrics count the TP group's rows once, and the grad norm spans both meshes' gradients
        assert result["tp_metrics1"]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-5)
        assert result["tp_metrics1"]["grad_norm"] == pytest.approx(reference[0]["grad_norm"], rel=1e-5)
        assert result["tp_metrics2"]["loss"] == pytest.approx(reference[1]["loss"], rel=1e-5)
        # the same log-probs on both ranks as the DP policy's on the whole batch, after the same step
        torch.testing.assert_close(result["tp_logprobs"], rank0["dp_logprobs_full_batch"], atol=1e-5, rtol=0)
    # the decoder layers' linear weights are 2-D DTensors, FSDP over dp (of 1) and split over tp (row-wise ones on
    # their input dimension); the other weights FSDP over dp only
    assert rank0["tp_placements"] == [
        "(Shard(dim=0), Shard(dim=1))",
        "(Shard(dim=0),)",
        "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
    ]


def test_tensor_parallel_composes_with_checkpointing_chunked_scoring_and_dynamic_batching(run):
    rank0 = run["ranks"][0]
    assert_weights_close(rank0["tp_checkpointed_chunked_step1"], rank0["tp_step1"], atol=1e-6)
    assert_weights_close(rank0["tp_dynamic_batching_step1"], rank0["tp_step1"], atol=1e-6)


def test_tensor_parallel_exports_full_weights_and_its_checkpoint_reloads_without_tp(run):
    rank0 = run["ranks"][0]
    assert run["ranks"][1]["tp_step1"] == {}  # only rank 0 receives them, as without TP
    model = LlamaForCausalLM.from_pretrained(run["workdir"] / "hf_tp")
    assert_weights_close(model.state_dict(), rank0["tp_step1"], atol=0)
    # DCP resharded the 2-D (dp, tp) weights and Adam's moments onto 2 DP ranks: the same second step
    assert_weights_close(rank0["tp_resumed_as_dp_step2"], rank0["tp_step2"], atol=1e-5)


def test_the_grpo_trainers_step_counters_count_a_tp_groups_rows_once(run):
    for result in run["ranks"]:
        stats, as_dp = result["tp_reduced_stats"], result["tp_reduced_stats_as_dp"]
        assert (stats["rows"], stats["trained_rows"], stats["failed_rows"]) == (4.0, 4.0, 1.0)
        assert stats["reward"] == pytest.approx(2 / 3) and stats["response_len"] == 2.0
        assert (as_dp["rows"], as_dp["reward"]) == (8.0, pytest.approx(2 / 3))  # two DP ranks' rows: both count


def test_tensor_parallel_refuses_what_it_cannot_split(run):
    needed = (
        "a Llama-style Hugging Face model (model.model.layers, each with self_attn.q_proj, self_attn.k_proj, "
        "self_attn.v_proj, self_attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)"
    )
    for result in run["ranks"]:
        assert result["tp_3"] == "ValueError: tp_size=3 must be an int >= 1 that divides the world size 2"
        assert result["tp_not_llama"] == f"ValueError: tp_size=2 needs {needed}; got Linear without model.model.layers"
        assert result["tp_no_mlp"] == (
            f"ValueError: tp_size=2 needs {needed}; layer 0 of LlamaForCausalLM has no nn.Linear mlp.gate_proj, "
            "mlp.up_proj, mlp.down_proj"
        )
        assert result["tp_odd_heads"] == (
            "ValueError: tp_size=2 must divide the model's num_attention_heads, num_key_value_heads and "
            "intermediate_size (each TP rank takes an equal share of them); got num_attention_heads=1, "
            "num_key_value_heads=1, intermediate_size=64"
        )


WIDE = 128  # hidden size of the GPU test's model: activations of a long batch dwarf its weights


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_activation_offloading_keeps_no_activations_on_the_gpu():
    """One rank on NCCL (a world of one): the CUDA bytes allocated when the loss is computed (after the forward,
    before the backward) above those before the step are the activations kept for the backward; with offloading
    they are in pinned host memory instead, and the update is the same."""
    device = init_process_group(0, 1, "127.0.0.1", _free_ports(1)[0], backend="nccl")
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDE,
        intermediate_size=2 * WIDE,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(1, VOCAB, (8, 512), generator=generator)}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["response_mask"] = (torch.arange(512) >= 2).float().expand(8, 512).contiguous()
    held, weights = {}, {}
    try:
        for offloading in (False, True):
            torch.manual_seed(0)
            policy = FSDPPolicy(
                lambda: LlamaForCausalLM(config),
                device=device,
                optimizer=OPTIMIZER,
                micro_batch_size=8,
                activation_offloading=offloading,
            )
            at_loss: list[int] = []

            def measured_nll(*, logprobs: torch.Tensor, batch: dict[str, torch.Tensor], at_loss=at_loss):
                at_loss.append(torch.cuda.memory_allocated(device))
                return token_mean_nll(logprobs=logprobs, batch=batch)

            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            policy.train_step(batch, measured_nll)
            held[offloading] = at_loss[0] - before
            weights[offloading] = policy.full_state_dict()
            del policy
    finally:
        dist.destroy_process_group()
    assert held[False] > 10 * 2**20, held  # tens of MB of activations without offloading ...
    assert held[True] < 0.05 * held[False], held  # ... about none with it
    assert_weights_close(weights[True], weights[False], atol=1e-5)  # the same update (CUDA kernels may reorder sums)


def test_init_process_group_rejects_a_bad_rank():
    with pytest.raises(ValueError, match=r"rank=2 is not in \[0, world_size=2\)"):
        init_process_group(2, 2, "127.0.0.1", 1)


def test_latest_checkpoint_orders_by_step_number(tmp_path):
    for step in (2, 10, 9):
        (checkpoint_path(tmp_path, step) / "dcp").mkdir(parents=True)
        (checkpoint_path(tmp_path, step) / "dcp" / ".metadata").touch()
        (checkpoint_path(tmp_path, step) / "checkpoint.json").write_text("{}")
    (tmp_path / "step_11").mkdir()  # incomplete
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000010"


def _fake_checkpoint(path):
    (path / "dcp").mkdir(parents=True)
    (path / "dcp" / ".metadata").touch()
    (path / "checkpoint.json").write_text("{}")


def test_prune_keeps_the_newest_k_and_clears_crash_leftovers(tmp_path):
    for step in (1, 2, 3, 4):
        _fake_checkpoint(checkpoint_path(tmp_path, step))
    _fake_checkpoint(tmp_path / "reference")
    _fake_checkpoint(tmp_path / ".step_00000005.tmp")
    deleted = prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reference", "step_00000003", "step_00000004"]
    assert len(deleted) == 3
    with pytest.raises(ValueError, match="keep_last must be >= 1, got 0"):
        prune_checkpoints(tmp_path, keep_last=0)


def test_a_crash_mid_swap_leaves_the_old_checkpoint_found(tmp_path):
    # the overwrite renamed step 4 aside and died before the new one took its name
    _fake_checkpoint(checkpoint_path(tmp_path, 3))
    _fake_checkpoint(tmp_path / ".step_00000004.old")
    _fake_checkpoint(tmp_path / ".step_00000004.tmp")
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 4)


def test_decoder_layers_finds_hf_layers_or_no_split_modules():
    llama = tiny_model(0)
    assert decoder_layers(llama) == list(llama.model.layers)

    class Block(nn.Module):
        def __init__(self, inner: bool = False):
            super().__init__()
            self.inner = Block(inner=True) if not inner else nn.Identity()

    class GPTLike(nn.Module):
        _no_split_modules = ("Block",)

        def __init__(self):
            super().__init__()
            self.h = nn.ModuleList([Block(), Block()])

    model = GPTLike()
    outer, inner = model.h[0], model.h[0].inner
    layers = decoder_layers(model)
    assert len(layers) == 4 and layers.index(inner) < layers.index(outer)  # nested blocks before their parents


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 64, 65])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_shard_rows_follow_torch_chunk(rows, world_size):
    # FSDP2 shards dim 0 with torch.chunk; the one-collective full_state_dict lays shards out by these counts
    chunks = [c.shape[0] for c in torch.empty(rows).chunk(world_size)] if rows else []
    assert _shard_rows(rows, world_size) == chunks + [0] * (world_size - len(chunks))


def test_the_trainers_all_gather_concatenates_in_rank_order_without_torchs_deprecation_warning():
    import warnings

    from trainers.fsdp import all_gather_single

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out = torch.empty(3, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # torch 2.13 deprecates all_gather_into_tensor
            all_gather_single(out, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
        assert out.tolist() == [1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- dynamic_batching


def test_dynamic_batching_gives_the_same_update_and_metrics_as_one_row_micro_batches(run):
    assert_weights_close(run["ranks"][0]["dynamic_batching_step1"], run["ranks"][0]["step1"], atol=1e-6)
    for result in run["ranks"]:
        assert result["dynamic_batching_metrics"].keys() == result["metrics1"].keys()
        for name, value in result["metrics1"].items():
            assert result["dynamic_batching_metrics"][name] == pytest.approx(value, rel=1e-6, abs=1e-9), name


def test_dynamic_batching_packs_rows_by_length_and_trims_padding_columns(run):
    # rank 0's rows are 10, 9, 10 and 8 tokens long: one per micro-batch (two would pass the 12-token budget),
    # longest first; rank 1's are 3, 4, 2 and 3: the 4-, 3- and 3-token rows in 3 x 4 columns, the 2-token one alone
    assert run["ranks"][0]["dynamic_batching_seen"] == [
        ([0], (1, 10), (1, 10)),
        ([2], (1, 10), (1, 10)),
        ([1], (1, 9), (1, 9)),
        ([3], (1, 8), (1, 8)),
    ]
    assert run["ranks"][1]["dynamic_batching_seen"] == [([1, 0, 3], (3, 4), (3, 4)), ([2], (1, 2), (1, 2))]


def test_dynamic_batching_evens_out_different_micro_batch_counts_across_ranks(run):
    for result in run["ranks"]:  # every rank learns every rank's count; rank 1 ran 2 filler passes, nothing hung
        assert result["dynamic_batching_train_counts"] == [4, 2]
        assert result["dynamic_batching_logprob_counts"] == [4, 2]
        assert result["dynamic_batching_no_rows_counts"] == [4, 0]
        assert result["dynamic_batching_no_rows_train"] == (
            "ValueError: with dynamic batching every rank needs at least one row to train on; "
            "micro-batches per rank: [4, 0]"
        )
        assert result["dynamic_batching_bad_budget"] == "ValueError: max_tokens_per_micro_batch=0 must be >= 1"


def test_dynamic_batching_computes_fewer_padded_tokens_than_fixed_micro_batches(run):
    fixed = 4 * SEQ_LEN  # 4 full-width rows per rank, whatever micro_batch_size
    rank0, rank1 = run["ranks"]
    assert rank0["dynamic_batching_train_tokens"] == rank0["dynamic_batching_logprob_tokens"] == 10 + 10 + 9 + 8
    # 3 x 4 and 1 x 2 tokens, then two 1-token filler passes to match rank 0's 4 micro-batches
    assert rank1["dynamic_batching_train_tokens"] == rank1["dynamic_batching_logprob_tokens"] == 12 + 2 + 2
    computed = rank0["dynamic_batching_train_tokens"] + rank1["dynamic_batching_train_tokens"]
    assert computed < 0.7 * (2 * fixed)


def test_dynamic_batching_logprobs_equal_fixed_ones_in_the_original_order_and_width(run):
    for rank, result in enumerate(run["ranks"]):
        mask = rank_rows(run["batch1"], rank, WORLD_SIZE)["attention_mask"]
        logprobs = result["dynamic_batching_logprobs"]
        assert logprobs.shape == (4, SEQ_LEN) and logprobs.dtype == torch.float32
        torch.testing.assert_close(logprobs, result["dynamic_batching_fixed_logprobs"], atol=1e-6, rtol=0)
        assert (logprobs[mask == 0] == 0).all() and (logprobs[mask == 1] != 0).any()
    torch.testing.assert_close(
        run["ranks"][0]["dynamic_batching_no_rows"], run["ranks"][0]["dynamic_batching_logprobs"], atol=0, rtol=0
    )
    assert run["ranks"][1]["dynamic_batching_no_rows"].shape == (0, SEQ_LEN)


def test_plan_micro_batches_keeps_the_budget_and_takes_every_row_once():
    lengths = [3, 10, 4, 0, 7, 7, 2, 9]
    plan = plan_micro_batches(lengths, 14)
    assert plan == [[1], [7], [4, 5], [2, 0, 6], [3]]  # longest first: similar lengths share a micro-batch
    assert sorted(row for rows in plan for row in rows) == list(range(len(lengths)))
    padded = [len(rows) * max(1, *(lengths[row] for row in rows)) for rows in plan]
    assert max(padded) <= 14
    assert sum(padded) == 46 < len(lengths) * max(lengths)  # fixed micro-batches compute every row at full width


def test_plan_micro_batches_gives_a_row_over_the_budget_a_micro_batch_of_its_own():
    assert plan_micro_batches([20, 3, 3, 30], 8) == [[3], [0], [1, 2]]
    assert plan_micro_batches([5, 5, 5], 1) == [[0], [1], [2]]
    assert plan_micro_batches([], 8) == []


def test_plan_micro_batches_refuses_a_bad_budget_or_length():
    with pytest.raises(ValueError, match=r"^max_tokens must be >= 1, got 0$"):
        plan_micro_batches([1], 0)
    with pytest.raises(ValueError, match=r"^lengths must be >= 0, got -1$"):
        plan_micro_batches([2, -1], 4)


def test_row_lengths_end_at_the_last_attended_token():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]])
    # right padding: the length; left padding: the full width (nothing to trim); none attended: 0
    assert row_lengths(mask).tolist() == [2, 4, 3, 0]
    assert row_lengths(torch.zeros((2, 0))).tolist() == [0, 0]
