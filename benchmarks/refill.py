"""A restarted storage unit's refill (``replicas=2``) at growing queue sizes, in process: a controller and three
storage units wired as tests/unit/transfer_queue/controller/test_replicas_local.py wires them (no Ray).

    PYTHONPATH=. .venv/bin/python benchmarks/refill.py [--puts 300 1200 3000 10000]

Per size: ``N`` puts of 64 rows x 4 floats into one partition (one block each, on two of the three units), then unit 0
restarted empty; the seconds until the status reports no unit refilling (``wall``) and the seconds the controller's
serving thread spent planning and starting the refill's batches (``planning``: every ``_start_refill``), which nothing
else is served during.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from tests.unit.transfer_queue.controller.test_replicas_local import UNITS, start_queue, stop_queue, storage, store
from transfer_queue.config import QueueConfig
from transfer_queue.state.placement import replica_units
from transfer_queue.state.queue_state import QueueState


def measure(puts: int) -> dict[str, float]:
    config = QueueConfig(global_batch_size=4, num_storage_units=UNITS, default_timeout=10.0, replicas=2)
    replica_of = replica_units([""] * UNITS, 2)
    queue = start_queue(QueueState(config, None), [store(u, replica_of) for u in range(UNITS)])
    try:
        client, controller = queue.client, queue.controller
        rows = torch.ones(64, 4)
        for _ in range(puts):
            client.put({"x": rows}, partition_id="p")
        spent = [0.0]
        start_refill = controller._start_refill

        def timed(unit: int, now: float) -> bool:
            began = time.perf_counter()
            try:
                return start_refill(unit, now)
            finally:
                spent[0] += time.perf_counter() - began

        controller._start_refill = timed  # type: ignore[method-assign]
        began = time.perf_counter()
        queue.restart(0)
        while storage(client)["refilling"]:
            time.sleep(0.01)
        wall = time.perf_counter() - began
        return {"puts": puts, "blocks_refilled": storage(client)["blocks_refilled"], "wall_s": wall,
                "planning_s": spent[0]}  # fmt: skip
    finally:
        stop_queue(queue)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--puts", type=int, nargs="+", default=[300, 1200, 3000, 10000])
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    for puts in args.puts:
        row = measure(puts)
        print(f"puts={row['puts']} blocks refilled={row['blocks_refilled']} wall={row['wall_s']:.2f} s "
              f"planning={row['planning_s']:.2f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
