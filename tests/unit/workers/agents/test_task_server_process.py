"""TaskServerProcess: a task server owned by its parent leaves no orphan, however the parent ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parents[4]
PARENT = """
import time
from workers.agents.server_process import TaskServerProcess
servers = [TaskServerProcess("guess-number") for _ in range(2)]
for server in servers:
    print(server.process.pid, server.url, flush=True)
time.sleep(600)
"""
# the two servers started at once from a thread pool whose threads then exit (PDEATHSIG follows the forking thread)
PARENT_POOL = """
import os, threading, time
from concurrent.futures import ThreadPoolExecutor
from workers.agents.server_process import TaskServerProcess
def start(_):
    return TaskServerProcess("guess-number"), threading.get_native_id()
with ThreadPoolExecutor(2) as pool:
    started = list(pool.map(start, range(2)))
while any(os.path.exists(f"/proc/self/task/{tid}") for _, tid in started):  # the kernel let the workers go
    time.sleep(0.01)
for server, _ in started:
    print(server.process.pid, server.url, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for init to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("script", [PARENT, PARENT_POOL], ids=["main-thread", "pool-threads"])
def test_killing_the_parent_outright_leaves_no_task_server_running(script: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert parent.stdout is not None
        servers = [parent.stdout.readline().split() for _ in range(2)]
        pids, urls = [int(pid) for pid, _ in servers], [url for _, url in servers]
        for url in urls:  # alive, also when the threads that started them have exited
            assert httpx.get(f"{url}/api/health", timeout=10).json()["status"] == "healthy"
        parent.send_signal(signal.SIGKILL)  # no atexit hook runs: only the kernel can tell the servers
        parent.wait(10)
        for pid in pids:
            wait_until(lambda pid=pid: gone(pid), timeout=30, what=f"task server {pid} to exit after its parent")
        for url in urls:
            try:
                httpx.get(f"{url}/api/health", timeout=2)
            except httpx.TransportError:
                continue
            raise AssertionError(f"{url} still answers after its owner was killed")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_task_server_process_expires_idle_episodes_after_its_idle_timeout() -> None:
    from workers.agents.server_process import TaskServerProcess

    with TaskServerProcess("guess-number", idle_timeout=0.5) as server:
        assert server.process.args[-2:] == ["--idle-timeout", "0.5"]
        started = httpx.post(
            f"{server.url}/api/episode/start",
            json={"sample_id": "game-00"},
            headers={"Authorization": f"Bearer {server.api_key}"},
            timeout=10,
        )
        assert started.status_code == 200
        health = f"{server.url}/api/health"
        wait_until(lambda: httpx.get(health, timeout=10).json()["active_episodes"] == 0, what="the episode to expire")


def test_each_task_server_process_requires_its_own_fresh_key_which_its_clients_send() -> None:
    import asyncio

    from workers.agents.server_process import TaskServerProcess
    from workers.agents.servers import EpisodeStartError, TaskServerPool, Unauthorized

    with TaskServerProcess("guess-number") as server, TaskServerProcess("guess-number") as other:
        assert server.api_key and other.api_key and server.api_key != other.api_key
        assert server.api_key not in " ".join(server.process.args) and server.api_key not in repr(server)
        assert not any(server.api_key in line for line in server.lines)
        assert httpx.post(f"{server.url}/api/episode/start", json={"sample_id": "game-00"}).status_code == 401

        async def start_one(pool: TaskServerPool) -> str:
            try:
                return (await pool.start("game-00")).episode_id
            finally:
                await pool.aclose()

        with pytest.raises(EpisodeStartError, match=r"answered 401: missing or wrong API key") as refused:
            asyncio.run(start_one(TaskServerPool(server.url, start_wait=0, api_key=other.api_key)))
        assert isinstance(refused.value.__cause__, Unauthorized)
        assert asyncio.run(start_one(TaskServerPool(server.url, api_key=server.api_key)))
