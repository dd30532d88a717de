"""A network partition that heals: host B is cut off for a few seconds while clients on A and B keep calling.

Controller and unit 0 on host A, unit 1 on host B. Prints STEP lines the test acts on (PARTITION: cut host B off, then
heal it and answer), then one JSON line: what every call saw, per host.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Any

import ray
import torch

from transfer_queue import TransferQueueClient, TransferQueueController
from transfer_queue.errors import TransferQueueError

address, node_ip = sys.argv[1], sys.argv[2]
ray.init(address=address, _node_ip_address=node_ip, logging_level="ERROR")
TIMEOUT = 2.0  # each call's timeout during the test


def on(host: str) -> dict[str, Any]:
    return {"resources": {f"host_{host}": 1}}


def attempt(events: list[dict[str, Any]], what: str, fn: Any) -> Any:
    started = time.monotonic()
    try:
        value = fn()
        events.append({"what": what, "ok": True, "s": time.monotonic() - started})
        return value
    except TransferQueueError as exc:
        error = {"error": type(exc).__name__, "msg": str(exc)[:300]}
        events.append({"what": what, **error, "s": time.monotonic() - started})
        return None


def recovered(events: list[dict[str, Any]], calls_per_round: int) -> bool:
    """Some call failed, and the last three rounds all succeeded."""
    tail = events[-3 * calls_per_round :]
    return any("error" in e for e in events) and len(tail) == 3 * calls_per_round and all(e.get("ok") for e in tail)


@ray.remote(num_cpus=0)
class Prober:
    def __init__(self, info: Any):
        self.client = TransferQueueClient(f"prober-{socket.gethostname()}", info)

    def put(self, value: float) -> Any:
        return self.client.put({"x": torch.full((2, 8), value)}, partition_id="p")

    def loop_a(self, meta_on_b: Any, seconds: float) -> list[dict[str, Any]]:
        """Host A: reads of rows on B's unit, and puts; until they failed and then worked again."""
        events: list[dict[str, Any]] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not recovered(events, 2):
            attempt(events, "get_data(unit 1)", lambda: self.client.get_data(meta_on_b, timeout=TIMEOUT))
            meta = attempt(
                events,
                "put",
                lambda: self.client.put({"x": torch.zeros(2, 8)}, partition_id="q", timeout=TIMEOUT),
            )
            if meta is not None:
                events[-1]["units"] = sorted(set((meta.blocks[:, 0] % 2).tolist()))
            time.sleep(0.3)
        return events

    def loop_b(self, seconds: float) -> list[dict[str, Any]]:
        """Host B: calls to the controller on A; until they failed and then worked again."""
        events: list[dict[str, Any]] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not recovered(events, 1):
            attempt(events, "get_production_status", lambda: self.client.get_production_status(partition_id="p"))
            time.sleep(0.3)
        return events


def step(name: str) -> None:
    print(name, flush=True)
    assert sys.stdin.readline().strip() == "done"


def main() -> None:
    controller = TransferQueueController.options(**on("a")).remote(
        8, num_storage_units=2, storage_unit_options=[on("a"), on("b")], default_timeout=TIMEOUT
    )
    info = ray.get(controller.get_info.remote())
    a, b = Prober.options(**on("a")).remote(info), Prober.options(**on("b")).remote(info)
    metas = [ray.get(a.put.remote(v)) for v in (1.0, 2.0)]  # small puts take the units in turn
    meta_on_b = next(m for m in metas if int(m.blocks[0, 0]) % 2 == 1)
    runs = [a.loop_a.remote(meta_on_b, 90.0), b.loop_b.remote(90.0)]
    time.sleep(2.0)  # a few calls that work before the partition
    step("PARTITION")  # the test cuts host B off, waits, heals it, then answers
    events_a, events_b = ray.get(runs, timeout=150)
    stats = ray.get(controller.server_stats.remote())
    ray.get(controller.shutdown.remote())
    print(json.dumps({"a": events_a, "b": events_b, "down_after": stats["storage_units_down"]}))


main()
