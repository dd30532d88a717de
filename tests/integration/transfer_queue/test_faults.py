"""Faults and concurrency on a live queue: a storage unit that dies, a client killed in the middle of a put, hostile
frames on the sockets, many producer and consumer processes on one partition, and a waiting reader that must not
stall anybody else."""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import pytest
import ray
import torch
import zmq
from tensordict import TensorDict

from transfer_queue import StorageUnit, TransferQueueClient, TransferQueueController
from transfer_queue.errors import GetMetaTimeout, PartitionOverfilled, StorageUnavailable, StorageUnitDown
from transfer_queue.metadata import FieldSchema
from transfer_queue.wire import protocol as p
from transfer_queue.wire.auth import secure_client

# Remote functions defined here run in Ray workers, which cannot import this file: pickle them by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

X = FieldSchema("dense", "float32", (256,))


class RawPeer:
    """A bare DEALER socket speaking (or abusing) the wire format to one server."""

    def __init__(self, endpoint: p.Endpoint, session_id: str, secret: bytes = b""):
        self.session_id = session_id
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_client(self.sock, secret)  # an authenticated peer (b"": a stranger, refused before any frame is read)
        self.sock.connect(endpoint.tcp)
        self.ids = iter(range(1000, 10**9))

    def envelope(self, session_id: str | None = None) -> tuple[bytes, int]:
        request_id = next(self.ids)
        return p.encode(p.Envelope(p.PROTOCOL_VERSION, session_id or self.session_id, request_id)), request_id

    def send(self, *frames: Any) -> None:
        self.sock.send_multipart(list(frames))

    def reply(self, timeout: float = 15.0) -> tuple[p.ReplyHeader, list[bytes]] | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        frames = self.sock.recv_multipart()
        return p.decode_reply_header(frames[0]), frames[1:]

    def call(self, body: Any, *buffers: Any) -> tuple[p.ReplyHeader, list[bytes]]:
        envelope, request_id = self.envelope()
        self.send(envelope, p.encode(body), *buffers)
        answer = self.reply()
        assert answer is not None, f"no reply to {type(body).__name__}"
        assert answer[0].request_id == request_id
        return answer

    def close(self) -> None:
        self.sock.close()


def values_of(client: TransferQueueClient, meta: Any, name: str = "x") -> list[float]:
    return client.get_data(meta)[name][:, 0].tolist()


