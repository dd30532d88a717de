"""Sandbox: run an agent's shell commands in a throwaway directory tree, with no network and bounded resources.

Each command runs in its own bubblewrap (``bwrap``) container: new user, PID, mount, network, IPC, UTS and cgroup
namespaces (no further user namespace inside); a syscall filter (:mod:`workers.agents.sandbox_seccomp`); the host's
``/usr`` read-only; the episode's directory as the only writable, persistent place (``/home/agent``, the working
directory); a fresh size-limited ``/tmp`` and ``/dev/shm``, the rest of ``/dev`` read-only device nodes; no host
network (not even its loopback). Per-process limits come from ``prlimit``: CPU seconds, address space, file size, open
files and the number of processes; the wall time is enforced here (the whole container is killed).

When this process runs as root, commands run under an unprivileged uid of their own, so the process limit counts
exactly the sandbox's processes; the episode's directory is a tmpfs of ``disk_bytes`` (a hard bound on what all its
processes together write); and, where the host allows it, one cgroup per sandbox caps the memory and the processes
of the whole episode (:mod:`workers.agents.sandbox_cgroup`). Elsewhere the disk quota and the episode's memory are
polled while a command runs, and a command beyond either is killed.

>>> with Sandbox() as sandbox:                                                              # doctest: +SKIP
...     sandbox.run("echo 3 > n && cat n").output
'3\\n'
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from workers.agents.sandbox_cgroup import SandboxCgroup, create_cgroup, join_argv, resident_bytes, sweep_cgroups
from workers.agents.sandbox_seccomp import seccomp_program

logger = logging.getLogger(__name__)
BWRAP = shutil.which("bwrap")
PRLIMIT = shutil.which("prlimit")
SETPRIV = shutil.which("setpriv")
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
    """What one command may use. Each limit applies per command; the disk quota and memory budget to the episode."""

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
    #: size of the command's private /dev/shm, bytes
    shm_bytes: int = 16 * 2**20
    #: output (stdout and stderr together) kept per command; the rest is discarded
    output_bytes: int = 16 * 2**10
    #: what the episode's directory tree may hold (bytes on disk; a tmpfs of this size as root, else polled)
    disk_bytes: int = 64 * 2**20
    #: memory of all the episode's processes together, its tmpfs files included (a cgroup's limit, else polled)
    episode_memory_bytes: int = 1024 * 2**20

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name}={value!r} must be > 0")
        held = self.disk_bytes + self.tmp_bytes + self.shm_bytes
        if self.episode_memory_bytes <= held:
            raise ValueError(
                f"SandboxLimits.episode_memory_bytes={self.episode_memory_bytes} must exceed what its filesystems "
                f"may hold (disk_bytes + tmp_bytes + shm_bytes = {held})"
            )


@dataclass(frozen=True)
class CommandResult:
    """What a command printed (stdout and stderr interleaved, decoded leniently) and how it ended."""

    output: str
    exit_code: int
    #: killed at ``wall_seconds``
    timed_out: bool = False
    #: the output went beyond ``output_bytes`` and was cut
    truncated: bool = False
    #: the directory tree filled ``disk_bytes`` (the episode cannot go on)
    quota_exceeded: bool = False
    #: a process was killed because the episode's processes together reached ``episode_memory_bytes``
    memory_exceeded: bool = False


class Sandbox:
    """One episode's sandbox: a throwaway directory tree and the commands run in it, one at a time.

    Args:
        limits: per-command resource limits.
        files: files to create before the first command, relative path (inside ``/home/agent``) to content.

    Raises:
        SandboxUnavailable: bubblewrap/prlimit missing or unusable (use :func:`sandbox_unavailable_reason` to test).
    """

    def __init__(self, limits: SandboxLimits | None = None, files: dict[str, str] | None = None) -> None:
        if BWRAP is None or PRLIMIT is None or SETPRIV is None:
            raise SandboxUnavailable(
                "the sandbox needs bubblewrap (apt-get install bubblewrap), prlimit and setpriv (util-linux)"
            )
        try:
            self._seccomp = seccomp_program()
        except OSError as err:
            raise SandboxUnavailable(str(err)) from err
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
            sweep_cgroups(_of_a_dead_process)
        _sweep_leftovers(base)
        self.root = Path(tempfile.mkdtemp(prefix=f"tq-sandbox-{os.getpid()}-", dir=base))
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._closed = False
        self._home_mounted = False
        self._cgroup: SandboxCgroup | None = None
        try:
            self._populate(files or {})
            if self._uid is not None:
                self._cgroup = create_cgroup(self.root.name, self.limits.episode_memory_bytes, self._process_cap())
        except BaseException:
            self._release()
            raise

    @property
    def memory_budget(self) -> str:
        """How ``episode_memory_bytes`` is enforced: ``"cgroup v1 (...)"``, ``"cgroup v2 (...)"`` or ``"polled"``."""
        return self._cgroup.description if self._cgroup is not None else "polled"

    def _populate(self, files: dict[str, str]) -> None:
        self.home.mkdir(mode=0o755)
        if self._uid is not None:  # the quota as a filesystem's size: every process together cannot write more
            _mount_tmpfs(self.home, self.limits.disk_bytes, _MAX_WALKED_ENTRIES, self._uid)
            self._home_mounted = True
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
            seccomp, writer = os.pipe()  # bwrap reads the filter from this pipe until EOF
            try:
                os.write(writer, self._seccomp)
                os.close(writer)
                self._process = subprocess.Popen(
                    self._argv(command, seccomp),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=(seccomp,),
                )
            finally:
                os.close(seccomp)
            try:
                if self._closed:  # close() ran between the check above and now: it could not see this process
                    self._kill(self._process)
                return self._collect(self._process)
            finally:
                self._kill(self._process)
                self._process = None

    def close(self) -> None:
        """Kill a command still running, remove the cgroup and delete the directory tree. Idempotent."""
        self._closed = True
        process = self._process
        if process is not None:
            self._kill(process)
        with self._lock:
            self._release()

    def _release(self) -> None:
        """Remove the cgroup, the home's tmpfs and the tree; what cannot go is logged (close() never raises)."""
        if self._cgroup is not None:
            try:
                self._cgroup.remove()
            except OSError as err:  # a process that would not die: its cgroup (empty or not) stays, logged
                logger.warning("cannot remove the sandbox's %s: %s", self._cgroup.description, err)
            self._cgroup = None
        if self._home_mounted:
            try:
                _unmount(self.home)
            except OSError as err:
                logger.warning("%s; its files stay", err)
                return
            self._home_mounted = False
        shutil.rmtree(self.root, ignore_errors=True)

    def _process_cap(self) -> int:
        nproc = self.limits.max_processes
        if self._uid is None:  # our own uid: RLIMIT_NPROC counts every thread we already run too
            nproc += _tasks_of_uid(os.getuid())
        return nproc

    def _argv(self, command: str, seccomp_fd: int) -> list[str]:
        limits = self.limits
        rlimits = [
            f"--cpu={limits.cpu_seconds}",
            f"--as={limits.memory_bytes}",
            f"--nproc={self._process_cap()}",
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
        # As root: join the cgroup (still root), then become the sandbox's uid, no groups, and set the limits.
        privileges = []
        if self._uid is not None:
            privileges = [SETPRIV or "setpriv", f"--reuid={self._uid}", f"--regid={self._uid}", "--clear-groups"]
        argv = [
            *privileges,
            PRLIMIT or "prlimit",
            *rlimits,
            BWRAP or "bwrap",
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",  # no user namespace inside (the seccomp filter refuses them again)
            "--seccomp",
            str(seccomp_fd),
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
            str(limits.shm_bytes),
            "--tmpfs",
            "/dev/shm",
            "--remount-ro",  # not recursive: /dev/shm stays writable, the device nodes stay usable
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
        return join_argv(self._cgroup, argv)

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
        oom_kills = self._cgroup.oom_kills() if self._cgroup is not None else 0
        timed_out = over_quota = over_memory = False
        while process.poll() is None:
            try:
                process.wait(timeout=min(_QUOTA_POLL_SECONDS, max(deadline - time.monotonic(), 0.0)))
            except subprocess.TimeoutExpired:
                timed_out = time.monotonic() >= deadline
                over_quota = self._over_quota()
                # no cgroup: the resident memory of the command's processes, polled (tmpfs pages are not seen)
                over_memory = self._cgroup is None and resident_bytes(process.pid) > self.limits.episode_memory_bytes
                if timed_out or over_quota or over_memory:
                    self._kill(process)
        over_quota = over_quota or self._over_quota()
        over_memory = over_memory or (self._cgroup is not None and self._cgroup.oom_kills() > oom_kills)
        reader_done.wait(timeout=5.0)
        process.stdout.close()
        output = kept.decode("utf-8", errors="replace")
        code = 124 if timed_out else _exit_code(process.returncode)
        return CommandResult(
            output,
            code,
            timed_out=timed_out,
            truncated=truncated,
            quota_exceeded=over_quota,
            memory_exceeded=over_memory,
        )

    def _over_quota(self) -> bool:
        """The home tmpfs is full (no block or no inode left), or the polled tree holds more than ``disk_bytes``."""
        if self._home_mounted:
            filesystem = os.statvfs(self.home)
            return filesystem.f_bavail == 0 or filesystem.f_favail == 0
        return self.disk_usage() > self.limits.disk_bytes

    def disk_usage(self) -> int:
        """Bytes on disk under ``/home/agent`` (counted up to a bound: a tree too large to walk counts as full)."""
        if self._home_mounted:
            filesystem = os.statvfs(self.home)
            return (filesystem.f_blocks - filesystem.f_bfree) * filesystem.f_frsize
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

    def _kill(self, process: subprocess.Popen[bytes]) -> None:
        """SIGKILL bwrap's process group (its PID-1 child dies with it, and the PID namespace with that) and the
        cgroup's processes."""
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        if self._cgroup is not None:
            self._cgroup.kill()


_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2
#: the name of a sandbox's directory and cgroup, made by process PID: ``tq-sandbox-PID-XXXXXXXX``
_NAME = re.compile(r"tq-sandbox-(\d+)-[^/]+")
#: the tmpfs home of a sandbox: ``BASE/tq-sandbox-PID-XXXXXXXX/home``
_HOME_MOUNT = re.compile(rf"/({_NAME.pattern})/home$")


def _of_a_dead_process(name: str) -> bool:
    """``name`` is a sandbox's, made by a process that no longer runs (killed before it closed the sandbox)."""
    match = _NAME.fullmatch(name)
    return match is not None and not Path(f"/proc/{match.group(1)}").exists()


def _mount_tmpfs(path: Path, size: int, inodes: int, uid: int) -> None:
    options = f"size={size},nr_inodes={inodes},mode=0755,uid={uid},gid={uid}"
    if _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", 0, options.encode()) != 0:
        code = ctypes.get_errno()
        raise SandboxUnavailable(f"cannot mount a tmpfs ({options}) on {path}: {os.strerror(code)}")


def _unmount(path: Path) -> None:
    if _libc.umount2(os.fsencode(path), _MNT_DETACH) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT):
        code = ctypes.get_errno()
        raise OSError(code, f"cannot unmount {path}: {os.strerror(code)}")


def _sweep_leftovers(base: Path) -> None:
    """Unmount the tmpfs homes and delete the directory trees under ``base`` of sandboxes whose process died without
    closing them (SIGKILL), so that their memory and disk are not held until a reboot."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        match = _HOME_MOUNT.search(point)
        if match and Path(point).parent.parent == base and _of_a_dead_process(match.group(1)):
            try:
                _unmount(Path(point))
            except OSError:
                continue
    for entry in os.scandir(base):
        if _of_a_dead_process(entry.name) and not os.path.ismount(Path(entry.path, "home")):
            shutil.rmtree(entry.path, ignore_errors=True)


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
