"""Metrics, the whole-queue summary and the HTTP endpoint, without Ray: known traffic, exact numbers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from transfer_queue.errors import UnknownPartition
from transfer_queue.ops.metrics import (
    ControllerMetrics,
    Histogram,
    QueueEvents,
    StorageMetrics,
    controller_families,
    render,
    rl_metric_name,
    storage_families,
)
from transfer_queue.ops.status import format_summary, numeric_row, queue_summary
from transfer_queue.ops.web import HttpEndpoint
from transfer_queue.state.partition_status import row_state_counts
from transfer_queue.wire import protocol as p


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus exposition as {(name, sorted labels): value}."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_histogram_buckets_are_cumulative_with_inf():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert h.count == 4 and h.sum == pytest.approx(2.65)


def test_summary_after_known_traffic(make_queue):
    q = make_queue(global_batch_size=4, num_global_batch=2)
    q.put(0, 4)
    q.put(1, 2)
    train = q.get(0, ["x"], 3, "train")
    q.ok(p.Ack(train.partition_uid, "train", p.pack_indexes(train.global_indexes)))  # acknowledged
    q.get(1, ["x"], 1, "eval")  # leased
    q.get_async(1, ["x"], 4, "train")  # waits: only 2 rows exist
    s = queue_summary(q.state, clients=3)
    assert s["partitions_live"] == 2 and s["partitions_closed"] == 1  # step 0 is full: sealed
    assert s["rows_committed"] == 6 and s["waiting_get_meta"] == 1 and s["clients"] == 3
    assert s["tasks"] == {
        "eval": {"ready": 5, "leased": 1, "acknowledged": 0, "dead_lettered": 0},
        "train": {"ready": 3, "leased": 0, "acknowledged": 3, "dead_lettered": 0},
    }
    step0 = next(part for part in s["partitions"] if part["partition_id"] == 0)
    assert "eval" not in step0["tasks"]  # only the tasks that follow it; its 4 rows count as ready in "tasks"
    assert step0["fields"] == {"x": 4} and step0["capacity"] == 4
    assert sum(u["bytes"] for u in s["storage"]["units"]) == s["storage"]["bytes_held"] == 6 * 4
    json.dumps(s)  # what /status.json serves
    p.encode(s)  # what client.status() receives
    table = format_summary(s)
    assert "train=3/4" in table and "eval=0/2(+1 leased)" in table and "DEAD_LETTERED" in table


def test_row_state_counts_keys_and_a_task_that_never_read_has_every_row_ready(make_queue):
    q = make_queue()
    q.put(0, 4)
    q.get(0, ["x"], 1, "train")
    part = q.state.partitions[0]
    assert row_state_counts(part, "train") == {"ready": 3, "leased": 1, "acknowledged": 0, "dead_lettered": 0}
    assert row_state_counts(part, "never") == {"ready": 4, "leased": 0, "acknowledged": 0, "dead_lettered": 0}


def test_controller_metrics_from_answers_and_state(make_queue):
    q = make_queue()
    metrics, events = ControllerMetrics(), q.state.events  # the hook the lease code increments
    assert isinstance(events, QueueEvents)
    reservation = q.reserve(0, 4)
    meta = q.ok(p.Commit(reservation.put_id))
    metrics.answered("commit", 0.0, None, meta, None)
    get = q.get_request(0, ["x"], 2, "train")
    metrics.answered("get_meta", 0.0, get, q.ok(get), None)
    metrics.answered("status", 0.0, None, None, UnknownPartition("global_step=9 not found"))
    events.lease_expired("train", 2)
    events.redelivered("train", 2)
    summary = queue_summary(q.state, metrics=metrics)
    summary["run"]["last"] = numeric_row({"step": 3, "reward": 0.5, "kind": "grpo", "bad": float("nan")})
    got = samples(render(lambda: list(controller_families(summary, metrics, events))))
    assert got[("transfer_queue_rows", (("state", "leased"), ("task", "train")))] == 2
    assert got[("transfer_queue_rows", (("state", "ready"), ("task", "train")))] == 2
    assert got[("transfer_queue_partitions", (("state", "live"),))] == 1
    assert got[("transfer_queue_puts_total", ())] == 1 and got[("transfer_queue_put_rows_total", ())] == 4
    assert got[("transfer_queue_gets_total", (("task", "train"),))] == 1
    assert got[("transfer_queue_get_rows_total", (("task", "train"),))] == 2
    kind = (("component", "controller"), ("kind", "get_meta"))
    assert got[("transfer_queue_requests_total", kind)] == 1
    assert got[("transfer_queue_request_seconds_count", kind)] == 1
    error = (("component", "controller"), ("kind", "status"), ("type", "UnknownPartition"))
    assert got[("transfer_queue_errors_total", error)] == 1
    assert got[("transfer_queue_lease_expiries_total", (("task", "train"),))] == 2
    assert got[("transfer_queue_redeliveries_total", (("task", "train"),))] == 2
    assert got[("transfer_queue_rl_reward", ())] == 0.5 and ("transfer_queue_rl_bad", ()) not in got
    assert got[("transfer_queue_bytes_budget", ())] == q.config.storage_unit_bytes * q.config.num_storage_units
    assert summary["errors"]["recent"][0]["type"] == "UnknownPartition"


def test_storage_families_count_bytes_in_and_out():
    metrics = StorageMetrics()
    metrics.bytes_in, metrics.bytes_out = 100, 40
    metrics.record("write", 0.001)
    stats = {"unit": 1, "bytes": 100, "blocks": 2, "rss_bytes": 1 << 20}
    got = samples(render(lambda: list(storage_families(stats, metrics))))
    assert got[("transfer_queue_storage_bytes_in_total", (("unit", "1"),))] == 100
    assert got[("transfer_queue_storage_bytes_out_total", (("unit", "1"),))] == 40
    assert got[("transfer_queue_storage_bytes_used", (("unit", "1"),))] == 100
    assert got[("transfer_queue_requests_total", (("component", "storage"), ("kind", "write"), ("unit", "1")))] == 1


def test_rl_metric_names_are_valid():
    assert rl_metric_name("time/generate-s") == "transfer_queue_rl_time_generate_s"


def test_http_endpoint_serves_routes_read_only():
    web = HttpEndpoint({"/metrics": lambda: ("text/plain", b"x 1\n")})
    try:
        assert web.url.startswith("http://127.0.0.1:")
        assert urllib.request.urlopen(web.url + "/metrics").read() == b"x 1\n"
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(web.url + "/nope")
        with pytest.raises(urllib.error.HTTPError, match="501"):  # no method that could change anything
            urllib.request.urlopen(urllib.request.Request(web.url + "/metrics", data=b"{}", method="POST"))
    finally:
        web.stop()


def test_nbytes_of_every_buffer_kind():
    import numpy as np
    import torch

    from transfer_queue.ops.metrics import nbytes

    buffers = [np.zeros(3, np.int64), torch.zeros(2, dtype=torch.float32), b"abcd", memoryview(b"xy"), bytearray(5)]
    assert nbytes(buffers) == 24 + 8 + 4 + 2 + 5
