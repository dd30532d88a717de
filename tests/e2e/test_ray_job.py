"""The demo submitted with ``ray job submit`` to a head started by ``ray start --head``, as the docs show.

The head gets its own temp dir (so no other process attaches to it by accident) and is stopped afterwards by
killing exactly its processes: ``ray stop`` would also stop every other Ray on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.test_demo import SHORT

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_head(temp_dir: str) -> None:
    procs = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def ray_head():
    temp_dir = tempfile.mkdtemp(prefix="tqjob", dir="/tmp")  # short: Ray's unix socket paths must fit 107 chars
    # Ray 2.5x turns on token auth for a head when ~/.ray/auth_token exists (any earlier ray.init writes one);
    # the job CLI must then say so: the docs tell users the same (docs/recipes.md).
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    dashboard = free_port()
    # every port the head's agents listen on is a free one: with Ray's defaults (52365 for the job agent) a Ray
    # left on the machine, or one another test started, holds it and the head never gets a job agent ("No
    # available agent to submit job" for the whole 120 s, seen in a fresh-clone CI run)
    cmd = [
        RAY, "start", "--head", f"--port={free_port()}", f"--dashboard-port={dashboard}", f"--temp-dir={temp_dir}",
        f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
        "--num-cpus=16", "--include-dashboard=true", "--disable-usage-stats",
    ]  # fmt: skip
    try:
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=180)
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        stop_head(temp_dir)


@pytest.mark.slow
def test_the_demo_runs_as_a_ray_job(ray_head, tmp_path):
    address, env = ray_head
    out = tmp_path / "job"
    cmd = [
        RAY, "job", "submit", f"--address={address}", f"--working-dir={ROOT}", "--",
        sys.executable, "recipe/demo.py", f"output_dir={out}", "steps=1", *SHORT,
    ]  # fmt: skip
    deadline = time.monotonic() + 120
    while True:  # the head's job agent comes up a little after `ray start` returns
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if "No available agent to submit job" not in result.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert "succeeded" in result.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "grpo"] == [0]
