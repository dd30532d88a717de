"""``python -m transfer_queue status`` from another process attached to the running cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from tensordict import TensorDict

import transfer_queue
from transfer_queue.__main__ import file_sd
from transfer_queue.ops.trace import record_for

CONFIG = {"global_batch_size": 6, "num_n_samples": 1, "default_timeout": 15.0, "num_storage_units": 1}


@pytest.fixture(scope="module")
def started(ray_session: Any) -> Iterator[Any]:
    client = transfer_queue.init(**CONFIG, client_id="status-cli-test")
    yield client
    client.close()
    transfer_queue.shutdown()


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    return subprocess.run(
        [sys.executable, "-m", "transfer_queue", *args], env=env, capture_output=True, text=True, timeout=180
    )


def test_help_lists_the_commands() -> None:
    done = subprocess.run([sys.executable, "-m", "transfer_queue", "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    assert "status" in done.stdout and "targets" in done.stdout


@pytest.mark.slow  # ~15-50 s each: the slow tier keeps make test under 10 minutes
def test_status_from_another_process_prints_what_the_api_says(started: Any) -> None:
    started.put(TensorDict({"x": torch.zeros(6, 3)}, batch_size=[6]), global_step=0)
    started.get_data(started.get_meta(["x"], 4, global_step=0, task_name="train"))  # leased, then acknowledged
    done = cli("status")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.split()[:4] == ["0", "6/6", "yes", "72"] and "train=4/6" in line for line in lines), done.stdout
    assert any(line.split() == ["train", "2", "0", "4", "0"] for line in lines), done.stdout
    as_json = cli("status", "--json")
    assert as_json.returncode == 0, as_json.stderr[-3000:]
    summary = json.loads(as_json.stdout)
    assert summary["tasks"]["train"] == started.status()["tasks"]["train"]
    started.clear(global_step=0)  # the queue holds one step at a time (num_global_batch=1)


def test_targets_for_prometheus(started: Any, tmp_path: Any) -> None:
    path = tmp_path / "targets.json"
    done = cli("targets", "--output", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    targets = json.loads(path.read_text())
    endpoints = started.status()["endpoints"]
    assert targets == file_sd(endpoints)
    assert [t["labels"]["component"] for t in targets] == ["controller", "storage"]
    assert targets[0]["targets"][0].startswith("127.0.0.1:")


def waiting_consumer(client: Any, step: int, task: str) -> tuple[Any, list[Any]]:
    """A thread whose get_meta of ``step`` waits for a field nobody has put yet; the report it needs polled."""
    got: list[Any] = []
    thread = threading.Thread(
        target=lambda: got.append(client.get_meta(["x", "y"], 6, global_step=step, task_name=task, timeout=60)),
        daemon=True,
    )
    thread.start()
    return thread, got


def produce_y(client: Any, step: int) -> None:
    """The producer's turn: field ``y`` written into the step's rows (what the waiting consumer needs)."""
    meta = client.get_meta(["x"], 6, global_step=step, task_name="producer")
    client.put(TensorDict({"y": torch.ones(6, 1)}, batch_size=[6]), metadata=meta)


def wait_for_report(task: str) -> dict[str, Any]:
    controller = transfer_queue.get_controller()
    for _ in range(600):
        report = ray.get(controller.why_stuck.remote())
        if any(w.get("task") == task for w in report["waiting"]):
            return report
        time.sleep(0.05)
    raise AssertionError(f"no waiting get_meta of task {task!r} in {report}")


def test_why_stuck_names_a_waiting_consumer_and_the_field_it_waits_for(started: Any) -> None:
    started.put(TensorDict({"x": torch.zeros(6, 3)}, batch_size=[6]), global_step=1)
    thread, got = waiting_consumer(started, 1, "why-test")
    [entry] = [w for w in wait_for_report("why-test")["waiting"] if w["task"] == "why-test"]
    assert (entry["kind"], entry["partition"], entry["batch_size"], entry["fields"]) == (
        "get_meta", "global_step=1", 6, ["x", "y"]
    )  # fmt: skip
    assert "'y' missing on 6 rows" in entry["reason"], entry
    assert entry["client"] != "?"  # the client's own name
    produce_y(started, 1)
    thread.join(timeout=60)
    assert len(got) == 1 and got[0].size == 6
    started.clear(global_step=1)


@pytest.mark.slow  # a CLI process attaching to the cluster: ~15-50 s
def test_status_why_stuck_from_another_process(started: Any) -> None:
    started.put(TensorDict({"x": torch.zeros(6, 3)}, batch_size=[6]), global_step=2)
    thread, got = waiting_consumer(started, 2, "why-cli")
    wait_for_report("why-cli")
    done = cli("status", "--why-stuck")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "task 'why-cli', global_step=2, 6 rows, waiting" in done.stdout, done.stdout
    assert "why: task 'why-cli' asked global_step=2 for 6 rows of fields ['x', 'y']" in done.stdout, done.stdout
    produce_y(started, 2)
    thread.join(timeout=60)
    assert len(got) == 1
    started.clear(global_step=2)


def test_a_trace_records_the_rows_life_through_the_controller(started: Any) -> None:
    controller = transfer_queue.get_controller()
    assert ray.get(controller.trace_start.remote()) is True
    assert ray.get(controller.trace_start.remote()) is False  # already on: goes on
    try:
        started.put(TensorDict({"x": torch.zeros(6, 3)}, batch_size=[6]), global_step=3)
        meta = started.get_meta(["x"], 6, global_step=3, task_name="traced")
        started.get_data(meta)  # acknowledged on read: the ack goes out without waiting for an answer
        deadline = time.monotonic() + 60
        while not any(e["name"] == "ack" for e in ray.get(controller.trace_events.remote())):
            assert time.monotonic() < deadline, "the read's acknowledgement never reached the controller"
            time.sleep(0.05)
    finally:
        events = ray.get(controller.trace_stop.remote())
    started.clear(global_step=3)
    assert ray.get(controller.trace_events.remote()) == []  # off again
    names = [e["name"] for e in events]
    for name in ("put.reserve", "put.commit", "get_meta", "ack"):
        assert name in names, names
    get = next(e for e in events if e["name"] == "get_meta")
    assert get["args"]["task_name"] == "traced" and get["args"]["rows"] == 6
    assert get["tid"].startswith("status-cli-test#")  # the client that asked: its id and instance


def test_the_trace_command_leaves_a_trace_already_on_running_and_keeps_only_its_window(started: Any) -> None:
    """A run's own trace (``trace=true``) is on: ``python -m transfer_queue trace`` must not stop it, and writes only
    the spans of its own seconds."""
    controller = transfer_queue.get_controller()
    assert ray.get(controller.trace_start.remote()) is True  # the run's
    try:
        started.put(
            TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2]), partition_id="trace-window"
        )  # before the window

        def traffic(seconds: float) -> None:  # what happens while the command records
            time.sleep(0.05)  # the window's start is taken after the trace call: a span from then on is in it
            started.get_data(started.get_meta(["x"], 2, partition_id="trace-window", task_name="in-window"))

        events = record_for(controller, 0.5, sleep=traffic)
        names = {(e["name"], e["args"].get("task_name")) for e in events}
        assert ("get_meta", "in-window") in names
        assert not any(e["name"].startswith("put.") for e in events)  # the put came before the window
        assert ray.get(controller.trace_start.remote()) is False  # still on: the run's trace goes on
        assert any(e["name"] == "put.commit" for e in ray.get(controller.trace_events.remote()))  # nothing dropped
    finally:
        ray.get(controller.trace_stop.remote())
        started.clear(partition_id="trace-window")


@pytest.mark.slow  # a CLI process attaching to the cluster: ~15-50 s
def test_the_trace_command_writes_a_perfetto_file(started: Any, tmp_path: Any) -> None:
    path = tmp_path / "trace.json"
    stop = threading.Event()

    errors: list[BaseException] = []

    def traffic() -> None:
        step = 4
        try:
            while not stop.is_set():  # a cleared step is behind the live window: each round a new one
                started.put(TensorDict({"x": torch.zeros(6, 3)}, batch_size=[6]), global_step=step)
                started.get_data(started.get_meta(["x"], 6, global_step=step, task_name="cli-traced"))
                started.clear(global_step=step)
                step += 1
                time.sleep(0.1)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    try:
        done = cli("trace", "--seconds", "3", "--output", str(path))
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors, errors
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"spans in {path}: open it in https://ui.perfetto.dev" in done.stdout
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e["name"] == "get_meta" and e["args"].get("task_name") == "cli-traced" for e in events)
    assert any(e["ph"] == "M" and e["args"]["name"] == "transfer_queue controller" for e in events)
