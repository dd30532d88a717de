"""Join the Ray cluster of a running queue as an observer (the status and targets commands), or fail in seconds.

With no address, the target is this user's newest live run on this machine (its discovery record,
transfer_queue/ops/runs.py): its cluster's address and the Ray variables joining it takes (token authentication,
loopback node addresses) come from the record and replace the shell's, so ``python -m transfer_queue status`` needs
no flags and no environment. With an address (``--address`` or ``RAY_ADDRESS``), the Ray variables are the
caller's, completed by those of a run recorded at that address if there is one.

Before Ray is asked, a TCP connection to the cluster's GCS port must open within :data:`PROBE_TIMEOUT_S`
(``ClusterUnreachable`` otherwise), and Ray is given :data:`GCS_CONNECT_TRIES` tries instead of its default 20, one
second apart, so a cluster that refuses this process's token fails in a few seconds (``ClusterRefused``), each
error saying what to pass.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from transfer_queue.errors import ClusterRefused, ClusterUnreachable, InvalidRequest
from transfer_queue.ops.runs import (
    RAY_ATTACH_VARIABLES,
    STATUS_COMMAND,
    RunRecord,
    choose_run,
    live_runs,
    others_note,
    runs_dir,
)

PROBE_TIMEOUT_S = 3.0
# RAY_gcs_server_port_wait_time_s while joining: a running GCS answers the first; Ray's 20 (1 s apart) are for one
# still starting
GCS_CONNECT_TRIES = 1
AUTH_REFUSAL_MARKS = ("InvalidAuthToken", "Unauthenticated", "authentication token")
TOKEN_VARIABLES = "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the cluster's token> (or RAY_AUTH_TOKEN_PATH=<its file>)"


@dataclass(frozen=True)
class Target:
    """The cluster to join: its address, the Ray variables to set first, and the run it was found by (if any)."""

    address: str
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()  # Ray variables of this process to drop (the run had none: the shell's would mislead)
    run: RunRecord | None = None
    notes: tuple[str, ...] = ()  # lines for the person at the terminal (which run among several)


def find_target(address: str | None = None, run_pid: int | None = None, root: str | None = None) -> Target:
    """What to join: ``address`` (or ``RAY_ADDRESS``) if given, else the live run ``run_pid`` or the newest one.

    Raises:
        QueueNotFound: no address and no live run of this user on this machine (or none with ``run_pid``).
    """
    if address and run_pid is not None:
        raise InvalidRequest(f"pass --address ({address}) or --run ({run_pid}), not both")
    address = address or (os.environ.get("RAY_ADDRESS") if run_pid is None else None)
    if not address or address == "auto":  # the run's own Ray variables, exactly: the shell's may be another cluster's
        runs = live_runs(root)
        run = choose_run(runs, run_pid, runs_dir(root))
        note = others_note(run, runs)
        unset = tuple(name for name in RAY_ATTACH_VARIABLES if name not in run.ray_env)
        return Target(run.ray_address, dict(run.ray_env), unset, run, (note,) if note else ())
    # an address the caller chose: the caller's Ray variables, completed by those of a run recorded there
    recorded = next((r for r in live_runs(root) if r.ray_address == address), None)
    env = {k: v for k, v in recorded.ray_env.items() if k not in os.environ} if recorded else {}
    return Target(address, env, run=recorded)


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) as ``(host, port)``.

    Raises:
        InvalidRequest: not of that form.
    """
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not host or not port.isdigit():
        raise InvalidRequest(f"address={address!r} is not HOST:PORT (a Ray cluster's GCS address, e.g. 10.0.0.1:6379)")
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _what_to_pass(target: Target) -> str:
    if target.run is not None:
        return (
            f"the run that recorded it ({target.run.describe()}) may have lost its cluster; "
            "pass --address HOST:PORT of a live cluster, or --run PID of another live run"
        )
    return (
        "pass --address HOST:PORT of a live cluster's GCS (`ray status` on its head node prints it), "
        f"or run `python {STATUS_COMMAND}` with no flags on the run's machine, as the user who started it"
    )


