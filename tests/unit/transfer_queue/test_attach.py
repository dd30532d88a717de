"""Joining a run's cluster as an observer: the run is found by its record with no flags, its Ray variables come
with it, and a cluster that does not answer or refuses this process fails at once (TCP probe, bounded Ray tries)
with a message that says what to pass. No Ray cluster here: Ray's join is replaced where a test reaches it."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from transfer_queue import __main__ as cli
from transfer_queue import attach
from transfer_queue.errors import ClusterRefused, ClusterUnreachable, InvalidRequest, QueueNotFound
from transfer_queue.ops.runs import RunRecord, publish


def run_record(address: str = "127.0.0.1:6379", started_at: float = 1.0, pid: int | None = None) -> RunRecord:
    return RunRecord(
        pid=os.getpid() if pid is None else pid,
        started_at=started_at,
        command="python recipe/demo.py",
        ray_address=address,
        ray_env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/home/u/.ray/auth_token"},
        namespace="transfer_queue",
        controller="TransferQueueController",
        status_page=None,
        metrics=None,
    )


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def no_ray_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.fixture(autouse=True)
def not_a_ray_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests hold whether or not this process drives a Ray cluster (a whole-suite run's session does)."""
    ray = sys.modules.get("ray")
    if ray is not None:
        monkeypatch.setattr(ray, "is_initialized", lambda: False)


class DrivingAnotherCluster:
    """A ``ray`` module as seen by a process that already drives the cluster at 10.0.0.9:6379."""

    class _Context:
        gcs_address = "10.0.0.9:6379"

    def is_initialized(self) -> bool:
        return True

    def get_runtime_context(self) -> Any:
        return self._Context()