def is_dead(actor: Any, pid: int) -> bool:
    """Ray calls the actor dead, and its process is gone (Ray may report the death a moment before the process
    exits, and until then the unit's socket threads still answer)."""
    try:
        ray.get(actor.stats.remote(), timeout=10)
        return False
    except ray.exceptions.RayActorError:
        pass
    except ray.exceptions.GetTimeoutError:
        return False
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ---- a storage unit dies ---------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_dead_storage_unit_gives_storage_unavailable_not_a_hang(
    ray_session: Any, wait_until: Callable[..., Any]
) -> None:
    units = [StorageUnit.remote(i, 2) for i in range(2)]
    controller = TransferQueueController.remote(8, num_global_batch=2, default_timeout=3.0, storage_units=units)
    client = TransferQueueClient("survivor", ray.get(controller.get_info.remote()))
    try:
        # Small puts go to the units in turn: one batch on each unit.
        on_unit = {}
        for value in (1.0, 2.0):
            meta = client.put(TensorDict({"x": torch.full((2, 256), value)}, batch_size=[2]), partition_id="p")
            on_unit[int(meta.blocks[0, 0]) % 2] = (meta, value)
        assert sorted(on_unit) == [0, 1]
        pid = ray.get(units[0].stats.remote())["pid"]
        ray.kill(units[0])
        wait_until(lambda: is_dead(units[0], pid), 60, what="storage unit 0 to die")  # ray.kill does not wait
        (dead, _), (alive, alive_value) = on_unit[0], on_unit[1]
        started = time.monotonic()
        with pytest.raises(
            StorageUnavailable, match=r"storage units \[0\] did not answer.*a storage unit may have died"
        ):
            client.get_data(dead)
        assert time.monotonic() - started < 3.0 + 30  # the reader's timeout, plus slack for a loaded machine
        assert values_of(client, alive) == [alive_value] * 2  # the other unit still serves
        # Writers: once the controller has seen the unit go, puts are placed on the live unit only (defect 10).
        wait_until(
            lambda: ray.get(controller.server_stats.remote())["storage_units_down"] == [0], 30, what="unit 0 down"
        )
        # Ray's view too: the controller's watcher finds the actor dead, and says so for good.
        wait_until(
            lambda: "its Ray actor died" in ray.get(controller.server_stats.remote())["storage_units_down_reasons"][0],
            30,
            what="the watcher to see the actor dead",
        )
        for value in (3.0, 4.0):
            meta = client.put(TensorDict({"x": torch.full((2, 256), value)}, batch_size=[2]), partition_id="p")
            assert set((meta.blocks[:, 0] % 2).tolist()) == {1}
        # The client now knows (every controller reply says which units are down): reads of unit 0's rows fail at once.
        with pytest.raises(StorageUnitDown, match=r"storage unit 0 is down \(its Ray actor died.*\): it held rows"):
            client.get_data(dead, timeout=60.0)
        status = client.get_production_status(partition_id="p")
        assert status["rows"] == 8 and status["rows_in_flight"] == 0
        # The controller keeps serving: metadata of every committed row, reads from the live unit.
        meta = client.get_meta(["x"], 8, partition_id="p", task_name="t")
        assert len(meta) == 8
        live = meta.select_samples(np.flatnonzero(meta.blocks[:, 0] % 2 == 1))
        assert sorted(values_of(client, live)) == sorted([alive_value] * 2 + [3.0] * 2 + [4.0] * 2)
        client.clear(partition_id="p")  # answered even though one unit cannot acknowledge the drop
        assert "p" not in client.list_partitions()
    finally:
        client.close()
        ray.get(controller.shutdown.remote())
        ray.kill(controller)
        ray.kill(units[1])


# ---- a client killed in the middle of a put ----------------------------------------------------------------------
HALF_A_PUT = """
import os, pickle, signal, sys
import numpy as np
import zmq
from transfer_queue.wire import protocol as p
from transfer_queue.wire.auth import secure_client
from transfer_queue.metadata import FieldSchema

info, step = pickle.load(sys.stdin.buffer)
X = FieldSchema("dense", "float32", (256,))
sock = zmq.Context.instance().socket(zmq.DEALER)
secure_client(sock, info.secret)
ids = iter(range(1, 100))

def call(endpoint, body, *buffers):
    sock.connect(endpoint.tcp)
    request_id = next(ids)
    envelope = p.Envelope(p.PROTOCOL_VERSION, info.session_id, request_id)
    sock.send_multipart([p.encode(envelope), p.encode(body), *buffers])
    header, *rest = sock.recv_multipart()
    header = p.decode_reply_header(header)
    assert header.error_type is None, header
    sock.disconnect(endpoint.tcp)
    return rest[0]

payload = np.full((8, 256), 7.0, dtype=np.float32)
reserve = p.Reserve(step, 8, {"x": X}, payload.nbytes, timeout=8.0)
reservation = p.decode_as(call(info.controller, reserve), p.Reservation)
for place in reservation.placements:
    rows = place.stop - place.start
    spec = [p.ColumnSpec("x", X, rows, 1)]
    write = p.Write(reservation.partition_uid, place.block_id, rows, spec, place.max_bytes, place.token)
    call(info.storage_units[place.unit], write, payload[place.start : place.stop].tobytes())
print(reservation.put_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # dies between the write and the commit
"""


