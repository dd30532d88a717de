"""Shared-memory segments (transfer_queue.wire.shm): the pool hands memory back only when the last view dies, keeps
at most its cap of free segments, locates buffers; descriptors, grants and fds over a real Unix socket pair."""

from __future__ import annotations

import gc
import os
import socket
from typing import Any

import numpy as np
import pytest
import torch

from transfer_queue.errors import InvalidRequest, MalformedMessage
from transfer_queue.wire import shm
from transfer_queue.wire.shm import (
    MIN_SHM_BYTES,
    SHM_OK,
    TABLE,
    ClientMaps,
    SegmentPool,
    ShmTable,
    UnitConnection,
    copy_pairs,
    decode_table,
    encode_table,
    segment_size,
)
from transfer_queue.wire.unix_socket import RELEASE_MESSAGE, FrameReader, FrameWriter, GatheredFrame, ProtocolViolation

MB = 1 << 20


def memfds_of(pool: SegmentPool) -> list[str]:
    """This process's mappings of ``pool``'s segments (``/memfd:<name>-<id> (deleted)`` in /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-2] for line in f if f"/memfd:{pool.name}-" in line})


def test_a_segment_goes_back_to_the_pool_only_when_its_last_view_dies_and_is_reused() -> None:
    pool = SegmentPool(16 * MB, "tq-test-views")
    array = pool.take(3 * MB)
    tensor = torch.frombuffer(memoryview(array[MB:]), dtype=torch.uint8)  # a view of a view, through torch
    del array
    gc.collect()
    assert pool.stats()["free_bytes"] == 0, "a torch view still holds the memory"
    del tensor
    assert pool.stats()["free_bytes"] == segment_size(3 * MB)
    again = pool.take(3 * MB)
    assert pool.stats()["reused"] == 1 and pool.stats()["created"] == 1
    assert pool.locate(again[100:200]) == (1, 100)
    pool.close()


def test_freed_segments_beyond_the_cap_are_closed_and_unmapped() -> None:
    pool = SegmentPool(4 * MB, "tq-test-cap")
    arrays = [pool.take(4 * MB) for _ in range(3)]
    assert len(memfds_of(pool)) == 3
    del arrays
    assert pool.stats() == {
        "segments": 1, "segment_bytes": 4 * MB, "free_bytes": 4 * MB, "created": 3, "reused": 0, "granted_bytes": 0,
    }  # fmt: skip
    assert len(memfds_of(pool)) == 1
    pool.close()
    assert memfds_of(pool) == []


def test_trim_closes_the_free_segments_idle_for_longer_than_asked() -> None:
    pool = SegmentPool(16 * MB, "tq-test-trim")
    first, second = pool.take(MB), pool.take(MB)
    del first
    assert pool.trim(idle_s=3600) == 0 and pool.stats()["free_bytes"] == MB
    assert pool.trim() == MB and pool.stats()["segments"] == 1
    del second
    pool.close()
    assert memfds_of(pool) == []


def test_a_private_pool_hands_out_copy_on_write_memory_to_a_forked_child() -> None:
    pool = SegmentPool(16 * MB, "tq-test-private", shared=False)
    array = pool.take(MB)
    array[:] = 1
    pid = os.fork()
    if pid == 0:  # the child writes its copy and leaves
        array[:] = 2
        os._exit(0)
    os.waitpid(pid, 0)
    assert np.all(array == 1) and memfds_of(pool) == []
    del array
    pool.close()


def test_locate_finds_buffers_inside_segments_in_use_only() -> None:
    pool = SegmentPool(0, "tq-test-locate")
    array = pool.take(MB)
    assert pool.locate(array[10:20]) == (1, 10)
    assert pool.locate(np.zeros(100, dtype=np.uint8)) is None  # not pool memory
    segment_id = pool.locate(array)
    del array
    assert segment_id is not None and not pool.is_open(segment_id[0])  # cap 0: closed at once
    pool.close()


def test_a_table_round_trips_and_a_bad_one_is_malformed() -> None:
    table = ShmTable(frames={2: [(1, 0, 5), (3, 64, 7)]}, fds=[1, 3], grant=(4, 1024), forget=[9])
    assert decode_table(encode_table(table)) == table
    with pytest.raises(MalformedMessage, match="shared-memory table that does not decode"):
        decode_table(b"\xc1junk")


def send_and_read(sender: socket.socket, receiver: socket.socket, frames: list, flags: int = 0, fds=()) -> list:
    writer = FrameWriter(frames, flags, fds)
    reader = FrameReader(fds=True)
    got: list = []
    while not got:
        writer.write(sender)
        got, closed = reader.read(receiver)
        assert not closed
    return got[0]


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def test_a_put_is_staged_in_the_grant_and_adopted_a_get_is_described_and_copied_out(pair) -> None:
    unit_sock, client_sock = pair
    pool, client_pool = SegmentPool(64 * MB, "tq-test-unit"), SegmentPool(64 * MB, "tq-test-client")
    unit, client = UnitConnection(pool), ClientMaps(client_pool)
    payload = np.arange(MB, dtype=np.uint8)
    # the first put travels in-band and earns a grant, sent with the write's reply (fd by SCM_RIGHTS)
    frames, flags = client.outgoing([b"env", b"body", payload, b"x" * 10])
    assert flags == SHM_OK and frames[2] is payload
    unit.incoming(frames, flags)
    reply = send_and_read(unit_sock, client_sock, *unit.outgoing([b"head", b"ok"]))
    assert reply.flags == TABLE and len(reply.fds) == 1
    assert not client.incoming(reply, reply.flags, reply.fds, None) and client.grant is not None
    # the second (the same shape) is copied into the grant: only descriptors travel, the unit adopts the memory
    frames, flags = client.outgoing([b"env", b"body", payload, b"x" * 10])
    assert flags == SHM_OK | TABLE and [memoryview(f).nbytes for f in frames[2:4]] == [0, 0]
    adopted = unit.incoming(frames, flags)
    assert np.array_equal(adopted[2], payload) and bytes(adopted[3]) == b"x" * 10
    assert pool.locate(adopted[2]) is not None and client.grant is None
    reply = send_and_read(unit_sock, client_sock, *unit.outgoing([b"head", b"ok"]))  # a fresh grant: a new segment
    assert not client.incoming(reply, reply.flags, reply.fds, None) and client.grant is not None
    assert len(client.maps) == 2 and pool.stats()["created"] == 2
    # a get of the adopted block: described, its segment already mapped (no fd), copied into ``into``
    into = {2: np.empty(MB, dtype=np.uint8)}
    out = send_and_read(unit_sock, client_sock, *unit.outgoing([b"head", b"read", adopted[2]]))
    assert out.fds == [] and memoryview(out[2]).nbytes == 0
    assert client.incoming(out, out.flags, out.fds, into) and out[2] is into[2]
    assert np.array_equal(into[2], payload) and len(unit.pins) == 1
    unit.incoming([b"env", b"next"], SHM_OK)  # the next message releases the pin
    assert unit.pins == []
    client.close()
    unit.close()
    pool.close()
    client_pool.close()


def test_a_descriptor_outside_the_grant_or_without_one_is_refused() -> None:
    pool = SegmentPool(64 * MB, "tq-test-refuse")
    unit = UnitConnection(pool)
    staged = [b"env", b"body", b"", encode_table(ShmTable(frames={2: [(1, 0, 10)]}))]
    with pytest.raises(MalformedMessage, match="this connection holds no grant"):
        unit.incoming(list(staged), SHM_OK | TABLE)
    unit.incoming([b"env", b"body", np.zeros(MIN_SHM_BYTES, dtype=np.uint8)], SHM_OK)
    unit.outgoing([b"head", b"ok"])
    assert unit.grant is not None
    beyond = encode_table(ShmTable(frames={2: [(unit.grant_id, 0, unit.grant.nbytes + 1)]}))
    with pytest.raises(MalformedMessage, match=r"the grant is \d+ bytes of segment"):
        unit.incoming([b"env", b"body", b"", beyond], SHM_OK | TABLE)
    unit.close()
    pool.close()


def test_a_gathered_frame_of_no_buffers_goes_out_as_it_is() -> None:
    """A read of blocks whose field holds no bytes (an empty gather: GatheredFrame([])) is answered on the socket
    (before: the unit took the frame itself for its one view, and memoryview() of it raised TypeError)."""
    pool = SegmentPool(64 * MB, "tq-test-empty-gather")
    unit = UnitConnection(pool)
    empty = GatheredFrame([])
    frames, flags, fds = unit.outgoing([b"head", b"read", empty])
    assert frames[2] is empty and (flags, fds) == (0, [])
    unit.close()
    pool.close()


def test_a_closed_segment_is_forgotten_by_the_client_with_the_next_reply(pair) -> None:
    unit_sock, client_sock = pair
    pool = SegmentPool(0, "tq-test-forget")  # nothing kept free: a freed segment is closed at once
    unit, client = UnitConnection(pool), ClientMaps()
    block = pool.take(MB)
    block[:] = 7
    reply = send_and_read(unit_sock, client_sock, *unit.outgoing([b"h", b"r", block]))
    client.incoming(reply, reply.flags, reply.fds, None)
    assert np.all(reply[2] == 7) and len(client.maps) == 1
    del block
    unit.release()  # the block's last view: its segment closes
    reply = send_and_read(unit_sock, client_sock, *unit.outgoing([b"h", b"r", np.zeros(MB, dtype=np.uint8)]))
    client.incoming(reply, reply.flags, reply.fds, None)
    assert client.maps == {} and memfds_of(pool) == []


def test_release_is_a_frameless_message_and_other_flags_with_it_are_a_violation(pair) -> None:
    a, b = pair
    a.send(RELEASE_MESSAGE)
    reader = FrameReader()
    (message,), closed = reader.read(b)
    assert list(message) == [] and message.flags and not closed
    a.send((1 << 29 | 1).to_bytes(4, "little"))  # RELEASE with a frame count
    with pytest.raises(ProtocolViolation, match="a RELEASE message has no frames"):
        reader.read(b)


def test_fds_that_come_with_a_message_are_received_once(pair) -> None:
    a, b = pair
    r, w = os.pipe()
    try:
        message = send_and_read(a, b, [b"x"], 0, [os.dup(w)])  # the writer owns (and closes) what it sends
        assert len(message.fds) == 1
        os.write(message.fds[0], b"!")
        assert os.read(r, 1) == b"!"
        os.close(message.fds[0])
    finally:
        os.close(r)
        os.close(w)


def test_the_config_keys_are_checked_and_the_environment_sets_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from transfer_queue.config import SHARED_MEMORY_ENV, QueueConfig
    from transfer_queue.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=r"shared_memory must be a bool, got 'yes'"):
        QueueConfig(global_batch_size=1, shared_memory="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match=r"shared_memory_pool_bytes must be an int >= 0, got -1"):
        QueueConfig(global_batch_size=1, shared_memory_pool_bytes=-1)
    monkeypatch.setenv(SHARED_MEMORY_ENV, "0")
    assert QueueConfig(global_batch_size=1).shared_memory_bytes == 0
    monkeypatch.setenv(SHARED_MEMORY_ENV, "1")
    config = QueueConfig(global_batch_size=1)
    assert config.shared_memory and config.shared_memory_bytes == 1 << 30
    assert QueueConfig.from_dict({**config.to_dict(), "shared_memory": False}).shared_memory is False
    monkeypatch.setenv(SHARED_MEMORY_ENV, "maybe")
    with pytest.raises(InvalidRequest, match=r"TRANSFER_QUEUE_SHARED_MEMORY must be 0 or 1, got 'maybe'"):
        QueueConfig(global_batch_size=1)


def test_grants_outstanding_are_bounded_by_the_pool_cap() -> None:
    """Each connection that puts holds a grant; together they stay within the cap (beyond it: the socket)."""
    pool = SegmentPool(5 * MB // 2, "tq-test-grants")  # room for two grants of 1 MiB
    connections = [UnitConnection(pool) for _ in range(3)]
    for connection in connections:
        connection.incoming([b"env", b"body", np.zeros(MB, dtype=np.uint8)], SHM_OK)
        connection.outgoing([b"head", b"ok"])
    assert [c.grant is not None for c in connections] == [True, True, False]
    assert pool.stats()["granted_bytes"] == 2 * MB
    connections[0].close()
    assert pool.stats()["granted_bytes"] == MB
    connections[2].incoming([b"env", b"body", np.zeros(MB, dtype=np.uint8)], SHM_OK)
    connections[2].outgoing([b"head", b"ok"])
    assert connections[2].grant is not None and pool.stats()["granted_bytes"] == 2 * MB
    for connection in connections:
        connection.close()
    pool.close()


def test_a_buffer_collected_by_a_gc_pass_inside_the_pools_lock_does_not_deadlock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cyclic-GC pass may run on any allocation, including those a pool makes under its lock; a pooled buffer
    whose last reference is in a cycle is then finalized on the thread that holds the lock."""
    import threading

    from transfer_queue.wire import shm

    pool = SegmentPool(16 * MB, "tq-test-gc", shared=False)

    class Holder:
        pass

    holder = Holder()
    holder.me = holder  # type: ignore[attr-defined]
    holder.data = pool.take(MB)  # type: ignore[attr-defined]
    del holder
    real = shm.segment_size
    monkeypatch.setattr(shm, "segment_size", lambda n: (gc.collect(), real(n))[1])  # a GC pass under the lock
    done, taken = threading.Event(), list[np.ndarray]()

    def take() -> None:
        taken.append(pool.take(2 * MB))
        done.set()

    threading.Thread(target=take, daemon=True).start()
    assert done.wait(30), "take() hung: the finalizer waited for the lock its own thread holds"
    monkeypatch.undo()
    assert pool.stats()["free_bytes"] == MB  # the collected buffer is back in the pool
    taken.clear()
    pool.close()


