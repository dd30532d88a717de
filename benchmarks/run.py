"""Benchmarks of the queue against same-run baselines (raw ZeroMQ, the Ray object store, memcpy).

    make bench                                   # everything (< 10 min on a loaded 2-core machine)
    .venv/bin/python benchmarks/run.py --quick   # fewer repetitions, a 256 MB "large" workload
    .venv/bin/python benchmarks/run.py --only grpo --only small

Prints a table (medians over repetitions, the baseline, ratio = our time / baseline time, the target) and writes
every result to ``benchmarks/results/<timestamp>.jsonl``. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import Results, loadavg, read_jsonl, run_metadata, table, write_jsonl  # noqa: E402

# Heavy imports (torch, ray, the queue) live inside main(): spawned client processes re-import this file.
ORDER = [
    "get_meta_state", "get_meta", "concurrent", "small", "grpo", "large", "shm", "gpu", "wake", "auth", "journal",
    "demo", "weight_publish",
]  # fmt: skip
# workloads that need no queue, or start their own (and Ray) in a subprocess: run after the others
SEPARATE = {"demo", "weight_publish"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 repetitions, 1k/1M get_meta sizes, 256 MB large")
    parser.add_argument(
        "--only", action="append", default=[], metavar="NAME", help=f"run only these workloads ({', '.join(ORDER)})"
    )
    parser.add_argument("--reps", type=int, default=None, help="repetitions per metric (default 5; --quick 3)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for the JSONL results")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads here (default: torch's)")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--show", metavar="JSONL", help="print the table of an earlier run and exit")
    args = parser.parse_args(argv)
    names = [n for item in args.only for n in item.split(",") if n]
    unknown = [n for n in names if n not in ORDER]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {ORDER}")
    args.only = names or ORDER
    args.reps = args.reps or (3 if args.quick else 5)
    return args


def show(path: str, markdown: bool) -> int:
    meta, results = read_jsonl(path)
    print(
        f"{path}: {meta['date']}, {meta['args']}, load average {meta['loadavg_start']:.2f} -> "
        f"{meta.get('loadavg_end', float('nan')):.2f} on {meta['cpus']} cpus, {meta.get('seconds')} s"
    )
    print(table(results, markdown=markdown))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.show:
        return show(args.show, args.markdown)
    import msgspec
    import ray
    import torch
    from baselines import RawZmq, ray_actor_class
    from bench import N_SAMPLES, SPIN, Bench
    from workloads import WORKLOADS

    import transfer_queue as tq

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    meta = run_metadata(
        {"quick": args.quick, "only": args.only, "reps": args.reps, "torch_threads": torch.get_num_threads()}
    )
    print(
        f"transfer_queue benchmarks: {args.only}, {args.reps} reps, load average {loadavg():.2f} "
        f"on {os.cpu_count()} cpus",
        flush=True,
    )
    started = time.monotonic()
    results = Results()
    if all(n in SEPARATE for n in args.only):  # no queue to start
        return finish(args, meta, results, started)
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="ERROR")
    raw = None
    try:
        first = tq.init(
            global_batch_size=64,
            num_n_samples=N_SAMPLES,
            num_global_batch=2,
            num_storage_units=2,
            storage_unit_bytes=4 << 30,
            sampler=tq.SequentialSampler(),
            shared_memory=True,  # the units pool shared memory; only the shm workload's "on" client asks for it
        )
        # the other workloads measure the socket path, as before: their clients do not ask for shared memory
        info = first.controller_info
        off = msgspec.structs.replace(info, config={**info.config, "shared_memory": False})
        first.close()
        client = tq.TransferQueueClient("bench", off)
        controller = tq.get_controller()
        ray.get(controller.register_sampler.remote("grpo", tq.GRPOSampler(N_SAMPLES)))
        spin_client = tq.TransferQueueClient("bench-spin", off, spin_seconds=SPIN)
        raw = RawZmq()
        peer = ray_actor_class().remote()
        bench = Bench(args.quick, args.reps, results, {0.0: client, SPIN: spin_client}, controller, raw, peer)
        print(f"(queue and baselines up in {time.monotonic() - started:.1f} s)", flush=True)
        for name in [n for n in ORDER if n in args.only and n not in SEPARATE]:
            t0 = time.monotonic()
            print(f"\n== {name} (load average {loadavg():.2f})", flush=True)
            try:
                WORKLOADS[name](bench)
            except Exception:
                traceback.print_exc()
                print(f"!! workload {name} failed", flush=True)
            print(f"   ({name} took {time.monotonic() - t0:.1f} s)", flush=True)
    finally:
        if raw is not None:
            raw.close()
        tq.shutdown()
        ray.shutdown()
    return finish(args, meta, results, started)


def finish(args: argparse.Namespace, meta: dict, results, started: float) -> int:
    """The workloads that start their own queue or need none (demo, weight_publish), then the table and the
    results file."""
    if "demo" in args.only:
        from demo_workload import bench_demo

        t0 = time.monotonic()
        print(f"\n== demo (load average {loadavg():.2f})", flush=True)
        try:
            bench_demo(args.quick, results)
        except Exception:
            traceback.print_exc()
            print("!! workload demo failed", flush=True)
        print(f"   (demo took {time.monotonic() - t0:.1f} s)", flush=True)
    if "weight_publish" in args.only:
        from weight_publish import bench_weight_publish

        t0 = time.monotonic()
        print(f"\n== weight_publish (load average {loadavg():.2f})", flush=True)
        try:
            bench_weight_publish(args.quick, results, args.reps)
        except Exception:
            traceback.print_exc()
            print("!! workload weight_publish failed", flush=True)
        print(f"   (weight_publish took {time.monotonic() - t0:.1f} s)", flush=True)
    meta["loadavg_end"] = loadavg()
    meta["seconds"] = round(time.monotonic() - started, 1)
    path = os.path.join(args.out, time.strftime("%Y%m%d-%H%M%S") + ".jsonl")
    write_jsonl(path, meta, results.items)
    print(f"\nratio = our time / baseline time (for rates: baseline rate / our rate); medians of {args.reps} reps")
    print(table(results.items, markdown=args.markdown))
    missed = [r.name for r in results.items if r.met is False]
    print(f"\n{sum(r.met is True for r in results.items)} targets met, {len(missed)} missed: {missed}")
    print(
        f"results: {path} ({meta['seconds']} s, load average {meta['loadavg_start']:.2f} -> {meta['loadavg_end']:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
