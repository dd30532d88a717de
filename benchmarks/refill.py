"""A restarted storage unit's refill (``replicas=2``) at growing queue sizes, in process: a controller and three
storage units wired as tests/unit/transfer_queue/controller/test_replicas_local.py wires them (no Ray).

    PYTHONPATH=. .venv/bin/python benchmarks/refill.py [--puts 300 1200 3000 10000] [--retire] [--rows 64]

Per size: ``N`` puts of 64 rows x 4 floats into one partition (one block each, on two of the three units), then unit 0
restarted empty; the seconds until the status reports no unit refilling (``wall``) and the seconds the controller's
serving thread spent planning and starting the refill's batches (``planning``: every ``_start_refill``), which nothing
else is served during.

``--retire``: unit 0 is lost for good instead (stopped, marked down for good as the unit watch does): the seconds until
its copies were moved onto the other two units (``wall``), the controller's time planning and starting the batches
(``planning``: every ``_start_move``), and the rate in blocks, rows and MB per second. ``--rows``: rows per put.
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


def measure(puts: int, retire: bool = False, rows_per_put: int = 64) -> dict[str, float]:
    config = QueueConfig(global_batch_size=4, num_storage_units=UNITS, default_timeout=10.0, replicas=2)
    replica_of = replica_units([""] * UNITS, 2)
    queue = start_queue(QueueState(config, None), [store(u, replica_of) for u in range(UNITS)])
    try:
        client, controller = queue.client, queue.controller
        rows = torch.ones(rows_per_put, 4)
        for _ in range(puts):
            client.put({"x": rows}, partition_id="p")
        spent = [0.0]
        start_refill = controller._start_move if retire else controller._start_refill

        def timed(unit: int, now: float) -> bool:
            began = time.perf_counter()
            try:
                return start_refill(unit, now)
            finally:
                spent[0] += time.perf_counter() - began

        if retire:
            controller._start_move = timed  # type: ignore[method-assign]
            began = time.perf_counter()
            queue.units[0].stop()
            controller.mark_unit(0, "retired by the benchmark", final=True)
            while 0 not in storage(client)["rereplicated"]:
                time.sleep(0.01)
            blocks = storage(client)["blocks_rereplicated"]
        else:
            controller._start_refill = timed  # type: ignore[method-assign]
            began = time.perf_counter()
            queue.restart(0)
            while storage(client)["refilling"]:
                time.sleep(0.01)
            blocks = storage(client)["blocks_refilled"]
        wall = time.perf_counter() - began
        nbytes = blocks * rows.numel() * rows.element_size()
        return {"puts": puts, "blocks": blocks, "wall_s": wall, "planning_s": spent[0],
                "rows_per_s": blocks * rows_per_put / wall, "mb_per_s": nbytes / wall / 1e6}  # fmt: skip
    finally:
        stop_queue(queue)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--puts", type=int, nargs="+", default=[300, 1200, 3000, 10000])
    parser.add_argument("--retire", action="store_true", help="unit 0 lost for good: its copies moved, not refilled")
    parser.add_argument("--rows", type=int, default=64, help="rows of 4 floats per put (one block)")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    for puts in args.puts:
        row = measure(puts, args.retire, args.rows)
        print(f"puts={row['puts']} blocks {'moved' if args.retire else 'refilled'}={row['blocks']} "
              f"wall={row['wall_s']:.2f} s planning={row['planning_s']:.2f} s rows/s={row['rows_per_s']:.0f} "
              f"MB/s={row['mb_per_s']:.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
