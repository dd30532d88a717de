"""``status --why-stuck``: each parked get_meta and put named with what it waits for (transfer_queue/ops/why_stuck.py),
on a QueueState without Ray."""

from __future__ import annotations

import msgspec

from transfer_queue.metadata import FieldSchema
from transfer_queue.ops.why_stuck import format_why_stuck, why_stuck

F32 = FieldSchema("dense", "float32", ())


def test_nothing_parked_says_so(make_queue) -> None:
    q = make_queue()
    report = why_stuck(q.state)
    assert report == {"waiting": [], "omitted": 0, "down_units": []}
    assert format_why_stuck(report) == "nothing is waiting: no get_meta or put is parked in the queue"


def test_a_getter_waiting_for_a_field_names_the_client_task_partition_and_the_field(make_queue) -> None:
    q = make_queue(global_batch_size=4)
    q.put(0, 4, {"prompts": F32})
    waiting = q.send(msgspec.structs.replace(q.get_request(0, ["prompts", "responses"], 4, "reward"), owner="rw-0"))
    assert not waiting.done
    q.advance(2.0)
    [entry] = why_stuck(q.state)["waiting"]
    assert entry["kind"] == "get_meta"
    assert (entry["client"], entry["task"], entry["partition"], entry["batch_size"]) == (
        "rw-0",
        "reward",
        "global_step=0",
        4,
    )
    assert entry["waited_s"] == 2.0
    assert entry["reason"] == (
        "task 'reward' asked global_step=0 for 4 rows of fields ['prompts', 'responses']; 0 rows are ready, "
        "4 unconsumed rows exist ('responses' missing on 4 rows); 4 of 4 rows are committed"
    )
    text = format_why_stuck(why_stuck(q.state))
    assert text.startswith("get_meta of client 'rw-0': task 'reward', global_step=0, 4 rows, waiting 2.0 s")
    assert "  why: task 'reward' asked global_step=0" in text


def test_a_getter_whose_rows_are_leased_names_who_holds_them(make_queue) -> None:
    q = make_queue(global_batch_size=8)  # 4 of 8 rows put: the step is not complete, so no short last batch
    q.put(0, 4, {"x": F32})
    taken = q.send(msgspec.structs.replace(q.get_request(0, "x", 3, "train"), owner="trainer-1", lease_s=60.0))
    assert taken.done and taken.error is None
    waiting = q.send(msgspec.structs.replace(q.get_request(0, "x", 4, "train"), owner="trainer-2"))
    assert not waiting.done
    [entry] = why_stuck(q.state)["waiting"]
    assert entry["leased"] == {"trainer-1": {"rows": 3, "lease_ends_in_s": 60.0}}
    assert entry["reason"].endswith("; leased to trainer-1 (3 rows)")
    assert "1 rows are ready" in entry["reason"]


def test_a_getter_of_a_step_never_put_and_a_put_waiting_for_the_ring_are_both_explained(make_queue) -> None:
    q = make_queue(global_batch_size=2, num_global_batch=1)
    q.put(0, 2)
    getter = q.get_async(5, "x", 2, "train")
    putter = q.send(q.reserve_request(1, 2))  # step 1 needs step 0's slot in a ring of one step
    assert not getter.done and not putter.done
    report = why_stuck(q.state)
    kinds = [w["kind"] for w in report["waiting"]]
    assert kinds == ["get_meta", "put"]
    get, put = report["waiting"]
    assert get["reason"].endswith("; the partition was never opened (no put reached it yet)")
    assert put["reason"].startswith("put to global_step=1 waited 0.0 s for a free slot in the step ring")
    assert (
        format_why_stuck(report).splitlines()[2] == "put to global_step=1 (2 rows), waiting 0.0 s (times out in 30.0 s)"
    )


def test_only_the_oldest_limit_requests_are_explained(make_queue) -> None:
    q = make_queue(global_batch_size=2)
    for step in range(3):
        q.get_async(step, "x", 2, "train")
        q.advance(1.0)
    report = why_stuck(q.state, limit=2)
    assert [w["partition"] for w in report["waiting"]] == ["global_step=0", "global_step=1"]
    assert report["omitted"] == 1
    assert format_why_stuck(report).endswith("... and 1 more waiting requests")
