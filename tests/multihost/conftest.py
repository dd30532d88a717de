"""The multi-host tier: three simulated hosts on one machine, joined into one Ray cluster with token auth.

Each host is a Linux network namespace (``tqmh<pid>-a`` ...) plugged into a bridge that lives in a namespace of its own
(``tqmh<pid>-sw``), on private ranges this fixture owns (``10.203.15.0/24``; ``fd03:15::/64`` for IPv6): no packet
leaves these namespaces. Every process of a host also runs in its own UTS namespace (its own hostname) and mount
namespace with its own tmpfs ``/tmp``, so "same host" is false across hosts and the cross-host TCP path really runs.
Host A runs the Ray head, B and C worker nodes, each with a custom resource (``host_a``, ``host_b``, ``host_c``) that
pins actors to it.

Tests run driver scripts (``tests/multihost/scripts``) on a host with :meth:`Cluster.driver` (or :meth:`Cluster.steered`
for a script that asks the test to act, e.g. to cut a link); a script prints one JSON line last, which is what the call
returns. Cleanup stops every process of every namespace by PID (SIGTERM, then SIGKILL) and deletes the namespaces, also
when a test fails; namespaces left by a killed run are swept at the next start. Never ``ray stop``: it would stop every
Ray on the machine.

The tier skips, saying why, where namespaces cannot be created (not root, no ``ip``/``unshare``/``nsenter``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import requirement

PREFIX = "tqmh"
SUBNET = "10.203.15"
SUBNET6 = "fd03:15::"  # a unique-local IPv6 prefix, on the same links
HOSTS = ("a", "b", "c")
RAY_PORT = 6380
REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TIMINGS: list[str] = []  # lines for the terminal summary (cross-host timings measured by the tests)


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60)


def _pids_in(ns: str) -> list[int]:
    out = _run("ip", "netns", "pids", ns, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def _stop_pids(pids: list[int], grace: float = 5.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _delete_namespace(ns: str) -> None:
    """Stop every process in ``ns`` (all started by this tier), then delete it."""
    for _ in range(3):  # a process may fork while its siblings are being stopped
        pids = _pids_in(ns)
        if not pids:
            break
        _stop_pids(pids)
    _run("ip", "netns", "del", ns, check=False)


def _sweep_stale() -> None:
    """Namespaces of earlier runs whose pytest process is gone (killed before its cleanup ran)."""
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX) :].split("-")[0]
        if owner.isdigit() and not _alive(int(owner)):
            _delete_namespace(name)


def _why_not() -> str | None:
    """Why this machine cannot build the hosts, or None if it can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One simulated host: its namespace, address, hostname, and the process that holds its UTS and mount namespaces."""

    name: str
    ns: str
    ip: str
    link: str  # its veth's end in the switch namespace (``ip link set down`` there partitions the host)
    holder: subprocess.Popen[str] | None = None

    @property
    def hostname(self) -> str:
        return f"tqmh-host-{self.name}"

    def command(self, *cmd: str) -> list[str]:
        """``cmd`` run inside this host's network, UTS and mount namespaces."""
        assert self.holder is not None
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-u", "-m", "--", *cmd]