def test_after_a_large_put_small_puts_neither_hold_its_grant_nor_keep_a_large_grant(pair) -> None:
    """A staged put far smaller than its grant is copied into a right-sized segment, and the next grant is sized
    from what was staged: a 64 KiB put after a 16 MiB one does not hold a 16 MiB segment as its block."""
    unit_sock, client_sock = pair
    pool = SegmentPool(1 << 30, "tq-test-amp")
    unit, client = UnitConnection(pool), ClientMaps()

    def put(payload: np.ndarray) -> Any:
        frames, flags = client.outgoing([b"env", b"body", payload])
        block = unit.incoming(frames, flags)[2]
        reply = send_and_read(unit_sock, client_sock, *unit.outgoing([b"head", b"ok"]))
        client.incoming(reply, reply.flags, reply.fds, None)
        return block, flags

    put(np.ones(16 * MB, dtype=np.uint8))  # in-band: earns a 16 MiB grant
    assert client.grant is not None and client.grant[1] == 16 * MB
    small = np.full(MIN_SHM_BYTES, 5, dtype=np.uint8)
    blocks = []
    for _ in range(4):
        block, flags = put(small)
        assert flags & TABLE and np.array_equal(block, small)
        blocks.append(block)
    assert client.grant is not None and client.grant[1] == MIN_SHM_BYTES
    held = [pool.segments[where[0]].size for where in map(pool.locate, blocks) if where is not None]
    assert held == [segment_size(MIN_SHM_BYTES)] * 4
    client.close()
    unit.close()
    del blocks, block
    pool.close()


