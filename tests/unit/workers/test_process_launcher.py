"""workers.process_launcher: the child's preexec_fn only calls the prctl resolved in the parent (no dlopen between
fork and exec), and a launcher that never answers gives a RuntimeError naming the command instead of a hang."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
from typing import Any

import pytest

from workers import process_launcher
from workers.process_launcher import _die_with_process, _Launcher, popen_for_process_lifetime


def test_the_preexec_fn_calls_the_prctl_resolved_at_import_and_loads_no_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, int]] = []
    ran: list[str] = []

    def no_dlopen(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"ctypes.CDLL{args} called in the forked child")

    monkeypatch.setattr(process_launcher.ctypes, "CDLL", no_dlopen)

    def prctl(option: int, sig: int) -> int:
        calls.append((option, sig))
        return 0

    monkeypatch.setattr(process_launcher, "_PRCTL", prctl)
    preexec = _die_with_process(os.getppid(), lambda: ran.append("then"))  # this process as the "child"
    preexec()
    assert calls == [(1, signal.SIGTERM)] and ran == ["then"]


def test_a_real_child_starts_through_the_launcher() -> None:
    child = popen_for_process_lifetime([sys.executable, "-c", "print('up')"], stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate(timeout=60)
    assert (child.returncode, out) == (0, "up\n")


def test_a_stuck_launcher_raises_naming_the_command_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = _Launcher()
    launcher._pid = os.getpid()  # as if its thread ran: but nothing serves this queue, the launcher is "stuck"
    launcher._requests = queue.SimpleQueue()
    monkeypatch.setattr(process_launcher, "_LAUNCH_TIMEOUT_S", 0.1)
    with pytest.raises(RuntimeError) as caught:
        launcher.popen(["my-engine-server", "--port", "30000"])
    assert str(caught.value) == (
        "the process launcher did not start ['my-engine-server', '--port', '30000'] within 0.1 s (it was not "
        "started); expected Popen to return within the launch timeout: the launcher thread is stuck"
    )
    [(future, _, _)] = [launcher._requests.get_nowait()]
    assert future.cancelled()  # a launcher that comes back later skips it: the server is not started after all
