"""The bubblewrap sandbox: what a command can reach, and that every escape attempt is contained.

Skipped, with the reason, where bubblewrap is missing or cannot create namespaces (CI installs ``bubblewrap``).
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import requirement, wait_until
from workers.agents.sandbox import Sandbox, SandboxLimits, SandboxUnavailable, sandbox_unavailable_reason

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
        # the shell waits with builtins only (no fork of its own), so it outlives the bomb by a second and ends
        bomb = "bomb() { bomb | bomb & }; bomb; end=$((SECONDS + 1)); while ((SECONDS <= end)); do :; done; echo ok"
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
