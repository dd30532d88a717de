"""What CURVE encryption costs on the TCP path: a 21 MB GRPO batch put and read over loopback TCP, with the queue's
secret (every connection CURVE-encrypted, as in production) and without (b"": plain ZeroMQ), in one process without Ray.

    python benchmarks/tcp_encryption.py [--reps 7]

Prints the median put and get_data per mode. Servers run on threads of this process, so client and servers share its
cores: compare the two lines with each other, not with cross-host figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from transfer_queue.client import TransferQueueClient
from transfer_queue.config import QueueConfig
from transfer_queue.controller.server import ControllerServer
from transfer_queue.state.queue_state import QueueState
from transfer_queue.storage.unit import BlockStore, StorageServer
from transfer_queue.wire import protocol as p

SESSION = "b" * 32


def grpo_batch(n: int = 256, seq: int = 4096) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, 32000, (n, seq)),
        "attention_mask": torch.ones(n, seq, dtype=torch.int64),
        "old_log_prob": torch.randn(n, seq),
        "rewards": torch.randn(n, 1),
    }


def measure(secret: bytes, reps: int) -> tuple[float, float]:
    config = QueueConfig(global_batch_size=256, num_storage_units=2, storage_unit_bytes=1 << 30)
    units = [StorageServer(BlockStore(u, 2, secret), "127.0.0.1", SESSION, secret, 1 << 31) for u in range(2)]
    endpoints = [u.endpoint for u in units]
    controller = ControllerServer(QueueState(config, None), SESSION, endpoints, "127.0.0.1", secret)
    info = p.ControllerInfo(p.PROTOCOL_VERSION, SESSION, controller.endpoint, endpoints, config.to_dict(), secret)
    client = TransferQueueClient("bench", info, force_tcp=True)
    batch = grpo_batch()
    puts, gets = [], []
    try:
        for i in range(reps):
            started = time.perf_counter()
            client.put(batch, partition_id=f"g{i}")
            puts.append(time.perf_counter() - started)
            meta = client.get_meta(list(batch), 256, partition_id=f"g{i}", task_name="t")
            started = time.perf_counter()
            client.get_data(meta)
            gets.append(time.perf_counter() - started)
            client.clear(partition_id=f"g{i}")
    finally:
        client.close()
        controller.stop()
        for unit in units:
            unit.stop()
    return statistics.median(puts), statistics.median(gets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    for name, secret in (("plain TCP", b""), ("CURVE (the default)", b"k" * 32)):
        put, get = measure(secret, args.reps)
        print(f"{name:20s} put {1000 * put:7.1f} ms   get_data {1000 * get:7.1f} ms   (medians of {args.reps})")


if __name__ == "__main__":
    main()