@pytest.mark.timeout(180)
def test_client_killed_mid_put_leaves_nothing_visible(fast_queue: Any, wait_until: Callable[..., Any]) -> None:
    client, step = fast_queue.client, fast_queue.step()
    bytes_before = fast_queue.storage_bytes()
    got: dict[str, Any] = {}
    reader = threading.Thread(
        target=lambda: got.update(
            meta=fast_queue.new_client("reader").get_meta(["x"], 8, global_step=step, task_name="t", timeout=60)
        )
    )
    reader.start()
    child = subprocess.run(
        [sys.executable, "-c", HALF_A_PUT],
        input=pickle.dumps((fast_queue.info, step)),
        capture_output=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-3000:]
    put_id = int(child.stdout.decode().split()[-1])
    # Its bytes sit in storage, its rows are reserved, and nothing is visible: the reader still waits.
    assert fast_queue.storage_bytes() == bytes_before + 8 * 256 * 4
    assert reader.is_alive() and "meta" not in got
    with pytest.raises(PartitionOverfilled, match="8 are already taken"):
        client.put(TensorDict({"x": torch.ones(8, 256)}, batch_size=[8]), global_step=step)
    # At its deadline (its timeout 8 s + put_grace 1 s) the controller aborts it: rows freed, bytes dropped.
    status = fast_queue.watcher.get_production_status
    wait_until(lambda: status(global_step=step)["rows_in_flight"] == 0, 30, what="the abort")
    wait_until(lambda: fast_queue.storage_bytes() == bytes_before, 30, what="the storage units to drop its bytes")
    assert status(global_step=step)["rows"] == 0
    # A late commit of the dead put is refused.
    peer = RawPeer(fast_queue.info.controller, fast_queue.info.session_id, fast_queue.info.secret)
    header, _ = peer.call(p.Commit(put_id))
    peer.close()
    assert header.error_type == "PutExpired" and "none of its rows are visible" in (header.error_message or "")
    # The freed rows take a new put, and the waiting reader is served from it: never the dead put's bytes.
    client.put(TensorDict({"x": torch.ones(8, 256)}, batch_size=[8]), global_step=step)
    reader.join(timeout=30)
    meta = got["meta"]
    assert sorted(meta.global_indexes.tolist()) == list(range(step * 8, step * 8 + 8))
    assert values_of(client, meta) == [1.0] * 8


