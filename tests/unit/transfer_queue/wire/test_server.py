"""The shared serving loop (transfer_queue.wire.server.Server): one exception boundary around requests, periodic work
and the Unix-socket reader; the peer of every request; disconnects reported; a slow reader delays nobody."""

from __future__ import annotations

import select
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from transfer_queue.errors import AuthenticationFailed, InvalidRequest
from transfer_queue.wire import protocol as p
from transfer_queue.wire.auth import secure_client
from transfer_queue.wire.server import Responder, Server
from transfer_queue.wire.server_sockets import Peer
from transfer_queue.wire.shm import SHM_OK, TABLE, ClientMaps, SegmentPool, ShmTable, encode_table
from transfer_queue.wire.unix_socket import FrameReader, FrameWriter, connect, exchange, send_all

SESSION = "s" * 32
BIG = 64 << 20  # a reply no socket buffer holds


class Probe(Server):
    """Answers StorageStats with its peer, fails DropPartition (typed) and DropBlocks (a bug), and answers Read
    with BIG bytes."""

    what = "probe"

    def __init__(self, secret: bytes = b"", shm_pool: SegmentPool | None = None) -> None:
        super().__init__("tq-probe", p.decode_storage_request, SESSION, "127.0.0.1", secret, shm_pool=shm_pool)
        self.peers: list[Peer] = []
        self.gone: list[Peer] = []
        self.periodic_error: Exception | None = None
        self.ticks = 0
        self.start()

    def handle(self, request: Any, buffers: list[Any], responder: Responder) -> None:
        if isinstance(request, p.DropPartition):
            raise InvalidRequest(f"partition uid {request.partition_uid} is not droppable")
        if isinstance(request, p.DropBlocks):
            raise RuntimeError("a bug in the handler")
        if isinstance(request, p.Read):
            responder.ok(None, [np.zeros(BIG, dtype=np.uint8)])
            return
        self.peers.append(responder.peer)
        responder.ok({"peer": repr(responder.peer)})

    def periodic(self, events: dict[Any, int]) -> None:
        self.ticks += 1
        if self.periodic_error is not None:
            raise self.periodic_error

    def on_disconnect(self, peer: Peer) -> None:
        self.gone.append(peer)


@pytest.fixture
def server() -> Any:
    server = Probe()
    yield server
    server.stop()


def frames(body: Any, request_id: int = 7) -> list[bytes]:
    return [p.encode(p.Envelope(p.PROTOCOL_VERSION, SESSION, request_id)), p.encode(body)]


def call_unix(path: str, body: Any, sock: Any = None) -> tuple[p.ReplyHeader, list[Any]]:
    sock = sock or connect(path)
    (reply,), failed = exchange([(sock, frames(body))], timeout=10)
    assert failed == [] and reply is not None
    return p.decode_reply_header(reply[0]), reply[1:]


def call_tcp(dealer: zmq.Socket, body: Any) -> tuple[p.ReplyHeader, list[bytes]]:
    dealer.send_multipart(frames(body))
    assert dealer.poll(10_000), "no reply"
    reply = dealer.recv_multipart()
    return p.decode_reply_header(reply[0]), reply[1:]


def dealer_to(server: Server) -> zmq.Socket:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server.endpoint.tcp)
    return dealer


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_failing_request_is_answered_counted_and_the_loop_keeps_serving(server: Probe) -> None:
    assert server.endpoint.unix is not None
    header, _ = call_unix(server.endpoint.unix, p.DropPartition(3))
    assert (header.error_type, header.error_message) == ("InvalidRequest", "partition uid 3 is not droppable")
    header, _ = call_unix(server.endpoint.unix, p.DropBlocks(1, [2]))
    assert header.error_type == "TransferQueueError" and "RuntimeError: a bug in the handler" in header.error_message
    header, body = call_unix(server.endpoint.unix, p.StorageStats())
    assert header.error_type is None and p.decode_as(body[0], Any)["peer"].startswith("Peer(unix:")
    stats = server.stats()
    assert stats["failures.request"] == 1 and stats["requests"] == 3


