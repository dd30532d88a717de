"""Framed messages over Unix sockets: round trips, partial reads and writes, hostile headers, parallel exchanges."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from transfer_queue.wire.unix_socket import (
    MAX_FRAMES,
    FrameReader,
    GatheredFrame,
    ProtocolViolation,
    UnixServer,
    connect,
    exchange,
    send_all,
)


def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def read_all(sock: socket.socket, reader: FrameReader, count: int = 1) -> list[list[bytearray]]:
    got: list[list[bytearray]] = []
    while len(got) < count:
        socket_ready = [sock]
        import select

        select.select(socket_ready, [], [], 5)
        messages, closed = reader.read(sock)
        got += messages
        assert not closed or len(got) >= count
    return got


def test_messages_round_trip_with_empty_and_large_frames():
    a, b = pair()
    payload = np.random.default_rng(0).integers(0, 255, size=3_000_000, dtype=np.uint8)  # > socket buffer
    frames = [b"envelope", b"", payload, memoryview(b"tail")]
    done = threading.Event()
    threading.Thread(target=lambda: (send_all(a, frames, 10), send_all(a, [b"second"], 10), done.set())).start()
    reader = FrameReader()
    (first, second) = read_all(b, reader, 2)
    assert done.wait(10)
    assert [bytes(f[:8]) for f in first[:2]] == [b"envelope", b""]
    assert np.array_equal(np.frombuffer(first[2], dtype=np.uint8), payload)
    assert bytes(first[3]) == b"tail" and [bytes(f) for f in second] == [b"second"]
    assert reader.idle


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (struct.pack("<I", 0), "1 to 4096 frames, the peer claims 0"),
        (struct.pack("<I", MAX_FRAMES + 1), "the peer claims 4097"),
        (struct.pack("<IQ", 1, 1 << 50), "over the 1099511627776-byte limit"),
    ],
)
def test_hostile_headers_are_refused_before_anything_is_allocated(header, message):
    a, b = pair()
    a.send(header)
    with pytest.raises(ProtocolViolation, match=message):
        read_all(b, FrameReader())


def test_a_closed_peer_is_reported():
    a, b = pair()
    a.send(struct.pack("<IQ", 1, 10) + b"abc")  # a message cut short
    a.close()
    messages, closed = FrameReader().read(b)
    assert messages == [] and closed


def echo_server(path: str, stop: threading.Event) -> None:
    import select

    server = UnixServer(path)
    while not stop.is_set():
        ready, writable, _ = select.select(server.fds(), server.writable_fds(), [], 0.05)
        for fd in writable:  # replies a reader did not take at once are queued, never waited for
            server.on_writable(fd)
        for fd in ready:
            for conn, frames in server.on_ready(fd):
                server.reply(conn, [bytes(frames[0]).upper(), *frames[1:]])
    server.close()


def test_exchange_talks_to_several_servers_at_once(tmp_path):
    stop = threading.Event()
    paths = [str(tmp_path / f"s{i}.sock") for i in range(2)]
    threads = [threading.Thread(target=echo_server, args=(p, stop)) for p in paths]
    for t in threads:
        t.start()
    try:
        for p in paths:
            for _ in range(200):
                if os.path.exists(p):
                    break
                threading.Event().wait(0.01)
        socks = [connect(p) for p in paths]
        big = np.arange(2_000_000, dtype=np.int64)  # 16 MB to each server
        replies, failed = exchange([(s, [b"hello", big]) for s in socks], timeout=20)
        assert failed == []
        for reply in replies:
            assert reply is not None and bytes(reply[0]) == b"HELLO"
            assert np.array_equal(np.frombuffer(reply[1], dtype=np.int64), big)
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_a_reply_frame_lands_in_the_array_given_for_it_when_the_sizes_agree():
    a, b = pair()
    payload = np.arange(1000, dtype=np.int64)
    out = np.zeros(2 * payload.nbytes, dtype=np.uint8)  # frames 1 and 2 of the reply land in its two halves
    first, second = out[: payload.nbytes], out[payload.nbytes :]
    too_small = np.zeros(3, dtype=np.uint8)
    reader = FrameReader({1: first, 2: second, 3: too_small})
    send_all(a, [b"header", payload, payload[::-1].copy(), b"1234"], 5)
    (reply,) = read_all(b, reader)
    assert reply[1] is first and reply[2] is second  # received in place, no copy
    assert np.array_equal(out.view(np.int64), np.concatenate([payload, payload[::-1]]))
    assert bytes(reply[3]) == b"1234" and reply[3] is not too_small  # the size disagrees: a buffer of its own
    send_all(a, [b"next", payload], 5)  # the targets are for the first message only
    (later,) = read_all(b, reader)
    assert later[1] is not first and np.array_equal(later[1].view(np.int64), payload)


def test_exchange_reports_a_server_that_does_not_answer(tmp_path):
    path = str(tmp_path / "silent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    sock = connect(path)
    replies, failed = exchange([(sock, [b"anyone?"])], timeout=0.2)
    assert replies == [None] and failed == [0]
    listener.close()


def test_exchange_reports_a_server_that_went_away():
    a, b = pair()
    b.close()  # the peer died: writing gives a broken pipe, which must come back as a failure, not an OSError
    replies, failed = exchange([(a, [b"x" * 1_000_000])], timeout=1.0)
    assert replies == [None] and failed == [0]


def test_a_stream_cut_anywhere_parses_to_the_same_messages():
    """Messages back to back, delivered in random pieces: headers and frames cut anywhere, empty frames, frames
    larger than one read, many small messages in one read."""
    from transfer_queue.wire.unix_socket import encode_header

    rng = np.random.default_rng(1)
    sizes = [0, 1, 7, 65_535, 65_536, 65_537, 200_000]
    messages = [
        [rng.integers(0, 255, size=int(rng.choice(sizes)), dtype=np.uint8).tobytes() for _ in range(rng.integers(1, 5))]
        for _ in range(60)
    ] + [[b"x"] for _ in range(2000)]
    stream = b"".join(encode_header(m) + b"".join(m) for m in messages)
    a, b = pair()
    reader, got, pos = FrameReader(), [], 0
    while len(got) < len(messages):
        if pos < len(stream):
            try:
                pos += a.send(stream[pos : pos + int(rng.integers(1, 150_000))])
            except BlockingIOError:
                pass
        received, closed = reader.read(b)
        assert not closed
        got += received
    assert [[bytes(f) for f in m] for m in got] == messages
    assert reader.idle


def connect_to_a_dying_server(tmp_path, serve, match: str) -> None:
    """``connect`` to a Unix socket whose one connection ``serve(conn)`` handles then closes: it raises
    ConnectionResetError (the server is gone) matching ``match``."""
    from transfer_queue.wire.unix_socket import connect

    path = str(tmp_path / "dying.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def accept() -> None:
        conn, _ = listener.accept()
        serve(conn)
        conn.close()

    thread = threading.Thread(target=accept)
    thread.start()
    with pytest.raises(ConnectionResetError, match=match):
        connect(path, b"s" * 32)
    thread.join()
    listener.close()


def test_a_server_that_closes_before_its_challenge_is_gone_not_an_authentication_failure(tmp_path):
    """A server killed with connections in its backlog closes them before challenging: the client must read that as
    a dead server (an OSError, as a refused connection: transports then report ServerGone or take TCP), never as a
    wrong secret (AuthenticationFailed, which says the controller_info is from another queue)."""
    connect_to_a_dying_server(
        tmp_path, lambda conn: None, r"closed the connection before its challenge \(the server is gone\)"
    )


def test_a_gathered_frame_arrives_as_one_frame_of_its_pieces_end_to_end():
    a, b = pair()
    rng = np.random.default_rng(1)
    pieces = [rng.integers(0, 255, size=n, dtype=np.uint8) for n in (2_000_000, 0, 7, 1_500_000)]
    gathered = GatheredFrame(pieces)
    assert gathered.nbytes == sum(x.nbytes for x in pieces)
    done = threading.Event()
    threading.Thread(target=lambda: (send_all(a, [b"head", gathered, b"tail"], 10), done.set())).start()
    (message,) = read_all(b, FrameReader())
    assert done.wait(10)
    assert [bytes(message[0]), bytes(message[2])] == [b"head", b"tail"] and len(message) == 3
    assert np.array_equal(np.frombuffer(message[1], dtype=np.uint8), np.concatenate(pieces))
    assert np.array_equal(gathered.join(), np.concatenate(pieces))  # what the ZeroMQ path sends


def test_a_server_that_dies_after_the_proof_before_its_answer_is_gone_not_an_authentication_failure(tmp_path):
    """A storage unit SIGKILLed while a client connects: the client got the challenge and sent its proof, then the
    connection closed with no answer. Found by benchmarks/kill_anything.py (a rollout worker's put to a unit killed
    at that moment ended the run with AuthenticationFailed): gone, as above; a refusal is an answer of its own."""
    from transfer_queue.wire.auth import NONCE_BYTES, PROOF_BYTES

    def challenge(conn: socket.socket) -> None:
        conn.sendall(b"n" * NONCE_BYTES)
        proof = b""
        while len(proof) < PROOF_BYTES:
            proof += conn.recv(PROOF_BYTES - len(proof))

    connect_to_a_dying_server(
        tmp_path, challenge, r"closed the connection before answering the proof \(the server is gone\)"
    )


class CountingSocket:
    """A socket whose reads are counted (``socket.socket`` takes no instance attributes to patch)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.reads = 0
        self.direct = 0  # of which straight into a frame's buffer (recv_into)

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv(self, n: int) -> bytes:
        self.reads += 1
        return self.sock.recv(n)

    def recv_into(self, buffer: memoryview) -> int:
        self.reads += 1
        self.direct += 1
        return self.sock.recv_into(buffer)


