"""Metrics endpoints, ``client.status()`` and the status JSON of a running queue, after known traffic."""

from __future__ import annotations

import json
import threading
import urllib.request
from typing import Any

import pytest
import ray
import torch
from prometheus_client.parser import text_string_to_metric_families
from tensordict import TensorDict

from transfer_queue.errors import PartitionCleared


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def batch(n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(n * 64, dtype=torch.float32).reshape(n, 64)}, batch_size=[n])


def test_metrics_after_known_traffic(queue: Any, wait_until: Any) -> None:
    endpoints = ray.get(queue.controller.http_endpoints.remote())
    assert endpoints["controller"].startswith("http://127.0.0.1:")
    assert len(endpoints["storage_units"]) == 2
    controller_url = endpoints["controller"] + "/metrics"
    before = scrape(controller_url)
    units_before = [scrape(u) for u in endpoints["storage_units"]]
    client, step = queue.client, queue.step()
    task = f"obs-{step}"
    client.put(batch(8), global_step=step)
    client.put(batch(8), global_step=step)
    meta = client.get_meta(["x"], 6, global_step=step, task_name=task)
    got = client.get_data(meta)
    acked = ("transfer_queue_rows", (("state", "acknowledged"), ("task", task)))
    # get_data's acknowledgement over the Unix socket is not waited for: the scrape may come first
    after = wait_until(lambda: (m := scrape(controller_url)).get(acked) == 6 and m, what="the acknowledgement")

    def delta(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert after[acked] == 6
    assert after[("transfer_queue_rows", (("state", "ready"), ("task", task)))] == 10
    assert delta("transfer_queue_puts_total") == 2 and delta("transfer_queue_put_rows_total") == 16
    assert delta("transfer_queue_get_rows_total", (("task", task),)) == 6
    assert delta("transfer_queue_request_seconds_count", (("component", "controller"), ("kind", "commit"))) == 2
    assert after[("transfer_queue_clients_connected", ())] >= 1
    payload = 16 * 64 * 4
    units_after = [scrape(u) for u in endpoints["storage_units"]]
    bytes_in = sum(
        a[("transfer_queue_storage_bytes_in_total", (("unit", str(i)),))]
        - b[("transfer_queue_storage_bytes_in_total", (("unit", str(i)),))]
        for i, (a, b) in enumerate(zip(units_after, units_before, strict=True))
    )
    bytes_out = sum(
        a[("transfer_queue_storage_bytes_out_total", (("unit", str(i)),))]
        - b[("transfer_queue_storage_bytes_out_total", (("unit", str(i)),))]
        for i, (a, b) in enumerate(zip(units_after, units_before, strict=True))
    )
    assert bytes_in == payload
    assert bytes_out == got["x"].numel() * 4 == 6 * 64 * 4


def test_status_matches_the_per_partition_calls(queue: Any) -> None:
    client, step = queue.client, queue.step()
    task = f"status-{step}"
    client.put(batch(5), global_step=step)
    client.get_data(client.get_meta(["x"], 2, global_step=step, task_name=task))  # leased, then acknowledged
    status = client.status()
    part = next(p for p in status["partitions"] if p["partition_id"] == step)
    production = client.get_production_status(global_step=step)
    consumption = client.get_consumption_status(global_step=step, task_name=task)
    assert part["rows"] == production["rows"] == 5
    assert part["fields"]["x"] == production["fields"]["x"]["produced"]
    assert part["tasks"][task]["acknowledged"] == consumption["tasks"][task]["consumed"] == 2
    assert ray.get(queue.controller.status.remote()).keys() == status.keys()  # the same summary through Ray
    page = json.loads(urllib.request.urlopen(status["endpoints"]["controller"] + "/status.json", timeout=10).read())
    page_part = next(p for p in page["partitions"] if p["partition_id"] == step)
    assert page_part["tasks"][task] == part["tasks"][task]


def test_status_is_consistent_while_partitions_are_cleared(queue: Any) -> None:
    """One request, one read under the controller's lock: never UnknownPartition, never a half-cleared partition."""
    writer = queue.new_client("writer")
    names = [queue.partition(f"c{i}") for i in range(20)]
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for name in names:
                writer.put(batch(4), partition_id=name)
                writer.clear(partition_id=name)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=churn)
    thread.start()
    while thread.is_alive():
        status = queue.client.status()
        parts = [part for part in status["partitions"] if part["partition_id"] in names]
        assert len(parts) <= 1  # one put then its clear at a time
        for part in parts:
            assert part["rows"] in (0, 4) and part["rows"] + part["rows_in_flight"] <= 4
            assert sum(part["fields"].values()) == part["rows"]
        assert status["partitions_live"] == len(status["partitions"])
    thread.join()
    assert not errors
    assert not [p for p in queue.client.status()["partitions"] if p["partition_id"] in names]


def test_run_metrics_become_gauges_and_curves(queue: Any) -> None:
    controller = queue.controller
    for step in range(3):
        ray.get(controller.record_run_metrics.remote({"kind": "grpo", "step": step, "reward": 0.1 * step, "loss": 1.0}))
    endpoints = ray.get(controller.http_endpoints.remote())
    got = scrape(endpoints["controller"] + "/metrics")
    assert got[("transfer_queue_rl_reward", ())] == 0.2 and got[("transfer_queue_rl_step", ())] == 2
    history = queue.client.status(run_history=True)["run"]["history"]
    assert [r["reward"] for r in history[-3:]] == [0.0, 0.1, 0.2]


def test_errors_are_counted_by_type(queue: Any) -> None:
    endpoints = ray.get(queue.controller.http_endpoints.remote())
    before = scrape(endpoints["controller"] + "/metrics")
    key = (
        "transfer_queue_errors_total",
        (("component", "controller"), ("kind", "get_meta"), ("type", "PartitionCleared")),
    )
    step = queue.step()
    queue.client.put(batch(1), global_step=step)
    queue.client.clear(global_step=step)
    with pytest.raises(PartitionCleared, match=f"global_step={step} was cleared"):
        queue.client.get_meta(["x"], 1, global_step=step, task_name="late")
    after = scrape(endpoints["controller"] + "/metrics")
    assert after[key] - before.get(key, 0) == 1
    recent = queue.client.status()["errors"]["recent"]
    assert recent[-1]["type"] == "PartitionCleared" and recent[-1]["kind"] == "get_meta"
