"""EngineServer with a stand-in server process (tests/fake_engine_server.py, standard library only): start and
health, registry, crash and restart budget, never-healthy and port errors quoting the log, release/resume, and no
orphaned processes when the run is stopped by SIGTERM, SIGINT or SIGKILL."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from workers.engines.errors import EngineNeverHealthy, PortInUse, RestartBudgetExhausted
from workers.engines.server import EngineServer, ServiceRegistry

FAKE = str(Path(__file__).resolve().parents[3] / "fake_engine_server.py")
REPO = str(Path(__file__).resolve().parents[4])


def fake(*flags: str):
    return lambda host, port: [sys.executable, FAKE, "--host", host, "--port", str(port), *flags]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_start_register_health_and_stop(tmp_path):
    registry = ServiceRegistry(tmp_path / "registry")
    server = EngineServer(fake("--spawn-child"), name="s0", model="tiny", registry=registry, health_interval=0)
    with server:
        assert server.healthy()
        record = registry.get("s0")
        assert (record.status, record.model, record.url) == ("healthy", "tiny", server.url)
        assert record.url.startswith("http://127.0.0.1:")
        pgid = server.process.pid
        assert wait_for(lambda: len(group_members(pgid)) == 2)  # the server and its child
        server.set_version(3)
        assert registry.get("s0").version == 3
    assert registry.get("s0").status == "stopped"
    assert wait_for(lambda: group_members(pgid) == [])


def test_crash_restarts_then_budget_is_a_typed_error(tmp_path):
    restarted = []
    server = EngineServer(
        fake(), name="s1", health_interval=0.1, max_restarts=1, log_dir=str(tmp_path), on_restart=restarted.append
    )
    with server:
        first = server.process.pid
        os.kill(first, signal.SIGKILL)
        assert wait_for(lambda: server.record.restarts == 1 and server.record.status == "healthy")
        assert server.process.pid != first and server.healthy() and restarted == [None]
        os.kill(server.process.pid, signal.SIGKILL)
        assert wait_for(lambda: server.error is not None)
        assert server.record.status == "failed"
        with pytest.raises(RestartBudgetExhausted, match=r"crashed again after 1 restarts \(budget max_restarts=1\)"):
            server.check()


def test_never_healthy_quotes_the_log(tmp_path):
    server = EngineServer(fake("--never-healthy"), name="s2", startup_timeout=1.5, log_dir=str(tmp_path))
    with pytest.raises(EngineNeverHealthy, match=r"(?s)did not answer 200 within 2 s.*fake engine server: ready"):
        server.start()
    assert server.record.status == "failed"
    assert wait_for(lambda: group_members(server.process.pid) == [])


def test_port_conflicts_are_typed_errors(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUse, match=f"port 127.0.0.1:{port} is already in use; expected a free port"):
            EngineServer(fake(), name="s3", port=port, log_dir=str(tmp_path)).start()
        # a server that picks the port itself and finds it taken: the error comes from its log
        squatter = EngineServer(
            lambda host, _: [sys.executable, FAKE, "--host", host, "--port", str(port)],
            name="s4",
            log_dir=str(tmp_path),
        )
        with pytest.raises(PortInUse, match=r"(?s)could not bind.*Address already in use"):
            squatter.start()


class _Engine:
    """An engine client with release/resume (as SGLangEngine) against the fake's routes."""

    def __init__(self, url: str):
        import httpx

        self.url, self._http = url, httpx.Client(base_url=url, trust_env=False)

    def release_memory(self):
        self._http.post("/release_memory_occupation")

    def resume_memory(self):
        self._http.post("/resume_memory_occupation")


def test_release_and_resume_memory(tmp_path):
    with EngineServer(fake(), name="s5", engine_factory=_Engine, health_interval=0, log_dir=str(tmp_path)) as server:
        assert server.release_memory() == "engine"
        assert not server.healthy() and server.record.status == "released"
        server.resume_memory()
        assert server.healthy()
    reloaded = []
    with EngineServer(fake(), name="s6", health_interval=0, log_dir=str(tmp_path)) as server:
        pid = server.process.pid
        assert server.release_memory() == "stop"
        assert wait_for(lambda: group_members(pid) == [])
        server.resume_memory(reload=reloaded.append)
        assert server.healthy() and server.process.pid != pid and reloaded == [None]


