"""The controller's request trace (transfer_queue/ops/trace.py): spans of a row's life, written as a Chrome trace."""

from __future__ import annotations

import json

import msgspec
import pytest

from transfer_queue.ops.trace import RequestTrace, chrome_trace, span
from transfer_queue.wire import protocol as p


def traced_queue(make_queue, **kw):
    q = make_queue(**kw)
    q.table.trace = RequestTrace(clock=lambda: q.now[0])
    return q


def test_a_rows_life_is_a_span_per_request_with_its_rows(make_queue) -> None:
    q = traced_queue(make_queue, global_batch_size=4)
    reservation = q.reserve(0, 4)
    q.advance(0.5)
    q.commit(reservation)
    waiting = q.send(msgspec.structs.replace(q.get_request(0, "x", 4, "train"), owner="trainer-0"))
    assert waiting.done  # served at once: 4 rows ready
    meta = waiting.result()
    q.ok(p.Ack(meta.partition_uid, "train", meta.global_indexes, "trainer-0"))
    spans = q.table.trace.events()
    assert [s["name"] for s in spans] == ["put.reserve", "put.commit", "get_meta", "ack"]
    reserve, commit, get, ack = spans
    assert reserve["args"] == {"partition": "global_step=0", "num_rows": 4}
    assert commit["ts"] == 0.5e6 and commit["args"]["global_indexes"] == [0, 1, 2, 3]
    assert get["tid"] == "trainer-0" and get["cat"] == "train"
    assert get["args"] == {
        "partition": "global_step=0",
        "task_name": "train",
        "batch_size": 4,
        "rows": 4,
        "global_indexes": [0, 1, 2, 3],
    }
    assert ack["args"]["global_indexes"] == [0, 1, 2, 3] and ack["args"]["rows"] == 4
    assert reserve["tid"] == "storage and others"  # no owner named


def test_a_parked_get_meta_spans_its_wait_and_a_failure_carries_the_error(make_queue) -> None:
    q = traced_queue(make_queue, global_batch_size=4)
    waiting = q.get_async(0, "x", 4, "train", timeout=3.0)
    q.advance(1.0)
    q.put(0, 4)
    assert waiting.done
    get = next(s for s in q.table.trace.events() if s["name"] == "get_meta")
    assert (get["ts"], get["dur"]) == (0.0, 1.0e6)  # from its arrival to its answer
    timing_out = q.get_async(1, "x", 4, "train", timeout=2.0)
    q.advance(2.5)
    assert timing_out.error is not None
    failed = [s for s in q.table.trace.events() if "error" in s["args"]]
    assert failed[-1]["args"]["error"].startswith("GetMetaTimeout: get_meta timed out after 2.0 s")


def test_the_ring_keeps_the_newest_spans_and_counts_the_dropped(make_queue) -> None:
    q = make_queue(global_batch_size=4)
    q.table.trace = RequestTrace(max_events=2, clock=lambda: q.now[0])
    q.put(0, 4)  # reserve + commit
    q.clear(0)
    assert [s["name"] for s in q.table.trace.events()] == ["put.commit", "clear"]
    assert q.table.trace.dropped == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_max_events_must_be_a_positive_int(bad) -> None:
    with pytest.raises(ValueError, match=rf"max_events: expected an int >= 1, got {bad!r}"):
        RequestTrace(max_events=bad)


def test_the_chrome_trace_names_processes_and_threads(make_queue, tmp_path) -> None:
    q = traced_queue(make_queue, global_batch_size=2)
    q.put(0, 2)
    stages = [span("generate", 1.0, 2.5, "RL driver", "rollout", step=0)]
    path = chrome_trace(tmp_path / "sub" / "trace.json", q.table.trace.events(), stages)
    doc = json.loads(path.read_text())
    names = {(e["name"], e["args"]["name"]) for e in doc["traceEvents"] if e["ph"] == "M"}
    assert names == {
        ("process_name", "transfer_queue controller"),
        ("thread_name", "storage and others"),
        ("process_name", "RL driver"),
        ("thread_name", "rollout"),
    }
    generate = next(e for e in doc["traceEvents"] if e["name"] == "generate")
    assert (generate["ts"], generate["dur"], generate["args"]) == (1.0e6, 1.5e6, {"step": 0})
    assert isinstance(generate["pid"], int) and isinstance(generate["tid"], int)
    assert not list(tmp_path.glob("sub/.*.tmp"))


def test_a_put_from_a_connection_is_traced_too(make_queue) -> None:
    # a reservation that came on a connection is answered through the state's owner record: still one span
    q = traced_queue(make_queue, global_batch_size=4)
    reply = q.send(q.reserve_request(0, 4), peer="connection-1")
    assert reply.done and reply.error is None
    assert [s["name"] for s in q.table.trace.events()] == ["put.reserve"]