# ---- hostile frames ----------------------------------------------------------------------------------------------
def test_hostile_frames_get_an_error_or_are_dropped(queue: Any) -> None:
    info, client, partition = queue.info, queue.client, queue.partition()
    client.put(TensorDict({"x": torch.full((4, 256), 5.0)}, batch_size=[4]), partition_id=partition)
    good = client.get_meta(["x"], 4, partition_id=partition, task_name="before")
    storage_unit = int(good.blocks[0, 0]) % len(info.storage_units)
    targets = {"controller": info.controller, "storage": info.storage_units[storage_unit]}

    def still_serving() -> None:
        fresh = queue.partition()
        client.put(TensorDict({"x": torch.full((2, 256), 9.0)}, batch_size=[2]), partition_id=fresh)
        assert values_of(client, client.get_meta(["x"], 2, partition_id=fresh, task_name="t")) == [9.0, 9.0]
        assert values_of(client, good) == [5.0] * 4

    for name, endpoint in targets.items():
        peer = RawPeer(endpoint, info.session_id, info.secret)
        # Too few frames to hold an envelope: dropped without an answer.
        peer.send(b"garbage")
        assert peer.reply(timeout=0.5) is None
        # Garbage where the envelope should be; a truncated envelope.
        for envelope in (b"\xff\x00garbage", p.encode(p.Envelope(p.PROTOCOL_VERSION, info.session_id, 3))[:-2]):
            peer.send(envelope, p.encode(p.Hello("x")))
            answer = peer.reply()
            assert answer is not None and answer[0].error_type == "MalformedMessage", (name, answer)
        # A valid envelope and a garbage body.
        for body in (b"\x00\x01\x02", p.encode({"kind": "nothing"}), p.encode(["write", 1, 2]), b""):
            envelope, request_id = peer.envelope()
            peer.send(envelope, body)
            header, _ = peer.reply() or pytest.fail(f"{name}: no reply to a garbage body")
            assert header.request_id == request_id and header.error_type == "MalformedMessage", (name, header)
        # The wrong session.
        envelope, request_id = peer.envelope(session_id="f" * 32)
        peer.send(envelope, p.encode(p.Hello("x") if name == "controller" else p.StorageStats()))
        header, _ = peer.reply() or pytest.fail(f"{name}: no reply to a wrong session")
        assert header.error_type == "SessionMismatch" and "another session" in (header.error_message or ""), name
        assert "f" * 32 not in header.error_message and info.session_id not in header.error_message, (name, header)
        # Another protocol version.
        peer.send(p.encode(p.Envelope(99, info.session_id, 5)), p.encode(p.Hello("x")))
        header, _ = peer.reply() or pytest.fail(f"{name}: no reply to another protocol version")
        assert header.error_type == "ProtocolMismatch" and "speaks protocol 99" in (header.error_message or "")
        # A body of the other server's protocol.
        other = p.StorageStats() if name == "controller" else p.ListPartitions()
        assert peer.call(other)[0].error_type == "MalformedMessage"
        still_serving()
        peer.close()

    controller = RawPeer(info.controller, info.session_id, info.secret)
    # Huge claimed sizes: refused before anything is allocated.
    for reserve, error in (
        (p.Reserve(partition, 10**12, {"x": X}, 10**6, timeout=1.0), "InvalidRequest"),
        (p.Reserve(partition, 4, {"x": X}, 10**18, timeout=1.0), "QueueFull"),
        (p.Reserve(partition, -4, {"x": X}, 16, timeout=1.0), "InvalidRequest"),
        (p.GetMeta(partition, ["x"], 10**12, "t", timeout=1.0), "GetMetaTimeout"),
        (p.GetMeta(partition, ["x"], 4, "t", {"dp_size": 10**9, "dp_rank": 0}, timeout=1.0), "InvalidRequest"),
        (p.Release(good.partition_uid, "before", b"\x01\x02\x03"), "MalformedMessage"),
        (p.Release(good.partition_uid, "before", p.pack_indexes(np.array([10**15, -5]))), None),
    ):
        header, _ = controller.call(reserve)
        assert header.error_type == error, (reserve, header)
    still_serving()
    controller.close()

    # Writes and reads whose buffers lie about their sizes.
    storage = RawPeer(info.storage_units[0], info.session_id, info.secret)
    bytes_before = queue.storage_bytes()
    uid = good.partition_uid
    jagged = FieldSchema("jagged", "int64", ())
    lies = [
        (p.Write(uid, 10**6 * 2, 4, [p.ColumnSpec("x", X, 4, 1)]), [b"\x00" * 10], "a torch.float32 buffer of shape"),
        (p.Write(uid, 10**6 * 2 + 2, 10**12, [p.ColumnSpec("x", X, 10**12, 1)]), [b"\x00" * 16], "needs"),
        (p.Write(uid, 10**6 * 2 + 4, 2, [p.ColumnSpec("x", X, 2, 1)]), [], "describes 1 buffers and carries 0"),
        (p.Write(uid, 10**6 * 2 + 6, 2, [p.ColumnSpec("x", X, 3, 1)]), [b"\x00" * 3072], "3 rows in a block of 2"),
        (p.Write(uid, 10**6 * 2 + 1, 1, [p.ColumnSpec("x", X, 1, 1)]), [b"\x00" * 1024], "belongs to storage unit 1"),
        (
            p.Write(uid, 10**6 * 2 + 8, 2, [p.ColumnSpec("j", jagged, 2, 2)]),
            [b"\x00" * 8, p.pack_indexes(np.array([0, 10**12, 1]))],
            "jagged offsets must start at 0 and never decrease",
        ),
        (
            p.Write(uid, 10**6 * 2 + 10, 2, [p.ColumnSpec("j", jagged, 2, 2)]),
            [b"\x00" * 8, p.pack_indexes(np.array([0, 1, 10**12]))],
            "needs",
        ),
        (
            p.Write(uid, 10**6 * 2 + 12, 2, [p.ColumnSpec("o", FieldSchema("object", "object", ()), 2, 1)]),
            [b"\xc1\xc1"],
            "malformed object column",
        ),
        (p.Read(uid, [p.ReadField("x", p.pack_indexes(np.array([10**9])), p.pack_indexes(np.array([0])))]), [], "gone"),
        (p.Read(uid, [p.ReadField("x", b"\x01", b"\x02")]), [], "multiple of 8 bytes"),
    ]
    for request, buffers, message in lies:
        header, _ = storage.call(request, *buffers)
        assert header.error_type is not None and message in (header.error_message or ""), (request, header)
    # Sizes that lie to the byte budget (defect 11): a put declaring 16 bytes writes 4 KiB; a write with no
    # reservation of the controller's; a reservation's token replayed for another block.
    controller = RawPeer(info.controller, info.session_id, info.secret)
    header, (body, *_) = controller.call(p.Reserve(partition, 4, {"x": X}, 16, timeout=5.0))
    reservation = p.decode_as(body, p.Reservation)
    place = reservation.placements[0]
    writer = RawPeer(info.storage_units[place.unit], info.session_id, info.secret)
    columns = [p.ColumnSpec("x", X, 4, 1)]
    payload = np.zeros((4, 256), dtype=np.float32).tobytes()
    for write, message in (
        (
            p.Write(reservation.partition_uid, place.block_id, 4, columns, place.max_bytes, place.token),
            "its put reserved 16",
        ),
        (
            p.Write(reservation.partition_uid, place.block_id, 4, columns, 10**6, place.token),
            "does not carry the controller's",
        ),
        (
            p.Write(reservation.partition_uid, place.block_id + 2, 4, columns, 16, place.token),
            "does not carry the controller's",
        ),
    ):
        header, _ = writer.call(write, payload)
        assert header.error_type == "InvalidRequest" and message in (header.error_message or ""), header
    assert controller.call(p.Abort(reservation.put_id))[0].error_type is None
    writer.close()
    controller.close()
    assert queue.storage_bytes() == bytes_before  # nothing of the lies was stored
    still_serving()
    storage.close()


