"""Scratch directories in shared memory: named after their owner, removed by it however it ends (return, exception,
interpreter exit), and swept by the next one made on the host when the owner was killed outright (issue 25, §3)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rl_contracts.scratch import LOCK_NAME, ScratchDir, owner_alive, sweep_dead

ROOT = Path(__file__).resolve().parents[3]


def _in_child(root: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh interpreter that makes ``scratch = ScratchDir("tq-test-", root)`` first and prints its
    path."""
    code = textwrap.dedent(f"""
        import os, signal, sys
        from rl_contracts.scratch import ScratchDir
        scratch = ScratchDir("tq-test-", {str(root)!r})
        print(scratch.path, flush=True)
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_a_scratch_dir_is_named_after_its_owner_and_removed_once(tmp_path):
    scratch = ScratchDir("tq-test-", str(tmp_path))
    assert scratch.path.parent == tmp_path and scratch.path.name.startswith(f"tq-test-{os.getpid()}-")
    assert (scratch.path / LOCK_NAME).is_file() and owner_alive(scratch.path, os.getpid())
    (scratch.path / "weights.pt").write_bytes(b"x" * 10)
    scratch.remove()
    scratch.remove()  # idempotent
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("ending", "returncode"),
    [
        ("sys.exit(0)", 0),
        ("raise RuntimeError('start-up failed')", 1),
        ("os.kill(os.getpid(), signal.SIGINT)", -signal.SIGINT),
    ],
    ids=["normal-exit", "exception", "ctrl-c"],
)
def test_the_owner_removes_it_at_exit_however_the_interpreter_ends(tmp_path, ending, returncode):
    child = _in_child(tmp_path, ending)
    assert child.returncode == returncode, child.stderr
    assert child.stdout.strip().startswith(str(tmp_path / "tq-test-"))
    assert list(tmp_path.iterdir()) == []


def test_a_killed_owners_dir_is_swept_by_the_next_one_made(tmp_path):
    child = _in_child(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    assert child.returncode == -signal.SIGKILL
    orphan = Path(child.stdout.strip())
    assert orphan.is_dir()  # no handler runs on SIGKILL
    live = ScratchDir("tq-test-", str(tmp_path))  # sweeps first
    other_prefix = tmp_path / "tq-other-999999999-x"
    other_prefix.mkdir()
    assert not orphan.exists()
    assert sweep_dead("tq-test-", str(tmp_path)) == [] and live.path.is_dir()  # a live owner's is never touched
    assert other_prefix.is_dir()  # nor another prefix's
    live.remove()


def test_a_dir_caught_before_its_lock_existed_is_judged_by_the_pid_in_its_name(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f"tq-test-{dead_pid}-abc").mkdir()
    (tmp_path / f"tq-test-{os.getpid()}-abc").mkdir()  # this process is making it right now
    (tmp_path / "tq-test-notapid").mkdir()  # not a name this module makes
    assert sweep_dead("tq-test-", str(tmp_path)) == [str(tmp_path / f"tq-test-{dead_pid}-abc")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"tq-test-{os.getpid()}-abc", "tq-test-notapid"]


def test_a_dir_whose_lock_is_free_but_whose_owner_lives_is_kept(tmp_path):
    """Between making its directory and locking it, an owner holds no lock: a sweep then must not take it."""
    mine = tmp_path / f"tq-test-{os.getpid()}-abc"
    mine.mkdir()
    (mine / LOCK_NAME).write_bytes(b"")  # created, not locked yet
    assert owner_alive(mine, os.getpid())
    assert sweep_dead("tq-test-", str(tmp_path)) == [] and mine.is_dir()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory owned by another user")
def test_another_users_dir_is_never_touched(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    theirs = tmp_path / f"tq-test-{int(dead.stdout)}-abc"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # nobody's, on a /dev/shm shared by every user
    assert sweep_dead("tq-test-", str(tmp_path)) == [] and theirs.is_dir()
