"""``shm``: the ``large`` (~1 GB) and ``grpo`` (~21 MB) payloads through shared memory and over the Unix socket, in
the same run, against a preallocated memcpy (issue 29).

Clients of the same queue (its storage units pool shared memory), one after the other: one with ``shared_memory``
off (the socket path, as before), then with it on, its copies on one thread (``.one_copy_thread`` rows) and as
they are (split over ``transfer_queue.wire.shm.COPY_THREADS`` threads from 64 MiB on; the goal rows). Per client
and repetition: a put of the batch, then ``reads`` get_datas of it in a row (9 of the large batch, 5 of grpo; the
first one's median is the figure, every read's time says whether a slow mode is left), then a clear. The baseline
copies the batch's bytes into preallocated, already touched arrays (the best any one-copy path can do here).

Each read also counts the client's minor page faults (``getrusage``): the slow mode was first-touch faults of fresh
receive buffers, which a loaded machine's scheduling cannot fake.

Goals (issue 29): 1 GB get_data >= 50% of the memcpy's GB/s, 1 GB put >= 6 GB/s, 21 MB get_data <= 2x the memcpy.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import msgspec
import numpy as np
import torch
from bench import Bench, grpo_batch, payload_bytes
from common import settle, timed, wait_until

import transfer_queue as tq
from transfer_queue.wire import shm as shm_wire


def preallocated_memcpy(td: Any) -> float:
    """Seconds to copy ``td``'s bytes into arrays allocated and touched beforehand (one thread, numpy)."""
    views = [v.reshape(-1).view(torch.uint8).numpy() for v in td.values()]
    targets = [np.ones_like(v) for v in views]  # touched: no page fault in the timed copy
    t0 = time.perf_counter()
    for target, view in zip(targets, views, strict=True):
        np.copyto(target, view)
    return time.perf_counter() - t0


def _client(bench: Bench, shared_memory: bool) -> tq.TransferQueueClient:
    info = bench.client.controller_info
    info = msgspec.structs.replace(info, config={**info.config, "shared_memory": shared_memory})
    return tq.TransferQueueClient(f"bench-shm-{'on' if shared_memory else 'off'}", info)


def _rounds(bench: Bench, client: tq.TransferQueueClient, td: Any, reads: int) -> dict[str, list[float]]:
    """Per repetition: one put (seconds), ``reads`` get_datas of its rows (seconds each)."""
    import ray

    stats = lambda: ray.get(bench.controller.storage_stats.remote())  # noqa: E731
    base = sum(u["bytes"] for u in stats())
    puts, gets, faults, put_faults, unit_put_faults, checked = [], [], [], [], [], False
    unit_faults = lambda: sum(u["page_faults"] for u in stats())  # noqa: E731
    for _ in range(bench.reps + 1):  # the first round warms up (pools, mappings, grants): not counted
        pid = bench.fresh("shm")
        settle()
        before, unit_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, unit_faults()
        t_put, meta = timed(lambda pid=pid: client.put(td, partition_id=pid))
        put_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        unit_put_faults.append(unit_faults() - unit_before)
        times = []
        for _ in range(reads):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t_get, back = timed(lambda m=meta: client.get_data(m))
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            if not checked:
                for k, v in td.items():
                    assert torch.equal(back[k][::97], v[::97]), k
                checked = True
            del back
            times.append(t_get)
        client.clear(partition_id=pid)
        wait_until(lambda: sum(u["bytes"] for u in stats()) <= base, 60, "storage drop")
        puts.append(t_put)
        gets.append(times)
    counted = faults[reads:]  # the warm-up round's reads left out
    return {"put": puts[1:], "get": [t[0] for t in gets[1:]], "all_gets": [x for t in gets[1:] for x in t],
            "faults": counted, "put_faults": put_faults[1:], "unit_put_faults": unit_put_faults[1:]}  # fmt: skip


def bench_shm(bench: Bench) -> None:
    import ray

    rows = 3 * 1024 if bench.quick else 12 * 1024
    for label, td, reads in (("grpo", grpo_batch(256), 5), (f"large{rows}", grpo_batch(rows), 9)):
        gb = payload_bytes(td) / 1e9
        copies = [preallocated_memcpy(td) for _ in range(max(5, bench.reps))]
        memcpy_s = float(np.median(copies))
        bench.add(f"memcpy.preallocated.{label}", "shm", "GB/s", [gb / t for t in copies],
                  extra={"GB": round(gb, 3)})  # fmt: skip
        # the socket; shared memory with its copies on one thread; shared memory as it is (COPY_THREADS)
        for on, threads in ((False, None), (True, 1), (True, shm_wire.COPY_THREADS)):
            if on and threads == 1 and shm_wire.COPY_THREADS == 1:
                continue  # one thread is the default here: the row below is it
            client = _client(bench, on)
            mode = "shm" if on else "socket"
            if on and threads != shm_wire.COPY_THREADS:
                mode += ".one_copy_thread"
            default_threads, shm_wire.COPY_THREADS = shm_wire.COPY_THREADS, threads or shm_wire.COPY_THREADS
            try:
                got = _rounds(bench, client, td, reads)
            finally:
                shm_wire.COPY_THREADS = default_threads
                client.close()
            on = on and mode == "shm"  # the goal rows: shared memory as it is
            spread = [round(1e3 * t, 1) for t in got["all_gets"]]
            if label == "grpo":
                get_ms = [1e3 * t for t in got["get"]]
                bench.add(f"get_data.{label}.{mode}", "shm", "ms", get_ms, baseline="memcpy preallocated",
                          baseline_value=1e3 * memcpy_s, target="<= 2x memcpy" if on else None,
                          met=float(np.median(get_ms)) <= 2e3 * memcpy_s if on else None,
                          extra={"reads_ms": spread, "client_page_faults_per_read": got["faults"]})  # fmt: skip
                bench.add(f"put.{label}.{mode}", "shm", "ms", [1e3 * t for t in got["put"]],
                          baseline="memcpy preallocated", baseline_value=1e3 * memcpy_s,
                          extra={"client_page_faults_per_put": got["put_faults"],
                                 "units_page_faults_per_put": got["unit_put_faults"]})  # fmt: skip
                continue
            gets = [gb / t for t in got["get"]]
            slowest = round(max(spread) / float(np.median(spread)), 2)
            bench.add(f"get_data.{label}.{mode}", "shm", "GB/s", gets, baseline="memcpy preallocated",
                      baseline_value=gb / memcpy_s, target=">= 0.5x memcpy" if on else None,
                      met=float(np.median(gets)) >= 0.5 * gb / memcpy_s if on else None,
                      extra={"reads_ms": spread, "slowest_over_median": slowest,
                             "client_page_faults_per_read": got["faults"]})  # fmt: skip
            puts = [gb / t for t in got["put"]]
            bench.add(f"put.{label}.{mode}", "shm", "GB/s", puts, target=">= 6 GB/s" if on else None,
                      met=float(np.median(puts)) >= 6.0 if on else None,
                      extra={"client_page_faults_per_put": got["put_faults"],
                                 "units_page_faults_per_put": got["unit_put_faults"]})  # fmt: skip
    shm = [u.get("shm", {}) for u in ray.get(bench.controller.storage_stats.remote())]
    print(f"   storage units' shared-memory pools: {shm}", flush=True)
