"""The status summary stays bounded (issue 23 defect 10): per-partition task rows only for the tasks a partition
follows, at most ``status_partitions`` partitions detailed, the rest in aggregate."""

from __future__ import annotations

import json

from transfer_queue.ops.status import format_summary, queue_summary


def test_the_summary_of_500_partitions_and_200_task_names_stays_small(make_queue):
    q = make_queue(global_batch_size=16)
    for i in range(500):
        q.put(f"p{i}", 16)
        q.get(f"p{i}", "x", 4, "train")
        q.get(f"p{i}", "x", 4, f"t{i % 200}")
    summary = queue_summary(q.state)
    size = len(json.dumps(summary).encode())
    assert size < 200_000, f"the summary is {size} bytes of JSON"  # it was 7.6 MB: every task name x partition
    assert summary["partitions_live"] == 500 and len(summary["tasks"]) == 201
    assert len(summary["partitions"]) == summary["partitions_limit"] == 100
    assert summary["partitions_omitted"] == {"count": 400, "closed": 0, "rows": 400 * 16, "bytes": 400 * 16 * 4}
    assert [p["partition_id"] for p in summary["partitions"]] == [f"p{i}" for i in range(400, 500)]  # the newest
    assert sorted(summary["partitions"][-1]["tasks"]) == ["t99", "train"]  # only the tasks that follow it
    # totals cover every live partition; a task that never read a partition has all of its rows ready
    assert summary["tasks"]["train"] == {"ready": 500 * 12, "leased": 500 * 4, "acknowledged": 0, "dead_lettered": 0}
    assert summary["tasks"]["t7"] == {"ready": 500 * 16 - 3 * 4, "leased": 3 * 4, "acknowledged": 0, "dead_lettered": 0}
    assert summary["rows_committed"] == 500 * 16


def test_the_number_of_detailed_partitions_is_configurable_and_stated(make_queue):
    q = make_queue(status_partitions=2)
    for name in ("a", "b", "c"):
        q.put(name, 2)
    summary = queue_summary(q.state)
    assert [p["partition_id"] for p in summary["partitions"]] == ["b", "c"] and summary["partitions_limit"] == 2
    assert summary["partitions_omitted"]["count"] == 1 and summary["partitions_live"] == 3
    assert "... and 1 older live partitions not shown" in format_summary(summary)
