"""A server that dies is reported at once as ``ServerGone``, over both of the sync client's transports (the Unix
socket to a same-host server and ZeroMQ TCP), whether it died before the request or while handling it; a server
that is alive but slow still ends in ``RequestTimeout``. The server is a real process killed with SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from transfer_queue.errors import RequestTimeout, ServerGone
from transfer_queue.wire import protocol as p
from transfer_queue.wire.transport import AsyncioTransport, BlockingTransport, run_sync

# Answers every request with an empty reply carrying its request id; a request whose body is b"die" kills the
# server before it answers, b"slow" is never answered.
SERVER = r"""
import json, os, signal, sys
from transfer_queue.wire import protocol as p
from transfer_queue.wire.server_sockets import ServerSockets
server = ServerSockets(host="127.0.0.1")
e = server.endpoint
print(json.dumps([e.tcp, e.unix, e.hostname]), flush=True)
while True:
    for frames, reply in server.requests(server.poll(1000)):
        body = bytes(frames[1])
        if body == b"die":
            os.kill(os.getpid(), signal.SIGKILL)
        if body != b"slow":
            reply([p.encode(p.ReplyHeader(int(bytes(frames[0]))))])
"""


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen, p.Endpoint]]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        tcp, unix, hostname = json.loads(proc.stdout.readline())
        yield proc, p.Endpoint(tcp, unix, hostname)
    finally:
        proc.kill()
        proc.wait()


def call(transport: BlockingTransport, endpoint: p.Endpoint, body: bytes, timeout: float = 60.0) -> Any:
    request_id = transport.next_request_id()
    return run_sync(transport.call_many([(endpoint, [str(request_id).encode(), body], request_id)], timeout))


def by(endpoint: p.Endpoint, route: str) -> p.Endpoint:
    """The endpoint as a client on this host sees it ("unix"), or as one on another host does ("tcp")."""
    return endpoint if route == "unix" else p.Endpoint(endpoint.tcp, None, endpoint.hostname)


@pytest.mark.parametrize("connected", [True, False], ids=["after-a-reply", "before-any-request"])
@pytest.mark.parametrize("route", ["unix", "tcp"])
def test_a_server_killed_between_requests_is_reported_at_once(server: Any, route: str, connected: bool) -> None:
    proc, endpoint = server
    transport = BlockingTransport()
    if connected:
        assert call(transport, by(endpoint, route), b"hi")  # connected, answered
    proc.kill()
    proc.wait()
    started = time.monotonic()
    with pytest.raises(ServerGone, match=r"the server is gone"):
        call(transport, by(endpoint, route), b"hi")
    assert time.monotonic() - started < 15.0  # not the 60 s timeout (slack for a loaded machine)
    transport.close()


@pytest.mark.parametrize("route", ["unix", "tcp"])
def test_a_server_that_dies_while_handling_a_request_is_reported_at_once(server: Any, route: str) -> None:
    _, endpoint = server
    transport = BlockingTransport()
    assert call(transport, by(endpoint, route), b"hi")
    started = time.monotonic()
    with pytest.raises(ServerGone, match=r"closed the connection.*the server is gone"):
        call(transport, by(endpoint, route), b"die")
    assert time.monotonic() - started < 15.0
    transport.close()


@pytest.mark.parametrize("route", ["unix", "tcp"])
def test_a_live_server_that_does_not_answer_is_still_a_timeout(server: Any, route: str) -> None:
    _, endpoint = server
    transport = BlockingTransport()
    with pytest.raises(RequestTimeout, match=r"no reply within 0\.5 s"):
        call(transport, by(endpoint, route), b"slow", timeout=0.5)
    assert call(transport, by(endpoint, route), b"hi")  # a new connection after the timeout: served
    transport.close()


def test_the_asyncio_transport_reports_a_dead_server_at_once(server: Any) -> None:
    """AsyncTransferQueueClient's transport (ZeroMQ only): a server that dies while handling a request, and then
    one that is gone before the next request, both end in ServerGone well before the timeout."""
    import asyncio

    proc, endpoint = server
    transport = AsyncioTransport()

    async def ask(body: bytes) -> Any:
        request_id = transport.next_request_id()
        return await transport.call_many([(endpoint, [str(request_id).encode(), body], request_id)], 60.0)

    async def scenario() -> None:
        assert await ask(b"hi")
        for _ in range(2):  # dies while handling "die"; then nothing listens any more
            started = time.monotonic()
            with pytest.raises(ServerGone, match=r"the server is gone"):
                await ask(b"die")
            assert time.monotonic() - started < 15.0
        proc.wait()

    asyncio.run(scenario())
    transport.close()


# libzmq sends monitor events with a blocking send from the context's I/O thread. A monitor that filled up (pyzmq's
# get_monitor_socket: 1,000 events, 100 s of a socket retrying a dead server), or whose reading end was closed
# before the socket it watches, blocked that thread, and with it every TCP connection of the process: in CI the
# client's calls to live servers all timed out after a test left a socket to a killed server open.


def _dead_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exchange_works(ctx: Any) -> bool:
    """A fresh ROUTER and DEALER of ``ctx`` reach each other over TCP (the context's I/O thread is alive)."""
    import zmq

    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hi")
        return bool(router.poll(10_000))
    finally:
        router.close(linger=0)
        dealer.close(linger=0)


def _retrying_dealer(ctx: Any) -> Any:
    """A DEALER that retries a port where nothing listens every millisecond (an event each time)."""
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 1)
    return sock


