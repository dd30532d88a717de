"""Run records: what ``python -m transfer_queue status`` finds a run by. Private to the user, locked while the run
lives, removed when it stops; a dead run's record is ignored and removed; the newest live run is chosen unless a pid
is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from transfer_queue.errors import QueueNotFound
from transfer_queue.ops.runs import (
    RunRecord,
    choose_run,
    live_runs,
    others_note,
    publish,
    python_command,
    ray_attach_env,
    runs_dir,
    start_block,
    status_command,
)


def record(pid: int | None = None, started_at: float = 1000.0, **fields: object) -> RunRecord:
    values: dict = {
        "pid": os.getpid() if pid is None else pid,
        "started_at": started_at,
        "command": "python recipe/demo.py steps=3",
        "ray_address": "127.0.0.1:6379",
        "ray_env": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/home/u/.ray/auth_token"},
        "namespace": "transfer_queue",
        "controller": "TransferQueueController",
        "status_page": "http://127.0.0.1:41873/status",
        "metrics": "http://127.0.0.1:41873/metrics",
        "run_metrics": "outputs/demo/metrics.jsonl",
    }
    return RunRecord(**{**values, **fields})


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_published_record_is_private_found_while_it_lives_and_gone_once_removed(tmp_path: Path) -> None:
    published = publish(record(), str(tmp_path))
    directory = runs_dir(str(tmp_path))
    assert directory == str(tmp_path / f"transfer_queue-{os.getuid()}-runs")
    assert os.stat(directory).st_mode & 0o777 == 0o700
    assert os.stat(published.path).st_mode & 0o777 == 0o600
    assert os.listdir(directory) == [f"{os.getpid()}.json"]  # no staging file left behind
    assert live_runs(str(tmp_path)) == [record()]  # our own lock is held: alive, read back field for field
    published.remove()
    published.remove()  # idempotent
    assert live_runs(str(tmp_path)) == [] and os.listdir(directory) == []


def test_a_record_nobody_holds_is_ignored_and_removed(tmp_path: Path) -> None:
    directory = Path(runs_dir(str(tmp_path)))
    (directory / "123.json").write_text(record(pid=os.getpid()).to_json())  # written, never locked: its writer died
    (directory / "124.json").write_text("{not json")
    assert live_runs(str(tmp_path)) == []
    assert os.listdir(directory) == []


def test_a_record_whose_pid_is_gone_is_ignored_and_removed(tmp_path: Path) -> None:
    published = publish(record(pid=dead_pid()), str(tmp_path))  # locked (by us), but its pid exited
    assert live_runs(str(tmp_path)) == []
    assert not os.path.exists(published.path)
    published.remove()


# Publishes a record for itself under argv[1] and waits: SIGKILLed, it removes nothing.
WRITER = r"""
import os, sys, time
from transfer_queue.ops.runs import RunRecord, publish
publish(RunRecord(os.getpid(), time.time(), "writer", "127.0.0.1:1", {}, "ns", "c", None, None), sys.argv[1])
print("published", flush=True)
time.sleep(600)
"""


def test_the_record_of_a_killed_run_is_ignored_and_removed(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "published"
        assert [r.pid for r in live_runs(str(tmp_path))] == [proc.pid]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert os.listdir(runs_dir(str(tmp_path))) == [f"{proc.pid}.json"]  # SIGKILL: nothing removed it
    assert live_runs(str(tmp_path)) == []
    assert os.listdir(runs_dir(str(tmp_path))) == []


def test_a_shared_runs_directory_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / f"transfer_queue-{os.getuid()}-runs"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(PermissionError, match=f"must be a directory of uid {os.getuid()} with mode 0700"):
        runs_dir(str(tmp_path))


def test_the_newest_run_is_chosen_unless_a_pid_is_named() -> None:
    runs = [record(pid=30, started_at=3.0), record(pid=20, started_at=2.0)]
    assert choose_run(runs, where="/runs").pid == 30
    assert choose_run(runs, 20, where="/runs").pid == 20


def test_a_pid_without_a_live_run_names_the_live_ones() -> None:
    runs = [record(pid=30, started_at=0.0)]
    with pytest.raises(QueueNotFound, match=r"no live transfer_queue run with pid 7 in /runs; live runs: pid 30 \("):
        choose_run(runs, 7, where="/runs")


def test_no_live_run_says_what_to_pass() -> None:
    with pytest.raises(QueueNotFound, match=r"/runs holds no record of one\..* or pass --address HOST:PORT"):
        choose_run([], where="/runs")


def test_live_runs_are_newest_first(tmp_path: Path) -> None:
    older = publish(record(pid=os.getpid(), started_at=1.0), str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        newer = publish(record(pid=child.pid, started_at=2.0), str(tmp_path))  # we hold its lock; its pid lives
        assert [r.pid for r in live_runs(str(tmp_path))] == [child.pid, os.getpid()]
        newer.remove()
    finally:
        child.kill()
        child.wait()
        older.remove()


def test_several_runs_are_listed_and_the_status_command_names_its_run() -> None:
    chosen, other = record(pid=30, started_at=3.0), record(pid=20, started_at=2.0)
    assert others_note(chosen, [chosen]) is None
    note = others_note(chosen, [chosen, other])
    assert note is not None and note.startswith("2 live runs: showing pid 30 (python recipe/demo.py steps=3, ")
    assert "others: pid 20 (" in note and note.endswith("Choose one with --run PID")
    assert status_command(chosen, [chosen]) == f"{python_command()} -m transfer_queue status"
    assert status_command(chosen, [chosen, other]) == f"{python_command()} -m transfer_queue status --run 30"


def test_the_start_block_says_the_status_command_the_status_page_and_the_metrics() -> None:
    run = record(pid=30, ray_address="127.0.0.1:6379")
    assert start_block(run, [run]).splitlines() == [
        "transfer_queue: queue started by pid 30 on the Ray cluster at 127.0.0.1:6379",
        f"  status:      {python_command()} -m transfer_queue status",
        "  status page: http://127.0.0.1:41873/status",
        "  metrics:     outputs/demo/metrics.jsonl | Prometheus http://127.0.0.1:41873/metrics",
    ]
    quiet = record(status_page=None, metrics=None, run_metrics=None)
    assert start_block(quiet, [quiet]).splitlines()[2:] == [
        "  status page: none (the queue was started with http_port=-1)",
        "  metrics:     none",
    ]


def test_the_ray_variables_a_driver_needs_are_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("secret")
    token_mode = {"RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PATH": "/bin"}
    assert ray_attach_env(token_mode) == {
        "RAY_AUTH_MODE": "token",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_TOKEN_PATH": str(tmp_path / ".ray" / "auth_token"),  # where Ray read it from, named
    }
    from_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t0k"}
    assert ray_attach_env(from_env) == from_env
    assert ray_attach_env({"RAY_AUTH_MODE": "disabled"}) == {"RAY_AUTH_MODE": "disabled"}


def test_a_record_of_another_version_is_not_read() -> None:
    with pytest.raises(ValueError, match="not a version-1 run record"):
        RunRecord.from_json('{"version": 99}')
