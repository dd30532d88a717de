"""Sandbox: run an agent's shell commands in a throwaway directory tree, with no network and bounded resources.

Each command runs in its own bubblewrap (``bwrap``) container: new user, PID, mount, network, IPC, UTS and cgroup
namespaces; the host's ``/usr`` read-only; the episode's directory as the only writable, persistent place
(``/home/agent``, the working directory); a fresh size-limited ``/tmp``; no host network (not even its loopback).
Resource limits come from ``prlimit``: CPU seconds, address space, file size, open files and the number of processes;
the wall time is enforced here (the whole container is killed). When this process runs as root, commands run under
an unprivileged uid of their own, so the process limit counts exactly the sandbox's processes.

>>> with Sandbox() as sandbox:                                                              # doctest: +SKIP
...     sandbox.run("echo 3 > n && cat n").output
'3\\n'
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

BWRAP = shutil.which("bwrap")
PRLIMIT = shutil.which("prlimit")
#: where a command starts, and the home directory inside the sandbox
WORKDIR = "/home/agent"
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: read-only pieces of the host's /etc that ordinary commands need (dynamic linker cache, `awk` and friends)
_QUOTA_POLL_SECONDS = 0.2
_BACKSTOP_SECONDS = 2.0
#: a directory tree with more entries than this counts as over its disk quota
_MAX_WALKED_ENTRIES = 20000
_ETC = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")


class SandboxUnavailable(RuntimeError):
    """bubblewrap or prlimit is missing, or cannot create namespaces here (the message says what failed)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one command may use. Each limit applies per command; the directory quota to the whole episode."""

    #: CPU seconds per process (SIGKILL beyond)
    cpu_seconds: int = 5
    #: wall-clock seconds for the whole command (every process of it is killed beyond)
    wall_seconds: float = 10.0
    #: address space per process, bytes
    memory_bytes: int = 512 * 2**20
    #: processes (and threads) at once
    max_processes: int = 32
    #: largest file a command may write, bytes
    file_bytes: int = 16 * 2**20
    #: open file descriptors per process
    open_files: int = 256
    #: size of the command's private /tmp, bytes
    tmp_bytes: int = 16 * 2**20
    #: output (stdout and stderr together) kept per command; the rest is discarded
    output_bytes: int = 16 * 2**10
    #: what the episode's directory tree may hold (bytes on disk); checked while a command runs
    disk_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name}={value!r} must be > 0")


@dataclass(frozen=True)
class CommandResult:
    """What a command printed (stdout and stderr interleaved, decoded leniently) and how it ended."""

    output: str
    exit_code: int
    #: killed at ``wall_seconds``
    timed_out: bool = False
    #: the output went beyond ``output_bytes`` and was cut
    truncated: bool = False
    #: killed because the directory tree outgrew ``disk_bytes`` (the episode cannot go on)
    quota_exceeded: bool = False


class Sandbox:
    """One episode's sandbox: a throwaway directory tree and the commands run in it, one at a time.

    Args:
        limits: per-command resource limits.
        files: files to create before the first command, relative path (inside ``/home/agent``) to content.

    Raises:
        SandboxUnavailable: bubblewrap/prlimit missing or unusable (use :func:`sandbox_unavailable_reason` to test).
    """

    def __init__(self, limits: SandboxLimits | None = None, files: dict[str, str] | None = None) -> None:
        if BWRAP is None or PRLIMIT is None:
            raise SandboxUnavailable(
                "the sandbox needs bubblewrap (apt-get install bubblewrap) and prlimit (util-linux)"
            )
        self.limits = limits or SandboxLimits()
        # As root: a uid of our own (never a real account), so RLIMIT_NPROC counts only this sandbox's processes.
        self._uid = secrets.randbelow(2**30) + 2**20 if os.geteuid() == 0 else None
        base = Path(tempfile.gettempdir()).resolve()
        if self._uid is not None:
            for folder in (base, *base.parents):
                if not folder.stat().st_mode & 0o001:
                    raise SandboxUnavailable(
                        f"{folder} is not searchable by other users (mode {folder.stat().st_mode & 0o777:o}), so the "
                        "sandbox's own uid cannot reach its directory; set TMPDIR to a directory that is"
                    )
        self.root = Path(tempfile.mkdtemp(prefix="tq-sandbox-", dir=base))
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._closed = False
        try:
            self._populate(files or {})
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    def _populate(self, files: dict[str, str]) -> None:
        self.home.mkdir(mode=0o755)
        for relative, content in files.items():
            path = (self.home / relative).resolve()
            if not path.is_relative_to(self.home):
                raise ValueError(f"sandbox file {relative!r} is outside {WORKDIR}")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        if self._uid is not None:
            self.root.chmod(0o711)  # the sandbox uid may pass through to its home, and list nothing else
            for path in [self.home, *self.home.rglob("*")]:
                os.lchown(path, self._uid, self._uid)

    @property
    def home(self) -> Path:
        """The host directory seen as ``/home/agent`` inside the sandbox."""
        return self.root / "home"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, command: str) -> CommandResult:
        """Run ``command`` with ``bash -c`` in the sandbox and wait for it (at most ``wall_seconds``).

        Raises:
            RuntimeError: the sandbox is closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the sandbox is closed")
            self._process = subprocess.Popen(
                self._argv(command),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                user=self._uid,
                group=self._uid,
                extra_groups=[] if self._uid is not None else None,
                close_fds=True,
            )
            try:
                if self._closed:  # close() ran between the check above and now: it could not see this process
                    self._kill(self._process)
                return self._collect(self._process)
            finally:
                self._kill(self._process)
                self._process = None

    def close(self) -> None:
        """Kill a command still running and delete the directory tree. Idempotent."""
        self._closed = True
        process = self._process
        if process is not None:
            self._kill(process)
        with self._lock:
            shutil.rmtree(self.root, ignore_errors=True)

    def _argv(self, command: str) -> list[str]:
        limits = self.limits
        nproc = limits.max_processes
        if self._uid is None:  # our own uid: RLIMIT_NPROC counts every thread we already run too
            nproc += _tasks_of_uid(os.getuid())
        rlimits = [
            f"--cpu={limits.cpu_seconds}",
            f"--as={limits.memory_bytes}",
            f"--nproc={nproc}",
            f"--fsize={limits.file_bytes}",
            f"--nofile={limits.open_files}",
            "--core=0",
        ]
        mounts = ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                mounts += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                mounts += ["--ro-bind", top, top]
        for path in _ETC:
            mounts += ["--ro-bind-try", path, path]
        return [
            PRLIMIT or "prlimit",
            *rlimits,
            BWRAP or "bwrap",
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--hostname",
            "sandbox",
            *mounts,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(limits.tmp_bytes),
            "--tmpfs",
            "/tmp",
            "--bind",
            str(self.home),
            WORKDIR,
            "--remount-ro",
            "/",
            "--chdir",
            WORKDIR,
            "--clearenv",
            "--setenv",
            "PATH",
            _PATH,
            "--setenv",
            "HOME",
            WORKDIR,
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--",
            # A backstop inside the sandbox for the wall time this process enforces: if this process dies in the
            # instant before bwrap has tied itself to it (--die-with-parent), the command still ends.
            "/usr/bin/timeout",
            "--signal=KILL",
            f"{limits.wall_seconds + _BACKSTOP_SECONDS:g}",
            "/bin/bash",
            "-c",
            command,
        ]

    def _collect(self, process: subprocess.Popen[bytes]) -> CommandResult:
        """Read at most ``output_bytes`` of output until the command exits or its wall time runs out."""
        assert process.stdout is not None
        limit = self.limits.output_bytes
        kept = bytearray()
        truncated = False
        reader_done = threading.Event()

        def read() -> None:  # a thread, so a command that prints forever never stalls the deadline
            nonlocal truncated
            try:
                while chunk := os.read(process.stdout.fileno(), 65536):  # type: ignore[union-attr]
                    room = limit - len(kept)
                    kept.extend(chunk[:room])
                    truncated = truncated or len(chunk) > room
            finally:
                reader_done.set()

        reader = threading.Thread(target=read, name="sandbox-output", daemon=True)
        reader.start()
        deadline = time.monotonic() + self.limits.wall_seconds
        timed_out = over_quota = False
        while process.poll() is None:
            try:
                process.wait(timeout=min(_QUOTA_POLL_SECONDS, max(deadline - time.monotonic(), 0.0)))
            except subprocess.TimeoutExpired:
                timed_out = time.monotonic() >= deadline
                over_quota = self.disk_usage() > self.limits.disk_bytes
                if timed_out or over_quota:
                    self._kill(process)
        over_quota = over_quota or self.disk_usage() > self.limits.disk_bytes
        reader_done.wait(timeout=5.0)
        process.stdout.close()
        output = kept.decode("utf-8", errors="replace")
        code = 124 if timed_out else _exit_code(process.returncode)
        return CommandResult(output, code, timed_out=timed_out, truncated=truncated, quota_exceeded=over_quota)

    def disk_usage(self) -> int:
        """Bytes on disk under ``/home/agent`` (counted up to a bound: a tree too large to walk counts as full)."""
        total, entries, stack = 0, 0, [str(self.home)]
        while stack:
            try:
                with os.scandir(stack.pop()) as scan:
                    for entry in scan:
                        entries += 1
                        if entries > _MAX_WALKED_ENTRIES:
                            return self.limits.disk_bytes + 1
                        stat = entry.stat(follow_symlinks=False)
                        total += stat.st_blocks * 512  # what is allocated, so sparse files count as what they hold
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                continue
        return total

    @staticmethod
    def _kill(process: subprocess.Popen[bytes]) -> None:
        """SIGKILL bwrap's process group: its PID-1 child dies with it, and the PID namespace with that."""
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def _exit_code(returncode: int) -> int:
    """A shell-style exit code: 128 + N for a command killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _tasks_of_uid(uid: int) -> int:
    """Threads run by ``uid`` now: what RLIMIT_NPROC counts on Linux."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdecimal():
            try:
                if os.stat(entry.path).st_uid == uid:
                    count += len(os.listdir(f"{entry.path}/task"))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass
    return count


_UNAVAILABLE: list[str | None] = []


def sandbox_unavailable_reason() -> str | None:
    """None if sandboxes work here, else why not (bwrap missing, namespaces refused...). Checked once per process."""
    if not _UNAVAILABLE:
        try:
            with Sandbox(SandboxLimits(wall_seconds=30)) as sandbox:
                result = sandbox.run("echo ok")
            ok = result.exit_code == 0 and result.output == "ok\n"
            _UNAVAILABLE.append(None if ok else f"bwrap failed here: {result.output.strip()!r}")
        except SandboxUnavailable as err:
            _UNAVAILABLE.append(str(err))
    return _UNAVAILABLE[0]
