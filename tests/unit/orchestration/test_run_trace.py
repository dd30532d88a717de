"""StageTrace (orchestration/run_trace.py) without Ray: the spans of a step, and the file it writes with the queue's
events beside them (or without them when the queue is gone)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestration import run_trace
from orchestration.run_trace import StageTrace


class Call:
    """What ``controller.method.remote(...)`` returns here: ``ray.get`` (patched) calls it."""

    def __init__(self, fn: Any, *args: Any):
        self.fn, self.args = fn, args


class Method:
    def __init__(self, fn: Any):
        self.fn = fn

    def remote(self, *args: Any) -> Call:
        return Call(self.fn, *args)


class FakeController:
    def __init__(self, events: list[dict[str, Any]] | None = None, gone: bool = False):
        self.started_with: int | None = None
        self.events = events or []
        self.gone = gone
        self.trace_start = Method(self._start)
        self.trace_stop = Method(self._stop)

    def _start(self, max_events: int) -> None:
        self.started_with = max_events

    def _stop(self) -> list[dict[str, Any]]:
        if self.gone:
            raise ConnectionError("the controller's actor died")
        return self.events


@pytest.fixture(autouse=True)
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_trace.ray, "get", lambda call, timeout=None: call.fn(*call.args))


def spans_of(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(span name, track name) -> the span, from a written trace file."""
    events = json.loads(path.read_text())["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    return {(e["name"], threads[e["tid"]]): e for e in events if e["ph"] == "X"}


def test_a_steps_stages_land_on_their_tracks(tmp_path: Path) -> None:
    controller = FakeController()
    trace = StageTrace(controller, tmp_path / "trace.json", max_events=1000)
    assert controller.started_with == 1000
    rollout = [
        {"started_at": 101.0, "ended_at": 104.0, "rows": 8.0, "generate_s": 2.5, "tokens": 96.0},
        {"rows": 0.0},  # a worker with no rows of this step: no span
    ]
    reward = [{"started_at": 104.0, "ended_at": 104.5, "rows": 8.0, "reward_s": 0.4}]
    trace.step(3, wall=(100.0, 107.0), train=(104.5, 106.0), rollout=rollout, reward=reward, publish_s=0.5)
    spans = spans_of(trace.write())
    assert set(spans) == {
        ("step 3", "driver"),
        ("train", "trainer"),
        ("publish", "weights"),
        ("generate", "rollout worker 0"),
        ("reward", "reward worker 0"),
    }
    publish = spans[("publish", "weights")]
    assert (publish["ts"], publish["dur"]) == (106.5e6, 0.5e6)  # drawn as ending with the step
    generate = spans[("generate", "rollout worker 0")]
    assert (generate["ts"], generate["dur"]) == (101.0e6, 3.0e6)
    assert generate["args"] == {"step": 3, "rows": 8.0, "generate_s": 2.5, "tokens": 96.0}
    assert spans[("reward", "reward worker 0")]["args"] == {"step": 3, "rows": 8.0, "reward_s": 0.4}


def test_no_publish_span_when_the_weights_took_no_time(tmp_path: Path) -> None:
    trace = StageTrace(FakeController(), tmp_path / "trace.json")
    trace.step(0, wall=(0.0, 1.0), train=(0.5, 1.0), rollout=[], reward=[], publish_s=0.0)
    assert set(spans_of(trace.write())) == {("step 0", "driver"), ("train", "trainer")}


def test_the_queues_events_are_written_beside_the_stages(tmp_path: Path) -> None:
    queue_event = {
        "name": "get_meta",
        "ph": "X",
        "ts": 1.0e6,
        "dur": 2.0e3,
        "pid": "queue",
        "tid": "trainer",
        "args": {},
    }
    trace = StageTrace(FakeController(events=[queue_event]), tmp_path / "trace.json")
    trace.step(0, wall=(0.0, 1.0), train=(0.5, 1.0), rollout=[], reward=[], publish_s=0.0)
    events = json.loads(trace.write().read_text())["traceEvents"]
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {"queue", run_trace.PROCESS}
    assert [e["name"] for e in events if e["ph"] == "X"] == ["get_meta", "step 0", "train"]


def test_a_queue_that_is_gone_still_leaves_the_stages(tmp_path: Path) -> None:
    """A failed run (its controller dead) still writes the stages it saw."""
    trace = StageTrace(FakeController(gone=True), tmp_path / "trace.json")
    trace.step(1, wall=(0.0, 1.0), train=(0.5, 1.0), rollout=[], reward=[], publish_s=0.0)
    assert set(spans_of(trace.write())) == {("step 1", "driver"), ("train", "trainer")}