@dataclass
class Cluster:
    hosts: dict[str, Host]
    switch: str
    env: dict[str, str]
    address: str
    logs: Path
    started: list[subprocess.Popen[str]] = field(default_factory=list)

    def popen(self, host: str, *cmd: str, **kwargs: Any) -> subprocess.Popen[str]:
        proc = subprocess.Popen(self.hosts[host].command(*cmd), env=self.env, text=True, **kwargs)
        self.started.append(proc)
        return proc

    def driver(self, host: str, script: str, *args: str, timeout: float = 240.0) -> dict[str, Any]:
        """Run ``scripts/<script>`` as a Ray driver on ``host``; returns the JSON of its last stdout line."""
        proc = self.popen(
            host,
            sys.executable,
            str(SCRIPTS / script),
            self.address,
            self.hosts[host].ip,
            *args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"{script} on host {host} ran past {timeout} s; stderr:\n{err[-4000:]}") from None
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise AssertionError(f"{script} on host {host} exited {proc.returncode}; stderr:\n{err[-6000:]}")
        return json.loads(lines[-1])

    def steered(self, host: str, script: str, *args: str, on: dict[str, Any], timeout: float = 240.0) -> dict[str, Any]:
        """Like :meth:`driver`, for a script that asks the test to act: a stdout line naming a key of ``on`` runs that
        callable here, then ``done`` is written to the script's stdin."""
        err_path = self.logs / f"{script}-{host}-{len(self.started)}.stderr"
        with open(err_path, "w") as err:
            proc = self.popen(
                host,
                sys.executable,
                str(SCRIPTS / script),
                self.address,
                self.hosts[host].ip,
                *args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
            assert proc.stdout is not None and proc.stdin is not None
            deadline = time.monotonic() + timeout
            result = None
            for line in proc.stdout:
                if line.strip() in on:
                    on[line.strip()]()
                    proc.stdin.write("done\n")
                    proc.stdin.flush()
                elif line.startswith("{"):
                    result = json.loads(line)
                if time.monotonic() > deadline:
                    proc.kill()
                    break
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        if code != 0 or result is None:
            raise AssertionError(f"{script} on host {host} exited {code}; stderr:\n{err_path.read_text()[-6000:]}")
        return result

    def partition(self, host: str, up: bool) -> None:
        """Cut ``host`` off the network (its link to the switch down), or heal it."""
        _run("ip", "-n", self.switch, "link", "set", self.hosts[host].link, "up" if up else "down")

    def kill_host(self, host: str) -> None:
        """The host dies: every process in its namespace is killed at once (SIGKILL), the namespace stays."""
        pids = [pid for pid in _pids_in(self.hosts[host].ns) if pid != self.hosts[host].holder.pid]  # type: ignore[union-attr]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _build_network(owner: str) -> tuple[dict[str, Host], str]:
    switch = f"{owner}-sw"
    _run("ip", "netns", "add", switch)
    _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", switch, "link", "set", "br0", "up")
    hosts = {}
    for i, name in enumerate(HOSTS, start=1):
        ns, link = f"{owner}-{name}", f"v{name}"
        _run("ip", "netns", "add", ns)
        # both ends are created in the host's namespace, then one end moves to the switch
        _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", link)
        _run("ip", "-n", ns, "link", "set", link, "netns", switch)
        _run("ip", "-n", switch, "link", "set", link, "master", "br0")
        _run("ip", "-n", switch, "link", "set", link, "up")
        _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i}/24", "dev", "eth0")
        _run("ip", "-n", ns, "addr", "add", f"{SUBNET6}{i}/64", "dev", "eth0", "nodad")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        hosts[name] = Host(name, ns, f"{SUBNET}.{i}", link)
    return hosts, switch


def _kept_under_tmp(paths: list[Path]) -> list[Path]:
    """The outermost of ``paths`` that lie under /tmp (the checkout, the venv, pytest's temp dirs): a host's own tmpfs
    /tmp would hide them, so they are bound back into it (a CI clone often lives under /tmp)."""
    under = sorted({p.resolve() for p in paths if p.resolve().is_relative_to("/tmp") and p.resolve() != Path("/tmp")})
    return [p for p in under if not any(p != q and p.is_relative_to(q) for q in under)]


