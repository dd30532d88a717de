"""Shared-memory puts and gets with their copies on one thread against split over two (issue 29 s1), without Ray.

A controller and two storage units (each a spawned process, shared memory on: ``auth_cost.RaylessQueue`` with
``shared_memory_bytes``) and one client in this process. Each round puts the grpo schema's ``--rows`` samples and reads
them back 3 times, once with ``transfer_queue.wire.shm.COPY_THREADS = 1`` and once with 2 (the order alternating
round by round, so a busy moment of the machine slows both), and clears them; the first two rounds warm the pools
up and are not counted. ``PARALLEL_COPY_BYTES`` is set to 1 MiB so that both sizes split.

    PYTHONPATH=. .venv/bin/python benchmarks/copy_threads.py --rows 256 --rounds 16    # 20.98 MB
    PYTHONPATH=. .venv/bin/python benchmarks/copy_threads.py --rows 3072 --rounds 8    # 252 MB
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import msgspec
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import auth_cost
from bench import grpo_batch, payload_bytes

POOL = 1 << 31


def main() -> None:
    import transfer_queue as tq
    from transfer_queue.wire import shm
    from transfer_queue.wire.auth import new_secret

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256, help="grpo samples per put (256: 20.98 MB)")
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args()
    queue = auth_cost.RaylessQueue(new_secret(), shared_memory_bytes=POOL)
    config = {**queue.info.config, "shared_memory": True, "shared_memory_pool_bytes": POOL}
    client = tq.TransferQueueClient("copy-threads", msgspec.structs.replace(queue.info, config=config))
    shm.PARALLEL_COPY_BYTES = 1 << 20
    td = grpo_batch(args.rows)
    times: dict[tuple[str, int], list[float]] = {(op, t): [] for op in ("put", "get") for t in (1, 2)}
    try:
        for r in range(args.rounds + 2):
            for threads in (1, 2) if r % 2 else (2, 1):
                shm.COPY_THREADS = threads
                pid = f"round{r}-{threads}"
                t0 = time.perf_counter()
                meta = client.put(td, partition_id=pid)
                put_s = time.perf_counter() - t0
                gets = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    client.get_data(meta)
                    gets.append(time.perf_counter() - t0)
                client.clear(partition_id=pid)
                time.sleep(0.2)
                if r >= 2:
                    times[("put", threads)].append(put_s)
                    times[("get", threads)].extend(gets)
    finally:
        client.close()
        queue.close()
    gb = payload_bytes(td) / 1e9
    print(f"{gb * 1e3:.2f} MB, {args.rounds} rounds; medians:")
    for (op, threads), values in times.items():
        median = float(np.median(values))
        print(f"  {op} copy threads {threads}: {median * 1e3:.2f} ms  {gb / median:.2f} GB/s")


if __name__ == "__main__":
    main()