def test_a_monitor_nobody_reads_does_not_stop_the_other_sockets() -> None:
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from transfer_queue.wire.sockets import close_watched, watch

    ctx = zmq.Context()
    try:
        sock = _retrying_dealer(ctx)
        monitor = watch(sock, zmq.EVENT_CONNECT_RETRIED)
        sock.connect(f"tcp://127.0.0.1:{_dead_port()}")
        time.sleep(4.0)  # thousands of retries, none read
        assert _exchange_works(ctx)
        events = 0
        while monitor.poll(0):
            recv_monitor_message(monitor)
            events += 1
        assert events > 1000  # more than pyzmq's monitor would hold before blocking the I/O thread
        close_watched(sock)
        assert monitor.closed and sock.closed
    finally:
        ctx.destroy(linger=0)


def test_closing_a_watched_socket_never_leaves_its_events_without_a_reader() -> None:
    import zmq

    from transfer_queue.wire.sockets import close_watched, watch

    ctx = zmq.Context()
    try:
        for _ in range(20):
            sock = _retrying_dealer(ctx)
            watch(sock, zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED)
            sock.connect(f"tcp://127.0.0.1:{_dead_port()}")
            time.sleep(0.05)
            close_watched(sock)
        time.sleep(0.5)
        assert _exchange_works(ctx)
    finally:
        ctx.destroy(linger=0)


def test_an_idle_socket_to_a_dead_server_is_closed_by_the_next_call(server: Any, monkeypatch: Any) -> None:
    """A thread's socket to a server that died is closed by its next call to any server (no retries for ever)."""
    import transfer_queue.wire.transport as transport_module

    proc, endpoint = server
    transport = BlockingTransport(force_tcp=True)
    assert call(transport, endpoint, b"hi")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    other = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert other.stdout is not None
        tcp, unix, hostname = json.loads(other.stdout.readline())
        proc.kill()
        proc.wait()
        time.sleep(0.5)  # the connection drops: its monitor says so
        monkeypatch.setattr(transport_module, "_SWEEP_S", 0.0)
        assert call(transport, p.Endpoint(tcp, unix, hostname), b"hi")
        assert list(transport._thread_sockets("sockets")) == [tcp]
    finally:
        other.kill()
        other.wait()
        transport.close()


@pytest.fixture
def hung_server(tmp_path: Any) -> Iterator[p.Endpoint]:
    """A server that is there and never answers (a process frozen with SIGSTOP): its sockets listen, the kernel
    completes connections into their backlog, and nothing is ever read or sent (no Unix challenge, no CURVE)."""
    import socket

    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(tmp_path / "hung.sock"))
    unix.listen(8)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    yield p.Endpoint(f"tcp://127.0.0.1:{tcp.getsockname()[1]}", str(tmp_path / "hung.sock"), socket.gethostname())
    unix.close()
    tcp.close()


@pytest.mark.parametrize("route", ["unix", "tcp"])
def test_a_hung_server_is_a_timeout_after_the_calls_timeout_on_either_transport(
    hung_server: p.Endpoint, route: str
) -> None:
    """Not AuthenticationFailed after a fixed 10 s on the Unix socket: the same RequestTimeout as over TCP, naming
    the call's timeout (the client then reports the storage unit down, StorageUnitDown, on both paths)."""
    transport = BlockingTransport(secret=b"s" * 32)
    started = time.monotonic()
    with pytest.raises(RequestTimeout, match=r"no reply within 0\.5 s") as raised:
        call(transport, by(hung_server, route), b"hi", timeout=0.5)
    assert time.monotonic() - started < 8.0  # the call's 0.5 s, not a fixed handshake timeout of 10 s
    assert set(raised.value.addresses) & {hung_server.tcp, hung_server.unix}  # type: ignore[attr-defined]
    transport.close()


@pytest.mark.parametrize("route", ["unix", "tcp"])
def test_a_read_from_a_hung_storage_unit_is_storage_unit_down_on_either_transport(
    hung_server: p.Endpoint, route: str
) -> None:
    """The client's answer, the same on both paths: the unit did not answer within the read's timeout."""
    import numpy as np

    from transfer_queue.client import TransferQueueClient
    from transfer_queue.config import QueueConfig
    from transfer_queue.errors import StorageUnitDown
    from transfer_queue.metadata import BatchMeta, FieldSchema

    config = QueueConfig(2, num_storage_units=1, default_timeout=0.5)
    unit = by(hung_server, route)
    info = p.ControllerInfo(p.PROTOCOL_VERSION, "a" * 32, unit, [unit], config.to_dict(), b"s" * 32)
    client = TransferQueueClient("reader", info, force_tcp=route == "tcp")
    zeros = np.zeros((2, 1), dtype=np.int64)
    meta = BatchMeta(0, 1, np.arange(2), np.arange(2), {"x": FieldSchema("dense", "float32", ())}, zeros, zeros)
    with pytest.raises(StorageUnitDown, match=r"no reply within 0\.5 s.*storage unit 0 is down"):
        client.get_data(meta, timeout=0.5)
    client.close()