def test_a_small_message_costs_one_read_and_a_large_frame_skips_the_stage():
    from transfer_queue.wire.unix_socket import DIRECT_BYTES, STAGE_BYTES

    a, b = pair()
    counted = CountingSocket(b)
    reader = FrameReader()
    send_all(a, [b"envelope", b"body" * 40], 5)
    (message,), closed = reader.read(counted)  # type: ignore[arg-type]
    assert [bytes(f) for f in message] == [b"envelope", b"body" * 40] and not closed
    assert counted.reads == 1  # header, envelope and body in one recv; no read that finds the socket empty
    # two messages that arrived together are both parsed out of the one read
    send_all(a, [b"one"], 5)
    send_all(a, [b"two"], 5)
    counted.reads = 0
    got, _ = reader.read(counted)  # type: ignore[arg-type]
    assert [[bytes(f) for f in m] for m in got] == [[b"one"], [b"two"]] and counted.reads == 1
    # a large frame: what the first read staged is copied, the rest lands in the frame's array itself
    payload = np.arange(4 * STAGE_BYTES, dtype=np.uint8)
    target = np.zeros(payload.nbytes, dtype=np.uint8)
    reader = FrameReader({1: target})
    counted.reads = 0
    threading.Thread(target=send_all, args=(a, [b"h", payload], 5)).start()
    (message,) = read_all(counted, reader)  # type: ignore[arg-type]
    assert message[1] is target and np.array_equal(target, payload)
    assert payload.nbytes - STAGE_BYTES >= DIRECT_BYTES and counted.direct >= 1  # the remainder skipped the stage


def test_a_queued_reply_is_polled_for_room_until_it_is_written():
    """The server keeps the connections with replies queued as they change (no scan of every connection per
    wake-up): POLLOUT is wanted while a reply waits for room, and no longer once the peer took it."""
    import select
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "s.sock")
    server = UnixServer(path)
    client = connect(path)
    server.on_ready(server.listener.fileno())
    (fd,) = server.connections
    server.take_changes()
    big = np.zeros(8 << 20, dtype=np.uint8)  # far more than the socket buffer holds
    assert server.reply(fd, [b"h", big])
    assert server.writable_fds() == [fd] and server.take_changes()[fd] == select.EPOLLIN | select.EPOLLOUT
    reader, got = FrameReader(), []
    while not got:
        readable, writable, _ = select.select([client], server.writable_fds(), [], 5)
        for w in writable:
            server.on_writable(w)
        if readable:
            got, _ = reader.read(client)
    assert got[0][1].nbytes == big.nbytes
    assert server.writable_fds() == [] and server.blocked == set()
    assert server.drop_stalled(time.monotonic() + 3600) == []  # nothing queued: nothing to call stalled
    client.close()
    server.close()