def probe(target: Target, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Open (and close) a TCP connection to the cluster's GCS port within ``timeout`` seconds.

    Raises:
        ClusterUnreachable: refused, timed out or unresolvable; the message says what to pass.
    """
    host, port = split_address(target.address)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except TimeoutError:
        reason = f"no answer within {timeout:g} s"
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
    else:
        return
    raise ClusterUnreachable(f"no Ray cluster answers at {target.address} ({reason}); {_what_to_pass(target)}")


@contextmanager
def _bounded_gcs_tries(tries: int = GCS_CONNECT_TRIES) -> Iterator[None]:
    """Ray's tries to reach the GCS while joining, ``tries`` instead of 20 (unless the caller set their own)."""
    name = "RAY_gcs_server_port_wait_time_s"
    if name in os.environ:
        yield
        return
    os.environ[name] = str(tries)
    try:
        yield
    finally:
        os.environ.pop(name, None)


def _missing_token(target: Target, exc: BaseException) -> ClusterRefused:
    """Ray's ``AuthenticationError`` before it asked the cluster: token mode, but no token where it looked."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path and not os.path.isfile(path):
        found = f"RAY_AUTH_TOKEN_PATH={path} is not a file"
    else:
        found = getattr(exc, "message", None) or type(exc).__name__
    return ClusterRefused(
        f"this process has no authentication token for the Ray cluster at {target.address} ({found}); pass "
        f"{TOKEN_VARIABLES} in the environment, or run `python {STATUS_COMMAND}` with no flags on the run's "
        "machine, as the user who started it"
    )


def refusal(target: Target, exc: BaseException) -> ClusterRefused | ClusterUnreachable:
    """The typed error for Ray's failure to join: no token to send, a token refused, or a cluster not answering."""
    from ray.exceptions import AuthenticationError

    if isinstance(exc, AuthenticationError):
        return _missing_token(target, exc)
    text = f"{exc} {exc.__cause__ or ''}"
    if any(mark.lower() in text.lower() for mark in AUTH_REFUSAL_MARKS):
        told = "" if os.environ.get("RAY_AUTH_MODE", "").lower() == "token" else " (this process had no RAY_AUTH_MODE)"
        return ClusterRefused(
            f"the Ray cluster at {target.address} refused this process's authentication token{told}; pass "
            f"{TOKEN_VARIABLES} in the environment, or run `python {STATUS_COMMAND}` with no flags on the run's "
            "machine, as the user who started it"
        )
    return ClusterUnreachable(f"Ray could not join the cluster at {target.address} ({exc}); {_what_to_pass(target)}")


def join(target: Target) -> None:
    """Make this process a driver of ``target``'s cluster, or fail within seconds (see the module docstring).

    Raises:
        ClusterUnreachable: nothing answers at the address (checked first), or Ray could not join it.
        ClusterRefused: the cluster refused this process's token.
        InvalidRequest: this process already drives another cluster.
    """
    probe(target)  # first: an address where nothing answers is the news, whatever this process drives
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if current != target.address:
            raise InvalidRequest(f"this process already drives the Ray cluster at {current}, not {target.address}")
        return
    for name in target.unset:
        os.environ.pop(name, None)
    os.environ.update(target.env)  # before Ray is imported: it reads some of them once, at import
    if _is_loopback(split_address(target.address)[0]):  # a loopback GCS means the cluster's nodes are loopback too
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

    from ray.exceptions import RayError  # AuthenticationError: token mode, and no token found

    from transfer_queue.runtime import init_ray

    try:
        with _bounded_gcs_tries():
            init_ray(address=target.address, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError, RayError) as exc:
        raise refusal(target, exc) from exc


def attach(address: str | None = None, run_pid: int | None = None) -> Target:
    """:func:`find_target` then :func:`join`: this process is a driver of the run's cluster; returns the target."""
    target = find_target(address, run_pid)
    join(target)
    return target