def test_a_failing_periodic_task_is_counted_and_the_loop_keeps_serving(server: Probe) -> None:
    server.periodic_error = RuntimeError("timer bug")
    wait_for(lambda: server.stats().get("failures.periodic", 0) >= 2)
    dealer = dealer_to(server)
    header, _ = call_tcp(dealer, p.StorageStats())
    assert header.error_type is None and server.serving
    dealer.close()


def test_a_failing_unix_reader_drops_that_connection_only(server: Probe, monkeypatch: pytest.MonkeyPatch) -> None:
    assert server.endpoint.unix is not None
    victim = connect(server.endpoint.unix)
    call_unix(server.endpoint.unix, p.StorageStats(), victim)
    real = server.sockets.unix_messages
    victim_fd = next(iter(server.sockets.unix.connections))  # type: ignore[union-attr]

    def broken(fd: int) -> list[Any]:
        if fd == victim_fd:
            raise MemoryError("the reader broke")
        return real(fd)

    monkeypatch.setattr(server.sockets, "unix_messages", broken)
    send_all(victim, frames(p.StorageStats()), timeout=5)
    wait_for(lambda: server.stats().get("failures.unix reader", 0) == 1)
    header, _ = call_unix(server.endpoint.unix, p.StorageStats())  # another connection is served
    assert header.error_type is None
    wait_for(lambda: any(peer.transport == "unix" for peer in server.gone))
    assert server.serving


def test_every_request_names_its_peer_and_disconnects_are_reported(server: Probe) -> None:
    assert server.endpoint.unix is not None
    dealer = dealer_to(server)
    call_tcp(dealer, p.StorageStats())
    call_tcp(dealer, p.StorageStats())
    sock = connect(server.endpoint.unix)
    call_unix(server.endpoint.unix, p.StorageStats(), sock)
    tcp_peer, tcp_again, unix_peer = server.peers
    assert tcp_peer == tcp_again and tcp_peer.transport == "tcp" and unix_peer.transport == "unix"
    assert server.gone == []
    dealer.close(linger=0)
    sock.close()
    wait_for(lambda: len(server.gone) == 2 and server.stats()["disconnects"] == 2)
    assert set(server.gone) == {tcp_peer, unix_peer}


def test_a_reader_that_never_reads_delays_no_other_client(server: Probe) -> None:
    assert server.endpoint.unix is not None
    stuck = connect(server.endpoint.unix)
    send_all(stuck, frames(p.Read(1, [])), timeout=5)  # asks for BIG bytes, then never reads them
    wait_for(lambda: server.stats().get("requests", 0) == 1)
    started = time.monotonic()
    for _ in range(20):
        header, _ = call_unix(server.endpoint.unix, p.StorageStats())
        assert header.error_type is None
    assert time.monotonic() - started < 5.0
    assert server.sockets.unix is not None and server.sockets.unix.writable_fds()  # the big reply is still queued
    stuck.close()


def test_connections_closed_and_opened_again_on_reused_fds_are_all_served(server: Probe) -> None:
    """The Unix connections sit in an epoll set updated as they come and go: a connection closed and a new one that
    gets the same fd number on the server, between two wake-ups or across them, is served; a closed one leaves the
    set."""
    assert server.endpoint.unix is not None
    path = server.endpoint.unix
    polled = len(server.sockets.poller.sockets)
    socks = [connect(path) for _ in range(40)]
    for sock in socks:
        header, _ = call_unix(path, p.StorageStats(), sock)
        assert header.error_type is None
    assert len(server.sockets.poller.sockets) == polled  # zmq_poll's set does not grow with the connections
    for sock in socks[::2]:
        sock.close()
    wait_for(lambda: len(server.gone) == 20)
    fresh = [connect(path) for _ in range(20)]  # the server's fds of the closed ones are reused
    for sock in socks[1::2] + fresh:
        header, _ = call_unix(path, p.StorageStats(), sock)
        assert header.error_type is None
    assert server.sockets.unix is not None
    wait_for(lambda: len(server.sockets._fds) == len(server.sockets.unix.connections) + 1 == 41)  # and the listener
    for sock in socks[1::2] + fresh:
        sock.close()
    wait_for(lambda: len(server.sockets._fds) == 1)


# ---- authentication ------------------------------------------------------------------------------------------------
SECRET = b"k" * 32


@pytest.fixture
def guarded() -> Any:
    server = Probe(secret=SECRET)
    yield server
    server.stop()


