"""What the queue workloads share: the :class:`Bench` (options, results, clients, baselines' peers) and data."""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from common import Result, Results, loadavg
from tensordict import TensorDict

import transfer_queue as tq

SPIN = 200e-6
BATCH = 32
N_SAMPLES = 4
SEQ = 4096


@dataclass
class Bench:
    """What the workloads share: options, results, the queue's clients and the baselines' peers."""

    quick: bool
    reps: int
    results: Results
    clients: dict[float, tq.TransferQueueClient]  # by spin_seconds
    controller: Any
    raw: Any  # baselines.RawZmq
    ray_peer: Any
    _names: itertools.count = field(default_factory=itertools.count)

    @property
    def client(self) -> tq.TransferQueueClient:
        return self.clients[0.0]

    def pids(self) -> dict[str, int]:
        """Process ids of the controller and the storage units."""
        import ray

        out = {"controller": ray.get(self.controller.__ray_call__.remote(lambda _: os.getpid()))}
        for unit in ray.get(self.controller.storage_stats.remote()):
            out[f"storage{unit['unit']}"] = unit["pid"]
        return out

    def fresh(self, prefix: str) -> str:
        return f"{prefix}-{next(self._names)}"

    def add(self, name: str, group: str, unit: str, reps: list[float], **kw: Any) -> Result:
        kw.setdefault("extra", {})["loadavg"] = round(loadavg(), 2)
        return self.results.add(Result(name, group, unit, reps, **kw))


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process used so far (all its threads: ZeroMQ's I/O thread included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spin_label(spin: float) -> str:
    return "spin0" if spin == 0 else f"spin{round(spin * 1e6)}us"


def grpo_batch(rows: int, seq: int = SEQ) -> TensorDict:
    """The GRPO schema (pages touched, so copies and sends cost what they would with real data)."""
    return TensorDict(
        {
            "input_ids": torch.randint(0, 32000, (rows, seq), dtype=torch.int64),
            "attention_mask": torch.ones(rows, seq, dtype=torch.int64),
            "old_log_prob": torch.full((rows, seq), -0.5, dtype=torch.float32),
            "rewards": torch.full((rows, 1), 1.0, dtype=torch.float32),
        },
        batch_size=[rows],
    )


def payload_bytes(td: TensorDict) -> int:
    return sum(v.numel() * v.element_size() for v in td.values())


def buffers_of(td: TensorDict) -> list[np.ndarray]:
    return [v.reshape(-1).view(torch.uint8).numpy() for v in td.values()]


def fill(client: tq.TransferQueueClient, pid: str, rows: int, chunk: int = 10_000) -> float:
    """Put ``rows`` rows of a tiny int8 field into partition ``pid``; returns seconds."""
    t0 = time.perf_counter()
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        client.put(TensorDict({"t": torch.zeros(n, dtype=torch.int8)}, batch_size=[n]), partition_id=pid)
    return time.perf_counter() - t0
