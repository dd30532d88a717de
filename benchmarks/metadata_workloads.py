"""Metadata workloads: get_meta latency by partition size and sampler, the controller alone, concurrent clients.

- ``get_meta``: batch 32 on ready data, built-in samplers (Sequential, GRPO, DP via ``sampler_params``), partitions
  of 1k .. 1M rows of a tiny int8 field, spin 0 and spin 200 us; baseline a raw ZeroMQ request/reply of the same
  request and reply sizes (and a raw Unix-domain socket). Also the first call of a task (it builds the task's
  ready index) and a 1M-row partition half consumed.
- ``get_meta_state``: the controller's own cost (``RequestTable.handle`` + encoding the reply), in process.
- ``concurrent``: get_meta/s from 4 client processes (spawned once), each its own task; baseline 4 raw clients.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
from bench import BATCH, N_SAMPLES, Bench, fill, proc_cpu_seconds, spin_label
from common import p50_ms, p99_ms, settle, timed

import transfer_queue as tq
from transfer_queue.config import QueueConfig
from transfer_queue.controller.requests import RequestTable
from transfer_queue.state.queue_state import QueueState
from transfer_queue.wire import protocol as p

SIZES = {"1k": 1_000, "10k": 10_000, "100k": 100_000, "1M": 1_000_000}
SAMPLERS = ("seq", "grpo", "dp")


class MetaCaller:
    """Batch-32 get_metas of one task on one partition, resetting the task's consumption when rows run out."""

    def __init__(self, bench: Bench, pid: str, rows: int, sampler: str):
        self.bench, self.pid, self.rows, self.sampler = bench, pid, rows, sampler
        self.task = f"{sampler}"
        self.left = rows
        self.rounds = itertools.count()
        self._dp_group: str | None = None

    def call(self, client: tq.TransferQueueClient) -> tq.BatchMeta:
        if self.sampler == "dp":  # rank 0 opens a round (reserves 2 x 32 rows), rank 1 takes its share
            if self._dp_group is None:
                self._dp_group, rank = f"round-{next(self.rounds)}", 0
                self.left -= 2 * BATCH
            else:
                rank = 1
            params = {"dp_size": 2, "dp_rank": rank, "dp_group_id": self._dp_group}
            if rank == 1:
                self._dp_group = None
            meta = client.get_meta(["t"], BATCH, partition_id=self.pid, task_name=self.task, sampler_params=params)
        else:
            self.left -= BATCH
            meta = client.get_meta(["t"], BATCH, partition_id=self.pid, task_name=self.task)
        assert len(meta) == BATCH, (len(meta), self.sampler)
        return meta

    def ensure(self, calls: int) -> float | None:
        """Make sure ``calls`` more calls find ready rows; returns the seconds of the first call after a reset."""
        if self.left >= (calls + 2) * BATCH:
            return None
        self.bench.client.reset_consumption(task_name=self.task, partition_id=self.pid)
        self.left = self.rows
        first, _ = timed(lambda: self.call(self.bench.client))  # builds the task's ready index
        if self.sampler == "dp":
            self.call(self.bench.client)
        return first


def meta_sizes(bench: Bench, pid: str) -> tuple[int, int]:
    """Bytes on the wire (envelope + body) of a batch-32 get_meta request and of its reply."""
    envelope = p.encode(p.Envelope(p.PROTOCOL_VERSION, "0" * 32, 1_000_000))
    req = p.encode(p.GetMeta(pid, ["t"], BATCH, "seq", None, False, 60.0))
    meta = bench.client.get_meta(["t"], BATCH, partition_id=pid, task_name="sizes")
    reply = p.encode(p.MetaWire.from_meta(meta))
    return len(envelope) + len(req), len(p.encode(p.ReplyHeader(1_000_000))) + len(reply)