def test_with_no_flags_the_run_s_record_gives_the_address_and_the_ray_variables(
    tmp_path: Path, no_ray_address: None
) -> None:
    published = publish(run_record("127.0.0.1:7000"), str(tmp_path))
    try:
        target = attach.find_target(root=str(tmp_path))
    finally:
        published.remove()
    assert target.address == "127.0.0.1:7000"
    assert target.env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/home/u/.ray/auth_token"}
    assert target.unset == ("RAY_AUTH_TOKEN", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")  # the shell's would override
    assert target.run is not None and target.run.pid == os.getpid() and target.notes == ()


def test_with_no_run_and_no_address_it_says_what_to_pass(tmp_path: Path, no_ray_address: None) -> None:
    with pytest.raises(QueueNotFound, match="holds no record of one"):
        attach.find_target(root=str(tmp_path))


def test_an_address_takes_the_ray_variables_of_a_run_recorded_there(
    tmp_path: Path, no_ray_address: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/mine")  # the caller's own variable wins at an address they chose
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    published = publish(run_record("127.0.0.1:7000"), str(tmp_path))
    try:
        recorded = attach.find_target("127.0.0.1:7000", root=str(tmp_path))
        elsewhere = attach.find_target("10.0.0.1:6379", root=str(tmp_path))
    finally:
        published.remove()
    assert recorded.env == {"RAY_AUTH_MODE": "token"} and recorded.unset == () and recorded.run is not None
    assert elsewhere.env == {} and elsewhere.run is None and elsewhere.address == "10.0.0.1:6379"


def test_ray_address_in_the_environment_counts_as_an_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert attach.find_target(root=str(tmp_path)).address == "10.0.0.1:6379"


def test_an_address_and_a_run_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match=r"pass --address \(10.0.0.1:6379\) or --run \(12\), not both"):
        attach.find_target("10.0.0.1:6379", 12, root=str(tmp_path))


def test_an_address_that_is_not_host_port_is_refused() -> None:
    with pytest.raises(InvalidRequest, match=r"address='ray://head:10001' is not HOST:PORT"):
        attach.split_address("ray://head:10001")
    assert attach.split_address("[::1]:6379") == ("::1", 6379)


def test_an_unreachable_address_fails_at_once_saying_what_to_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    address = closed_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    monkeypatch.setattr(os, "environ", environ)
    with pytest.raises(ClusterUnreachable, match=rf"no Ray cluster answers at {address} \(Connection refused\); pass"):
        attach.join(attach.Target(address, {"RAY_AUTH_MODE": "token"}))
    assert not any(k.startswith("RAY_") for k in environ)  # failed before Ray was set up or asked


def test_a_driver_of_another_cluster_hears_first_that_nothing_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", DrivingAnotherCluster())
    address = closed_port()
    with pytest.raises(ClusterUnreachable, match=rf"no Ray cluster answers at {address} \(Connection refused\)"):
        attach.join(attach.Target(address))
    listener = socket.create_server(("127.0.0.1", 0))  # a cluster that answers: then the other one is the news
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(InvalidRequest, match=rf"already drives the Ray cluster at 10.0.0.9:6379, not {address}$"):
            attach.join(attach.Target(address))
    finally:
        listener.close()


def test_the_probe_waits_a_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[float] = []

    def silent(address: tuple[str, int], timeout: float) -> Any:
        asked.append(timeout)
        raise TimeoutError("timed out")

    monkeypatch.setattr(attach.socket, "create_connection", silent)
    with pytest.raises(ClusterUnreachable, match=r"no Ray cluster answers at 10.0.0.1:6379 \(no answer within 3 s\)"):
        attach.probe(attach.Target("10.0.0.1:6379"))
    assert asked == [attach.PROBE_TIMEOUT_S]


def test_the_status_command_prints_the_error_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    address = closed_port()
    assert cli.main(["status", "--address", address]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ClusterUnreachable: no Ray cluster answers at {address} (Connection refused); pass")


def refused() -> ConnectionError:
    try:
        try:
            raise RuntimeError("Failed to get cluster ID: Unauthenticated: RPC error: InvalidAuthToken: missing")
        except RuntimeError as cause:
            raise ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:6379") from cause
    except ConnectionError as exc:
        return exc


def test_a_token_refusal_says_which_variables_carry_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    error = attach.refusal(attach.Target("127.0.0.1:6379"), refused())
    assert isinstance(error, ClusterRefused)
    assert str(error).startswith(
        "the Ray cluster at 127.0.0.1:6379 refused this process's authentication token (this process had no "
        "RAY_AUTH_MODE); pass RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the cluster's token> (or "
        "RAY_AUTH_TOKEN_PATH=<its file>) in the environment"
    )
    other = attach.refusal(attach.Target("127.0.0.1:6379"), ConnectionError("Failed to connect to Ray cluster"))
    assert isinstance(other, ClusterUnreachable) and "Ray could not join the cluster at 127.0.0.1:6379" in str(other)


def test_ray_joins_with_the_run_s_variables_and_bounded_tries(monkeypatch: pytest.MonkeyPatch) -> None:
    from transfer_queue import runtime

    listener = socket.create_server(("127.0.0.1", 0))  # the GCS port answers the probe
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    environ["RAY_AUTH_TOKEN"] = "another cluster's"
    monkeypatch.setattr(os, "environ", environ)
    seen: list[dict[str, Any]] = []

    def refusing_init(**kwargs: Any) -> None:  # what Ray does when the cluster refuses the token
        seen.append({**kwargs, "env": dict(environ)})
        raise refused()

    monkeypatch.setattr(runtime, "init_ray", refusing_init)
    try:
        with pytest.raises(ClusterRefused, match=f"the Ray cluster at {address} refused"):
            attach.join(
                attach.Target(address, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/t"}, ("RAY_AUTH_TOKEN",))
            )
    finally:
        listener.close()
    assert seen[0]["address"] == address
    env = seen[0]["env"]
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == "/t" and "RAY_AUTH_TOKEN" not in env
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # a loopback GCS: the cluster's nodes are loopback too
    assert env["RAY_gcs_server_port_wait_time_s"] == str(attach.GCS_CONNECT_TRIES)
    assert "RAY_gcs_server_port_wait_time_s" not in environ  # only while joining


def test_token_mode_with_no_token_found_is_a_refusal_naming_the_missing_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ray.exceptions import AuthenticationError, RaySystemError

    from transfer_queue import runtime

    listener = socket.create_server(("127.0.0.1", 0))  # the GCS port answers the probe
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    monkeypatch.setattr(os, "environ", environ)
    deleted = tmp_path / "auth_token"  # the run recorded a token file that is gone since
    errors: list[Exception] = [
        AuthenticationError("Token authentication is enabled but no token was found"),
        RaySystemError("x"),
    ]

    def failing_init(**kwargs: Any) -> None:  # what Ray does with RAY_AUTH_MODE=token and no token to read
        raise errors.pop(0)

    monkeypatch.setattr(runtime, "init_ray", failing_init)
    try:
        with pytest.raises(ClusterRefused) as refused_here:
            attach.join(attach.Target(address, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(deleted)}))
        with pytest.raises(ClusterUnreachable, match=f"Ray could not join the cluster at {address}"):
            attach.join(attach.Target(address))
    finally:
        listener.close()
    assert str(refused_here.value).startswith(
        f"this process has no authentication token for the Ray cluster at {address} (RAY_AUTH_TOKEN_PATH={deleted} "
        "is not a file); pass RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the cluster's token> (or "
        "RAY_AUTH_TOKEN_PATH=<its file>) in the environment"
    )
    environ.pop("RAY_AUTH_TOKEN_PATH")
    error = attach.refusal(attach.Target(address), AuthenticationError("no token was found"))
    assert isinstance(error, ClusterRefused) and f"at {address} (no token was found); pass" in str(error)
