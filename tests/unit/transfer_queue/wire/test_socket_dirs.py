"""Server socket directories: private, locked while their server lives, removed on close, at exit, and (after a
SIGKILL) by the next sweep, which never touches a live server's directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from transfer_queue.wire.server_sockets import ServerSockets
from transfer_queue.wire.socket_dirs import LOCK_NAME, STAGING_PREFIX, SocketDir, socket_root, sweep_stale

# Creates a SocketDir under argv[1], prints its path, then: "exit" returns normally (atexit), "wait" sleeps.
OWNER = r"""
import sys, time
from transfer_queue.wire.socket_dirs import SocketDir
d = SocketDir(sys.argv[1])
print(d.path, flush=True)
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def owner(root: str, mode: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", OWNER, root, mode], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_socket_dir_is_private_locked_and_removed_on_close(tmp_path: pytest.TempPathFactory) -> None:
    d = SocketDir(str(tmp_path))
    assert os.path.dirname(d.path) == str(tmp_path) and not os.path.basename(d.path).startswith(STAGING_PREFIX)
    assert os.path.exists(os.path.join(d.path, LOCK_NAME))
    assert sweep_stale(str(tmp_path)) == []  # our own lock is held: alive
    d.remove()
    d.remove()  # idempotent
    assert os.listdir(tmp_path) == []


def test_the_sweep_removes_dead_servers_dirs_and_keeps_live_ones(tmp_path: pytest.TempPathFactory) -> None:
    root = str(tmp_path)
    live, live_dir = owner(root, "wait")
    killed, killed_dir = owner(root, "wait")
    try:
        open(os.path.join(killed_dir, "server.sock"), "w").close()
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert os.path.isdir(killed_dir)  # SIGKILL: no atexit ran
        old_staging = os.path.join(root, f"{STAGING_PREFIX}1-x")
        new_staging = os.path.join(root, f"{STAGING_PREFIX}2-y")
        os.mkdir(old_staging)
        os.mkdir(new_staging)
        os.utime(old_staging, (time.time() - 3600, time.time() - 3600))
        assert sorted(sweep_stale(root)) == sorted([killed_dir, old_staging])
        assert sorted(os.listdir(root)) == sorted([os.path.basename(live_dir), os.path.basename(new_staging)])
        assert os.path.exists(os.path.join(live_dir, LOCK_NAME))
    finally:
        live.kill()
        live.wait()
    assert sweep_stale(root) == [live_dir]  # now dead too


def test_a_process_that_exits_without_closing_removes_its_dir(tmp_path: pytest.TempPathFactory) -> None:
    proc, path = owner(str(tmp_path), "exit")
    assert proc.wait(timeout=60) == 0
    assert not os.path.exists(path)


def test_server_sockets_live_in_their_own_dir_under_the_user_root() -> None:
    server = ServerSockets(host="127.0.0.1")
    path = server.endpoint.unix
    assert path is not None and os.path.exists(path)
    directory = os.path.dirname(path)
    assert os.path.dirname(directory) == socket_root()
    assert os.stat(socket_root()).st_mode & 0o777 == 0o700
    server.close()
    assert not os.path.exists(directory)
