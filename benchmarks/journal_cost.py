"""The ``journal`` workload: what the controller's journal (``journal_dir``) adds to small puts and get_metas.

Three controllers of their own (not the named queue), each with its own two storage units: no journal,
``journal_fsync="never"`` (one write() per serving pass) and ``"always"`` (a write and an fsync per pass, before its
replies). A client of each talks to its controller over TCP (a journaled controller is reached over TCP only: its
port is the one thing that stays the same across its restart); the rounds alternate between the three so drift in
the machine's load hits them alike. Each rep: ``per_rep`` puts of 64 x 1 KiB rows into a fresh partition, then
``per_rep`` get_metas of 64 of them; p50 of each. Ratio = journaled / not journaled.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import msgspec
import numpy as np
import ray
import torch
from bench import Bench
from common import p50_ms, settle, timed
from tensordict import TensorDict

import transfer_queue as tq

MODES = ("off", "never", "always")


def _queue(mode: str, directory: str) -> tuple[Any, tq.TransferQueueClient]:
    journal = {} if mode == "off" else {"journal_dir": f"{directory}/{mode}", "journal_fsync": mode}
    controller = tq.TransferQueueController.remote(64, num_storage_units=2, http_port=-1, **journal)
    info = ray.get(controller.get_info.remote())
    info = msgspec.structs.replace(info, controller=msgspec.structs.replace(info.controller, unix=None))
    return controller, tq.TransferQueueClient(f"journal-{mode}", info)


def bench_journal(bench: Bench) -> None:
    td = TensorDict({"x": torch.randint(0, 255, (64, 1024), dtype=torch.uint8)}, batch_size=[64])
    per_rep = 50
    directory = tempfile.mkdtemp(prefix="tq-bench-journal-")
    queues = {mode: _queue(mode, directory) for mode in MODES}
    puts: dict[str, list[float]] = {m: [] for m in MODES}
    gets: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for rep in range(bench.reps + 1):  # the first rep warms up
            order = MODES[rep % 3 :] + MODES[: rep % 3]
            for mode in order:
                client = queues[mode][1]
                pid = bench.fresh("journal")
                settle()
                put_times = [timed(lambda c=client, pid=pid: c.put(td, partition_id=pid))[0] for _ in range(per_rep)]
                get_times = [
                    timed(lambda c=client, pid=pid: c.get_meta(["x"], 64, partition_id=pid, task_name="t"))[0]
                    for _ in range(per_rep)
                ]
                client.clear(partition_id=pid)
                if rep:
                    puts[mode].append(p50_ms(put_times))
                    gets[mode].append(p50_ms(get_times))
        for op, reps in (("put", puts), ("get_meta", gets)):
            base = float(np.median(reps["off"]))
            bench.add(f"{op}.small.journal_off.tcp", "journal", "ms", reps["off"])
            for mode in ("never", "always"):
                bench.add(
                    f"{op}.small.journal_{mode}.tcp",
                    "journal",
                    "ms",
                    reps[mode],
                    baseline="no journal (tcp)",
                    baseline_value=base,
                )
    finally:
        for controller, client in queues.values():
            client.close()
            ray.get(controller.shutdown.remote())
            ray.kill(controller)
        shutil.rmtree(directory, ignore_errors=True)
