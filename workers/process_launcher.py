"""Server processes whose lifetime is this process's: ``popen_for_process_lifetime(argv, ...)`` is
``subprocess.Popen`` whose child gets SIGTERM when this process dies, even by SIGKILL (no ``atexit``, no signal
handler), whichever thread calls it.

Linux's ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the process: a server started
from a thread-pool worker (the natural way to start several slow servers at once) would be killed as soon as that
worker exits. So no caller forks: each hands its ``Popen`` to one launcher thread, started on first use, that never
returns and so exits only with the process; PDEATHSIG then means "the process died". Other ways were weighed: a pipe
the child watches needs a wrapper around every server command (and the wrapper, not the server, would lead the
process group that ``stop`` signals); a watchdog process can itself be killed. ``EngineServer`` and
``TaskServerProcess`` start their servers here.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1
_LAUNCH_TIMEOUT_S = 60.0  # a Popen (fork + exec) takes milliseconds; past this the launcher thread is stuck
_Requests = queue.SimpleQueue[tuple[concurrent.futures.Future[Any], tuple[Any, ...], dict[str, Any]]]


def popen_for_process_lifetime(*args: Any, **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(*args, **kwargs)`` forked by the launcher thread, the child given SIGTERM when this process
    dies (its own ``preexec_fn``, if any, runs first). Raises what ``Popen`` raises (``FileNotFoundError``, ...)."""
    return _LAUNCHER.popen(*args, **kwargs)


class _Launcher:
    """The one thread of this process that forks the servers (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._requests: _Requests = queue.SimpleQueue()

    def popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen[Any]:
        self._ensure_thread()
        future: concurrent.futures.Future[subprocess.Popen[Any]] = concurrent.futures.Future()
        kwargs["preexec_fn"] = _die_with_process(os.getpid(), kwargs.get("preexec_fn"))
        self._requests.put((future, args, kwargs))
        try:
            return future.result(timeout=_LAUNCH_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            started = "may still start" if not future.cancel() else "was not started"
            command = args[0] if args else kwargs.get("args")
            raise RuntimeError(
                f"the process launcher did not start {command!r} within {_LAUNCH_TIMEOUT_S:g} s (it {started}); "
                "expected Popen to return within the launch timeout: the launcher thread is stuck"
            ) from None

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child (threads do not survive a fork)
                self._requests = queue.SimpleQueue()
                thread = threading.Thread(target=_serve, args=(self._requests,), name="process-launcher", daemon=True)
                thread.start()
                self._pid = os.getpid()


def _serve(requests: _Requests) -> None:
    while True:
        future, args, kwargs = requests.get()
        if not future.set_running_or_notify_cancel():  # the caller gave up waiting (the launch timeout)
            continue
        try:
            future.set_result(subprocess.Popen(*args, **kwargs))
        except BaseException as exc:  # handed to the caller; the thread goes on
            future.set_exception(exc)


def _die_with_process(parent_pid: int, then: Callable[[], Any] | None) -> Callable[[], None]:
    """A ``preexec_fn`` (in the child before exec): SIGTERM when the launcher thread, i.e. the process, dies (Linux
    ``PR_SET_PDEATHSIG``); if the process died before ``prctl`` took effect, exit at once."""

    def preexec() -> None:
        if _PRCTL is not None:  # resolved in the parent: no dlopen between fork and exec in a threaded process
            with contextlib.suppress(Exception):
                _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:
            os._exit(1)
        if then is not None:
            then()

    return preexec


def _libc_prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or None where there is none (not Linux)."""
    try:
        prctl: Callable[..., int] = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


_PRCTL = _libc_prctl()
_LAUNCHER = _Launcher()