def test_a_queued_reply_sends_its_segment_even_if_the_segment_closed_and_its_fd_number_was_reused(pair) -> None:
    """A reply waits in the outbox behind a full socket; meanwhile its pins go and the segment closes (cap 0). The
    fd the client receives is still that segment's, not whatever file reused the closed fd's number."""
    unit_sock, client_sock = pair
    pool = SegmentPool(0, "tq-test-fdreuse")
    unit = UnitConnection(pool)
    block = pool.take(MB)
    frames, flags, fds = unit.outgoing([b"head", b"read", block])
    writer = FrameWriter(frames, flags, fds)  # queued, not written yet
    name = os.readlink(f"/proc/self/fd/{pool.fd(1)}")
    unit.release()
    del block  # the segment closes (cap 0): its fd number is free
    assert not pool.is_open(1)
    victim = os.memfd_create("tq-test-victim")
    try:
        reader, got = FrameReader(fds=True), []
        while not got:
            writer.write(unit_sock)
            got, _ = reader.read(client_sock)
        assert [os.readlink(f"/proc/self/fd/{fd}") for fd in got[0].fds] == [name]
        for fd in got[0].fds:
            os.close(fd)
    finally:
        os.close(victim)
    pool.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shm_client_pair() -> tuple[socket.socket, socket.socket]:
    from transfer_queue.wire.unix_socket import ShmSocket

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = ShmSocket(fileno=b.detach())
    client.shm = ClientMaps()
    client.setblocking(False)
    a.setblocking(False)
    return a, client


