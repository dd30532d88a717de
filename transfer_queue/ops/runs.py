"""Where a run left word of itself: the per-user discovery records the status command finds a run by.

The process that starts a queue (``transfer_queue.init``) writes one record, ``<tmp>/transfer_queue-<uid>-runs/
<pid>.json`` (the directory 0700, the file 0600, both this user's; not under the socket root, whose sweep removes
every directory that is not a live server's), with what another process of the same user on
this machine needs to join its Ray cluster and find the queue: the cluster's address, the Ray variables of its
environment that joining takes (token authentication, loopback node address), the controller's name and namespace,
the status page and where the metrics go. The writer holds an exclusive ``flock`` on the file while it lives and
removes the file at ``transfer_queue.shutdown`` and at exit; a record whose lock can be taken, or whose pid is gone,
belongs to a dead process (SIGKILL, an OOM kill) and is removed by the next reader.

Plain files and no Ray: unit-tested without a cluster (tests/unit/transfer_queue/ops/test_runs.py).
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shlex
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from transfer_queue.errors import QueueNotFound
from transfer_queue.wire.socket_dirs import lock_held

RECORD_VERSION = 1
# Ray reads these from a driver's environment when it joins a cluster: token authentication (the mode, the token or
# the file that holds it) and whether node addresses are loopback ones (a cluster started with it at 0 lives on
# 127.0.0.1, and a driver without it looks for its node at the machine's external address).
RAY_ATTACH_VARIABLES = (
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
)
RAY_DEFAULT_TOKEN_PATH = Path("~/.ray/auth_token")  # where Ray keeps the token of a local cluster it started
STATUS_COMMAND = "-m transfer_queue status"


@dataclass(frozen=True)
class RunRecord:
    """One run's discovery record (``<pid>.json``)."""

    pid: int
    started_at: float  # time.time() when the queue started
    command: str  # the run's command line
    ray_address: str  # the GCS host:port of its Ray cluster
    ray_env: dict[str, str]  # the RAY_ATTACH_VARIABLES a driver must have to join it
    namespace: str  # the controller's Ray namespace and actor name
    controller: str
    status_page: str | None  # None: the queue serves no HTTP (http_port=-1)
    metrics: str | None  # the controller's Prometheus endpoint
    run_metrics: str | None = None  # where the run writes its own metrics (e.g. its metrics.jsonl)
    version: int = RECORD_VERSION
    path: str = field(default="", compare=False)  # the file it was read from (not written)

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("path")
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, path: str = "") -> RunRecord:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
            raise ValueError(f"not a version-{RECORD_VERSION} run record")
        return cls(**{**data, "path": path})

    def describe(self) -> str:
        """``pid 123 (python recipe/demo.py, started 01:02:03)``: the run, for a person choosing among several."""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_at))
        return f"pid {self.pid} ({self.command}, started {started})"


