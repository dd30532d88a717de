"""A run announces itself and the status command finds it: ``transfer_queue.init`` prints the status command, the
status page and the metrics, and writes the run's record; ``python -m transfer_queue status`` attaches by that
record with no address and no Ray variables; ``shutdown`` removes the record."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import ray

import transfer_queue
from transfer_queue import __main__ as cli
from transfer_queue.ops.runs import live_runs

CONFIG: dict[str, Any] = {"global_batch_size": 4, "num_n_samples": 1, "default_timeout": 15.0, "num_storage_units": 1}


def own_run() -> Any:
    return next((r for r in live_runs() if r.pid == os.getpid()), None)


@pytest.fixture(scope="module")
def started(ray_session: Any) -> Iterator[tuple[Any, str]]:
    """The queue this test process starts (once for the module: a storage unit takes seconds to start), and what
    starting it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        client = transfer_queue.init(**CONFIG, run_metrics="outputs/test/metrics.jsonl")
    yield client, printed.getvalue()
    client.close()
    transfer_queue.shutdown()


def test_a_started_queue_prints_where_to_look_and_records_its_run(started: Any) -> None:
    client, printed = started
    url = client.status()["endpoints"]["controller"]
    lines = printed.splitlines()
    start = lines.index(f"transfer_queue: queue started by pid {os.getpid()} on the Ray cluster at "
                        f"{ray.get_runtime_context().gcs_address}")  # fmt: skip
    assert lines[start + 1].startswith("  status:      ") and "-m transfer_queue status" in lines[start + 1]
    assert lines[start + 2] == f"  status page: {url}/status"
    assert lines[start + 3] == f"  metrics:     outputs/test/metrics.jsonl | Prometheus {url}/metrics"
    run = own_run()
    assert run is not None
    assert run.ray_address == ray.get_runtime_context().gcs_address and run.status_page == f"{url}/status"
    assert run.ray_env.get("RAY_AUTH_MODE") == os.environ.get("RAY_AUTH_MODE")


def test_the_status_command_attaches_by_the_run_s_record(started: Any, capsys: pytest.CaptureFixture[str]) -> None:
    client, _ = started
    assert cli.main(["status", "--run", str(os.getpid())]) == 0
    out, err = capsys.readouterr()
    assert f"status page: {client.status()['endpoints']['controller']}/status" in out
    assert err.startswith(f"run: pid {os.getpid()} (") and "its metrics: outputs/test/metrics.jsonl" in err


@pytest.mark.slow  # a Ray driver of its own: ~10-20 s
def test_the_status_command_needs_no_address_and_no_ray_variables(started: Any) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run(
        [sys.executable, "-m", "transfer_queue", "status", "--run", str(os.getpid())],
        env={**env, "PYTHONPATH": os.getcwd()},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"status page: {started[0].status()['endpoints']['controller']}/status" in done.stdout


def test_a_cluster_that_refuses_the_token_fails_at_once_saying_what_to_pass(ray_session: Any) -> None:
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        pytest.skip("the test session's Ray cluster has no token authentication (RAY_AUTH_MODE is not token)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    join = "from transfer_queue.attach import Target, join; import sys; join(Target(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", join, ray.get_runtime_context().gcs_address],
        env={**env, "PYTHONPATH": os.getcwd()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "ClusterRefused: the Ray cluster at" in done.stderr
    assert "pass RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=" in done.stderr


def test_shutdown_removes_the_run_s_record(started: Any) -> None:  # last: it stops the module's queue
    assert own_run() is not None
    transfer_queue.shutdown()
    assert own_run() is None