def memfds(n: int, size: int) -> list[int]:
    fds = [os.memfd_create("tq-test-leak") for _ in range(n)]
    for fd in fds:
        os.ftruncate(fd, size)
    return fds


@pytest.mark.parametrize(
    "table, flags",
    [(b"\xc1junk", TABLE), (encode_table(ShmTable(fds=[1, 2, 3])), 0), (encode_table(ShmTable(fds=[1, 2])), TABLE)],
    ids=["undecodable", "no-table-flag", "fewer-named-than-carried"],
)
def test_a_reply_that_is_refused_closes_every_fd_it_carried(table: bytes, flags: int) -> None:
    from transfer_queue.wire.unix_socket import exchange

    server, client = shm_client_pair()
    FrameWriter([b"head", b"ok", table], flags, memfds(3, 4096)).write(server)  # the writer closes its fds
    before = open_fds()
    exchange([(client, [b"env", b"body"])], 5.0)
    assert open_fds() == before
    client.close()
    server.close()


def test_a_segment_fd_that_does_not_map_is_malformed_and_every_fd_is_closed() -> None:
    fds = memfds(3, 0)  # empty: mmap refuses it
    before = open_fds()
    message = [b"head", b"ok", encode_table(ShmTable(fds=[1, 2, 3]))]
    with pytest.raises(MalformedMessage, match="segment 1's fd of a reply does not map"):
        ClientMaps().incoming(message, TABLE, fds, None)
    assert open_fds() == before - 3


