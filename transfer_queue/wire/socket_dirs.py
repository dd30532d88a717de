"""Where a server's Unix socket lives: a private directory per server process, removed when it stops.

Every server (the controller, each storage unit) creates its own directory under one per-user root,
``<tmp>/transfer_queue-<uid>`` (mode 0700), and holds an exclusive ``flock`` on a lock file inside it for as long as
it runs. The directory is removed when the server closes its sockets, at interpreter exit (``atexit``), and, when
the process was killed (SIGKILL, an OOM kill, a driver that exited without ``shutdown``), by the next server or
``transfer_queue.init`` on the host: a directory whose lock can be taken belongs to a dead process (the kernel
drops a lock with its holder), so it is swept; a live server's lock cannot be taken, so its sockets are never
touched. A directory is only named (renamed from a hidden staging name) once its lock is held.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import stat
import tempfile
import time

LOCK_NAME = "owner.lock"
STAGING_PREFIX = ".new-"
STAGING_GRACE_S = 60.0  # a staging directory older than this was left by a process that died while creating it


def socket_root() -> str:
    """This user's root of server socket directories (created 0700 if missing)."""
    root = os.path.join(tempfile.gettempdir(), f"transfer_queue-{os.getuid()}")
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        # Someone else's (or a link, or open to others): never put sockets there; use a private one of our own.
        return tempfile.mkdtemp(prefix="transfer_queue-")
    return root


def lock_held(path: str | os.PathLike[str], shared: bool = False) -> bool | None:
    """Whether a live process holds an ``flock`` on the file at ``path`` (taking it, when free, proves its holder is
    gone: the kernel drops a dead process's locks); ``None`` when there is no such file. ``shared``: try a shared lock
    (checkers then never block each other), else an exclusive one."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except PermissionError:  # another user's: it cannot be told, so it counts as held (never swept)
        return True
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the lock if we took it
    return False


def _owner_alive(directory: str) -> bool:
    """Whether a live process holds the directory's lock."""
    return bool(lock_held(os.path.join(directory, LOCK_NAME)))


def sweep_stale(root: str | None = None) -> list[str]:
    """Remove the socket directories of dead servers under ``root`` (default: :func:`socket_root`); returns them."""
    root = root or socket_root()
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        if name.startswith(STAGING_PREFIX):
            try:
                stale = time.time() - os.lstat(path).st_mtime > STAGING_GRACE_S
            except FileNotFoundError:
                continue
        else:
            stale = not _owner_alive(path)
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class SocketDir:
    """This server's socket directory: created (after sweeping dead ones), locked while alive, removed on close."""

    def __init__(self, root: str | None = None):
        root = root or socket_root()
        sweep_stale(root)
        staging = tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=root)
        self._lock = os.open(os.path.join(staging, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(self._lock, f"{os.getpid()}\n".encode())
        self.path = os.path.join(root, os.path.basename(staging)[len(STAGING_PREFIX) :])
        os.rename(staging, self.path)
        atexit.register(self.remove)

    def socket_path(self, name: str) -> str:
        return os.path.join(self.path, name)

    def remove(self) -> None:
        """Delete the directory and everything in it (idempotent)."""
        atexit.unregister(self.remove)
        if self._lock >= 0:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._lock)
            self._lock = -1
