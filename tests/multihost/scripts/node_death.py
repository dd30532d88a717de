"""A node dies: host C (a storage unit's node) is killed outright while the queue holds rows on it.

Controller and unit 0 on host A, unit 1 on host C; this driver (on A) is the client. Prints KILL_C (the test kills
every process of host C and answers), then one JSON line: what the reads, puts and clear saw, and how the controller
and Ray reported the unit.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import ray
import torch

from transfer_queue import TransferQueueClient, TransferQueueController
from transfer_queue.errors import TransferQueueError

address, node_ip = sys.argv[1], sys.argv[2]
ray.init(address=address, _node_ip_address=node_ip, logging_level="ERROR")


def on(host: str) -> dict[str, Any]:
    return {"resources": {f"host_{host}": 1}}


def timed(fn: Any) -> dict[str, Any]:
    started = time.monotonic()
    try:
        fn()
        return {"ok": True, "s": time.monotonic() - started}
    except TransferQueueError as exc:
        return {"error": type(exc).__name__, "msg": str(exc)[:400], "s": time.monotonic() - started}


def main() -> None:
    controller = TransferQueueController.options(**on("a")).remote(
        8, num_storage_units=2, storage_unit_options=[on("a"), on("c")], default_timeout=60.0
    )
    client = TransferQueueClient("driver-a", ray.get(controller.get_info.remote()))
    metas = [client.put({"x": torch.full((2, 8), v)}, partition_id="p") for v in (1.0, 2.0)]  # one put per unit
    on_c = next(m for m in metas if int(m.blocks[0, 0]) % 2 == 1)
    out: dict[str, Any] = {"rows_on_c": on_c.global_indexes.tolist()}
    print("KILL_C", flush=True)
    assert sys.stdin.readline().strip() == "done"
    killed = time.monotonic()
    out["first_read"] = timed(lambda: client.get_data(on_c, timeout=60.0))  # the first failure: seen by the socket
    deadline = time.monotonic() + 60
    while 1 not in ray.get(controller.server_stats.remote())["storage_units_down"]:
        assert time.monotonic() < deadline, "the controller never marked unit 1 down"
        time.sleep(0.2)
    out["controller_knew_after_s"] = time.monotonic() - killed
    out["puts"] = []
    for v in (3.0, 4.0, 5.0):
        meta = client.put({"x": torch.full((2, 8), v)}, partition_id="p", timeout=60.0)
        out["puts"].append(sorted(set((meta.blocks[:, 0] % 2).tolist())))
    out["second_read"] = timed(lambda: client.get_data(on_c, timeout=60.0))  # known down: at once
    out["clear"] = timed(lambda: client.clear(partition_id="p"))
    # Ray's verdict (the node's health checks, or the actor's death) replaces the socket's: down for good.
    deadline = time.monotonic() + 120
    reason = ""
    while "Ray" not in reason and time.monotonic() < deadline:
        reason = ray.get(controller.server_stats.remote())["storage_units_down_reasons"].get(1, "")
        time.sleep(0.5)
    out["ray_reason"] = reason
    out["ray_knew_after_s"] = time.monotonic() - killed
    client.close()
    ray.get(controller.shutdown.remote())
    print(json.dumps(out))


main()