def _start_holder(host: Host, keep: list[Path]) -> None:
    """A process that owns the host's UTS and mount namespaces (own hostname, own tmpfs /tmp) inside its netns.

    ``keep``: directories under /tmp that stay visible inside (bound from the real /tmp, seen through a bind of it
    made before the tmpfs covers it)."""
    outer = f"/run/{PREFIX}{host.ns}-tmp"
    binds = "".join(f" && mkdir -p {p} && mount --bind {outer}/{p.relative_to('/tmp')} {p}" for p in keep)
    script = (
        f"hostname {host.hostname} && mkdir -p {outer} && mount --bind /tmp {outer}"
        f" && mount -t tmpfs -o size=2g tmpfs /tmp{binds} && echo ready && exec sleep 1000000"
    )
    host.holder = subprocess.Popen(
        ["ip", "netns", "exec", host.ns, "unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert host.holder.stdout is not None
    line = host.holder.stdout.readline()
    if line.strip() != "ready":
        raise RuntimeError(f"host {host.name}: its namespaces could not be set up (got {line!r})")
    # the shell exec'd sleep: the holder's pid is the process in the namespaces; nsenter joins it


def _ray_start(cluster: Cluster, host: Host, head: bool) -> tuple[subprocess.Popen[str], Path]:
    """``ray start`` on ``host`` (it returns once the node runs); :func:`_ray_started` waits for it."""
    ray = str(Path(sys.executable).with_name("ray"))
    resources = json.dumps({f"host_{host.name}": 100})
    common = [
        "--node-ip-address",
        host.ip,
        "--num-cpus",
        "4",
        "--resources",
        resources,
        "--object-store-memory",
        str(200 << 20),
        "--disable-usage-stats",
    ]
    if head:
        cmd = [ray, "start", "--head", "--port", str(RAY_PORT), "--include-dashboard=false", *common]
    else:
        cmd = [ray, "start", "--address", cluster.address, *common]
    log = cluster.logs / f"ray-start-{host.name}.log"
    with open(log, "w") as f:
        return cluster.popen(host.name, *cmd, stdout=f, stderr=subprocess.STDOUT), log


def _ray_started(started: tuple[subprocess.Popen[str], Path]) -> None:
    proc, log = started
    if proc.wait(timeout=180) != 0:
        raise RuntimeError(f"ray start failed ({log.name}): {log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three hosts (A: Ray head, B and C: worker nodes), torn down after the session."""
    reason = _why_not()
    if reason is not None:
        pytest.skip(requirement(f"root and network namespaces for the multi-host tier: {reason}", "run as root"))
    _sweep_stale()
    owner = f"{PREFIX}{os.getpid()}"
    hosts: dict[str, Host] = {}
    switch = f"{owner}-sw"
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(REPO),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_DEDUP_LOGS": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "GLOO_SOCKET_IFNAME": "eth0",  # gloo (the trainer ranks) finds no address for a hostname DNS does not know
        "PYTHONUNBUFFERED": "1",
    }
    logs = tmp_path_factory.mktemp("multihost-logs")
    result = None
    try:
        hosts, switch = _build_network(owner)
        keep = _kept_under_tmp([REPO, Path(sys.prefix), Path(sys.executable).parent, logs.parent])
        for host in hosts.values():
            _start_holder(host, keep)
        result = Cluster(hosts, switch, env, f"{hosts['a'].ip}:{RAY_PORT}", logs)
        _ray_started(_ray_start(result, hosts["a"], head=True))
        for started in [_ray_start(result, hosts[name], head=False) for name in HOSTS[1:]]:  # the workers together
            _ray_started(started)
        nodes = result.driver("a", "nodes.py", timeout=120)
        assert sorted(nodes["hostnames"]) == sorted(h.hostname for h in hosts.values()), nodes
        yield result
    finally:
        for host in hosts.values():
            _delete_namespace(host.ns)  # every process in it, the holder too
            with contextlib.suppress(OSError):
                os.rmdir(f"/run/{PREFIX}{host.ns}-tmp")  # the mount point of the real /tmp, inside the host only
        _delete_namespace(switch)
        if result is not None:
            for proc in result.started:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        for host in hosts.values():
            if host.holder is not None:
                host.holder.wait()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TIMINGS:
        terminalreporter.section("multi-host timings")
        for line in TIMINGS:
            terminalreporter.write_line(line)
