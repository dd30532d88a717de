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

from transfer_queue import protocol as p
from transfer_queue.errors import RequestTimeout, ServerGone
from transfer_queue.transport import AsyncioTransport, BlockingTransport, run_sync

# Answers every request with an empty reply carrying its request id; a request whose body is b"die" kills the
# server before it answers, b"slow" is never answered.
SERVER = r"""
import json, os, signal, sys
from transfer_queue import protocol as p
from transfer_queue.transport import ServerSockets
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
