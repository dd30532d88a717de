"""A task server in its own process, owned: started with a deadline to become healthy, stopped with its group.

    with TaskServerProcess("guess-number") as server:      # python -m workers.agents.task_server ... --port 0
        workflow = TaskServerWorkflow(server.url, ...)

The server binds a free port on 127.0.0.1 and prints the seed's banner; its URL is read from the banner. The
process leads its own process group, so stopping it (SIGTERM, then SIGKILL after ``stop_timeout``) also ends
whatever it started; an ``atexit`` hook stops it if the parent exits without doing so, and if the parent is killed
outright (SIGKILL, no ``atexit``) the kernel sends the server SIGTERM (``PR_SET_PDEATHSIG``, through
``workers.process_launcher``, so whichever thread started it): no orphan is left.

Each server gets a fresh API key by default (``server.api_key``; through ``TQ_API_KEY`` in its environment, never its
command line): hand it to the clients, ``TaskServerWorkflow(server.url, ..., api_key=server.api_key)``.
"""

from __future__ import annotations

import atexit
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from workers.api_key import API_KEY_ENV, bearer_headers, new_api_key
from workers.process_launcher import popen_for_process_lifetime

ROOT = Path(__file__).resolve().parents[2]


class TaskServerError(RuntimeError):
    """The task server process did not come up; the message holds its last log lines."""


class TaskServerProcess:
    """See the module docstring.

    Args:
        env_name: a registered environment (``guess-number``) or ``"module:Class"``.
        host: the address to bind.
        max_episodes: the server's ``--max-episodes`` (None: its default, from the memory free and the environment).
        idle_timeout: the server's ``--idle-timeout``, seconds before an episode without a call expires (None: the
            server's default, 300).
        start_timeout: seconds to print its URL and answer ``/api/health``.
        api_key: the key the server requires: True (default) a fresh one, a string that one, False none (the server
            then answers everyone).
    """

    def __init__(
        self,
        env_name: str,
        host: str = "127.0.0.1",
        max_episodes: int | None = None,
        start_timeout: float = 60.0,
        idle_timeout: float | None = None,
        stop_timeout: float = 5.0,
        api_key: str | bool = True,
    ):
        self.env_name = env_name
        self.api_key: str | None = new_api_key() if api_key is True else (api_key or None)
        self.stop_timeout = stop_timeout
        self.url: str | None = None
        self.lines: collections.deque[str] = collections.deque(maxlen=40)
        cmd = [sys.executable, "-m", "workers.agents.task_server", env_name, "--port", "0", "--host", host]
        if max_episodes is not None:
            cmd += ["--max-episodes", str(max_episodes)]
        if idle_timeout is not None:
            cmd += ["--idle-timeout", str(idle_timeout)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        env.pop(API_KEY_ENV, None)
        if self.api_key is not None:
            env[API_KEY_ENV] = self.api_key
        # forked by the process-lifetime launcher thread: the server outlives the thread that starts it (a pool
        # worker) and dies with this process
        self.process = popen_for_process_lifetime(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        atexit.register(self.stop)
        self._found = threading.Event()
        threading.Thread(target=self._read, name=f"task-server-{env_name}-log", daemon=True).start()
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip())
            if self.url is None and line.startswith("Server URL:"):
                self.url = line.split(":", 1)[1].strip()
                self._found.set()

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            if self._found.wait(0.05):
                try:
                    reply = httpx.get(f"{self.url}/api/health", headers=bearer_headers(self.api_key), timeout=2)
                    if reply.json().get("status") == "healthy":
                        return
                except (httpx.HTTPError, ValueError):
                    pass
        log = "\n".join(self.lines)
        state = f"exited with {self.process.returncode}" if self.process.poll() is not None else "still starting"
        raise TaskServerError(
            f"task server {self.env_name!r} not healthy within {timeout} s ({state}); last lines:\n{log}"
        )

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``stop_timeout``; idempotent."""
        atexit.unregister(self.stop)
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass

    def __repr__(self) -> str:  # the key stays out
        return f"TaskServerProcess({self.env_name!r}, url={self.url!r})"

    def __enter__(self) -> TaskServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
