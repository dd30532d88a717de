"""Payload workloads: put and get_data of small, grpo and large batches, next to raw ZeroMQ, Ray and memcpy.

- ``small``: 64 rows x 1 KiB, spin 0 and 200 us.
- ``grpo``: 256 samples x {input_ids, attention_mask int64[4096], old_log_prob float32[4096], rewards float32[1]}
  (~21 MB).
- ``large``: ~1 GB (the grpo schema x 48 rows) over 2 storage units: GB/s each way, storage bytes and RSS.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from bench import Bench, buffers_of, grpo_batch, payload_bytes, spin_label
from common import p50_ms, settle, timed, wait_until
from tensordict import TensorDict

import transfer_queue as tq


class TransportLog:
    """Times every transport round trip of a client (wraps its private transport while active): splits a put into
    reserve / write / commit and a get_data into its storage round trip, the rest being client-side work."""

    def __init__(self, client: tq.TransferQueueClient):
        self._transport = client._client._transport
        self.times: list[float] = []

    def __enter__(self) -> TransportLog:
        inner = self._transport.call_many

        async def call_many(calls: Any, timeout: float, into: Any = None) -> Any:
            t0 = time.perf_counter()
            out = await inner(calls, timeout, into)
            self.times.append(time.perf_counter() - t0)
            return out

        self._transport.call_many = call_many
        return self

    def __exit__(self, *exc: Any) -> None:
        del self._transport.call_many  # back to the class's method


def _put_get_reps(bench: Bench, client: tq.TransferQueueClient, td: TensorDict, per_rep: int) -> tuple:
    """Per repetition: ``per_rep`` puts then ``per_rep`` get_datas of their metas (p50 each), then ``per_rep``
    get_datas of get_meta's metas of the same rows (the consumer's path: get_data then acknowledges them), then a
    clear. Also returns the median split of a put (reserve, write, commit, client) and a get (storage, client), in
    ms."""
    puts, gets, put_split, get_split, leased_gets = [], [], [], [], []
    pid = bench.fresh("payload")
    meta = client.put(td, partition_id=pid)  # warm up, and check the round trip once
    back = client.get_data(meta)
    for k, v in td.items():
        assert torch.equal(back[k], v), k
    client.clear(partition_id=pid)
    for _ in range(bench.reps):
        pid = bench.fresh("payload")
        settle()
        put_times, metas = [], []
        for _ in range(per_rep):
            with TransportLog(client) as log:
                t, meta = timed(lambda pid=pid: client.put(td, partition_id=pid))
            put_times.append(t)
            put_split.append([*log.times, t - sum(log.times)])
            metas.append(meta)
        get_times = []
        for m in metas:
            with TransportLog(client) as log:
                t, _ = timed(lambda m=m: client.get_data(m))
            get_times.append(t)
            get_split.append([*log.times, t - sum(log.times)])
        leased_times = []  # the consumer's path: a get_meta's meta, which get_data also acknowledges
        for m in metas:
            leased = client.get_meta(list(td.keys()), len(m), partition_id=pid, task_name="bench")
            t, _ = timed(lambda m=leased: client.get_data(m))
            leased_times.append(t)
        puts.append(p50_ms(put_times))
        gets.append(p50_ms(get_times))
        leased_gets.append(p50_ms(leased_times))
        client.clear(partition_id=pid)
    put_ms = _split(("reserve", "write", "commit", "client"), put_split)
    return puts, gets, put_ms, _split(("storage", "client"), get_split), leased_gets


def _split(names: tuple[str, ...], rows: list[list[float]]) -> dict[str, float]:
    return dict(zip(names, (1e3 * np.median(rows, axis=0)).round(3).tolist(), strict=True))


def _raw_payload(bench: Bench, td: TensorDict, label: str, per_rep: int, transports: tuple[str, ...]) -> None:
    bufs = buffers_of(td)
    sizes = [b.nbytes for b in bufs]
    for transport in transports:
        sends = [p50_ms(bench.raw.send(bufs, transport) for _ in range(per_rep)) for _ in range(bench.reps)]
        bench.add(f"raw_zmq.send.{label}.{transport}", label, "ms", sends)
        fetches = [p50_ms(bench.raw.fetch(sizes, transport) for _ in range(per_rep)) for _ in range(bench.reps)]
        bench.add(f"raw_zmq.fetch.{label}.{transport}", label, "ms", fetches)
    bench.raw.drop_cache()


def _ray_and_memcpy(bench: Bench, td: TensorDict, label: str, per_rep: int) -> None:
    from baselines import memcpy, ray_get_from_actor, ray_put_get, torch_clone

    tensors = dict(td.items())
    copies = [p50_ms(memcpy(tensors) for _ in range(per_rep)) for _ in range(bench.reps)]
    bench.add(f"memcpy.{label}", label, "ms", copies)
    clones = [p50_ms(torch_clone(tensors) for _ in range(per_rep)) for _ in range(bench.reps)]
    bench.add(f"torch_clone.{label}", label, "ms", clones, extra={"torch_threads": torch.get_num_threads()})
    for kind, value in (("torch", tensors), ("numpy", {k: v.numpy() for k, v in tensors.items()})):
        puts = [p50_ms(ray_put_get(bench.ray_peer, value) for _ in range(per_rep)) for _ in range(bench.reps)]
        bench.add(f"ray.put+actor_get.{label}.{kind}", label, "ms", puts)
        import ray

        ray.get(bench.ray_peer.hold.remote(value))
        gets = []
        for _ in range(bench.reps):
            times = []
            for _ in range(per_rep):
                t, got = ray_get_from_actor(bench.ray_peer)
                times.append(t)
                del got
            gets.append(p50_ms(times))
        ray.get(bench.ray_peer.drop.remote())
        bench.add(f"ray.actor_return+get.{label}.{kind}", label, "ms", gets)


def bench_small(bench: Bench) -> None:
    td = TensorDict({"x": torch.randint(0, 255, (64, 1024), dtype=torch.uint8)}, batch_size=[64])
    per_rep = 50
    _raw_payload(bench, td, "small", 200, ("ipc",))
    raw_send = bench.results.value("raw_zmq.send.small.ipc")
    raw_fetch = bench.results.value("raw_zmq.fetch.small.ipc")
    for spin in sorted(bench.clients):
        puts, gets, put_ms, get_ms, leased = _put_get_reps(bench, bench.clients[spin], td, per_rep)
        tag = spin_label(spin)
        bench.add(f"get_data.small.get_meta.{tag}", "small", "ms", leased, baseline="raw zmq fetch",
                  baseline_value=raw_fetch)  # fmt: skip
        bench.add(
            f"put.small.{tag}",
            "small",
            "ms",
            puts,
            baseline="raw zmq send",
            baseline_value=raw_send,
            target="<= 0.6 ms",
            met=float(np.median(puts)) <= 0.6,
            extra={"split_ms": put_ms},
        )
        bench.add(
            f"get_data.small.{tag}",
            "small",
            "ms",
            gets,
            baseline="raw zmq fetch",
            baseline_value=raw_fetch,
            target="<= 0.6 ms",
            met=float(np.median(gets)) <= 0.6,
            extra={"split_ms": get_ms},
        )
    _ray_and_memcpy(bench, td, "small", 20)


def bench_grpo(bench: Bench) -> None:
    td = grpo_batch(256)
    per_rep = 8
    _raw_payload(bench, td, "grpo", per_rep, ("ipc", "tcp"))
    puts, gets, put_ms, get_ms, leased = _put_get_reps(bench, bench.client, td, per_rep)
    raw_send = min(bench.results.value(f"raw_zmq.send.grpo.{t}") for t in ("ipc", "tcp"))
    raw_fetch = min(bench.results.value(f"raw_zmq.fetch.grpo.{t}") for t in ("ipc", "tcp"))
    mb = payload_bytes(td) / 1e6
    for op, reps, base, what, split in (
        ("put", puts, raw_send, "send", put_ms),
        ("get_data", gets, raw_fetch, "fetch", get_ms),
    ):
        ratio = float(np.median(reps)) / base
        bench.add(
            f"{op}.grpo",
            "grpo",
            "ms",
            reps,
            baseline=f"raw zmq {what} (best)",
            baseline_value=base,
            target="<= 1.3x raw",
            met=ratio <= 1.3,
            extra={"MB": round(mb, 2), "split_ms": split},
        )
    bench.add("get_data.grpo.get_meta", "grpo", "ms", leased, baseline="raw zmq fetch (best)", baseline_value=raw_fetch)
    _ray_and_memcpy(bench, td, "grpo", 5)


def bench_large(bench: Bench) -> None:
    import ray

    rows = 3 * 1024 if bench.quick else 12 * 1024
    td = grpo_batch(rows)
    nbytes = payload_bytes(td)
    gb = nbytes / 1e9
    label = f"large{gb:.2f}GB"
    client = bench.client
    stats = lambda: ray.get(bench.controller.storage_stats.remote())  # noqa: E731
    start = stats()
    rss_start = sum(u["rss_bytes"] for u in start)
    bytes_start = sum(u["bytes"] for u in start)  # other workloads' partitions, if any
    puts, gets, gets_again, held, rss_growth, rss_back, split = [], [], [], [], [], [], []
    for rep in range(bench.reps):
        pid = bench.fresh("large")
        settle()
        before = stats()
        t_put, meta = timed(lambda pid=pid: client.put(td, partition_id=pid))
        after = stats()
        with TransportLog(client) as log:
            t_get, back = timed(lambda m=meta: client.get_data(m))
        split.append([*log.times, t_get - sum(log.times)])
        if rep == 0:
            for k, v in td.items():
                assert torch.equal(back[k][::997], v[::997]), k
        del back
        t_again, _ = timed(lambda m=meta: client.get_data(m))  # the same rows again: memory already faulted in
        client.clear(partition_id=pid)
        cleared = wait_until(
            lambda: (s := stats()) and sum(u["bytes"] for u in s) <= bytes_start and s, 60, "storage drop"
        )
        puts.append(gb / t_put)
        gets.append(gb / t_get)
        gets_again.append(gb / t_again)
        held.append(sum(u["bytes"] for u in after) / nbytes)
        rss_growth.append((sum(u["rss_bytes"] for u in after) - sum(u["rss_bytes"] for u in before)) / nbytes)
        rss_back.append(sum(u["rss_bytes"] for u in cleared) / rss_start)
    from_puts = []  # the same rows put 256 at a time (a step from many rollout puts), read back in one get_data
    for _ in range(bench.reps):
        pid = bench.fresh("large-puts")
        for start in range(0, rows, 256):
            client.put(td[start : start + 256], partition_id=pid)
        meta = client.get_meta(list(td.keys()), rows, partition_id=pid, task_name="large")
        settle()
        t_get, back = timed(lambda m=meta: client.get_data(m))
        del back
        from_puts.append(gb / t_get)
        client.clear(partition_id=pid)
        wait_until(lambda: sum(u["bytes"] for u in stats()) <= bytes_start, 60, "storage drop")
    bufs, sizes = buffers_of(td), [b.nbytes for b in buffers_of(td)]
    raw: dict[str, float] = {}
    for transport in ("ipc", "tcp"):
        for what, fn in (
            ("send", lambda t=transport: bench.raw.send(bufs, t)),
            ("fetch", lambda t=transport: bench.raw.fetch(sizes, t)),
        ):
            reps = [gb / fn() for _ in range(bench.reps)]
            raw[f"{what}.{transport}"] = float(np.median(reps))
            bench.add(f"raw_zmq.{what}.{label}.{transport}", "large", "GB/s", reps)
    bench.raw.drop_cache()
    bench.add(
        f"put.{label}",
        "large",
        "GB/s",
        puts,
        baseline="raw zmq send (best)",
        baseline_value=max(raw["send.ipc"], raw["send.tcp"]),
        target=">= 1.2 GB/s",
        met=float(np.median(puts)) >= 1.2,
    )
    fetch = {"baseline": "raw zmq fetch (best)", "baseline_value": max(raw["fetch.ipc"], raw["fetch.tcp"])}
    bench.add(f"get_data.{label}", "large", "GB/s", gets, **fetch, target=">= 1.2 GB/s",
              met=float(np.median(gets)) >= 1.2, extra={"split_ms": _split(("storage", "client"), split)})  # fmt: skip
    bench.add(f"get_data.{label}.again", "large", "GB/s", gets_again, **fetch,
              extra={"note": "a second get of the same rows (its memory was just freed by the first)"})  # fmt: skip
    bench.add(f"get_data.{label}.from_puts", "large", "GB/s", from_puts, **fetch,
              extra={"note": f"the rows put in {-(-rows // 256)} puts of 256, read back in one get_data"})  # fmt: skip
    bench.add(f"storage.bytes/payload.{label}", "large", "x", held, target="<= 1.2", met=max(held) <= 1.2)
    bench.add(
        f"storage.rss_growth/payload.{label}",
        "large",
        "x",
        rss_growth,
        target="<= 1.2",
        met=float(np.median(rss_growth)) <= 1.2,
    )
    bench.add(
        f"storage.rss_after_clear/start.{label}",
        "large",
        "x",
        rss_back,
        target="<= 1.10",
        met=max(rss_back) <= 1.10,
        extra={"rss_start_bytes": rss_start},
    )
    tensors = dict(td.items())
    from baselines import memcpy, ray_get_from_actor, ray_put_get, torch_clone

    bench.add(f"memcpy.{label}", "large", "GB/s", [gb / memcpy(tensors) for _ in range(bench.reps)])
    bench.add(f"torch_clone.{label}", "large", "GB/s", [gb / torch_clone(tensors) for _ in range(bench.reps)])
    bench.add(
        f"ray.put+actor_get.{label}.torch",
        "large",
        "GB/s",
        [gb / ray_put_get(bench.ray_peer, tensors) for _ in range(bench.reps)],
    )
    ray.get(bench.ray_peer.hold.remote(tensors))
    gets_ray = []
    for _ in range(bench.reps):
        t, got = ray_get_from_actor(bench.ray_peer)
        del got
        gets_ray.append(gb / t)
    ray.get(bench.ray_peer.drop.remote())
    bench.add(f"ray.actor_return+get.{label}.torch", "large", "GB/s", gets_ray)