def curve_dealer(server: Server, server_secret: bytes, client_keys: tuple[bytes, bytes] | None = None) -> zmq.Socket:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    secure_client(dealer, server_secret)
    if client_keys is not None:  # the server's true key, but a client key pair of its own
        dealer.curve_publickey, dealer.curve_secretkey = client_keys
    dealer.connect(server.endpoint.tcp)
    return dealer


def test_clients_with_the_secret_are_served_over_both_transports(guarded: Probe) -> None:
    assert guarded.endpoint.unix is not None
    header, _ = call_unix(guarded.endpoint.unix, p.StorageStats(), connect(guarded.endpoint.unix, SECRET))
    assert header.error_type is None
    dealer = curve_dealer(guarded, SECRET)
    assert call_tcp(dealer, p.StorageStats())[0].error_type is None
    dealer.close()
    assert guarded.stats()["dropped.unauthenticated"] == 0


def test_strangers_are_refused_before_any_frame_is_read_and_counted(guarded: Probe) -> None:
    assert guarded.endpoint.unix is not None
    with pytest.raises(AuthenticationFailed, match="refused this queue's secret"):
        connect(guarded.endpoint.unix, b"w" * 32)
    raw = connect(guarded.endpoint.unix)  # no handshake at all: valid frames where the proof belongs
    send_all(raw, frames(p.StorageStats()), timeout=5)
    (reply,), failed = exchange([(raw, frames(p.StorageStats()))], timeout=2)
    assert reply is None and failed == [0]
    strangers = [
        curve_dealer(guarded, b""),  # plain ZMTP to a CURVE server
        curve_dealer(guarded, b"w" * 32),  # keys from another secret
        curve_dealer(guarded, SECRET, zmq.curve_keypair()),  # the server's key, but not the queue's client key
    ]
    for dealer in strangers:
        dealer.send_multipart(frames(p.StorageStats()))
    for dealer in strangers:
        assert not dealer.poll(300), "a stranger got a reply"
        dealer.close()
    wait_for(lambda: guarded.stats()["dropped.unauthenticated"] >= 5)
    assert guarded.stats().get("requests", 0) == 0
    header, _ = call_unix(guarded.endpoint.unix, p.StorageStats(), connect(guarded.endpoint.unix, SECRET))
    assert header.error_type is None  # and the queue's own clients are still served


def test_a_header_claiming_more_than_the_limit_is_refused_before_allocating(guarded: Probe) -> None:
    assert guarded.endpoint.unix is not None
    sock = connect(guarded.endpoint.unix, SECRET)
    sock.send(struct.pack("<IQ", 1, 1 << 40))  # 12 bytes claiming a 1 TiB frame
    wait_for(lambda: guarded.stats()["disconnects"] == 1)
    assert not guarded.stats().get("failures.unix reader")  # refused by the limit, not by a MemoryError
    header, _ = call_unix(guarded.endpoint.unix, p.StorageStats(), connect(guarded.endpoint.unix, SECRET))
    assert header.error_type is None


def test_a_bad_staged_message_is_answered_malformed_and_its_connection_keeps_serving() -> None:
    """A table naming a segment the connection was never granted is refused with a typed reply, not a hang-up
    (which the client reads as its storage unit gone)."""
    server = Probe(shm_pool=SegmentPool(64 << 20, "tq-test-refuse"))
    try:
        assert server.endpoint.unix is not None
        sock = connect(server.endpoint.unix, shm=ClientMaps())
        bad = [*frames(p.StorageStats()), b"", encode_table(ShmTable(frames={2: [(99, 0, 10)]}))]
        FrameWriter(bad, SHM_OK | TABLE).write(sock)
        reader, got = FrameReader(fds=True), []
        while not got:
            assert select.select([sock], [], [], 10)[0], "no reply"
            got, closed = reader.read(sock)
            assert not closed, "the unit hung up"
        header = p.decode_reply_header(got[0][0])
        assert header.request_id == 7 and header.error_type == "MalformedMessage"
        assert "staged in shared memory, but this connection holds no grant" in str(header.error_message)
        header, _ = call_unix(server.endpoint.unix, p.StorageStats(), sock)  # the same connection, served
        assert header.error_type is None and server.gone == []
        sock.close()
    finally:
        server.stop()
