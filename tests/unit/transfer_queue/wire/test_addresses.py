"""Addresses: bind and advertise are separate (a wildcard bind never advertises tcp://0.0.0.0), IPv6 literals are
bracketed and served (tested on ::1), and "same host" is decided by the Ray node id, then the hostname, then a probe of
the Unix socket."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from transfer_queue.errors import InvalidRequest
from transfer_queue.storage.unit import BlockStore, StorageServer
from transfer_queue.wire import protocol as p
from transfer_queue.wire.sockets import server_addresses, tcp_address
from transfer_queue.wire.transport import AsyncioTransport, BlockingTransport, run_sync

SESSION = "a" * 32
SECRET = b"s" * 32


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_server_addresses_split_bind_and_advertise() -> None:
    assert server_addresses(None, None) == ("127.0.0.1", "127.0.0.1")  # outside Ray: the node is loopback
    assert server_addresses("0.0.0.0", None) == ("0.0.0.0", "127.0.0.1")  # a wildcard advertises the node's address
    assert server_addresses("::", None) == ("::", "127.0.0.1")
    assert server_addresses("0.0.0.0", "10.1.2.3") == ("0.0.0.0", "10.1.2.3")
    assert server_addresses("[::1]", None) == ("::1", "::1")
    with pytest.raises(InvalidRequest, match=r"advertise_host='0\.0\.0\.0': clients cannot connect to a wildcard"):
        server_addresses("0.0.0.0", "0.0.0.0")


def test_tcp_addresses_bracket_ipv6_literals() -> None:
    assert tcp_address("10.0.0.1", 5) == "tcp://10.0.0.1:5"
    assert tcp_address("::1", 5) == "tcp://[::1]:5"
    assert tcp_address("[fd00::2]", 5) == "tcp://[fd00::2]:5"


def serve(host: str, advertise: str | None = None) -> StorageServer:
    return StorageServer(BlockStore(0, 1, SECRET), host, SESSION, SECRET, advertise_host=advertise)


def stats(transport: Any, endpoint: p.Endpoint) -> Any:
    request_id = transport.next_request_id()
    frames = [p.encode(p.Envelope(p.PROTOCOL_VERSION, SESSION, request_id)), p.encode(p.StorageStats())]
    (reply,) = run_sync(transport.call_many([(endpoint, frames, request_id)], 10.0))
    header = p.decode_reply_header(reply[0])
    assert header.error_type is None, header
    return p.decode_as(reply[1], Any)


@pytest.fixture
def servers() -> Iterator[list[StorageServer]]:
    started: list[StorageServer] = []
    yield started
    for server in started:
        server.stop()


def test_a_wildcard_bind_advertises_a_reachable_address(servers: list[StorageServer]) -> None:
    server = serve("0.0.0.0")
    servers.append(server)
    assert server.endpoint.tcp.startswith("tcp://127.0.0.1:")
    assert stats(BlockingTransport(secret=SECRET, force_tcp=True), server.endpoint)["unit"] == 0
    with pytest.raises(InvalidRequest, match="wildcard"):
        serve("0.0.0.0", "::")


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
def test_ipv6_servers_are_reached_by_both_transports(servers: list[StorageServer]) -> None:
    server = serve("::1")
    servers.append(server)
    assert server.endpoint.tcp.startswith("tcp://[::1]:")
    assert stats(BlockingTransport(secret=SECRET, force_tcp=True), server.endpoint)["unit"] == 0
    transport = AsyncioTransport(secret=SECRET)

    async def ask() -> Any:
        request_id = transport.next_request_id()
        frames = [p.encode(p.Envelope(p.PROTOCOL_VERSION, SESSION, request_id)), p.encode(p.StorageStats())]
        (reply,) = await transport.call_many([(server.endpoint, frames, request_id)], 10.0)
        return p.decode_as(reply[1], Any)

    import asyncio

    assert asyncio.run(ask())["unit"] == 0
    transport.close()
    wildcard = serve("::", "::1")  # every IPv6 interface, advertising loopback
    servers.append(wildcard)
    assert wildcard.endpoint.tcp.startswith("tcp://[::1]:")
    assert stats(BlockingTransport(secret=SECRET, force_tcp=True), wildcard.endpoint)["unit"] == 0


def test_same_host_is_the_ray_node_then_the_hostname(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "server.sock")
    open(path, "w").close()
    here = socket.gethostname()
    monkeypatch.setattr(p, "ray_node_id", lambda: "node-a")
    assert p.Endpoint("tcp://x:1", path, here, "node-a").local_path() == path
    assert p.Endpoint("tcp://x:1", path, here, "node-b").local_path() is None  # another Ray node, same hostname
    assert p.Endpoint("tcp://x:1", path, "elsewhere", "node-a").local_path() == path  # the node id decides
    assert p.Endpoint("tcp://x:1", path, here, "").local_path() == path  # a server outside Ray: the hostname
    monkeypatch.setattr(p, "ray_node_id", lambda: "")  # a client outside Ray: the hostname
    assert p.Endpoint("tcp://x:1", path, here, "node-b").local_path() == path
    assert p.Endpoint("tcp://x:1", path, "elsewhere", "node-b").local_path() is None
    os.remove(path)
    assert p.Endpoint("tcp://x:1", path, here, "node-b").local_path() is None  # no socket file


def test_a_dead_socket_file_sends_the_client_to_tcp(servers: list[StorageServer], tmp_path: Any) -> None:
    """The probe: a socket file of this hostname that nothing of ours listens on (another host's, on a shared /tmp, or
    a dead server's) is not taken; TCP is."""
    server = serve("127.0.0.1")
    servers.append(server)
    stale = str(tmp_path / "stale.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(stale)  # a socket file with no listener
    endpoint = p.Endpoint(server.endpoint.tcp, stale, socket.gethostname(), "")
    transport = BlockingTransport(secret=SECRET)
    assert transport._local_path(endpoint, 5.0) is None
    assert stats(transport, endpoint)["unit"] == 0  # served over TCP
    assert transport._local_path(server.endpoint, 5.0) == server.endpoint.unix  # the real one is taken
