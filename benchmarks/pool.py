"""A pool of client processes (spawned once: importing torch in 4 fresh processes on a loaded 2-core machine
takes longer than the measurement) that run request loops in lock step, for throughput under concurrency.

Each job runs ``reps`` repetitions; a repetition starts at a barrier shared by all workers, and the rate of a
repetition is the total number of requests over the span from the first start to the last end.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any


def _raw_loop(address: str, req_bytes: int, rep_bytes: int) -> Any:
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    op, pad = f"echo:{rep_bytes}".encode(), b"x" * max(0, req_bytes - 8)

    def once() -> None:
        sock.send_multipart([op, pad], copy=False)
        sock.recv_multipart(copy=False)

    return once, lambda: sock.close(linger=0)


def _meta_loop(info: Any, pid: str, task: str, spin: float, batch: int) -> Any:
    import transfer_queue as tq

    client = tq.TransferQueueClient(f"bench-{task}", info, spin_seconds=spin)

    def once() -> None:
        meta = client.get_meta(["t"], batch, partition_id=pid, task_name=task)
        assert len(meta) == batch

    return once, client.close


def _worker(index: int, jobs: Any, out: Any, barrier: Any) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        kind, args, reps, calls = job
        try:
            if kind == "raw":
                once, close = _raw_loop(*args)
            else:
                info, pid, task_prefix, spin, batch = args
                once, close = _meta_loop(info, pid, f"{task_prefix}{index}", spin, batch)
            for _ in range(5):  # connect, and build this task's ready index
                once()
            for rep in range(reps):
                barrier.wait(timeout=300)
                t0 = time.perf_counter()
                for _ in range(calls):
                    once()
                out.put((rep, t0, time.perf_counter(), calls))
            close()
        except Exception as exc:  # report, and keep the pool usable
            barrier.abort()
            out.put(("error", repr(exc)))


class ClientPool:
    def __init__(self, procs: int):
        ctx = mp.get_context("spawn")
        self.procs = procs
        self._barrier = ctx.Barrier(procs)
        self._out = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(procs)]
        self._workers = [
            ctx.Process(target=_worker, args=(i, self._jobs[i], self._out, self._barrier), daemon=True)
            for i in range(procs)
        ]
        for w in self._workers:
            w.start()

    def rates(self, kind: str, args: tuple, reps: int, calls: int, timeout: float = 300) -> list[float]:
        """Requests per second of each repetition, all workers together."""
        for q in self._jobs:
            q.put((kind, args, reps, calls))
        spans = []
        deadline = time.monotonic() + timeout
        while len(spans) < reps * self.procs:
            item = self._out.get(timeout=max(1.0, deadline - time.monotonic()))
            if item[0] == "error":
                raise RuntimeError(f"a pool worker failed: {item[1]}")
            spans.append(item)
        out = []
        for rep in range(reps):
            mine = [s for s in spans if s[0] == rep]
            out.append(sum(s[3] for s in mine) / (max(s[2] for s in mine) - min(s[1] for s in mine)))
        return out

    def close(self) -> None:
        for q in self._jobs:
            q.put(None)
        for w in self._workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
