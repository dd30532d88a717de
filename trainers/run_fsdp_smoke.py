"""Smoke run of the FSDP2 engine: a few GRPO-shaped steps on a tiny random Llama, printing step time and loss.

    torchrun --nproc_per_node=2 trainers/run_fsdp_smoke.py            # gloo on CPU, NCCL + bf16 on GPUs
    torchrun --nproc_per_node=2 trainers/run_fsdp_smoke.py --hidden 512 --layers 8 --seq-len 512

Checks on the way: the loss falls (the loss pushes up the logprobs of fixed responses), the gradient norm is
finite, ``full_state_dict`` is complete on rank 0, and a checkpoint round-trips.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from trainers.fsdp import AdamWConfig, FSDPPolicy, init_process_group


def token_mean_nll(*, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]):
    mask = batch["response_mask"]
    loss = -(logprobs * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"response_tokens": mask.sum()}


def make_batch(rows: int, seq_len: int, vocab: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(1, vocab, (rows, seq_len), generator=generator)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (rows,), generator=generator)
    positions = torch.arange(seq_len)
    attention_mask = (positions < lengths[:, None]).long()
    response_mask = ((positions >= seq_len // 4) & (positions < lengths[:, None])).float()
    input_ids = input_ids * attention_mask  # pad id 0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows-per-rank", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    device = init_process_group(
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        int(os.environ.get("MASTER_PORT", "29500")),
    )
    rank, world_size = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
    )
    torch.manual_seed(0)
    policy = FSDPPolicy(
        lambda: LlamaForCausalLM(config),
        device=device,
        optimizer=AdamWConfig(lr=args.lr, weight_decay=0.0),
        micro_batch_size=args.micro_batch_size,
    )
    n_params = sum(p.numel() for p in policy.model.parameters())
    if rank == 0:
        print(f"backend={dist.get_backend()} device={device} world_size={world_size} params={n_params:,}", flush=True)

    batch = make_batch(args.rows_per_rank, args.seq_len, args.vocab, torch.Generator().manual_seed(rank))
    losses = []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        metrics = policy.train_step(batch, token_mean_nll)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        losses.append(metrics["loss"])
        if rank == 0:
            print(
                f"step {step}: {seconds * 1000:.1f} ms  loss {metrics['loss']:.4f}  "
                f"grad_norm {metrics['grad_norm']:.3f}  lr {metrics['lr']:.1e}",
                flush=True,
            )
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"

    state_dict = policy.full_state_dict()
    if rank == 0:
        assert len(state_dict) == len(LlamaForCausalLM(config).state_dict()), "full_state_dict is incomplete"
    with tempfile.TemporaryDirectory() as scratch:
        root = [scratch]
        dist.broadcast_object_list(root, src=0)  # one directory for all ranks (single node)
        policy.save_checkpoint(Path(root[0]) / "step_1", {"step": args.steps})
        assert policy.load_checkpoint(Path(root[0]) / "step_1") == {"step": args.steps}
        dist.barrier()
    if rank == 0:
        print("ok: loss fell, full_state_dict complete, checkpoint round-trip", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
