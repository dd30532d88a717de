"""``python -m transfer_queue status`` from another process attached to the running cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from tensordict import TensorDict

import transfer_queue
from transfer_queue.__main__ import file_sd

CONFIG = {"global_batch_size": 6, "num_n_samples": 1, "default_timeout": 15.0, "num_storage_units": 1}


@pytest.fixture(scope="module")
def started(ray_session: Any) -> Iterator[Any]:
    client = transfer_queue.init(**CONFIG)
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


def test_targets_for_prometheus(started: Any, tmp_path: Any) -> None:
    path = tmp_path / "targets.json"
    done = cli("targets", "--output", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    targets = json.loads(path.read_text())
    endpoints = started.status()["endpoints"]
    assert targets == file_sd(endpoints)
    assert [t["labels"]["component"] for t in targets] == ["controller", "storage"]
    assert targets[0]["targets"][0].startswith("127.0.0.1:")