# ---- many processes on one partition -----------------------------------------------------------------------------
def produce(info: p.ControllerInfo, partition: str, producer: int, batches: int) -> list[tuple[int, int, int]]:
    """Puts ``batches`` batches of 5 rows of random jagged bytes; returns (row_id, crc32, bytes) written."""
    client = TransferQueueClient(f"producer{producer}", info)
    rng = np.random.default_rng(producer)
    written = []
    for batch in range(batches):
        lengths = rng.integers(1, 300, size=5)
        payloads = [torch.from_numpy(rng.integers(0, 256, size=n, dtype=np.uint8)) for n in lengths]
        row_ids = [producer * 10_000 + batch * 5 + i for i in range(5)]
        checksums = [zlib.crc32(t.numpy().tobytes()) for t in payloads]
        client.put(
            TensorDict(
                {
                    "payload": torch.nested.nested_tensor(payloads, layout=torch.jagged),
                    "row_id": torch.tensor(row_ids),
                    "checksum": torch.tensor(checksums),
                },
                batch_size=[5],
            ),
            partition_id=partition,
        )
        written += [(r, c, int(n)) for r, c, n in zip(row_ids, checksums, lengths, strict=True)]
    client.close()
    return written


def consume(info: p.ControllerInfo, partition: str, consumer: int) -> list[tuple[str, int, int, int]]:
    """Reads both tasks until each reaches the end of the stream; returns (task, row_id, crc32 read, bytes read)."""
    client = TransferQueueClient(f"consumer{consumer}", info)
    read = []
    open_tasks = ["train", "eval"]
    while open_tasks:
        for task in list(open_tasks):
            meta = client.get_meta(
                ["payload", "row_id", "checksum"], 4, partition_id=partition, task_name=task, timeout=60
            )
            if len(meta) == 0:
                open_tasks.remove(task)
                continue
            data = client.get_data(meta)
            for payload, row_id in zip(data["payload"].unbind(), data["row_id"].tolist(), strict=True):
                read.append((task, row_id, zlib.crc32(payload.numpy().tobytes()), payload.numel()))
    client.close()
    return read


