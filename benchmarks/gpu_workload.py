"""``gpu``: CUDA tensors through the queue (issue 29, section 3), against torch's own host<->device copies taken in
the same run. Skipped, with the reason printed, where torch sees no GPU.

Per payload (the ``grpo`` batch, ~21 MB, and ``large``, ~1 GB; 256 MB with ``--quick``), on a client with shared
memory (its storage units on the same host):

- the baselines: torch copies of the batch's tensors into buffers allocated beforehand, host->device and
  device->host, from and to page-locked ("pinned") and ordinary ("pageable") host memory;
- ``put.<payload>.from_cuda``: a put of the batch on the GPU (the queue copies it to page-locked host memory, then
  into the unit), against the page-locked device->host copy alone, and ``put.<payload>.cpu_then_put``: what a
  caller did before, ``put(batch.to("cpu"))``;
- ``get_data.<payload>.to_cuda``: ``get_data(meta, device="cuda")`` (by DMA from the units' shared memory, their
  segments page-locked for CUDA), against the page-locked host->device copy alone; ``.to_cuda.socket``: the same
  from a client without shared memory (received into page-locked memory, then one DMA); and
  ``get_data.<payload>.get_then_to``: ``get_data(meta).to("cuda")``, the path before either.

Ratios are the queue's time over the copy's: 1.0 would be a queue that costs nothing beyond the PCIe transfer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from bench import Bench, grpo_batch, payload_bytes
from common import settle, timed, wait_until
from shm_workload import _client


def _gpu_seconds(fn: Callable[[], Any]) -> float:
    """Seconds of ``fn`` with the GPU's queued work before and after it waited for."""
    torch.cuda.synchronize()
    seconds, _ = timed(lambda: (fn(), torch.cuda.synchronize()))
    return seconds


def _copies(td: Any, reps: int) -> dict[str, list[float]]:
    """Seconds per repetition of torch copying ``td``'s tensors between host buffers and device buffers allocated
    (and touched) beforehand."""
    on_gpu = [v.to("cuda") for v in td.values()]
    device_buffers = [torch.empty_like(v) for v in on_gpu]
    out: dict[str, list[float]] = {}
    for kind in ("pinned", "pageable"):
        host = [torch.empty(v.shape, dtype=v.dtype, pin_memory=kind == "pinned").fill_(1) for v in on_gpu]
        for direction in ("h2d", "d2h"):
            ends = (device_buffers, host) if direction == "h2d" else (host, on_gpu)
            pairs = list(zip(*ends, strict=True))
            copy = functools.partial(_copy_all, pairs, kind == "pinned")
            copy()  # warm-up
            out[f"{direction}.{kind}"] = [_gpu_seconds(copy) for _ in range(reps)]
    return out


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]], non_blocking: bool) -> None:
    for dst, src in pairs:
        dst.copy_(src, non_blocking=non_blocking)


def _rounds(bench: Bench, client: Any, socket_client: Any, on_gpu: Any, reps: int) -> dict[str, list[float]]:
    """Seconds per repetition of each of :func:`_round`'s calls; the first round warms up (torch's pinned-memory
    cache, the shared-memory pools) and checks the bytes."""
    out: dict[str, list[float]] = {}
    for rep in range(reps + 1):
        settle()
        for name, seconds in _round(bench, client, socket_client, on_gpu, check=rep == 0).items():
            if rep:
                out.setdefault(name, []).append(seconds)
    return out


def _round(bench: Bench, client: Any, socket_client: Any, on_gpu: Any, check: bool) -> dict[str, float]:
    """A put from the GPU, get_data(device="cuda") of its rows (shared memory, then the socket), get_data then
    .to("cuda"), and put(batch.to("cpu"))."""
    import ray

    stored = lambda: sum(u["bytes"] for u in ray.get(bench.controller.storage_stats.remote()))  # noqa: E731
    empty, got = stored(), dict[str, Any]()
    pid = bench.fresh("gpu")
    times = {"put": _gpu_seconds(lambda: got.update(meta=client.put(on_gpu, partition_id=pid)))}
    meta = got.pop("meta")
    times["get"] = _gpu_seconds(lambda: got.update(td=client.get_data(meta, device="cuda")))
    if check:
        for k, v in on_gpu.items():
            assert got["td"][k].is_cuda and torch.equal(got["td"][k], v), k
    got.clear()
    times["get_socket"] = _gpu_seconds(lambda: got.update(td=socket_client.get_data(meta, device="cuda")))
    if check:
        for k, v in on_gpu.items():
            assert got["td"][k].is_cuda and torch.equal(got["td"][k], v), k
    got.clear()
    times["get_to"] = _gpu_seconds(lambda: got.update(td=client.get_data(meta).to("cuda")))
    got.clear()
    client.clear(partition_id=pid)
    wait_until(lambda: stored() <= empty, 60, "storage drop")
    again = bench.fresh("gpu")
    times["cpu_put"] = _gpu_seconds(lambda: client.put(on_gpu.to("cpu"), partition_id=again))
    client.clear(partition_id=again)
    wait_until(lambda: stored() <= empty, 60, "storage drop")
    return times


def _page_locked(client: Any) -> int:
    """How many of the units' segments this thread's connections of ``client`` page-locked for CUDA."""
    sockets = client._client._transport._local.__dict__.get("unix", {}).values()
    return sum(
        1 for sock in sockets if getattr(sock, "shm", None) for address in sock.shm.registered.values() if address
    )


def bench_gpu(bench: Bench) -> None:
    if not torch.cuda.is_available():
        print("   skipped: torch sees no CUDA device here (torch.cuda.is_available() is False)", flush=True)
        return
    print(f"   {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    reps = max(5, bench.reps)
    rows = 3 * 1024 if bench.quick else 12 * 1024
    client, socket_client = _client(bench, True), _client(bench, False)
    try:
        for label, td in (("grpo", grpo_batch(256)), (f"large{rows}", grpo_batch(rows))):
            gb = payload_bytes(td) / 1e9
            extra = {"GB": round(gb, 3)}
            copies = _copies(td, reps)
            for name, secs in copies.items():
                bench.add(f"torch.{name}.{label}", "gpu", "GB/s", [gb / s for s in secs], extra=extra)
            h2d, d2h = gb / float(np.median(copies["h2d.pinned"])), gb / float(np.median(copies["d2h.pinned"]))
            got = _rounds(bench, client, socket_client, td.to("cuda"), reps)
            torch.cuda.empty_cache()
            print(f"   {label}: {_page_locked(client)} segments of the units page-locked for the GPU", flush=True)
            for name, key, base, value in (
                ("put.{}.from_cuda", "put", "torch d2h pinned", d2h),
                ("put.{}.cpu_then_put", "cpu_put", "torch d2h pinned", d2h),
                ("get_data.{}.to_cuda", "get", "torch h2d pinned", h2d),
                ("get_data.{}.to_cuda.socket", "get_socket", "torch h2d pinned", h2d),
                ("get_data.{}.get_then_to", "get_to", "torch h2d pinned", h2d),
            ):
                bench.add(name.format(label), "gpu", "GB/s", [gb / t for t in got[key]], baseline=base,
                          baseline_value=value, extra=extra)  # fmt: skip
    finally:
        client.close()
        socket_client.close()
