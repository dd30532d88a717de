"""Where the time goes: run one operation in a loop while py-spy samples the client, controller and storage units.

    .venv/bin/python benchmarks/profile_queue.py small_put --seconds 10
    .venv/bin/python benchmarks/profile_queue.py get_meta_drained --top 25

Writes collapsed stacks per process to ``benchmarks/results/profile-<op>-<role>.txt`` (open them with
speedscope or ``flamegraph.pl``) and prints, per process, the functions with the most samples (self and
inclusive, as % of that process's samples; idle waits in poll/recv are included, so a server that is mostly
idle shows them on top).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from bench import BATCH, N_SAMPLES, fill, grpo_batch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

PY_SPY = os.path.join(os.path.dirname(sys.executable), "py-spy")


def _ops(client: Any, op: str) -> Callable[[], Any]:
    """A closure doing one ``op`` (setup outside the loop)."""
    if op.startswith(("small", "grpo", "large")):
        if op.startswith("small"):
            td = TensorDict({"x": torch.randint(0, 255, (64, 1024), dtype=torch.uint8)}, batch_size=[64])
        else:
            td = grpo_batch(256 if op.startswith("grpo") else 3072)
        if op.endswith("_put"):
            counter = iter(range(10**9))

            def put() -> None:
                k = next(counter)
                client.put(td, partition_id=f"prof-{k // 50}")
                if k % 50 == 49:
                    client.clear(partition_id=f"prof-{k // 50}")

            return put
        meta = client.put(td, partition_id="prof-get")
        return lambda: client.get_data(meta)
    if op.startswith("get_meta"):
        rows = 1_000_000
        fill(client, "prof-meta", rows)
        client.get_meta(["t"], BATCH, partition_id="prof-meta", task_name="seq")  # builds the index
        if op == "get_meta_drained":
            for _ in range(rows // 2 // 4096):
                client.get_meta(["t"], 4096, partition_id="prof-meta", task_name="seq")
        return lambda: client.get_meta(["t"], BATCH, partition_id="prof-meta", task_name="seq")
    raise SystemExit(f"unknown op {op!r}")


def op_name_is_large(op: str) -> bool:
    return op.startswith("large")


def summarize(path: str, top: int) -> str:
    self_counts: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            self_counts[frames[-1]] += n
            for frame in set(frames):
                incl[frame] += n
    out = [f"{total} samples"]
    out.append("  self%   incl%  function")
    for frame, n in incl.most_common(top):
        out.append(f"  {100 * self_counts[frame] / total:5.1f}  {100 * n / total:6.1f}  {frame}")
    out.append("  -- top self --")
    for frame, n in self_counts.most_common(top // 2):
        out.append(f"  {100 * n / total:5.1f}  {100 * incl[frame] / total:6.1f}  {frame}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "op",
        choices=[
            "small_put",
            "small_get",
            "grpo_put",
            "grpo_get",
            "large_put",
            "large_get",
            "get_meta",
            "get_meta_drained",
        ],
    )
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--spin", type=float, default=0.0)
    parser.add_argument("--native", action="store_true", help="include native frames (C extensions)")
    parser.add_argument("--cprofile", action="store_true", help="also profile the client loop with cProfile")
    args = parser.parse_args()

    import ray

    import transfer_queue as tq

    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="ERROR")
    client = tq.init(global_batch_size=64, num_n_samples=N_SAMPLES, num_storage_units=2, spin_seconds=args.spin)
    controller = tq.get_controller()
    pids = {
        "client": os.getpid(),
        "controller": ray.get(controller.__ray_call__.remote(lambda self: os.getpid())),
    }
    for unit in ray.get(controller.storage_stats.remote()):
        pids[f"storage{unit['unit']}"] = unit["pid"]
    try:
        op = _ops(client, args.op)
        for _ in range(3 if op_name_is_large(args.op) else 20):
            op()
        out_dir = os.path.join(HERE, "results")
        os.makedirs(out_dir, exist_ok=True)
        procs, files = [], {}
        for role, pid in pids.items():
            files[role] = os.path.join(out_dir, f"profile-{args.op}-{role}.txt")
            cmd = [
                PY_SPY,
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(args.rate),
                "--format",
                "raw",
                "--duration",
                str(int(args.seconds)),
                "--output",
                files[role],
                "--nonblocking",
            ]
            if args.native:
                cmd.append("--native")
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)  # py-spy attaches
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds - 1.0:
            op()
            n += 1
        elapsed = time.perf_counter() - t0
        for proc in procs:
            proc.wait(timeout=60)
        print(f"{args.op}: {n} ops in {elapsed:.1f} s = {1e3 * elapsed / n:.3f} ms/op (under the profiler)")
        if args.cprofile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(n):
                op()
            profiler.disable()
            print(f"\n== client, cProfile of {n} ops (times are totals; per op divide by {n})")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
        for role, path in files.items():
            if os.path.exists(path):
                print(f"\n== {role} (pid {pids[role]}): {path}\n{summarize(path, args.top)}")
    finally:
        tq.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