def bench_get_meta(bench: Bench) -> None:
    calls = 24
    sizes = {"1k": SIZES["1k"], "1M": SIZES["1M"]} if bench.quick else SIZES
    spins = sorted(bench.clients)
    base_pid = None
    pids: list[str] = []
    for label, rows in sizes.items():
        pid = bench.fresh(f"gm-{label}")
        pids.append(pid)
        fill_s = fill(bench.client, pid, rows)
        print(f"  (filled {pid} with {rows} rows in {fill_s:.1f} s)", flush=True)
        if base_pid is None:
            base_pid = pid
            req_bytes, rep_bytes = meta_sizes(bench, pid)
            uds = [p50_ms(bench.raw.uds_rtt(req_bytes, rep_bytes, 200)) for _ in range(bench.reps)]
            bench.add(
                f"raw_uds.rtt[{req_bytes}B/{rep_bytes}B]",
                "get_meta",
                "ms",
                uds,
                extra={"note": "plain Unix socket, no ZeroMQ: the floor of a same-host transport"},
            )
            for spin in spins:
                reps = [p50_ms(bench.raw.rtt(req_bytes, rep_bytes, 200, "ipc", spin)) for _ in range(bench.reps)]
                bench.add(
                    f"raw_zmq.rtt[{req_bytes}B/{rep_bytes}B].{spin_label(spin)}",
                    "get_meta",
                    "ms",
                    reps,
                    extra={"req_bytes": req_bytes, "rep_bytes": rep_bytes},
                )
        for sampler in SAMPLERS:
            caller = MetaCaller(bench, pid, rows, sampler)
            first = caller.ensure(10**9)
            if first is not None:
                bench.add(
                    f"get_meta.{sampler}.{label}.first_call",
                    "get_meta",
                    "ms",
                    [first * 1e3],
                    extra={"note": "builds the task's ready index"},
                )
            for spin in spins:
                client = bench.clients[spin]
                per_rep, tails, cpu = [], [], []
                for _ in range(bench.reps):
                    caller.ensure(calls)
                    settle()
                    cpu0 = time.process_time()
                    times = [timed(lambda c=client, k=caller: k.call(c))[0] for _ in range(calls)]
                    cpu.append((time.process_time() - cpu0) / calls)
                    per_rep.append(p50_ms(times))
                    tails.append(p99_ms(times))
                raw = bench.results.value(f"raw_zmq.rtt[{req_bytes}B/{rep_bytes}B].{spin_label(spin)}")
                value = float(np.median(per_rep))
                bench.add(
                    f"get_meta.{sampler}.{label}.{spin_label(spin)}",
                    "get_meta",
                    "ms",
                    per_rep,
                    baseline="raw zmq rtt",
                    baseline_value=raw,
                    target="p50 <= 0.3 ms",
                    met=value <= 0.3,
                    extra={
                        "rows": rows,
                        "p99_ms_median": float(np.median(tails)),
                        "client_cpu_ms_per_call": 1e3 * float(np.median(cpu)),
                    },
                )
    for sampler in SAMPLERS:  # flatness: p50 at the largest size / p50 at 1k, same run
        for spin in spins:
            small = bench.results.get(f"get_meta.{sampler}.1k.{spin_label(spin)}")
            big = bench.results.get(f"get_meta.{sampler}.1M.{spin_label(spin)}")
            if small and big:
                ratio = big.value / small.value
                bench.add(
                    f"get_meta.{sampler}.1M/1k.{spin_label(spin)}",
                    "get_meta",
                    "x",
                    [ratio],
                    target="<= 1.5",
                    met=ratio <= 1.5,
                )
    if "1M" in sizes:
        bench_get_meta_drained(bench, SIZES["1M"])
    for pid in pids:
        bench.client.clear(partition_id=pid)


