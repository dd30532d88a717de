"""Where the sandbox's cgroup goes, read from fake ``/proc/self/mountinfo`` and ``/proc/self/cgroup`` files over a
fake cgroup tree (a plain directory: the kernel's files are written, not interpreted). The real v1 cgroup, its limits
and its removal are checked in test_sandbox.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.agents import sandbox_cgroup
from workers.agents.sandbox_cgroup import SandboxCgroup, create_cgroup, join_argv


def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mounts: list[str], cgroups: list[str]) -> None:
    (tmp_path / "mountinfo").write_text("".join(f"{n} 1 0:{n} {line}\n" for n, line in enumerate(mounts, 30)))
    (tmp_path / "cgroup").write_text("".join(f"{line}\n" for line in cgroups))
    monkeypatch.setattr(sandbox_cgroup, "MOUNTINFO", tmp_path / "mountinfo")
    monkeypatch.setattr(sandbox_cgroup, "SELF_CGROUP", tmp_path / "cgroup")
    monkeypatch.setattr(sandbox_cgroup.os, "geteuid", lambda: 0)


def test_v2_goes_under_the_nearest_ancestor_that_delegates_memory_and_pids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = tmp_path / "unified"
    (tree / "system.slice" / "server.service").mkdir(parents=True)
    (tree / "cgroup.subtree_control").write_text("cpu memory pids\n")
    (tree / "system.slice" / "cgroup.subtree_control").write_text("memory pids\n")
    (tree / "system.slice" / "server.service" / "cgroup.subtree_control").write_text("")
    host(tmp_path, monkeypatch, [f"/ {tree} rw - cgroup2 cgroup2 rw"], ["0::/system.slice/server.service"])
    cgroup = create_cgroup("tq-sandbox-1", 32 * 2**20, 16)
    assert cgroup == SandboxCgroup(2, (tree / "system.slice" / "tq-sandbox-1",))
    directory = cgroup.directories[0]
    assert (directory / "memory.max").read_text() == str(32 * 2**20) and (directory / "pids.max").read_text() == "16"
    assert not (directory / "memory.swap.max").exists()  # only where swap accounting is on
    (directory / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 2\n")
    assert cgroup.oom_kills() == 2
    assert join_argv(cgroup, ["prlimit", "bwrap"])[-5:] == [
        "sh",
        str(directory / "cgroup.procs"),
        "--",
        "prlimit",
        "bwrap",
    ]


def test_v1_goes_under_this_process_s_memory_and_pids_cgroups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    memory, pids = tmp_path / "memory", tmp_path / "pids"
    (memory / "7").mkdir(parents=True)
    pids.mkdir()
    mounts = [
        f"/ {tmp_path / 'unified'} rw - cgroup2 cgroup2 rw",  # a hybrid host: v2 without controllers
        f"/job {memory} rw - cgroup cgroup rw,memory",  # mounted from a sub-tree
        f"/ {pids} rw - cgroup cgroup rw,pids",
    ]
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.subtree_control").write_text("")
    host(tmp_path, monkeypatch, mounts, ["8:pids:/", "4:memory:/job/7", "0::/"])
    cgroup = create_cgroup("tq-sandbox-2", 1000, 9)
    assert cgroup == SandboxCgroup(1, (memory / "7" / "tq-sandbox-2", pids / "tq-sandbox-2"))
    assert (memory / "7" / "tq-sandbox-2" / "memory.limit_in_bytes").read_text() == "1000"
    assert (pids / "tq-sandbox-2" / "pids.max").read_text() == "9"
    assert cgroup.description == f"cgroup v1 ({memory / '7' / 'tq-sandbox-2'}, {pids / 'tq-sandbox-2'})"


def test_no_usable_hierarchy_means_no_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.subtree_control").write_text("cpu\n")
    host(tmp_path, monkeypatch, [f"/ {tmp_path / 'unified'} rw - cgroup2 cgroup2 rw"], ["0::/"])
    assert create_cgroup("tq-sandbox-3", 1000, 9) is None
    assert join_argv(None, ["bwrap"]) == ["bwrap"]


def test_memory_available_is_bounded_by_this_process_s_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    memory = tmp_path / "memory"
    memory.mkdir()
    (memory / "memory.limit_in_bytes").write_text(f"{3 * 2**20}\n")
    (memory / "memory.usage_in_bytes").write_text(f"{2**20}\n")
    host(tmp_path, monkeypatch, [f"/ {memory} rw - cgroup cgroup rw,memory"], ["4:memory:/"])
    assert sandbox_cgroup.memory_available() == 2 * 2**20
    (memory / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited: the machine's MemAvailable
    assert 2 * 2**20 < sandbox_cgroup.memory_available() < 2**50
