"""A node dies with ``replicas=2``: host B (one of three storage units' node) is killed outright while the queue holds
rows on it, each row's two copies on units of two different hosts.

Controller and unit 0 on host A, unit 1 on host B, unit 2 on host C; this driver (on A) is the client. Prints KILL_B
(the test kills every process of host B and answers), then one JSON line: what the reads of every row gave back, the
rows the queue reports lost, and what new puts and reads did with host B gone for good.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import ray
import torch

from transfer_queue import TransferQueueClient, TransferQueueController

address, node_ip = sys.argv[1], sys.argv[2]
ray.init(address=address, _node_ip_address=node_ip, logging_level="ERROR")


def on(host: str) -> dict[str, Any]:
    return {"resources": {f"host_{host}": 1}}


def main() -> None:
    controller = TransferQueueController.options(**on("a")).remote(
        8, num_storage_units=3, storage_unit_options=[on("a"), on("b"), on("c")], default_timeout=60.0, replicas=2
    )
    info = ray.get(controller.get_info.remote())
    client = TransferQueueClient("driver-a", info)
    out: dict[str, Any] = {"replica_of": list(info.replica_units or [])}
    metas = [client.put({"x": torch.full((2, 8), float(v))}, partition_id="p") for v in range(6)]
    out["units_per_put"] = [sorted({int(b) % 3 for b in m.blocks[:, 0].tolist()}) for m in metas]  # primaries
    print("KILL_B", flush=True)
    assert sys.stdin.readline().strip() == "done"
    killed = time.monotonic()
    reads = []
    for v, meta in enumerate(metas):  # each row from whichever copy lives: unit 1's from its partner
        started = time.monotonic()
        got = client.get_data(meta, timeout=60.0)["x"]
        reads.append({"ok": bool(torch.equal(got, torch.full((2, 8), float(v)))), "s": time.monotonic() - started})
    out["reads"] = reads
    out["first_read_after_kill_s"] = reads[0]["s"]
    deadline = time.monotonic() + 60
    while 1 not in ray.get(controller.server_stats.remote())["storage_units_down"]:
        assert time.monotonic() < deadline, "the controller never marked unit 1 down"
        time.sleep(0.2)
    out["controller_knew_after_s"] = time.monotonic() - killed
    fresh = []
    for v in (10.0, 11.0, 12.0):  # placed on the live units (A and C) only
        meta = client.put({"x": torch.full((2, 8), v)}, partition_id="p", timeout=60.0)
        fresh.append(
            {
                "units": sorted({int(b) % 3 for b in meta.blocks[:, 0].tolist()}),
                "ok": bool(torch.equal(client.get_data(meta, timeout=60.0)["x"], torch.full((2, 8), v))),
            }
        )
    out["fresh_puts"] = fresh
    out["lost_rows"] = client.lost_rows(partition_id="p")
    status = client.status()
    out["rows_lost"] = status["rows_lost"]
    out["rows_single_copy"] = status["storage"]["rows_single_copy"]
    served = client.get_meta(["x"], 18, partition_id="p", task_name="all", timeout=30.0)
    out["served_rows"] = len(served)
    out["served_ok"] = client.get_data(served, timeout=60.0)["x"].shape[0]
    client.close()
    ray.get(controller.shutdown.remote())
    print(json.dumps(out))


main()
