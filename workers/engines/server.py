"""EngineServer: one inference server process (vLLM, SGLang, or any HTTP engine) and its whole lifecycle.

The seed's ``InferenceService``: the server is started as a subprocess in its own process group on a free port of
127.0.0.1 (or the node's address), waited for until its health route answers (a deadline), registered (URL, model,
version, status) in a :class:`ServiceRegistry`, health-checked by a monitor thread while it runs, restarted after a
crash on the same port, so at the same URL (a budget of restarts, then :class:`RestartBudgetExhausted`), freed for
training and brought back (``release_memory`` / ``resume_memory``: the engine's own calls where it has them, stop /
start otherwise) and stopped with its whole process group (on ``stop``, at exit, and on SIGTERM / SIGINT of the run). If
the run dies without running any of that (SIGKILL), the kernel sends the server SIGTERM: servers are forked by one
launcher thread that lives as long as the process (``PR_SET_PDEATHSIG`` fires when the forking *thread* exits), so a
server started from a short-lived thread (a thread pool starting several servers at once) outlives that thread.

    server = EngineServer(fake_or_real_command, health_path="/health_generate", engine_factory=SGLangEngine)
    with server:                      # start() ... stop()
        server.engine.generate(...)   # the Engine client bound to the server's URL
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from workers.api_key import API_KEY_ENV, KEY_PLACEHOLDER, REDACTED, bearer_headers, new_api_key, redact
from workers.engines.errors import (
    EngineNeverHealthy,
    EngineServerError,
    EngineServerExited,
    PortInUse,
    RestartBudgetExhausted,
)
from workers.process_launcher import popen_for_process_lifetime

logger = logging.getLogger(__name__)
CommandFn = Callable[[str, int], list[str]]  # (host, port) -> argv
_LIVE: weakref.WeakSet[EngineServer] = weakref.WeakSet()
_HANDLERS_INSTALLED = False
PORT_REUSE_WAIT_S = 10.0  # how long a restart waits for its previous port to be free
_PORT_IN_USE_MARKERS = ("address already in use", "errno 98", "only one usage of each socket address")


@dataclass
class ServerRecord:
    """What the registry holds about one server."""

    name: str
    url: str | None
    model: str
    version: int = 0
    status: str = "new"  # new | starting | healthy | unhealthy | released | crashed | failed | stopped
    pid: int | None = None
    port: int | None = None
    restarts: int = 0
    log_path: str | None = None
    updated: float = field(default_factory=time.time)


class RecordSink(Protocol):
    """Where ``EngineServer`` writes its record at every status change (a :class:`ServiceRegistry`, or the ledger
    bridge of ``InferenceManager``, workers/engines/manager.py)."""

    def register(self, record: ServerRecord) -> None: ...


class ServiceRegistry:
    """Records of engine servers as one JSON file each in a directory (the seed keeps them in MongoDB)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def register(self, record: ServerRecord) -> None:
        record.updated = time.time()
        tmp = self.path / f".{record.name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, self.path / f"{record.name}.json")

    def get(self, name: str) -> ServerRecord | None:
        file = self.path / f"{name}.json"
        return ServerRecord(**json.loads(file.read_text())) if file.is_file() else None

    def list(self) -> list[ServerRecord]:
        return [ServerRecord(**json.loads(f.read_text())) for f in sorted(self.path.glob("*.json"))]

    def remove(self, name: str) -> None:
        (self.path / f"{name}.json").unlink(missing_ok=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A port of ``host`` that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """Whether a server can listen on ``host:port`` now. With ``SO_REUSEADDR``, as the servers bind (uvicorn,
    SGLang, Python's ``HTTPServer``): the connections of a server that just died, left in ``TIME_WAIT``, do not
    keep its successor from the port; a socket that listens on it does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


class EngineServer:
    """One engine server subprocess; see the module docstring.

    Args:
        command: ``(host, port) -> argv`` of the server (e.g. ``vllm_server_command`` bound to a model).
        name: the registry name (unique per server).
        model: what it serves, for the registry.
        health_path: the route that answers 200 when the server can generate.
        host: the address it binds (127.0.0.1, or the node's address for engines on other hosts).
        port: a fixed port (checked free first: :class:`PortInUse`); None picks a free one at the first start.
            Either way the server keeps its port, so its URL, across restarts (a crash, a release by stop): a
            restart waits up to ``PORT_REUSE_WAIT_S`` for the port to be free, then raises :class:`PortInUse`.
        env: environment additions for the server (a ``None`` value removes the variable from its environment).
        cwd: its working directory.
        log_dir: where its log goes (stdout and stderr, appended across restarts); a temporary directory if None.
        startup_timeout: seconds it has to become healthy.
        health_interval: seconds between the monitor's health checks; 0 disables the monitor.
        max_restarts: crashes restarted before the server is marked failed.
        engine_factory: ``url -> Engine`` (``SGLangEngine``, ``VLLMServerEngine``): ``server.engine``.
        registry: where the server's record is kept (any :class:`RecordSink`: it gets the record at every status
            change, and at every health check of the monitor).
        on_restart: called with the new engine client after a crash restart (e.g. to load the newest weights:
            a restarted server starts from the weights on its command line).
        api_key: the key the server requires (``workers/api_key.py``): True (default) draws a fresh one for this
            server, a string is used as is, False runs without one. The server gets it as ``TQ_API_KEY`` in its
            environment, and in place of any argv item equal to ``KEY_PLACEHOLDER`` (SGLang's ``--api-key``);
            the engine client, the health checks and nothing else get it: the logged command shows it redacted.
    """

    def __init__(
        self,
        command: CommandFn,
        *,
        name: str = "engine-0",
        model: str = "",
        health_path: str = "/health",
        host: str = "127.0.0.1",
        port: int | None = None,
        env: Mapping[str, str | None] | None = None,
        cwd: str | None = None,
        log_dir: str | None = None,
        startup_timeout: float = 120.0,
        health_interval: float = 5.0,
        max_restarts: int = 3,
        engine_factory: Callable[[str], Any] | None = None,
        registry: RecordSink | None = None,
        on_restart: Callable[[Any], None] | None = None,
        api_key: str | bool = True,
    ):
        self.command, self.name, self.model = command, name, model
        self.health_path, self.host, self.fixed_port = health_path, host, port
        self.env, self.cwd = dict(env or {}), cwd
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="tq-engine-server-")) / f"{name}.log"
        self.startup_timeout, self.health_interval, self.max_restarts = startup_timeout, health_interval, max_restarts
        self.engine_factory, self.registry, self.on_restart = engine_factory, registry, on_restart
        self.record = ServerRecord(name=name, url=None, model=model, log_path=str(self.log_path))
        self.process: subprocess.Popen[bytes] | None = None
        self.engine: Any = None
        self.error: EngineServerError | None = None
        self._lock = threading.RLock()
        self._stop_monitor = threading.Event()
        self._monitor: threading.Thread | None = None
        self._released_by_stop = False
        self.api_key: str | None = new_api_key() if api_key is True else (api_key or None)

    def __repr__(self) -> str:  # the key stays out
        return f"EngineServer(name={self.name!r}, url={self.record.url!r}, status={self.record.status!r})"

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> str:
        """Start the server and wait until it is healthy; returns its URL.

        Raises:
            PortInUse: the fixed port is taken, or the server said so in its log.
            EngineNeverHealthy: no healthy answer within ``startup_timeout`` (the server is stopped).
            EngineServerExited: it exited during startup.
        """
        with self._lock:
            self._launch()
            self._wait_healthy()
            if self.health_interval > 0 and (self._monitor is None or not self._monitor.is_alive()):
                self._stop_monitor.clear()
                self._monitor = threading.Thread(target=self._watch, name=f"{self.name}-monitor", daemon=True)
                self._monitor.start()
            return str(self.record.url)

    def _launch(self) -> None:
        # the fixed port, or the one the server had (a restart keeps its URL: clients built with it still reach it)
        port = self.fixed_port if self.fixed_port is not None else self.record.port
        if port is None:
            port = free_port(self.host)
        else:
            # a server that just died may leave its port bound for a moment (children exiting): wait briefly
            deadline = time.monotonic() + (0 if self.record.port is None else PORT_REUSE_WAIT_S)
            while not port_is_free(self.host, port):
                if time.monotonic() >= deadline:
                    raise PortInUse(f"{self.name}: port {self.host}:{port} is already in use; expected a free port")
                time.sleep(0.1)
        argv = self.command(self.host, port)
        shown = redact(" ".join(argv), self.api_key).replace(KEY_PLACEHOLDER, REDACTED)
        env = {key: value for key, value in {**os.environ, **self.env}.items() if value is not None}
        if self.api_key is None and KEY_PLACEHOLDER in argv:
            raise ValueError(f"{self.name}: the command asks for the API key ({KEY_PLACEHOLDER}) but api_key=False")
        if self.api_key is not None:
            argv = [self.api_key if item == KEY_PLACEHOLDER else item for item in argv]
            env[API_KEY_ENV] = self.api_key
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            os.chmod(self.log_path, 0o600)  # the server may print its arguments, key included (SGLang does)
            log.write(f"--- {time.strftime('%H:%M:%S')} start: {shown}\n".encode())
            log.flush()
            # on the launcher thread: the server dies with this process, not with the thread that calls start()
            self.process = popen_for_process_lifetime(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.cwd,
                start_new_session=True,  # its own process group: stop() kills the server and all its children
            )
        _install_exit_handlers()
        _LIVE.add(self)
        url_host = self.host if self.host != "0.0.0.0" else socket.gethostbyname(socket.gethostname())
        self.record.url, self.record.port, self.record.pid = f"http://{url_host}:{port}", port, self.process.pid
        self.engine = self.engine_factory(self.record.url) if self.engine_factory is not None else None
        if self.engine is not None and self.api_key is not None and hasattr(self.engine, "use_api_key"):
            self.engine.use_api_key(self.api_key)
        if self.engine is not None and hasattr(self.engine, "_version"):
            self.engine._version = self.record.version  # a restarted server is reloaded to this version
        self._set_status("starting")

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        assert self.process is not None
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                tail = self.log_tail()
                self._set_status("crashed")
                if any(marker in tail.lower() for marker in _PORT_IN_USE_MARKERS):
                    raise PortInUse(
                        f"{self.name}: the server could not bind {self.record.url} (exit {code}); expected a free "
                        f"port. Last lines of {self.log_path}:\n{tail}"
                    )
                raise EngineServerExited(
                    f"{self.name}: the server exited with code {code} during startup; expected it to become "
                    f"healthy. Last lines of {self.log_path}:\n{tail}"
                )
            if self.healthy():
                self._set_status("healthy")
                return
            time.sleep(0.2)
        self._kill_group()
        self._set_status("failed")
        raise EngineNeverHealthy(
            f"{self.name}: {self.record.url}{self.health_path} did not answer 200 within {self.startup_timeout:.0f} s "
            f"(server stopped). Last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def healthy(self, timeout: float = 5.0) -> bool:
        """One health check: the server process runs and its health route answers 200."""
        if self.process is None or self.process.poll() is not None or self.record.url is None:
            return False
        try:
            response = httpx.get(
                self.record.url + self.health_path,
                headers=bearer_headers(self.api_key),
                timeout=timeout,
                trust_env=False,
            )
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def _watch(self) -> None:
        while not self._stop_monitor.wait(self.health_interval):
            with self._lock:
                if self._stop_monitor.is_set() or self.process is None or self.record.status == "released":
                    continue
                code = self.process.poll()
                if code is None:
                    self._set_status("healthy" if self.healthy() else "unhealthy")
                    continue
                logger.warning("%s: server exited with code %s; restarting", self.name, code)
                try:
                    self.restart()
                except EngineServerError as exc:
                    self.error = exc
                    self._stop_monitor.set()

    def restart(self) -> str:
        """Replace a crashed (or hung) server with a new one (then ``on_restart``); counts against ``max_restarts``.

        Raises:
            RestartBudgetExhausted: after ``max_restarts`` restarts (the server is then marked failed).
        """
        with self._lock:
            if self.record.restarts >= self.max_restarts:
                self._kill_group()
                self._set_status("failed")
                self.error = RestartBudgetExhausted(
                    f"{self.name}: the server crashed again after {self.record.restarts} restarts (budget "
                    f"max_restarts={self.max_restarts}). Last lines of {self.log_path}:\n{self.log_tail()}"
                )
                raise self.error
            self._kill_group()
            self.record.restarts += 1
            self._set_status("crashed")
            self._launch()
            self._wait_healthy()
            if self.on_restart is not None:
                self.on_restart(self.engine)
            return str(self.record.url)

    def check(self) -> None:
        """Raise the error that made the server fail (restart budget spent), if any."""
        if self.error is not None:
            raise self.error

    def stop(self, grace: float = 10.0) -> None:
        """Terminate the server's whole process group (SIGTERM, then SIGKILL after ``grace`` seconds)."""
        self._stop_monitor.set()
        with self._lock:
            self._kill_group(grace)
            if self.record.status not in ("failed",):
                self._set_status("stopped")
            if self.engine is not None and hasattr(self.engine, "close"):
                with contextlib.suppress(Exception):
                    self.engine.close()
        _LIVE.discard(self)

    def _kill_group(self, grace: float = 10.0) -> None:
        process = self.process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        # the leader may be gone while children of the group live on: SIGKILL whatever is left of the group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)

    # ---- memory for training (colocated) ---------------------------------------------------------------------
    def release_memory(self) -> str:
        """Free the server's memory for a training phase: the engine's ``release_memory()`` when it has one,
        otherwise stop the server. Returns how (``"engine"`` or ``"stop"``)."""
        with self._lock:
            if self._engine_releases():
                self.engine.release_memory()
                self._released_by_stop = False
                how = "engine"
            else:
                self._stop_monitor.set()
                self._kill_group()
                self._released_by_stop = True
                how = "stop"
            self._set_status("released")
            return how

    def resume_memory(self, reload: Callable[[Any], None] | None = None) -> str:
        """Bring the server back after ``release_memory``. A stopped server is started again (on its port) and
        ``reload(engine)`` puts the newest weights back into it. Returns its URL."""
        with self._lock:
            if self._released_by_stop:
                self._released_by_stop = False
                url = self.start()
                if reload is not None:
                    reload(self.engine)
                return url
            if self._engine_releases():
                self.engine.resume_memory()
            self._set_status("healthy")
            return str(self.record.url)

    def _engine_releases(self) -> bool:
        engine = self.engine
        return (
            engine is not None
            and hasattr(engine, "release_memory")
            and bool(getattr(engine, "supports_release_memory", True))
        )

    # ---- bookkeeping -----------------------------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """Record the policy version the server's weights are now (``sync_weights_to_engines`` calls it)."""
        with self._lock:
            self.record.version = version
            self._set_status(self.record.status)

    def log_tail(self, lines: int = 20) -> str:
        """The log's last lines, the key redacted (they go into error messages)."""
        try:
            return redact("\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:]), self.api_key)
        except FileNotFoundError:
            return "(no log)"

    def _set_status(self, status: str) -> None:
        self.record.status = status
        if self.registry is not None:
            self.registry.register(self.record)

    @property
    def url(self) -> str | None:
        return self.record.url

    def __enter__(self) -> EngineServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_all_servers() -> None:
    """Stop every server this process started (exit and signal handlers call it)."""
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop(grace=5.0)


def _install_exit_handlers() -> None:
    """Stop all servers at interpreter exit and on SIGTERM / SIGINT, then let the signal do what it did before."""
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    import atexit

    atexit.register(stop_all_servers)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)

        def handler(sig: int, frame: Any, previous: Any = previous) -> None:
            stop_all_servers()
            if callable(previous):
                previous(sig, frame)
            elif previous == signal.SIG_IGN:
                return
            else:
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)

        signal.signal(signum, handler)
