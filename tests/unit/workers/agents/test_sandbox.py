"""The bubblewrap sandbox: what a command can reach, and that every escape attempt is contained.

Skipped, with the reason, where bubblewrap is missing or cannot create namespaces (CI installs ``bubblewrap``).
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import requirement, wait_until
from workers.agents.sandbox import Sandbox, SandboxLimits, SandboxUnavailable, sandbox_unavailable_reason
from workers.agents.sandbox_cgroup import create_cgroup
from workers.agents.sandbox_seccomp import _ARCHES, REFUSED

pytestmark = pytest.mark.skipif(
    sandbox_unavailable_reason() is not None,
    reason=requirement(
        f"a working bubblewrap sandbox: {sandbox_unavailable_reason()}", "apt-get install -y bubblewrap"
    ),
)


def running(token: str) -> list[int]:
    """Pids of host processes whose command line holds ``token``."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdecimal():
            try:
                if token.encode() in Path(entry.path, "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def sleeping(seconds: str) -> int:
    """How many host processes run exactly ``sleep SECONDS``."""
    return len([pid for pid in running(seconds) if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep\0")])


def test_files_persist_across_commands_in_the_home_directory() -> None:
    with Sandbox(files={"data/a.txt": "one\ntwo\n"}) as sandbox:
        first = sandbox.run("pwd; echo $HOME; wc -l < data/a.txt; echo kept > note")
        assert (first.output, first.exit_code) == ("/home/agent\n/home/agent\n2\n", 0)
        assert sandbox.run("cat note; exit 3") == sandbox.run("cat note; exit 3")
        assert sandbox.run("cat note; exit 3").exit_code == 3
        assert (sandbox.home / "note").read_text() == "kept\n"
    assert not sandbox.root.exists()


def test_files_must_stay_inside_the_home_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    base = Path(tempfile.mkdtemp(prefix="tq-sandbox-test-"))
    base.chmod(0o711)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    try:
        with pytest.raises(ValueError, match=r"sandbox file '../escape' is outside /home/agent"):
            Sandbox(files={"ok.txt": "fine", "../escape": "x"})
        assert list(base.iterdir()) == []  # nothing left behind
    finally:
        base.rmdir()


def test_writes_outside_the_sandbox_do_not_reach_the_host(tmp_path: Path) -> None:
    sentinel = tmp_path / "sentinel"
    sentinel.write_text("host\n")
    with Sandbox() as sandbox:
        result = sandbox.run(
            f"echo pwned > {sentinel}; rm -f {sentinel}; echo x > /usr/escape; touch /escape; echo x > /etc/escape;"
            " echo private > /tmp/t; cat /tmp/t"
        )
        assert "Read-only file system" in result.output and result.output.endswith("private\n")
        assert "private" not in sandbox.run("cat /tmp/t").output  # /tmp is private to each command
    assert sentinel.read_text() == "host\n"
    assert not any(Path(p).exists() for p in ("/usr/escape", "/escape", "/etc/escape"))


def test_the_network_is_unreachable() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        with Sandbox() as sandbox:
            result = sandbox.run(
                f"echo hi > /dev/tcp/127.0.0.1/{port} && echo CONNECTED; awk 'NR > 2 {{print $1}}' /proc/net/dev"
            )
        assert "CONNECTED" not in result.output and "Connection refused" in result.output
        assert result.output.split()[-1] == "lo:"  # only the sandbox's own loopback
        with pytest.raises(TimeoutError):
            listener.accept()


def test_own_pid_namespace_and_an_unprivileged_user() -> None:
    with Sandbox() as sandbox:
        result = sandbox.run("ls /proc | grep -c '^[0-9]'; id -u; hostname")
    processes, uid, hostname = result.output.split()
    assert int(processes) <= 5 and hostname == "sandbox"
    assert int(uid) != 0 or os.geteuid() != 0


def test_a_fork_bomb_is_contained() -> None:
    with Sandbox(SandboxLimits(max_processes=16, wall_seconds=60)) as sandbox:
        # The shell forks once, the bomb's first process, before any other exists (calling ``bomb`` itself would fork
        # both ends of the pipe, the second racing the first one's children for the last slots: under load it lost,
        # and the shell gave up with 254); then it waits with builtins only, outlives the bomb by a second and ends.
        bomb = "bomb() { bomb | bomb & }; (bomb) & end=$((SECONDS + 1)); while ((SECONDS <= end)); do :; done; echo ok"
        result = sandbox.run(bomb)
        assert not result.timed_out and result.exit_code == 0 and "ok\n" in result.output
        assert "fork: retry: Resource temporarily unavailable" in result.output  # refused at the process limit
        assert sandbox.run("echo still works").output == "still works\n"
    assert running("bomb()") == []


def test_a_command_that_sleeps_forever_is_killed_at_its_wall_time() -> None:
    with Sandbox(SandboxLimits(wall_seconds=1.0)) as sandbox:
        started = time.monotonic()
        result = sandbox.run("echo before; sleep 98765.4321 & sleep 98765.4321")
        assert 1.0 <= time.monotonic() - started < 30  # not 98765 s; the bound is loose for loaded hosts
        assert (result.output, result.exit_code, result.timed_out) == ("before\n", 124, True)
    wait_until(lambda: running("98765.4321") == [], timeout=5, what="the sleeping processes to be gone")


def test_cpu_and_memory_limits() -> None:
    # a wall limit far beyond the CPU limit: the loop must end by the CPU limit (a signal), however loaded the host
    with Sandbox(SandboxLimits(cpu_seconds=1, wall_seconds=60)) as sandbox:
        spin = sandbox.run("while :; do :; done")
        assert not spin.timed_out and spin.exit_code in (128 + 9, 128 + 24)  # SIGKILL or SIGXCPU
    with Sandbox(SandboxLimits(cpu_seconds=10, wall_seconds=10, memory_bytes=64 * 2**20)) as sandbox:
        hog = sandbox.run("x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}")
        assert "cannot allocate" in hog.output and "200000000" not in hog.output


def test_output_is_truncated_and_the_disk_quota_enforced() -> None:
    limits = SandboxLimits(output_bytes=1000, disk_bytes=4 * 2**20, wall_seconds=1.5)
    with Sandbox(limits) as sandbox:
        flood = sandbox.run("yes")
        assert flood.timed_out and flood.truncated and len(flood.output) == 1000
        fill = sandbox.run("for i in $(seq 100); do head -c 1000000 /dev/zero > f$i; done")
        assert fill.quota_exceeded and not fill.timed_out
    with Sandbox(SandboxLimits(disk_bytes=64 * 2**20)) as sandbox:
        too_big = sandbox.run("head -c 20000000 /dev/zero > big; stat -c %s big")
        assert "File size limit exceeded" in too_big.output and too_big.output.endswith(f"{16 * 2**20}\n")


def test_close_kills_a_running_command() -> None:
    sandbox = Sandbox(SandboxLimits(wall_seconds=30))
    results = []
    worker = threading.Thread(target=lambda: results.append(sandbox.run("sleep 45678.9")))
    worker.start()
    wait_until(lambda: sleeping("45678.9") == 1, timeout=10, what="the command to start")
    sandbox.close()
    worker.join(10)
    assert results and results[0].exit_code == 128 + 9
    wait_until(lambda: running("45678.9") == [], timeout=5, what="the command to be gone")
    assert not sandbox.root.exists()
    with pytest.raises(RuntimeError, match="the sandbox is closed"):
        sandbox.run("true")


@pytest.mark.parametrize("bad", [{"cpu_seconds": 0}, {"wall_seconds": -1.0}])
def test_limits_are_validated(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=rf"SandboxLimits.{next(iter(bad))}=.* must be > 0"):
        SandboxLimits(**bad)  # type: ignore[arg-type]


def test_the_memory_budget_must_exceed_what_the_filesystems_hold() -> None:
    message = (
        r"SandboxLimits.episode_memory_bytes=96 must exceed what its filesystems may hold "
        r"\(disk_bytes \+ tmp_bytes \+ shm_bytes = 96\)"
    )
    with pytest.raises(ValueError, match=message):
        SandboxLimits(episode_memory_bytes=96, disk_bytes=32, tmp_bytes=32, shm_bytes=32)


@pytest.mark.skipif(
    os.geteuid() != 0, reason=requirement("root (only root runs commands under a uid of their own)", "run as root")
)
def test_a_temp_directory_the_sandbox_uid_cannot_reach_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    with pytest.raises(SandboxUnavailable, match=r"private is not searchable by other users \(mode 700\)"):
        Sandbox()


needs_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason=requirement("root (the sandbox's tmpfs home and cgroup need it)", "run the tests as root"),
)
#: a small episode: 32 MiB of memory for everything, 4 MiB for each filesystem
SMALL = SandboxLimits(
    episode_memory_bytes=32 * 2**20, disk_bytes=4 * 2**20, tmp_bytes=4 * 2**20, shm_bytes=4 * 2**20, wall_seconds=20
)


def test_dev_shm_is_size_limited_and_the_rest_of_dev_is_read_only() -> None:
    with Sandbox(SMALL) as sandbox:
        result = sandbox.run(
            "for i in $(seq 20); do head -c 3000000 /dev/zero > /dev/shm/f$i; done; du -sb /dev/shm | cut -f1;"
            " echo x > /dev/escape; echo x > /dev/null && echo null-ok; head -c 3 /dev/zero | wc -c"
        )
        lines = result.output.splitlines()
        assert "No space left on device" in result.output and int(lines[-4]) <= SMALL.shm_bytes  # not 60 MB
        assert "/dev/escape: Read-only file system" in result.output and lines[-2:] == ["null-ok", "3"]
        assert sandbox.run("ls /dev/shm").output == ""  # private to each command


def many_allocators(count: int, mebibytes: int) -> str:
    """A command forking ``count`` processes that each hold ``mebibytes`` MiB (touched), 3 s long, then waiting."""
    hold = f'python3 -c \'import time; x = b"a" * ({mebibytes} << 20); time.sleep(3); print("held")\''
    return f"for i in $(seq {count}); do {hold} & done; wait; echo done"


@needs_root
def test_the_episode_memory_is_capped_across_processes_by_a_cgroup() -> None:
    with Sandbox(SMALL) as sandbox:
        assert sandbox.memory_budget.startswith("cgroup v")
        directories = sandbox._cgroup.directories if sandbox._cgroup else ()
        result = sandbox.run(many_allocators(8, 16))  # 8 x 16 MiB, each under the 512 MiB per-process cap
        assert result.memory_exceeded and not result.timed_out and "Killed" in result.output
        assert result.output.splitlines().count("held") < 8  # the kernel killed some at the budget
        assert sandbox.run("echo still works").output == "still works\n"
        assert all(directory.exists() for directory in directories)
    assert directories and not any(directory.exists() for directory in directories)  # removed with the sandbox


def test_the_episode_memory_is_polled_where_no_cgroup_can_be_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("workers.agents.sandbox.create_cgroup", lambda *args: None)
    with Sandbox(SMALL) as sandbox:
        assert sandbox.memory_budget == "polled"
        result = sandbox.run(many_allocators(8, 16))
        assert result.memory_exceeded and result.exit_code == 128 + 9 and "held" not in result.output.splitlines()
        assert sandbox.run("echo still works").output == "still works\n"
    assert running("time.sleep(3)") == []


@needs_root
def test_parallel_writers_cannot_exceed_the_disk_quota() -> None:
    with Sandbox(SMALL) as sandbox:
        result = sandbox.run("for i in $(seq 30); do head -c 3000000 /dev/zero > f$i & done; wait; echo done")
        assert result.quota_exceeded and "No space left on device" in result.output
        assert sandbox.disk_usage() <= SMALL.disk_bytes
        assert sum(path.stat().st_blocks * 512 for path in sandbox.home.iterdir()) <= SMALL.disk_bytes
        assert sandbox.run("rm f*; echo fits > note; cat note").output == "fits\n"  # room again once freed
    assert not sandbox.root.exists()


#: every call the filter refuses, made through libc's syscall() by a Python inside the sandbox
PROBE = """
import ctypes, errno, sys
libc = ctypes.CDLL(None, use_errno=True)
for name, number in (pair.split("=") for pair in sys.argv[1:]):
    libc.syscall(int(number), 0x10000000, 0, 0, 0, 0)  # args[0] = CLONE_NEWUSER, for clone
    print(name, errno.errorcode.get(ctypes.get_errno(), "OK"))
"""


def test_nested_namespaces_mounts_and_privileged_calls_are_refused() -> None:
    numbers = _ARCHES[platform.machine()][2]
    probes = " ".join(f"{name}={numbers[name]}" for name in (*REFUSED, "clone", "clone3"))
    with Sandbox() as sandbox:
        shell = sandbox.run(
            "unshare -U true || echo no-userns; unshare -r true || echo no-root; unshare -m true || echo no-mountns;"
            " mount -t tmpfs x /tmp || echo no-mount"
        )
        assert [line for line in shell.output.splitlines() if line.startswith("no-")] == [
            "no-userns",
            "no-root",
            "no-mountns",
            "no-mount",
        ]
        assert shell.output.count("unshare failed: Operation not permitted") == 3
        refused = sandbox.run(f"python3 -c '{PROBE}' {probes}")
        assert dict(line.split() for line in refused.output.splitlines()) == {
            **{name: "EPERM" for name in REFUSED},
            "clone": "EPERM",
            "clone3": "ENOSYS",
        }
        ordinary = sandbox.run(
            "printf 'b\\na\\nb\\n' | sort | uniq -c | wc -l; (sleep 0.1 &); x=$(echo sub); echo $x;"
            ' python3 -c \'import subprocess; print(subprocess.run(["echo", "child"]).returncode)\''
        )
        assert (ordinary.output, ordinary.exit_code) == ("2\nsub\nchild\n0\n", 0)


@pytest.fixture
def base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temporary directory the sandbox's uid can pass through, made the sandboxes' base (pytest's is 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="tq-sandbox-test-"))
    folder.chmod(0o711)
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@needs_root
def test_the_tmpfs_home_and_cgroup_of_a_killed_process_are_swept(base: Path) -> None:
    exited = subprocess.Popen(["true"])
    exited.wait()
    name = f"tq-sandbox-{exited.pid}-leaked"  # as a sandbox of that process names them
    leaked = base / name / "home"
    leaked.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(leaked)], check=True)
    cgroup = create_cgroup(name, 2**20, 1)
    alive = create_cgroup(f"tq-sandbox-{os.getpid()}-alive", 2**20, 1)  # this process runs: not swept
    try:
        with Sandbox() as sandbox:
            assert sandbox.run("echo ok").output == "ok\n"
        assert not leaked.parent.exists()
        assert str(leaked) not in Path("/proc/self/mountinfo").read_text()
        assert cgroup is None or not any(directory.exists() for directory in cgroup.directories)
        assert alive is None or all(directory.exists() for directory in alive.directories)
    finally:
        subprocess.run(["umount", "-l", str(leaked)], check=False, capture_output=True)
        for made in (cgroup, alive):
            if made is not None:
                made.remove()


@needs_root
def test_nothing_is_left_when_the_cgroup_cannot_be_made(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise PermissionError(13, "Permission denied", "/sys/fs/cgroup/memory/x")

    monkeypatch.setattr("workers.agents.sandbox.create_cgroup", refuse)
    with pytest.raises(PermissionError):
        Sandbox(files={"a": "b"})
    assert list(base.iterdir()) == [] and str(base) not in Path("/proc/self/mountinfo").read_text()