def test_fds_that_came_with_a_reply_cut_short_by_the_deadline_are_closed() -> None:
    import array
    import struct

    from transfer_queue.wire.unix_socket import exchange

    server, client = shm_client_pair()
    fds = memfds(2, 4096)
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
    server.sendmsg([struct.pack("<I", 3 | TABLE)], rights)  # a header's first word, then nothing
    for fd in fds:
        os.close(fd)
    before = open_fds()
    replies, failed = exchange([(client, [b"env", b"body"])], 0.2)
    assert replies == [None] and failed == [0]
    assert open_fds() == before
    client.close()
    server.close()


def test_a_unit_segment_holds_one_fd_not_the_mmaps_dup_and_ours() -> None:
    pool = SegmentPool(1 << 30, "tq-test-onefd")
    before = open_fds()
    blocks = [pool.take(MIN_SHM_BYTES) for _ in range(20)]
    assert open_fds() - before == 20
    segment = pool.segments[1]
    assert os.readlink(f"/proc/self/fd/{pool.fd(1)}") == f"/memfd:{pool.name}-1 (deleted)"
    assert np.frombuffer(os.pread(pool.fd(1), 4, 0), dtype=np.uint8).tolist() == [0, 0, 0, 0]
    blocks[0][:4] = 9  # the fd and the mapping are the same memory
    assert os.pread(pool.fd(1), 4, 0) == b"\t" * 4 and segment.mmap[:4] == b"\t" * 4
    del blocks, segment
    pool.close()
    assert open_fds() == before


