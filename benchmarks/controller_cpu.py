"""The controller's CPU per call (issue 29): a queue without Ray (``auth_cost.RaylessQueue``: a controller and two
storage units, each in a process of its own), one client in this process making ``get_meta`` calls of ``--batch``
rows of a 262,144-row partition, then small puts (64 rows x 1 KiB), in lock step. Per round: the client's time per
call and the controller process's CPU per call (utime + stime from ``/proc/<pid>/stat``), and, per thread of the
controller, its CPU per get_meta (the serving thread is the one that matters).

    PYTHONPATH=. .venv/bin/python benchmarks/controller_cpu.py --rounds 5 --calls 2000 --puts 300
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _cpu_s(stat_path: str) -> float:
    """utime + stime of a process or thread, in seconds."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid``, by "tid name"."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        path = f"/proc/{pid}/task/{tid}/stat"
        try:
            with open(path) as f:
                name = f.read().split("(", 1)[1].rsplit(")", 1)[0]
            out[f"{tid} {name}"] = _cpu_s(path)
        except OSError:  # the thread ended meanwhile
            continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000, help="get_meta calls per round")
    parser.add_argument("--puts", type=int, default=300, help="small puts per round")
    parser.add_argument("--batch", type=int, default=32, help="rows per get_meta")
    args = parser.parse_args()

    import torch
    from auth_cost import RaylessQueue
    from tensordict import TensorDict

    import transfer_queue as tq

    queue = RaylessQueue(b"")
    try:
        client = tq.TransferQueueClient("controller-cpu", queue.info)
        rows = TensorDict({"x": torch.zeros(1 << 15, 8, dtype=torch.int64)}, batch_size=[1 << 15])
        for _ in range(8):
            client.put(rows, partition_id="p")
        small = TensorDict({"x": torch.randint(0, 255, (64, 1024), dtype=torch.uint8)}, batch_size=[64])
        pid, stat = queue.controller_pid, f"/proc/{queue.controller_pid}/stat"
        if args.rounds * args.calls * args.batch > 8 << 15:
            raise SystemExit(f"--rounds x --calls x --batch must be at most {8 << 15} rows (each round a new task)")
        for r in range(args.rounds):
            client.get_meta(["x"], args.batch, partition_id="p", task_name=f"t{r}")  # the task's index, outside
            threads, cpu, t0 = _threads(pid), _cpu_s(stat), time.perf_counter()
            for _ in range(args.calls - 1):
                client.get_meta(["x"], args.batch, partition_id="p", task_name=f"t{r}")
            t1, cpu1, threads1 = time.perf_counter(), _cpu_s(stat), _threads(pid)
            for _ in range(args.puts):
                client.put(small, partition_id=f"s{r}")
            t2, cpu2 = time.perf_counter(), _cpu_s(stat)
            client.clear(partition_id=f"s{r}")
            n = args.calls - 1
            busiest = max(threads1, key=lambda k: threads1[k] - threads.get(k, 0.0))
            print(
                f"round {r}: get_meta {1e6 * (t1 - t0) / n:.0f} us/call, controller CPU {1e6 * (cpu1 - cpu) / n:.0f} "
                f"us/call (thread {busiest!r}: {1e6 * (threads1[busiest] - threads.get(busiest, 0.0)) / n:.0f}) | "
                f"small put {1e6 * (t2 - t1) / args.puts:.0f} us/call, controller CPU "
                f"{1e6 * (cpu2 - cpu1) / args.puts:.0f} us/put",
                flush=True,
            )
        client.close()
    finally:
        queue.close()


if __name__ == "__main__":
    main()