def check_every_row_once_per_task(written: list[tuple[int, int, int]], read: list[tuple[str, int, int, int]]) -> None:
    checksum = {row_id: crc for row_id, crc, _ in written}
    assert len(checksum) == len(written)
    for task in ("train", "eval"):
        rows = [(row_id, crc, n) for t, row_id, crc, n in read if t == task]
        assert sorted(r for r, _, _ in rows) == sorted(checksum), f"{task}: every row exactly once"
        assert all(crc == checksum[row_id] for row_id, crc, _ in rows), f"{task}: bytes read differ from written"
        assert sum(n for _, _, n in rows) == sum(n for _, _, n in written)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_producer_and_three_consumer_processes(queue: Any) -> None:
    partition = queue.partition("many")
    consumer, producer = ray.remote(num_cpus=1)(consume), ray.remote(num_cpus=1)(produce)
    consumers = [consumer.remote(queue.info, partition, c) for c in range(3)]
    producers = [producer.remote(queue.info, partition, w, 6) for w in range(3)]
    written = [row for rows in ray.get(producers, timeout=240) for row in rows]
    queue.client.close_partition(partition_id=partition)
    read = [row for rows in ray.get(consumers, timeout=240) for row in rows]
    assert len(written) == 3 * 6 * 5
    check_every_row_once_per_task(written, read)


@pytest.mark.timeout(120)
def test_three_producer_and_three_consumer_threads(queue: Any) -> None:
    """The same traffic from threads of this process (each with its own client): the default tier's version."""
    partition = queue.partition("many")
    written: list[tuple[int, int, int]] = []
    read: list[tuple[str, int, int, int]] = []
    consumers = [threading.Thread(target=lambda c=c: read.extend(consume(queue.info, partition, c))) for c in range(3)]
    producers = [
        threading.Thread(target=lambda w=w: written.extend(produce(queue.info, partition, w, 6))) for w in range(3)
    ]
    for thread in consumers + producers:
        thread.start()
    for thread in producers:
        thread.join(timeout=60)
    queue.client.close_partition(partition_id=partition)
    for thread in consumers:
        thread.join(timeout=60)
    assert len(written) == 3 * 6 * 5
    check_every_row_once_per_task(written, read)


# ---- waiting does not stall others ----------------------------------------------------------------------------------
def test_a_parked_get_meta_does_not_delay_other_clients(queue: Any, wait_until: Callable[..., Any]) -> None:
    waiting_partition, busy_partition = queue.partition("waiting"), queue.partition("busy")
    waiter, other = queue.new_client("waiter"), queue.new_client("other")
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            waiter.get_meta(["x"], 2, partition_id=waiting_partition, task_name="t", timeout=5)
        except GetMetaTimeout as exc:
            outcome["error"] = exc

    queue.client.put(TensorDict({"x": torch.zeros(1, 256)}, batch_size=[1]), partition_id=waiting_partition)
    parked = threading.Thread(target=wait)
    parked.start()
    # The wait has reached the controller once its task shows up in the partition's consumption status.
    wait_until(lambda: "t" in queue.client.get_consumption_status(partition_id=waiting_partition)["tasks"])
    for value in range(5):
        other.put(TensorDict({"x": torch.full((2, 256), float(value))}, batch_size=[2]), partition_id=busy_partition)
        meta = other.get_meta(["x"], 2, partition_id=busy_partition, task_name="t")
        assert values_of(other, meta) == [float(value)] * 2
        assert parked.is_alive(), "the other client's operations must complete while the first one still waits"
    parked.join(timeout=30)
    assert "timed out after 5.0 s" in str(outcome["error"])
