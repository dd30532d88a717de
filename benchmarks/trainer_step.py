"""Where the demo's trainer step goes: FSDP2 ranks (gloo, no Ray, no queue) against one plain process, same batch.

    .venv/bin/python benchmarks/trainer_step.py [--world-size 2] [--steps 30] [--no-single] [--cprofile PREFIX]

Builds the demo's policy (``AdditionTask``, ~100k parameters) and a GRPO batch of 256 rows shaped like the demo's (7
prompt tokens, 4 response tokens, group-normalised advantages, on-policy old log-probs). Times the same work in one
process (forward + backward on the whole batch, gradient clip, ``torch.optim.AdamW``, ``load_state_dict`` into an
engine copy), then, on each rank's share, ``FSDPPolicy.train_step`` with the ``grpo`` token-mean loss and
``full_state_dict`` (the weight publish's gather) for each of ``VARIANTS`` (optimizer kernels, FSDP units), the
variants taking turns step by step so a loaded machine's load falls on all alike. Every process runs one torch
thread, as Ray actors do. Prints medians over the steps after two warm-up steps: wall time and the rank's CPU time
(the robust figure on a loaded machine); ``--cprofile PREFIX`` prints rank 0's hottest functions in the variants
whose name starts with PREFIX.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainers.fsdp import AdamWConfig, FSDPPolicy, init_process_group
from trainers.losses import policy_loss
from workers.tasks.addition import AdditionTask

ROWS, PROMPT, RESPONSE = 256, 7, 4


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = PROMPT + RESPONSE
    ids = torch.randint(3, 15, (ROWS, width), generator=gen)
    response = torch.zeros(ROWS, width)
    response[:, PROMPT:] = 1.0
    rewards = (torch.rand(ROWS // 8, 8, generator=gen) < 0.4).float()
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(ROWS, width, dtype=torch.int64),
        "response_mask": response,
        "advantages": adv,
    }


def loss_fn(*, logprobs, batch):
    return policy_loss("grpo", logprobs, batch["old_logprobs"], batch["advantages"], batch["response_mask"],
                       loss_agg="token-mean")  # fmt: skip


def timed(fn) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


VARIANTS = {  # name: (AdamWConfig.foreach, FSDPPolicy keyword arguments)
    "per-parameter optimizer, per-layer units (before)": (False, {}),
    "foreach optimizer, per-layer units": (True, {}),
    "foreach, per-layer units, no reshard after forward": (True, {"reshard_after_forward": False}),
    "foreach, one unit (min_layer_params 1M, the demo's)": (True, {"min_layer_params": 1_000_000}),
}


def rank_main(rank: int, world_size: int, port: int, steps: int, profile: str, results) -> None:
    torch.set_num_threads(1)
    init_process_group(rank, world_size, "127.0.0.1", port, "gloo")
    policies = {}
    for name, (foreach, kwargs) in VARIANTS.items():
        torch.manual_seed(0)
        policies[name] = FSDPPolicy(
            AdditionTask().build_policy(),
            optimizer=AdamWConfig(lr=5e-4, weight_decay=0.01, foreach=foreach),
            grad_clip=1.0,
            micro_batch_size=128,
            **kwargs,
        )
    full = batch()
    share = {k: v[rank * ROWS // world_size : (rank + 1) * ROWS // world_size] for k, v in full.items()}
    any_policy = next(iter(policies.values()))
    share["old_logprobs"] = any_policy.compute_logprobs(share["input_ids"], share["attention_mask"])
    wall: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
    gather: dict[str, list[float]] = {name: [] for name in VARIANTS}
    profiler = cProfile.Profile() if profile and rank == 0 else None
    for step in range(steps + 2):  # the variants take turns, so the machine's load falls on all alike
        for name, policy in policies.items():
            dist.barrier()
            if profiler and step >= 2 and name.startswith(profile):
                profiler.enable()
            c0, t0 = time.process_time(), time.perf_counter()
            policy.train_step(share, loss_fn)
            t1 = time.perf_counter()
            policy.full_state_dict()
            t2, c2 = time.perf_counter(), time.process_time()
            if profiler:
                profiler.disable()
            if step >= 2:
                wall[name].append(t1 - t0)
                gather[name].append(t2 - t1)
                cpu[name].append(c2 - c0)
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    if rank == 0:
        results.put({name: (med(wall[name]), med(gather[name]), med(cpu[name])) for name in VARIANTS})
    dist.destroy_process_group()


def med(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def single(steps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AdditionTask().build_policy()
    engine = AdditionTask().build_policy()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    b = batch()
    from trainers.fsdp import token_logprobs

    with torch.no_grad():
        b["old_logprobs"] = token_logprobs(model(input_ids=b["input_ids"]).logits, b["input_ids"], b["attention_mask"])
    parts: dict[str, list[float]] = {"fwd_bwd": [], "clip": [], "optimizer": [], "load_state_dict": []}
    for step in range(steps + 2):
        t0 = time.perf_counter()
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        loss, _ = loss_fn(logprobs=token_logprobs(logits, b["input_ids"], b["attention_mask"]), batch=b)
        opt.zero_grad()
        loss.backward()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        engine.load_state_dict(model.state_dict())
        t4 = time.perf_counter()
        if step >= 2:
            for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                parts[name].append(dt)
    return {k: statistics.median(v) * 1000 for k, v in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cprofile", default="", help="cProfile rank 0 in the variants whose name starts so")
    parser.add_argument("--no-single", action="store_true")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    if not args.no_single:
        s = single(args.steps)
        print("single process, ms/step (median): " + ", ".join(f"{k} {v:.1f}" for k, v in s.items()))
        print(f"  total {sum(s.values()):.1f}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        ctx.Process(target=rank_main, args=(r, args.world_size, port, args.steps, args.cprofile, results))
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    fsdp = results.get()
    for p in procs:
        p.join()
    print(f"FSDP2 x{args.world_size} (gloo), rank 0, median ms per step: train_step wall | full_state_dict | CPU")
    for name, (wall, gather, cpu) in fsdp.items():
        print(f"  {wall:7.1f} | {gather:5.1f} | {cpu:7.1f}  {name}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
