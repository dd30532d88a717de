"""What a second copy of each row costs: put and get_data with ``replicas=1`` and ``replicas=2``, interleaved.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/python benchmarks/replicas.py            # Unix sockets
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/python benchmarks/replicas.py --tcp      # TCP loopback

Two queues (``TransferQueueController``, 2 storage units each, one with ``replicas=2``) on one local Ray; each round
puts and reads the same batch on both, in alternating order, so a loaded machine slows both alike. Workloads: the
bench table's ``small`` (64 rows x 1 KiB) and ``grpo`` (256 samples x 4 fields of 4096, 20.98 MB). A put with two
replicas writes each block to two units in parallel; a read reads one copy. Prints the median per call and the
ratio (replicas=2 / replicas=1); ``--out`` writes every call's seconds as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tcp", action="store_true", help="talk ZeroMQ over TCP (the path of clients on other hosts)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default=None, help="write the per-call seconds here (JSON)")
    args = parser.parse_args()

    import ray
    import torch

    from transfer_queue import TransferQueueClient, TransferQueueController

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", address="local")
    seq = 4096
    batches = {
        "small": {"x": torch.randint(0, 255, (64, 1024), dtype=torch.uint8)},
        "grpo": {
            "input_ids": torch.randint(0, 32000, (256, seq)),
            "attention_mask": torch.ones(256, seq, dtype=torch.int64),
            "old_log_prob": torch.randn(256, seq),
            "rewards": torch.randn(256, 1),
        },
    }
    clients: dict[int, Any] = {}
    controllers = []
    for replicas in (1, 2):
        controller = TransferQueueController.remote(
            256, num_storage_units=2, replicas=replicas, storage_unit_bytes=1 << 30, http_port=-1
        )
        controllers.append(controller)
        info = ray.get(controller.get_info.remote())
        clients[replicas] = TransferQueueClient(f"replicas-{replicas}", info, force_tcp=args.tcp)
    times: dict[str, list[float]] = {}
    for i in range(args.rounds):
        for name, batch in batches.items():
            for replicas in (1, 2) if i % 2 == 0 else (2, 1):
                client = clients[replicas]
                pid = f"{name}-{i}"
                t0 = time.perf_counter()
                meta = client.put(batch, partition_id=pid)
                t1 = time.perf_counter()
                client.get_data(meta)
                t2 = time.perf_counter()
                client.clear(partition_id=pid)
                if i:  # the first round warms up
                    times.setdefault(f"{name} put r{replicas}", []).append(t1 - t0)
                    times.setdefault(f"{name} get_data r{replicas}", []).append(t2 - t1)
    print(f"{'workload':<16} {'replicas=1 ms':>14} {'replicas=2 ms':>14} {'ratio':>7}")
    for name in batches:
        for op in ("put", "get_data"):
            one = statistics.median(times[f"{name} {op} r1"]) * 1e3
            two = statistics.median(times[f"{name} {op} r2"]) * 1e3
            print(f"{name + ' ' + op:<16} {one:>14.3f} {two:>14.3f} {two / one:>7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tcp": args.tcp, "rounds": args.rounds, "seconds": times}, f)
    for client in clients.values():
        client.close()
    for controller in controllers:
        ray.get(controller.shutdown.remote())
    ray.shutdown()


if __name__ == "__main__":
    main()
