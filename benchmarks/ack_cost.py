"""What get_data's acknowledgement costs: get_data of the same 64 x 1 KiB rows with and without it, interleaved.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/python benchmarks/ack_cost.py        # Unix socket: not waited for
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/python benchmarks/ack_cost.py --tcp  # TCP: a round trip

A meta from get_meta names its task, so get_data acknowledges it; the same meta with ``task_name=None`` is read
without one. The difference of the medians is the acknowledgement's cost on the consumer's path.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tcp", action="store_true", help="talk ZeroMQ over TCP (the path of clients on other hosts)")
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()

    import ray
    import torch
    from tensordict import TensorDict

    import transfer_queue as tq

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", address="local")
    first = tq.init(global_batch_size=64, num_storage_units=2)
    client = tq.TransferQueueClient("ack-cost", first.controller_info, force_tcp=args.tcp)
    td = TensorDict({"x": torch.randint(0, 255, (64, 1024), dtype=torch.uint8)}, batch_size=[64])
    with_ack: list[float] = []
    without: list[float] = []
    for i in range(args.rounds):
        pid = f"p{i}"
        client.put(td, partition_id=pid)
        meta = client.get_meta(["x"], 64, partition_id=pid, task_name="t")
        plain = dataclasses.replace(meta, task_name=None)
        for acked in (True, False) if i % 2 else (False, True):  # alternate which goes first
            t = time.perf_counter()
            client.get_data(meta if acked else plain)
            (with_ack if acked else without).append(time.perf_counter() - t)
        client.clear(partition_id=pid)
    warm = args.rounds // 20
    a, b = statistics.median(with_ack[warm:]), statistics.median(without[warm:])
    path = "tcp" if args.tcp else "unix"
    print(
        f"get_data 64 x 1 KiB over {path}: with ack {a * 1e3:.3f} ms, without {b * 1e3:.3f} ms, "
        f"ack {1e3 * (a - b):+.3f} ms (medians of {args.rounds - warm})"
    )
    client.close()
    tq.shutdown()


if __name__ == "__main__":
    main()