PARENT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {repo!r})
    from workers.engines.server import EngineServer
    server = EngineServer(lambda h, p: [sys.executable, {fake!r}, "--host", h, "--port", str(p), "--spawn-child"],
                          health_interval=0)
    server.start()
    print(server.process.pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_no_orphans_when_the_run_is_killed(signum):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(repo=REPO, fake=FAKE)], stdout=subprocess.PIPE, text=True
    )
    try:
        pgid = int(parent.stdout.readline())
        assert wait_for(lambda: len(group_members(pgid)) == 2)
        parent.send_signal(signum)
        parent.wait(30)
        assert wait_for(lambda: group_members(pgid) == [], timeout=30), f"left behind: {group_members(pgid)}"
    finally:
        parent.kill()
        for pid in group_members(pgid) if "pgid" in dir() else []:
            os.kill(pid, signal.SIGKILL)


THREAD_OWNER = textwrap.dedent(
    """
    import os, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    sys.path.insert(0, {repo!r})
    from workers.engines.server import EngineServer
    server = EngineServer(lambda h, p: [sys.executable, {fake!r}, "--host", h, "--port", str(p), "--spawn-child"],
                          health_interval=0)
    def start():
        server.start()
        return threading.get_native_id()
    with ThreadPoolExecutor(1) as pool:  # the natural way to start several slow servers at once
        worker = pool.submit(start).result()
    while os.path.exists(f"/proc/self/task/{{worker}}"):  # until the kernel has let the worker thread go
        time.sleep(0.01)
    print(server.process.pid, server.url, flush=True)
    time.sleep(600)
    """
)


def test_a_server_started_from_a_pool_thread_outlives_the_thread_and_dies_with_the_process():
    owner = subprocess.Popen(
        [sys.executable, "-c", THREAD_OWNER.format(repo=REPO, fake=FAKE)], stdout=subprocess.PIPE, text=True
    )
    pgid = None
    try:
        pid, url = owner.stdout.readline().split()
        pgid = int(pid)
        # the thread that started it has exited: the server still runs and answers (PDEATHSIG did not fire)
        assert httpx.get(url + "/health", timeout=10, trust_env=False).status_code == 200
        assert len(group_members(pgid)) == 2, "the server (and its child) died with the thread that started it"
        owner.kill()  # SIGKILL: no atexit, no signal handler; only the kernel can stop the server now
        owner.wait(30)
        assert wait_for(lambda: group_members(pgid) == [], timeout=30), f"left behind: {group_members(pgid)}"
    finally:
        owner.kill()
        for pid_left in group_members(pgid) if pgid is not None else []:
            os.kill(pid_left, signal.SIGKILL)


def test_a_server_gets_a_fresh_key_that_its_engine_sends_and_its_log_never_shows(tmp_path):
    from workers.api_key import KEY_PLACEHOLDER

    command = lambda host, port: [*fake()(host, port), "--api-key", KEY_PLACEHOLDER]  # noqa: E731  (as SGLang's)
    servers = [
        EngineServer(command, name=f"k{i}", engine_factory=_KeyedEngine, health_interval=0, log_dir=str(tmp_path))
        for i in range(2)
    ]
    assert servers[0].api_key and servers[1].api_key and servers[0].api_key != servers[1].api_key
    with servers[0] as server:
        assert httpx.post(server.url + "/release_memory_occupation", trust_env=False).status_code == 401
        assert server.release_memory() == "engine"  # the engine client sends the key
        server.resume_memory()
        assert server.healthy()
        log = server.log_path.read_text()
        assert "--api-key <redacted>" in log.splitlines()[0]  # what we log; the server itself prints the key:
        assert server.api_key in log and server.api_key not in server.log_tail()  # the tail quoted in errors
        assert server.log_path.stat().st_mode & 0o777 == 0o600
        assert server.api_key not in repr(server)


def test_the_key_reaches_the_server_through_its_environment(tmp_path):
    with EngineServer(
        fake("--key-from-env"), name="k2", api_key="my-key", health_interval=0, log_dir=str(tmp_path)
    ) as server:
        assert "my-key" not in server.log_path.read_text().splitlines()[0]
        post = lambda **kw: httpx.post(server.url + "/resume_memory_occupation", trust_env=False, **kw)  # noqa: E731
        assert post().status_code == 401
        assert post(headers={"Authorization": "Bearer my-key"}).status_code == 200


def test_a_key_placeholder_without_a_key_is_refused(tmp_path):
    from workers.api_key import KEY_PLACEHOLDER

    server = EngineServer(
        lambda h, p: [*fake()(h, p), "--api-key", KEY_PLACEHOLDER], api_key=False, log_dir=str(tmp_path)
    )
    with pytest.raises(ValueError, match=r"asks for the API key \(<api-key>\) but api_key=False"):
        server.start()


class _KeyedEngine(_Engine):
    """``_Engine`` that sends the key ``EngineServer`` hands it, as ``HTTPEngine.use_api_key``."""

    def use_api_key(self, api_key):
        self._http.headers["Authorization"] = f"Bearer {api_key}"
