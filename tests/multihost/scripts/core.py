"""The core cases across hosts: a controller on host A with one storage unit on every host, clients on every host.

Prints one JSON line: what each check saw, and the cross-host timings (a client on host C, units on A and B only).
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import sys
import time
from typing import Any

import ray
import torch

from transfer_queue import StorageUnit, TransferQueueClient, TransferQueueController
from transfer_queue.client import AsyncTransferQueueClient

address, node_ip = sys.argv[1], sys.argv[2]
ray.init(address=address, _node_ip_address=node_ip, logging_level="ERROR")


def on(host: str) -> dict[str, Any]:
    return {"resources": {f"host_{host}": 1}}


@ray.remote(num_cpus=0)
class Client:
    """A client process pinned to one host; runs scenario functions of this script against its client."""

    def __init__(self, info: Any, name: str):
        self.client = TransferQueueClient(name, info)
        self.info = info

    def run(self, fn: Any, *args: Any) -> Any:
        return fn(self.client, *args)

    def run_async(self, fn: Any, *args: Any) -> Any:
        client = AsyncTransferQueueClient("async", self.info)
        try:
            return asyncio.run(fn(client, *args))
        finally:
            client.close()


# ---- scenario functions (run inside the Client actors) -------------------------------------------------------------
def put_prompts(client: TransferQueueClient) -> dict[str, Any]:
    prompt = torch.arange(8 * 200_000, dtype=torch.float32).reshape(8, 200_000)  # 6.4 MB: spread over the units
    meta = client.put({"prompt": prompt}, global_step=0)
    return {"units": sorted(set((meta.blocks[:, 0] % 3).tolist())), "host": socket.gethostname()}


def read_prompts_write_responses(client: TransferQueueClient) -> dict[str, Any]:
    meta = client.get_meta(["prompt"], 8, global_step=0, task_name="rollout", timeout=30)
    data = client.get_data(meta, timeout=30)
    ok = bool(
        torch.equal(
            data["prompt"],
            torch.arange(8 * 200_000, dtype=torch.float32).reshape(8, 200_000)[torch.as_tensor(meta.global_indexes)],
        )
    )
    client.put({"response": torch.as_tensor(meta.global_indexes).reshape(-1, 1) * 10}, metadata=meta)
    return {"prompts_equal": ok, "host": socket.gethostname()}


def train(client: TransferQueueClient) -> dict[str, Any]:
    meta = client.get_meta(["prompt", "response"], 8, global_step=0, task_name="train", get_n_samples=True, timeout=30)
    data = client.get_data(meta)
    groups = meta.group_ids.tolist()
    client.clear(global_step=0)
    return {
        "responses": data["response"][:, 0].tolist(),
        "indexes": meta.global_indexes.tolist(),
        "groups": groups,
        "first_prompt_values": data["prompt"][:, 0].tolist(),
    }


def put_rows(client: TransferQueueClient, partition: str, values: list[float], groups: list[int] | None) -> None:
    x = torch.tensor(values, dtype=torch.float32).reshape(-1, 1).repeat(1, 16)
    client.put({"x": x}, partition_id=partition, group_ids=groups)


def dp_share(client: TransferQueueClient, rank: int) -> list[float]:
    params = {"dp_rank": rank, "dp_size": 3, "dp_group_id": "round0"}
    meta = client.get_meta(["x"], 4, partition_id="dp", task_name="train", sampler_params=params, timeout=30)
    return client.get_data(meta)["x"][:, 0].tolist()


def grpo_groups(client: TransferQueueClient) -> list[list[float]]:
    meta = client.get_meta(["x"], 4, partition_id="g", task_name="t", get_n_samples=True, timeout=30)
    x = client.get_data(meta)["x"][:, 0].tolist()
    by_group: dict[int, list[float]] = {}
    for g, v in zip(meta.group_ids.tolist(), x, strict=True):
        by_group.setdefault(g, []).append(v)
    return sorted(sorted(v) for v in by_group.values())


def kv_put(client: TransferQueueClient, keys: list[str], value: float) -> None:
    client.kv_batch_put(keys, "kv", {"v": torch.full((len(keys), 3), value)})


def kv_get(client: TransferQueueClient, keys: list[str]) -> list[float]:
    return client.kv_batch_get(keys, "kv")["v"][:, 0].tolist()


async def async_round_trip(client: AsyncTransferQueueClient) -> bool:
    x = torch.randn(6, 1000)
    await client.put({"x": x}, partition_id="async")
    meta = await client.get_meta(["x"], 6, partition_id="async", task_name="t", timeout=30)
    data = await client.get_data(meta)
    return bool(torch.equal(data["x"], x[torch.as_tensor(meta.global_indexes)]))


def ipv6_round_trip(client: TransferQueueClient) -> bool:
    x = torch.randn(4, 300_000)  # 4.8 MB: spread over both units
    meta = client.put({"x": x}, partition_id="v6")
    data = client.get_data(meta)
    return sorted(set((meta.blocks[:, 0] % 2).tolist())) == [0, 1] and bool(torch.equal(data["x"], x))


def timings(client: TransferQueueClient, reps: int) -> dict[str, Any]:
    """put / get_data of a 21 MB GRPO batch (256 samples) and get_meta latency, every byte across hosts."""
    n, seq = 256, 4096
    batch = {
        "input_ids": torch.randint(0, 32000, (n, seq)),
        "attention_mask": torch.ones(n, seq, dtype=torch.int64),
        "old_log_prob": torch.randn(n, seq),
        "rewards": torch.randn(n, 1),
    }
    nbytes = sum(t.numel() * t.element_size() for t in batch.values())
    puts, gets, exact = [], [], True
    for i in range(reps):
        started = time.perf_counter()
        client.put(batch, partition_id=f"grpo{i}")
        puts.append(time.perf_counter() - started)
        meta = client.get_meta(list(batch), n, partition_id=f"grpo{i}", task_name="t", timeout=30)
        started = time.perf_counter()
        data = client.get_data(meta)
        gets.append(time.perf_counter() - started)
        order = torch.as_tensor(meta.global_indexes)
        exact = exact and all(torch.equal(data[k], v[order]) for k, v in batch.items())
        client.clear(partition_id=f"grpo{i}")
    client.put({"x": torch.zeros(400, 4)}, partition_id="small")
    metas = []
    for _ in range(200):
        started = time.perf_counter()
        client.get_meta(["x"], 1, partition_id="small", task_name="t", timeout=30)
        metas.append(time.perf_counter() - started)
    client.clear(partition_id="small")
    return {
        "nbytes": nbytes,
        "put_ms": 1000 * statistics.median(puts),
        "get_data_ms": 1000 * statistics.median(gets),
        "get_meta_ms": 1000 * statistics.median(metas),
        "reps": reps,
        "byte_exact": exact,
    }


def main() -> None:
    out: dict[str, Any] = {}
    # The controller binds host A's address; the units it starts on B and C must bind their own (issue 15 s3).
    controller = TransferQueueController.options(**on("a")).remote(
        4,
        num_global_batch=2,
        num_n_samples=2,
        num_storage_units=3,
        storage_unit_options=[on(h) for h in "abc"],
        bind_host=node_ip,
        default_timeout=30.0,
    )
    info = ray.get(controller.get_info.remote())
    out["controller"] = info.controller.tcp
    out["units"] = [[u.tcp, u.hostname, u.node_id] for u in info.storage_units]
    clients = {h: Client.options(**on(h)).remote(info, f"client-{h}") for h in "abc"}
    out["put"] = ray.get(clients["b"].run.remote(put_prompts))
    out["rollout"] = ray.get(clients["c"].run.remote(read_prompts_write_responses))
    out["train"] = ray.get(clients["a"].run.remote(train))
    # DP: 12 rows put from two hosts, one round served to ranks on three hosts
    ray.get(clients["b"].run.remote(put_rows, "dp", [float(v) for v in range(6)], None))
    ray.get(clients["c"].run.remote(put_rows, "dp", [float(v) for v in range(6, 12)], None))
    out["dp"] = ray.get([clients[h].run.remote(dp_share, r) for r, h in enumerate("abc")])
    # GRPO: each group's members arrive from different hosts; served whole
    ray.get(clients["b"].run.remote(put_rows, "g", [10.0, 20.0], [0, 1]))
    ray.get(clients["c"].run.remote(put_rows, "g", [11.0, 21.0], [0, 1]))
    out["grpo"] = ray.get(clients["a"].run.remote(grpo_groups))
    # kv: insert from C, read from A, upsert from B, read from A again
    ray.get(clients["c"].run.remote(kv_put, ["k1", "k2"], 1.0))
    first = ray.get(clients["a"].run.remote(kv_get, ["k2", "k1"]))
    ray.get(clients["b"].run.remote(kv_put, ["k1"], 5.0))
    out["kv"] = [first, ray.get(clients["a"].run.remote(kv_get, ["k1", "k2"]))]
    out["async"] = ray.get(clients["b"].run_async.remote(async_round_trip))
    ray.get(controller.shutdown.remote())
    # IPv6: units placed by hand, each binding its host's IPv6 address; a client on C reaches both.
    units = [StorageUnit.options(**on(h)).remote(i, 2, bind_host=f"fd03:15::{i + 1}") for i, h in enumerate("ab")]
    v6 = TransferQueueController.options(**on("a")).remote(4, storage_units=units, bind_host="fd03:15::1")
    v6_info = ray.get(v6.get_info.remote())
    out["ipv6_endpoints"] = [v6_info.controller.tcp, *(u.tcp for u in v6_info.storage_units)]
    out["ipv6"] = ray.get(Client.options(**on("c")).remote(v6_info, "v6").run.remote(ipv6_round_trip))
    ray.get(v6.shutdown.remote())
    for unit in units:
        ray.kill(unit)
    # Timings: units on A and B, the client on C: every byte crosses hosts.
    timed = TransferQueueController.options(**on("a")).remote(
        256, num_storage_units=2, storage_unit_options=[on("a"), on("b")], storage_unit_bytes=1 << 30
    )
    timer = Client.options(**on("c")).remote(ray.get(timed.get_info.remote()), "timer")
    out["timings"] = ray.get(timer.run.remote(timings, int(sys.argv[3]) if len(sys.argv) > 3 else 5))
    ray.get(timed.shutdown.remote())
    print(json.dumps(out))


main()