def ray_attach_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Ray variables of ``environ`` (default: this process's, after ``ray.init``) that a driver joining the same
    cluster needs; under token authentication with no token variable, the file Ray read it from
    (``~/.ray/auth_token``), named explicitly."""
    environ = os.environ if environ is None else environ
    env = {name: environ[name] for name in RAY_ATTACH_VARIABLES if name in environ}
    if env.get("RAY_AUTH_MODE", "").lower() == "token" and not {"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & env.keys():
        token_file = RAY_DEFAULT_TOKEN_PATH.expanduser()
        if token_file.is_file():
            env["RAY_AUTH_TOKEN_PATH"] = str(token_file)
    return env


def runs_dir(root: str | None = None) -> str:
    """This user's directory of run records, ``<root>/transfer_queue-<uid>-runs`` (``root``: the system's temporary
    directory by default), created 0700.

    Raises:
        PermissionError: it exists but is not a private directory of this user (a link, another user's, shared).
    """
    path = os.path.join(root or tempfile.gettempdir(), f"transfer_queue-{os.getuid()}-runs")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{path} must be a directory of uid {os.getuid()} with mode 0700, not a link or shared")
    return path


class RunFile:
    """This process's published record: locked while the process lives, removed by :meth:`remove` or at exit."""

    def __init__(self, record: RunRecord, root: str | None = None):
        directory = runs_dir(root)
        self.path = os.path.join(directory, f"{record.pid}.json")
        staging = os.path.join(directory, f".{record.pid}.json.new")
        self._fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(self._fd, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # the lock goes with the file's inode through the rename
        os.write(self._fd, record.to_json().encode())
        os.rename(staging, self.path)  # readers only ever see whole, locked records
        atexit.register(self.remove)

    def remove(self) -> None:
        """Delete the record and drop its lock (idempotent)."""
        atexit.unregister(self.remove)
        if self._fd >= 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = -1


def publish(record: RunRecord, root: str | None = None) -> RunFile:
    """Write ``record`` for the status command to find (see the module docstring)."""
    return RunFile(record, root)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the pid: not our run
        return False
    return True


def _writer_alive(path: str) -> bool:
    """Whether a live process holds the record's lock (taking it, when free, proves its writer is dead)."""
    return bool(lock_held(path, shared=True))


def _read(path: str) -> RunRecord | None:
    """The record at ``path`` if its writer lives; a dead writer's record (or a damaged one) is removed."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    try:
        record: RunRecord | None = RunRecord.from_json(text, path)
    except (ValueError, TypeError):  # damaged, or of another version: kept while a live writer holds it
        record = None
    live = _writer_alive(path) and (record is None or _pid_alive(record.pid))
    if not live:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return record if live else None


def live_runs(root: str | None = None) -> list[RunRecord]:
    """The records of this user's live runs on this machine, newest first; dead runs' records are removed."""
    directory = runs_dir(root)
    names = sorted(n for n in os.listdir(directory) if n.endswith(".json") and not n.startswith("."))
    found = [r for r in (_read(os.path.join(directory, n)) for n in names) if r is not None]
    return sorted(found, key=lambda r: r.started_at, reverse=True)


def choose_run(runs: list[RunRecord], pid: int | None = None, where: str = "") -> RunRecord:
    """The run ``pid`` among ``runs``, or the newest when ``pid`` is None.

    Raises:
        QueueNotFound: no live run (with that pid); the message lists the live ones and what to pass.
    """
    where = where or runs_dir()
    if pid is None and runs:
        return runs[0]
    if pid is not None:
        for run in runs:
            if run.pid == pid:
                return run
        listed = "; ".join(r.describe() for r in runs) or "none"
        raise QueueNotFound(f"no live transfer_queue run with pid {pid} in {where}; live runs: {listed}")
    raise QueueNotFound(
        f"no live transfer_queue run of this user (uid {os.getuid()}) on this machine: {where} holds no record of "
        "one. Start a run (transfer_queue.init writes the record), run this command as the user and on the "
        "machine that started it, or pass --address HOST:PORT of the Ray cluster the queue runs on "
        "(with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH if the cluster uses token authentication)"
    )


def others_note(chosen: RunRecord, runs: list[RunRecord]) -> str | None:
    """The line that says which run a status command chose among several, and how to pick another."""
    others = [r for r in runs if r.pid != chosen.pid]
    if not others:
        return None
    listed = "; ".join(r.describe() for r in others)
    return f"{len(runs)} live runs: showing {chosen.describe()}; others: {listed}. Choose one with --run PID"


def python_command() -> str:
    """``python`` when that is this interpreter on the PATH, else this interpreter's full path."""
    on_path = shutil.which("python")
    same = on_path is not None and os.path.realpath(on_path) == os.path.realpath(sys.executable)
    return "python" if same else sys.executable


def status_command(record: RunRecord, runs: list[RunRecord]) -> str:
    """The exact command that shows ``record``'s queue: no flags when it is the user's only live run."""
    command = f"{python_command()} {STATUS_COMMAND}"
    return command if all(r.pid == record.pid for r in runs) else f"{command} --run {record.pid}"


def command_line(argv: list[str] | None = None) -> str:
    """The run's command line, for a person to recognise it by (``python recipe/demo.py steps=10``)."""
    return shlex.join([os.path.basename(sys.executable), *(sys.argv if argv is None else argv)])


def start_block(record: RunRecord, runs: list[RunRecord]) -> str:
    """What a run prints when its queue starts: the status command, the status page, where the metrics go."""
    metrics = [m for m in (record.run_metrics, record.metrics and f"Prometheus {record.metrics}") if m]
    lines = [
        f"transfer_queue: queue started by pid {record.pid} on the Ray cluster at {record.ray_address}",
        f"  status:      {status_command(record, runs)}",
        f"  status page: {record.status_page or 'none (the queue was started with http_port=-1)'}",
        f"  metrics:     {' | '.join(metrics) or 'none'}",
    ]
    return "\n".join(lines)