def test_a_reply_whose_shared_memory_part_fails_goes_in_band(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply that would grant a segment when no fd or memory is left (EMFILE from memfd_create) is not lost: it
    goes over the socket, and nothing of it stays pinned or granted."""
    import errno

    from transfer_queue.wire.unix_socket import UnixServer, connect

    pool = SegmentPool(64 * MB, "tq-test-fallback")
    server = UnixServer(str(tmp_path / "unit.sock"), pool=pool)
    client = connect(str(tmp_path / "unit.sock"), b"", 5.0, ClientMaps())
    block = pool.take(MB)
    block[:] = 7
    writer, got = FrameWriter([b"env", b"body", np.zeros(MB, dtype=np.uint8)], SHM_OK), []  # earns a grant
    while not got:
        writer.write(client)
        for fd in server.fds():
            got += server.on_ready(fd)
    ((fd, _),) = got

    def no_fds_left(nbytes: int) -> np.ndarray:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(pool, "take", no_fds_left)
    assert server.reply(fd, [b"head", b"read", block])
    reader, replies = FrameReader(fds=True), []
    while not replies:
        server.on_writable(fd)
        replies, closed = reader.read(client)
        assert not closed
    reply = replies[0]
    assert reply.flags == 0 and reply.fds == [] and np.array_equal(reply[2], block)
    conn = server.connections[fd].shm
    assert conn is not None and conn.pins == [] and conn.grant is None and pool.stats()["granted_bytes"] == 0
    monkeypatch.undo()
    client.close()
    server.close()
    del block


def test_a_read_over_more_unseen_segments_than_one_message_carries_sends_what_it_can_and_the_next_read_uses_them(
    pair,
) -> None:
    """65 blocks in 65 segments, none seen by the client: the first read goes in-band but sends 64 fds with it; the
    second is described, with the one fd left."""
    unit_sock, client_sock = pair
    pool = SegmentPool(1 << 30, "tq-test-maxfds")
    unit, client = UnitConnection(pool), ClientMaps()
    blocks = [pool.take(MIN_SHM_BYTES) for _ in range(65)]
    for k, block in enumerate(blocks):
        block[:] = k
    expected = np.concatenate(blocks)

    frame = GatheredFrame(blocks)

    def read() -> Any:
        reply = send_and_read(unit_sock, client_sock, *unit.outgoing([b"head", b"read", frame]))
        described = client.incoming(reply, reply.flags, reply.fds, None)
        unit.incoming([b"env", b"next"], SHM_OK)
        return reply, described

    first, described = read()
    assert not described and len(first.fds) == 64 and np.array_equal(first[2], expected)
    second, described = read()
    assert described and len(second.fds) == 1 and np.array_equal(second[2], expected)
    assert len(client.maps) == 65
    client.close()
    unit.close()
    del block
    pool.close()


def test_a_put_the_units_pool_cannot_take_now_is_read_into_plain_buffers(pair) -> None:
    """No fd or memory for a new segment (EMFILE from memfd_create): the message is still read, not the
    connection dropped."""
    import errno

    def no_fds_left(nbytes: int) -> np.ndarray:
        raise OSError(errno.EMFILE, "Too many open files")

    sender, receiver = pair
    payload = np.arange(MB, dtype=np.uint8)
    writer, reader, got = FrameWriter([b"env", b"body", payload], SHM_OK), FrameReader(allocate=no_fds_left), []
    while not got:
        writer.write(sender)
        got, closed = reader.read(receiver)
        assert not closed
    assert np.array_equal(got[0][2], payload)


def test_a_small_staged_put_adopts_its_grant_when_no_right_sized_segment_can_be_made(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    unit_sock, client_sock = pair
    pool = SegmentPool(1 << 30, "tq-test-amp-emfile")
    unit, client = UnitConnection(pool), ClientMaps()
    unit.incoming(*client.outgoing([b"env", b"body", np.ones(4 * MB, dtype=np.uint8)]))
    reply = send_and_read(unit_sock, client_sock, *unit.outgoing([b"head", b"ok"]))
    client.incoming(reply, reply.flags, reply.fds, None)

    def no_fds_left(nbytes: int) -> np.ndarray:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(pool, "take", no_fds_left)
    small = np.full(MIN_SHM_BYTES, 3, dtype=np.uint8)
    frames, flags = client.outgoing([b"env", b"body", small])
    block = unit.incoming(frames, flags)[2]
    assert flags & TABLE and np.array_equal(block, small) and pool.locate(block) is not None
    monkeypatch.undo()
    client.close()
    unit.close()
    del block
    pool.close()


class CountingCopier:
    """Stands in for the shared copy threads: counts the shares handed to them (and still copies them)."""

    def __init__(self) -> None:
        self.real = shm._copier.executor(2)
        self.shares: list[int] = []

    def executor(self, threads: int) -> Any:
        outer = self

        class Counting:
            def submit(self, fn: Any, pairs: Any) -> Any:
                outer.shares.append(sum(target.nbytes for target, _ in pairs))
                return outer.real.submit(fn, pairs)

        return Counting()


def test_a_large_copy_is_split_by_bytes_over_the_threads_and_every_byte_lands(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingCopier()
    monkeypatch.setattr(shm, "_copier", counting)
    monkeypatch.setattr(shm, "PARALLEL_COPY_BYTES", 4 * MB)
    PARALLEL_COPY_BYTES = shm.PARALLEL_COPY_BYTES
    rng = np.random.default_rng(0)
    sizes = [PARALLEL_COPY_BYTES // 3 + 17, 5, PARALLEL_COPY_BYTES // 2 - 3, 1, PARALLEL_COPY_BYTES // 5]
    sources = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    targets = [np.zeros(n, dtype=np.uint8) for n in sizes]
    copy_pairs(list(zip(targets, sources, strict=True)), threads=3)
    assert all(np.array_equal(t, s) for t, s in zip(targets, sources, strict=True))
    total = sum(sizes)
    assert len(counting.shares) == 2 and all(abs(n - total / 3) <= 2 for n in counting.shares)  # this thread: the rest
    counting.shares.clear()
    small = [(np.zeros(1000, np.uint8), np.ones(1000, np.uint8))]
    copy_pairs(small, threads=3)  # below PARALLEL_COPY_BYTES: copied here, no hand-off
    assert counting.shares == [] and small[0][0].sum() == 1000


def test_a_share_that_fails_is_raised_once_every_other_share_is_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "PARALLEL_COPY_BYTES", 4 * MB)
    n = 2 * MB
    source = np.full(n, 7, dtype=np.uint8)
    writable, readonly = np.zeros(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copy_pairs([(writable, source), (readonly, source)], threads=2)  # the read-only half is the other thread's
    assert np.array_equal(writable, source)  # the other share finished before the error came back


def test_a_large_get_is_copied_out_over_the_threads(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    unit_sock, client_sock = pair
    counting = CountingCopier()
    monkeypatch.setattr(shm, "_copier", counting)
    monkeypatch.setattr(shm, "COPY_THREADS", 2)
    monkeypatch.setattr(shm, "PARALLEL_COPY_BYTES", 8 * MB)
    pool, client_pool = SegmentPool(64 * MB, "tq-test-unit"), SegmentPool(64 * MB, "tq-test-client")
    unit, client = UnitConnection(pool), ClientMaps(client_pool)
    blocks = [pool.take(6 * MB), pool.take(5 * MB + 3)]
    for i, block in enumerate(blocks):
        block[:] = np.arange(block.nbytes, dtype=np.int64).astype(np.uint8) + i
    reply = send_and_read(unit_sock, client_sock, *unit.outgoing([b"head", b"read", *blocks]))
    into = {3: np.empty(blocks[1].nbytes, dtype=np.uint8)}
    assert client.incoming(reply, reply.flags, reply.fds, into) and reply[3] is into[3]
    assert np.array_equal(reply[2], blocks[0]) and np.array_equal(reply[3], blocks[1])
    assert len(counting.shares) == 1 and counting.shares[0] == (11 * MB + 3) // 2  # this thread copied the other half
    del blocks, into
    reply.clear()
    client.close()
    unit.close()
    pool.close()
    client_pool.close()


def test_the_copy_threads_come_from_the_environment_and_a_bad_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRANSFER_QUEUE_COPY_THREADS", "3")
    assert shm.copy_threads_default() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("TRANSFER_QUEUE_COPY_THREADS", bad)
        with pytest.raises(InvalidRequest, match=f"TRANSFER_QUEUE_COPY_THREADS must be an int >= 1, got '{bad}'"):
            shm.copy_threads_default()
    monkeypatch.delenv("TRANSFER_QUEUE_COPY_THREADS")
    assert 1 <= shm.copy_threads_default() <= 4


# ---- reads to a GPU: straight from the unit's segments (the CUDA calls stood in for: the logic runs on any host) --
@pytest.fixture
def cuda_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Stand-ins for shm's CUDA calls: page-locking answers ``calls["error"]`` (0: done) and is recorded as
    ``("lock", address, bytes)``, unlocking as ``("unlock", address, 0)``; the DMA copies on the CPU and records
    each piece's length in ``calls["copied"]``."""
    calls: dict[str, Any] = {"log": [], "copied": [], "error": 0}

    def register(address: int, nbytes: int) -> int:
        calls["log"].append(("lock", address, nbytes))
        return calls["error"]

    def copy_to_devices(pieces: list[Any]) -> None:
        for target, mapped, offset, length in pieces:
            target.copy_(torch.frombuffer(mapped, dtype=torch.uint8, count=length, offset=offset))
            calls["copied"].append(length)

    monkeypatch.setattr(shm, "_cuda_register", register)
    monkeypatch.setattr(shm, "_cuda_unregister", lambda address: calls["log"].append(("unlock", address, 0)))
    monkeypatch.setattr(shm, "_copy_to_devices", copy_to_devices)
    return calls


def read_for_a_gpu(unit_sock: Any, client_sock: Any, unit: UnitConnection, client: ClientMaps, payload: Any) -> Any:
    """One read of ``payload`` (a block in the unit's pool) into a target naming a stand-in GPU buffer; returns
    (the frame as resolved, the host target, the device buffer)."""
    device = torch.zeros(payload.nbytes, dtype=torch.uint8)
    target = shm.device_target(np.zeros(payload.nbytes, dtype=np.uint8), device)
    out = send_and_read(unit_sock, client_sock, *unit.outgoing([b"head", b"read", payload]))
    assert client.incoming(out, out.flags, out.fds, {2: target})
    unit.incoming([b"env", b"next"], SHM_OK)  # the client's release
    return out[2], target, device


@pytest.mark.parametrize("locked", [True, False], ids=["page-locked", "driver-refuses"])
def test_a_frame_for_a_gpu_goes_from_the_segment_to_the_device_buffer_or_through_host_memory(
    pair, cuda_calls: dict[str, Any], locked: bool
) -> None:
    """A described frame whose target names a device buffer is copied from the mapped segment into that buffer (the
    segment page-locked once, for every read after), and the buffer takes the frame's place; where the driver
    refuses to page-lock, the frame is copied into the host array as before. Unmapping unlocks first."""
    cuda_calls["error"] = 0 if locked else 1
    pool = SegmentPool(64 * MB, "tq-test-dma")
    unit, client = UnitConnection(pool), ClientMaps(None)
    payload = pool.take(MB)
    payload[:] = np.arange(MB, dtype=np.uint8) * 7
    for _ in range(2):
        frame, target, device = read_for_a_gpu(*pair, unit, client, payload)
        if locked:
            assert frame is device and np.array_equal(device.numpy(), payload) and not target.any()
        else:
            assert frame is target and np.array_equal(target, payload) and not device.any()
    segment = pool.locate(payload)[0]
    ((_, address, nbytes),) = cuda_calls["log"]  # once: the second read found it registered (or refused)
    assert nbytes == len(client.maps[segment]) and address
    assert cuda_calls["copied"] == ([MB, MB] if locked else [])
    client.close()
    assert cuda_calls["log"][1:] == ([("unlock", address, 0)] if locked else [])  # unlocked before it is unmapped
    assert client.registered == {} and client.maps == {}
    unit.close()
    del payload
    pool.close()


def test_a_connection_dropped_unclosed_unlocks_its_page_locked_segments(pair, cuda_calls: dict[str, Any]) -> None:
    pool = SegmentPool(64 * MB, "tq-test-dma-drop")
    unit, client = UnitConnection(pool), ClientMaps(None)
    payload = pool.take(MB)
    read_for_a_gpu(*pair, unit, client, payload)
    ((_, address, _),) = cuda_calls["log"]
    del client  # no close(): a socket its thread dropped
    gc.collect()
    assert cuda_calls["log"][1:] == [("unlock", address, 0)]
    unit.close()
    del payload
    pool.close()