def bench_get_meta_drained(bench: Bench, rows: int) -> None:
    """A 1M-row partition whose first half a task already consumed: the sequential read goes on."""
    pid = bench.fresh("gm-drain")
    fill(bench.client, pid, rows)
    for sampler in ("seq", "grpo"):
        caller = MetaCaller(bench, pid, rows, sampler)
        caller.ensure(10**9)
        for _ in range(rows // 2 // 4096):  # consume the first half, in big batches (untimed)
            bench.client.get_meta(["t"], 4096, partition_id=pid, task_name=caller.task)
            caller.left -= 4096
        per_rep = []
        for _ in range(bench.reps):
            settle()
            per_rep.append(p50_ms(timed(lambda k=caller: k.call(bench.client))[0] for _ in range(24)))
        value = float(np.median(per_rep))
        bench.add(
            f"get_meta.{sampler}.1M.half_consumed.spin0",
            "get_meta",
            "ms",
            per_rep,
            baseline="raw zmq rtt",
            baseline_value=bench.results.value(_raw_rtt_name(bench, 0.0)),
            target="p50 <= 0.3 ms",
            met=value <= 0.3,
        )
    bench.client.clear(partition_id=pid)


def _raw_rtt_name(bench: Bench, spin: float) -> str:
    r = next(r for r in bench.results.items if r.name.startswith("raw_zmq.rtt[") and r.name.endswith(spin_label(spin)))
    return r.name


# ---- the controller alone -----------------------------------------------------------------------------------------
class ControllerOnly:
    """A QueueState in this process, fed requests directly (no sockets), with ``rows`` rows of a tiny field."""

    def __init__(self, rows: int):
        self.state = QueueState(QueueConfig(global_batch_size=64, num_n_samples=N_SAMPLES))
        self.state.register_sampler("grpo", tq.GRPOSampler(N_SAMPLES))
        self.requests = RequestTable(self.state)  # what the controller's server calls
        self.last: Any = None
        schema = {"t": tq.FieldSchema("dense", "int8", ())}
        for start in range(0, rows, 10_000):
            n = min(10_000, rows - start)
            self.handle(p.Reserve("part", n, schema, n))
            self.handle(p.Commit(self.last.put_id))

    def _respond(self, value: Any, error: BaseException | None) -> None:
        if error is not None:
            raise error
        self.last = value

    def handle(self, request: Any) -> Any:
        self.requests.handle(request, self._respond)
        return self.last

    def p50s(self, request: p.GetMeta, reps: int, calls: int = 24) -> list[float]:
        """Per repetition, the p50 of ``calls`` handle + reply encoding, in ms."""
        per_rep = []
        for _ in range(reps):
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                p.encode(self.handle(request))
                times.append(time.perf_counter() - t0)
            per_rep.append(p50_ms(times))
        return per_rep


def bench_get_meta_state(bench: Bench) -> None:
    """RequestTable.handle(GetMeta) + encoding the reply, in process: the controller's share of a get_meta."""
    note = {"note": "in process, no sockets"}
    for label in ("1k", "1M"):
        rows = SIZES[label]
        ctl = ControllerOnly(rows)
        for task in ("seq", "grpo"):
            req = p.GetMeta("part", ["t"], BATCH, task, None, False, 60.0)
            first, _ = timed(lambda ctl=ctl, req=req: ctl.handle(req))  # builds the task's ready index
            bench.add(
                f"controller.first_get_meta.{task}.{label}",
                "get_meta",
                "ms",
                [first * 1e3],
                extra={"note": "in process; builds the task's ready index (O(rows))"},
            )
            bench.add(
                f"controller.handle_get_meta.{task}.{label}", "get_meta", "ms", ctl.p50s(req, bench.reps), extra=note
            )
        if rows >= 1_000_000:
            for task in ("seq", "grpo"):
                for _ in range(rows // 2 // 4096):  # consume the first half
                    ctl.handle(p.GetMeta("part", ["t"], 4096, task, None, False, 60.0))
                req = p.GetMeta("part", ["t"], BATCH, task, None, False, 60.0)
                bench.add(
                    f"controller.handle_get_meta.{task}.{label}.half_consumed",
                    "get_meta",
                    "ms",
                    ctl.p50s(req, bench.reps),
                    extra=note,
                )


# ---- concurrent clients ------------------------------------------------------------------------------------------
def bench_concurrent(bench: Bench, procs: int = 4) -> None:
    from pool import ClientPool

    calls = 200 if bench.quick else 400
    pid = bench.fresh("conc")
    spins = sorted(bench.clients)
    fill(bench.client, pid, procs * len(spins) * (bench.reps * calls + 5) * BATCH)
    req_bytes, rep_bytes = meta_sizes(bench, pid)
    pool = ClientPool(procs)
    try:
        raw = pool.rates("raw", (bench.raw.addresses["ipc"], req_bytes, rep_bytes), bench.reps, 2000)
        bench.add(f"raw_zmq.rtt.{procs}procs", "concurrent", "ops/s", raw, extra={"note": "python ROUTER echo loop"})
        controller_pid = bench.pids()["controller"]
        for spin in spins:
            info = bench.client.controller_info
            cpu0 = proc_cpu_seconds(controller_pid)
            rates = pool.rates("meta", (info, pid, f"conc-{spin_label(spin)}-", spin, BATCH), bench.reps, calls)
            cpu = proc_cpu_seconds(controller_pid) - cpu0
            requests = procs * (bench.reps * calls + 5)
            value = float(np.median(rates))
            bench.add(
                f"get_meta.seq.{procs}procs.{spin_label(spin)}",
                "concurrent",
                "ops/s",
                rates,
                baseline=f"raw zmq {procs} procs",
                baseline_value=float(np.median(raw)),
                target=">= 5,000/s",
                met=value >= 5000,
                extra={"controller_cpu_ms_per_request": round(1e3 * cpu / requests, 4)},
            )
    finally:
        pool.close()
    bench.client.clear(partition_id=pid)
