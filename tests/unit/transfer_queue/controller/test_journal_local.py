"""A controller that dies comes back from its journal (``journal_dir``), without Ray: a ControllerServer and
StorageServers in this process; the controller is stopped without a snapshot or any other clean-up ("crashed") and a
new one is started over the same journal and the same storage units (which kept their blocks), on the same port.
Committed rows read, acknowledged rows are not served again, leased unacknowledged rows stay leased to their owner
(their deadline re-armed from the restart), cleared partitions stay gone, puts that had not committed are gone."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from tests.unit.conftest import QueueHarness
from transfer_queue.client import TransferQueueClient
from transfer_queue.config import QueueConfig
from transfer_queue.controller.server import ControllerServer, _ControllerResponder
from transfer_queue.errors import (
    ConfigMismatch,
    GetMetaTimeout,
    InvalidRequest,
    JournalCorrupt,
    JournalError,
    NotLeased,
    RequestTimeout,
)
from transfer_queue.metadata import FieldSchema
from transfer_queue.samplers import SequentialSampler
from transfer_queue.state import journal as journal_module
from transfer_queue.state.journal import FSYNC_INTERVAL_S, LOG, SNAPSHOT, Journal, load, open_journal, read_log
from transfer_queue.state.partition_status import row_state_counts
from transfer_queue.state.queue_state import QueueState
from transfer_queue.state.snapshot import partition_snapshot, unarray
from transfer_queue.storage.unit import BlockStore, StorageServer
from transfer_queue.wire import protocol as p
from transfer_queue.wire.server_sockets import Incoming, Peer

SESSION = "j" * 32
SECRET = b"k" * 32


class Local:
    """Two storage units that outlive the controllers started over ``journal_dir``."""

    def __init__(self, journal_dir: Path, **config: object):
        self.config = QueueConfig(
            global_batch_size=4, num_storage_units=2, default_timeout=3.0, journal_dir=str(journal_dir), **config
        )
        self.units = [StorageServer(BlockStore(u, 2, SECRET), "127.0.0.1", SESSION, SECRET) for u in range(2)]
        self.controller: ControllerServer | None = None
        self.clients: list[TransferQueueClient] = []
        self.replayed = False

    def start(self, port: int = 0) -> ControllerServer:
        state, journal, self.replayed = open_journal(self.config)
        endpoints = [u.endpoint for u in self.units]
        self.controller = ControllerServer(state, SESSION, endpoints, "127.0.0.1", SECRET, journal=journal, port=port)
        return self.controller

    def client(self, name: str) -> TransferQueueClient:
        assert self.controller is not None
        endpoints = [u.endpoint for u in self.units]
        info = p.ControllerInfo(
            p.PROTOCOL_VERSION, SESSION, self.controller.endpoint, endpoints, self.config.to_dict(), SECRET
        )
        client = TransferQueueClient(name, info, force_tcp=True)
        self.clients.append(client)
        return client

    def crash(self) -> int:
        """Stop the controller as a dead process would: no snapshot, no goodbye; returns its port."""
        assert self.controller is not None
        port = int(self.controller.endpoint.tcp.rsplit(":", 1)[1])
        self.controller.stop()
        self.controller = None
        return port

    def close(self) -> None:
        for client in self.clients:
            client.close()
        if self.controller is not None:
            self.controller.stop()
        for unit in self.units:
            unit.stop()


@pytest.fixture
def local(tmp_path: Path) -> Iterator[Local]:
    queue = Local(tmp_path / "journal")
    yield queue
    queue.close()


def rows(value: float, n: int = 2) -> dict[str, torch.Tensor]:
    return {"x": torch.full((n, 3), value)}


def test_a_restarted_controller_replays_its_journal_and_finds_the_units_rows(local: Local) -> None:
    controller = local.start()
    assert not local.replayed
    client = local.client("producer")
    metas = [client.put(rows(float(v)), partition_id="p") for v in (1, 2, 3)]  # rows 0..5
    with controller.lock:
        metas_put_id = max(controller.state.ledger.committed)  # the last of them
    client.set_custom_meta(metas[2], [{"score": 1}, None])
    client.kv_put("k", "kv", {"x": torch.ones(1, 3)}, tag={"v": 2})
    client.put(rows(9.0), partition_id="gone")
    client.clear(partition_id="gone")
    client.set_task_options("t", ack="explicit")
    acked = client.get_meta(["x"], 2, partition_id="p", task_name="t")
    client.ack(acked)
    leased = client.get_meta(["x"], 2, partition_id="p", task_name="t")  # never acknowledged
    schema = {"x": FieldSchema("dense", "float32", (3,))}
    with controller.lock:  # a put reserved but never committed (its writer died)
        open_put = QueueHarness(controller.state).reserve("p", 2, schema)
    client.put(rows(4.0), partition_id="q")  # a pass after the reservation: the journal has its reserved rows
    port = local.crash()

    controller = local.start(port)
    assert local.replayed
    assert controller.endpoint.tcp.endswith(f":{port}")
    with controller.lock:
        counts = row_state_counts(controller.state.table.known("p"), "t")
        assert controller.state.table.known("p").num_reserved == 0
    assert counts["acknowledged"] == 2 and counts["leased"] == 2  # the lease survived the restart
    reader = local.client("reader")
    assert reader.list_partitions() == ["p", "kv", "q"]
    assert reader.get_custom_meta(metas[2]) == [{"score": 1}, {}]
    assert reader.kv_list("kv", with_tags=True) == {"k": {"v": 2}}
    for value, meta in zip((1.0, 2.0, 3.0), metas, strict=True):  # the units kept the blocks; the ids still point
        assert reader.get_data(meta)["x"].flatten().tolist() == [value] * 6
    again = reader.get_meta(["x"], 2, partition_id="p", task_name="t", timeout=1)
    # neither the acknowledged rows nor the leased ones are served again; the uncommitted put's rows are gone (6
    # committed rows in all: the 2 never handed out are what is left)
    taken = acked.global_indexes.tolist() + leased.global_indexes.tolist()
    assert sorted(again.global_indexes.tolist()) == [i for i in range(6) if i not in taken]
    client.ack(leased)  # the lease taken before the restart is acknowledged after it
    with controller.lock:
        assert row_state_counts(controller.state.table.known("p"), "t")["acknowledged"] == 4
    with controller.lock:  # put and block ids handed out before the crash are not handed out again
        later = QueueHarness(controller.state).reserve("p", 2, schema)
        assert later.put_id > open_put.put_id
        assert min(pl.block_id for pl in later.placements) > max(pl.block_id for pl in open_put.placements)
        controller.state.ledger.abort(later.put_id)
        # a commit of a put from before the restart (retried by a client that lost the answer): not known
        with pytest.raises(RequestTimeout, match=f"put {metas_put_id}: .* or the controller restarted since"):
            controller.state.ledger.commit(metas_put_id)
    # a put after the restart gets new ids: nothing committed before is overwritten
    new = reader.put(rows(5.0), partition_id="p")
    assert new.global_indexes.tolist() == [6, 7]
    assert reader.get_data(metas[0])["x"].flatten().tolist() == [1.0] * 6


def test_an_old_client_reconnects_to_the_restarted_controller_on_the_same_port(local: Local) -> None:
    local.start()
    client = local.client("old")
    meta = client.put(rows(7.0), partition_id="p")
    local.start(local.crash())
    assert client.list_partitions() == ["p"]  # the same client object: its socket reconnected by itself
    assert client.get_data(meta)["x"].flatten().tolist() == [7.0] * 6


def test_each_mutating_pass_is_one_record_written_before_its_reply(local: Local) -> None:
    controller = local.start()
    assert controller.journal is not None
    client = local.client("c")
    before = controller.journal.stats["records"]
    client.put(rows(1.0), partition_id="p")  # reserve (creates the partition), commit
    after_put = controller.journal.stats["records"]
    assert after_put - before == 2  # the reserve's (the put and block ids it handed out), the commit's
    client.list_partitions()
    client.get_production_status(partition_id="p")
    assert controller.journal.stats["records"] == after_put  # reads write nothing
    client.get_meta(["x"], 2, partition_id="p", task_name="t")  # a lease survives a restart: written
    assert controller.journal.stats["records"] == after_put + 1
    snapshot, _ = load(controller.journal.directory)
    assert snapshot is not None and [d["key"] for d in snapshot["partitions"]] == ["p"]
    assert controller.journal.stats["fsyncs"] >= controller.journal.stats["records"]  # journal_fsync="always"


def test_snapshots_bound_the_log(tmp_path: Path) -> None:
    queue = Local(tmp_path / "journal", journal_snapshot_bytes=4096)
    try:
        controller = queue.start()
        client = queue.client("c")
        for i in range(40):
            client.put(rows(float(i)), partition_id="p")
        assert controller.journal is not None
        with controller.lock:  # snapshots are written by the journal's thread: the last one may still be writing
            controller.journal.wait()
        assert controller.journal.stats["snapshots"] >= 2  # the first one is written when the journal starts
        assert controller.journal.stats["snapshots_written"] == controller.journal.stats["snapshots"]
        log = os.path.getsize(os.path.join(controller.journal.directory, LOG))
        snapshot = os.path.getsize(os.path.join(controller.journal.directory, SNAPSHOT))
        assert log <= max(4096, snapshot) + 4096  # at most one record past the bound
        queue.start(queue.crash())
        assert queue.client("r").get_production_status(partition_id="p")["rows"] == 80
    finally:
        queue.close()


def fill(journal_dir: Path, puts: int = 3) -> None:
    config = QueueConfig(global_batch_size=4, num_storage_units=2, journal_dir=str(journal_dir))
    state, journal, _ = open_journal(config)
    harness = QueueHarness(state)
    for _ in range(puts):
        harness.put("p", 2)
        journal.record(state, {"p"})
    journal.close()


def test_a_torn_last_record_is_dropped(tmp_path: Path) -> None:
    fill(tmp_path)
    log = tmp_path / LOG
    data = log.read_bytes()
    log.write_bytes(data[:-5])  # the process died in the middle of the last write
    snapshot, end = load(str(tmp_path))
    assert snapshot is not None and snapshot["seq"] == 2
    (part,) = snapshot["partitions"]
    assert part["num_rows"] == 4
    config = QueueConfig(global_batch_size=4, num_storage_units=2, journal_dir=str(tmp_path))
    state, journal, replayed = open_journal(config)  # the torn bytes are cut before anything is appended
    assert replayed and state.table.known("p").num_rows == 4
    assert os.path.getsize(log) == end
    journal.close()


def test_a_damaged_record_before_the_end_is_journal_corrupt(tmp_path: Path) -> None:
    fill(tmp_path)
    log = tmp_path / LOG
    data = bytearray(log.read_bytes())
    data[12] ^= 0xFF  # inside the first record's payload
    log.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match=r"the record at byte 0 fails its checksum .* bytes of records follow it"):
        load(str(tmp_path))


def test_a_journal_of_another_queue_is_refused(tmp_path: Path) -> None:
    fill(tmp_path)
    config = QueueConfig(global_batch_size=8, num_storage_units=2, journal_dir=str(tmp_path))
    with pytest.raises(ConfigMismatch, match="global_batch_size=4; this one has global_batch_size=8"):
        open_journal(config)


def test_a_journal_that_cannot_be_written_fails_the_passs_replies_typed(local: Local) -> None:
    controller = local.start()
    client = local.client("c")
    client.put(rows(1.0), partition_id="p")
    assert controller.journal is not None
    with controller.lock:  # the disk went away under the journal
        os.close(controller.journal._fd)
        controller.journal._fd = os.open(os.devnull, os.O_RDONLY)
    with pytest.raises(
        JournalError, match=r"could not write its journal under .* may not survive a controller restart"
    ):
        client.put(rows(2.0), partition_id="p")
    assert client.list_partitions() == ["p"]  # reads are answered as before


def arrays_of(d: dict) -> dict:
    """A partition as the snapshot holds it, its arrays decoded (to compare a replayed one with a live one)."""
    out = {k: v for k, v in d.items() if k not in ("arrays", "tasks")}
    out["arrays"] = {n: unarray(a).tolist() for n, a in d["arrays"].items()}
    out["tasks"] = {
        t: {"consumption": unarray(v["consumption"]).tolist(), "deliveries": unarray(v["deliveries"]).tolist(),
            "lease": unarray(v["lease"]).tolist(), "dead": sorted(list(x) for x in v["dead"])}
        for t, v in d["tasks"].items()
    }  # fmt: skip
    return msgspec.msgpack.decode(msgspec.msgpack.encode(out))


def test_replay_of_row_records_gives_the_state_that_wrote_them(tmp_path: Path) -> None:
    """Records after the first of a partition hold the rows that changed; replayed over the snapshot they give back
    every partition exactly (arrays, tasks, dicts), through capacity growth, acks, clears and kv keys."""
    config = QueueConfig(global_batch_size=4, num_storage_units=2, journal_dir=str(tmp_path))
    state, journal, _ = open_journal(config)
    q = QueueHarness(state)
    q.ok(p.SetTaskOptions("t", ack="explicit"))
    q.ok(p.SetTaskOptions("d", ack="explicit", max_deliveries=1))
    sizes = []
    for i in range(30):
        meta = q.put("p", 3)  # grows past its first capacity (64 rows): a whole record again, then rows again
        if i % 4 == 0:
            got = q.ok(p.GetMeta("p", ["x"], 2, "t", owner="o")).to_meta()
            q.ok(p.Ack(got.partition_uid, "t", p.pack_indexes(got.global_indexes), owner="o", explicit=True))
        if i % 5 == 1:  # delivered once, handed back: dead-lettered (a dead letter in the record's rows)
            got = q.ok(p.GetMeta("p", ["x"], 1, "d", owner="o")).to_meta()
            q.ok(p.Release(got.partition_uid, "d", p.pack_indexes(got.global_indexes), owner="o"))
        if i % 6 == 2:
            indexes = p.pack_indexes(meta.global_indexes[:1])
            q.ok(p.SetCustomMeta(meta.partition_uid, indexes, [{"i": i}]))
        if i == 10:
            q.put("gone", 2)
            journal.record(state, None)
            q.ok(p.Clear("gone"))
        if i == 20:  # rows forgotten (their groups, blocks and dead letters with them), a task dropped
            q.ok(p.ClearSamples(meta.partition_uid, p.pack_indexes(meta.global_indexes[:2])))
            q.ok(p.ResetConsumption("p", "t"))
        if i % 7 == 0:
            q.kv_put("kv", [f"k{i}"])
        if i == 15:
            q.ok(p.KvClear("kv", ["k7"]))
        sizes.append(journal.record(state, None))
    q.ok(p.GetMeta("p", ["x"], 2, "t", owner="kept"))  # a lease still live at the end (a record of it alone)
    assert journal.record(state, set())
    lost = state.unit_restarted(0)["rows"]  # rows lost with a unit: marked, written by the next pass's record
    assert lost and journal.record(state, set(), marked=True)
    journal.close()
    live_p = state.partitions["p"]
    assert live_p.tasks["d"].dead and live_p.custom_meta and "t" in live_p.tasks  # what the records had to carry
    records, _ = read_log(str(tmp_path / LOG))
    kinds = ["rows" if "rows" in d else "whole" for r in records for d in r["parts"] if d["key"] == "p"]
    # whole the first time and once its arrays grew past 64 rows; the rows that changed every other time
    # one a pass, one more at i == 10, the last lease, the lost rows
    assert kinds.count("whole") == 2 and kinds.count("rows") == 31
    assert max(sizes[-5:]) < sizes[0] / 4  # a row record is a fraction of a whole one
    snapshot, _ = load(str(tmp_path))
    assert snapshot is not None
    replayed = {d["key"]: arrays_of(d) for d in snapshot["partitions"]}
    live = {key: arrays_of(partition_snapshot(part)) for key, part in state.partitions.items()}
    assert sorted(replayed, key=str) == ["kv", "p"]
    assert replayed == live
    # the leases live at the end (granted, some acknowledged or handed back since) are the ones the journal holds
    assert state.delivery.leases.leases and snapshot["leases"] == state.delivery.journaled_leases(changed=False)


@pytest.mark.parametrize("policy", ["always", "interval", "never"])
def test_the_fsync_policy(tmp_path: Path, policy: str) -> None:
    now = [0.0]
    config = QueueConfig(global_batch_size=4, num_storage_units=2, journal_dir=str(tmp_path), journal_fsync=policy)
    state, opened, _ = open_journal(config)
    opened.close()
    journal = Journal(str(tmp_path), policy, clock=lambda: now[0])
    QueueHarness(state).put("p", 2)
    journal.record(state, None)
    assert journal.stats["fsyncs"] == (1 if policy == "always" else 0)
    now[0] += FSYNC_INTERVAL_S
    journal.sync_due()  # the serving loop calls it every pass
    assert journal.stats["fsyncs"] == (0 if policy == "never" else 1)
    journal.close()  # a clean close syncs what is left, unless the OS is to decide
    assert journal.stats["fsyncs"] == (0 if policy == "never" else 1)


def test_a_record_holds_the_rows_that_changed_not_the_partition(tmp_path: Path) -> None:
    """After a partition's whole record, a one-row change in 100k rows is a record of that row (its arrays' values,
    its group's and block's dict entries), not of the partition's arrays or dicts."""
    config = QueueConfig(global_batch_size=4, num_storage_units=2, journal_dir=str(tmp_path))
    state, journal, _ = open_journal(config)
    q = QueueHarness(state)
    for _ in range(10):
        q.put("big", 10_000)
    assert journal.record(state, None) > 100_000 * 8  # the partition's first record: whole
    meta = q.put("big", 1)
    size = journal.record(state, {"big"})
    got = q.ok(p.GetMeta("big", ["x"], 1, "t", owner="o")).to_meta()
    q.ok(p.Ack(got.partition_uid, "t", p.pack_indexes(got.global_indexes), owner="o"))
    acked = journal.record(state, {"big"})
    journal.close()
    records, _ = read_log(str(tmp_path / LOG))
    assert size < 2048 and acked < 2048  # bytes: O(1) rows, whatever the partition's size
    put_part, ack_part = records[-2]["parts"][0], records[-1]["parts"][0]
    assert np.frombuffer(put_part["rows"], np.int64).tolist() == [int(meta.global_indexes[0])]
    assert [g for g, _, _ in put_part["groups"]] == [100_000] and len(put_part["blocks"]) == 1
    assert np.frombuffer(ack_part["rows"], np.int64).tolist() == [int(got.global_indexes[0])]
    # a lease and its ack change the task's arrays of the row only: not its cells, groups or blocks
    assert ack_part["arrays"] == {} and ack_part["groups"] == [] and ack_part["blocks"] == []
    assert unarray(ack_part["tasks"]["t"]["lease"]).tolist() == [
        state.partitions["big"].tasks["t"].lease[got.global_indexes[0]]
    ]
    snapshot, _ = load(str(tmp_path))
    assert snapshot is not None
    assert arrays_of(snapshot["partitions"][0]) == arrays_of(partition_snapshot(state.partitions["big"]))


def test_a_lease_expiring_into_a_dead_letter_survives_a_restart(local: Local) -> None:
    """The controller's timer dead-letters a row whose lease expired (max_deliveries=1): no request touched the
    partition since, yet the next pass's record holds it."""
    local.start()
    client = local.client("c")
    client.put(rows(1.0), partition_id="p")
    client.set_task_options("t", ack="explicit", lease_s=0.2, max_deliveries=1)
    leased = client.get_meta(["x"], 1, partition_id="p", task_name="t")
    deadline = time.monotonic() + 10
    while not client.dead_letters(partition_id="p", task_name="t") and time.monotonic() < deadline:
        time.sleep(0.05)  # the serving thread's timer expires the lease
    dead = client.dead_letters(partition_id="p", task_name="t")  # answered after the timer's pass wrote its record
    assert [d["global_index"] for d in dead] == leased.global_indexes.tolist()
    local.start(local.crash())
    reader = local.client("reader")
    assert reader.dead_letters(partition_id="p", task_name="t") == dead


def failing_write(monkeypatch: pytest.MonkeyPatch, fd: int, short: bool) -> list[int]:
    """``os.write`` to ``fd`` fails once: ``short``: it writes half the bytes (a full disk), then the next call raises;
    else it raises at once. Returns the log sizes seen when it raised."""
    real, calls, seen = os.write, [0], []

    def write(target: int, data: bytes | memoryview) -> int:
        if target != fd or calls[0] >= (2 if short else 1):
            return real(target, data)
        calls[0] += 1
        if short and calls[0] == 1:
            return real(target, bytes(data)[: len(data) // 2])
        seen.append(os.fstat(fd).st_size)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", write)
    return seen


def live_and_replayed(local: Local) -> tuple[dict, dict]:
    assert local.controller is not None
    with local.controller.lock:
        live = {key: arrays_of(partition_snapshot(part)) for key, part in local.controller.state.partitions.items()}
    local.crash()
    snapshot, _ = load(local.config.journal_dir or "")
    assert snapshot is not None
    return live, {d["key"]: arrays_of(d) for d in snapshot["partitions"]}


@pytest.mark.parametrize("short", [False, True])
def test_a_failed_journal_write_loses_nothing_once_the_next_one_succeeds(
    local: Local, monkeypatch: pytest.MonkeyPatch, short: bool
) -> None:
    """A write that fails (or writes part of the record, then fails) leaves no torn record mid-log, and the next
    record writes what the failed pass changed."""
    controller = local.start()
    client = local.client("c")
    meta = client.put(rows(1.0), partition_id="p")
    assert controller.journal is not None
    seen = failing_write(monkeypatch, controller.journal._fd, short)
    with pytest.raises(JournalError, match="could not write its journal"):
        client.set_custom_meta(meta, [{"score": 1}, None])
    assert seen and os.path.getsize(Path(local.config.journal_dir or "") / LOG) == controller.journal.log_bytes
    client.put(rows(2.0), partition_id="q")  # a pass that writes: p's change goes with it
    live, replayed = live_and_replayed(local)
    assert replayed == live and replayed["p"]["custom_meta"] == {0: {"score": 1}}
    local.start()  # replays without JournalCorrupt
    assert local.client("reader").get_custom_meta(meta) == [{"score": 1}, {}]


def test_a_failed_journal_write_fails_the_replies_of_changes_not_of_reads(
    local: Local, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a pass whose record could not be written, a request that changed the state is answered JournalError; a read
    served in the same pass is answered as usual."""
    controller = local.start()
    meta = local.client("c").put(rows(1.0), partition_id="p")
    assert controller.journal is not None
    answers: dict[str, p.ReplyHeader] = {}

    def responder(name: str) -> _ControllerResponder:
        def reply(frames: list) -> None:
            answers[name] = p.decode_reply_header(frames[0])

        return _ControllerResponder(controller, Incoming([], Peer("tcp", name.encode()), reply))

    indexes = p.pack_indexes(meta.global_indexes[:1])
    with controller.lock:  # one pass: a read and a change, then its record fails
        failing_write(monkeypatch, controller.journal._fd, short=False)
        controller.handle(p.ListPartitions(), [], responder("read"))
        controller.handle(p.SetCustomMeta(meta.partition_uid, indexes, [{"a": 1}]), [], responder("change"))
        controller.handle(p.CancelGetMeta("c", 1), [], responder("cancel"))  # may hand a lease back: a change
        controller._journal_pass()
    assert answers["read"].error_type is None
    assert answers["change"].error_type == "JournalError" and answers["cancel"].error_type == "JournalError"
    assert "could not write its journal" in (answers["change"].error_message or "")


def test_task_options_survive_a_restart(local: Local) -> None:
    """A client that sets its task options and stays idle through the restart never sets them again: the replayed
    controller has them from its journal."""
    controller = local.start()
    client = local.client("c")
    client.put(rows(1.0), partition_id="p")
    client.set_task_options("t", ack="explicit", lease_s=30.0, max_deliveries=3)
    with controller.lock:
        live = controller.state.options("t")
    assert live.ack == "explicit"
    controller = local.start(local.crash())
    with controller.lock:
        assert controller.state.options("t") == live
    meta = local.client("reader").get_meta(["x"], 2, partition_id="p", task_name="t")
    local.clients[-1].get_data(meta)  # ack="explicit": reading the rows does not acknowledge them
    with controller.lock:
        assert row_state_counts(controller.state.table.known("p"), "t")["leased"] == 2


def test_the_units_restarts_survive_a_restart_of_the_controller(tmp_path: Path) -> None:
    """A replayed controller numbers a unit's next restart after those its clients saw (they drop a restart numbered
    no higher than one they know, and would go on using a dead unit's address), and keeps what each restart lost."""
    config = QueueConfig(global_batch_size=4, num_storage_units=2, journal_dir=str(tmp_path))
    state, journal, _ = open_journal(config)
    QueueHarness(state).put("p", 3)
    journal.record(state, None)
    state.unit_restarted(0)
    state.unit_restarted(0)
    assert journal.record(state, set(), counters=True, marked=True)
    journal.close()
    replayed, again, resumed = open_journal(config)
    try:
        assert resumed
        assert replayed.lost.restarts == {0: 2}
        assert replayed.lost.lost_below == state.lost.lost_below and replayed.lost.total == state.lost.total
        assert replayed.unit_restarted(0)["restarts"] == 3
    finally:
        again.close()


def lease_of(controller: ControllerServer, meta: object) -> object:
    """The live lease holding the rows of ``meta`` (one get_meta's)."""
    with controller.lock:
        part = controller.state.table.known("p")
        task = part.task("t")
        (lease_id,) = np.unique(task.lease[np.asarray(meta.global_indexes) - part.base_index]).tolist()  # type: ignore[attr-defined]
        return controller.state.delivery.leases.leases.get(lease_id)


def test_a_leased_row_is_not_served_to_another_consumer_after_replay_and_its_owner_acks_it(local: Local) -> None:
    """The owner of a lease taken before the restart keeps it: another consumer is not served its rows, the owner's
    extend_lease and ack of it succeed after the restart (the same client, reconnected)."""
    local.start()
    owner = local.client("owner")
    owner.put(rows(1.0, 4), partition_id="p")
    owner.set_task_options("t", ack="explicit")
    leased = owner.get_meta(["x"], 2, partition_id="p", task_name="t")
    controller = local.start(local.crash())
    lease = lease_of(controller, leased)
    assert lease is not None and lease.owner == owner.owner  # type: ignore[attr-defined]
    other = local.client("other")
    served = other.get_meta(["x"], 2, partition_id="p", task_name="t")  # the rows no lease holds
    assert not set(served.global_indexes.tolist()) & set(leased.global_indexes.tolist())
    with pytest.raises(GetMetaTimeout, match="0 rows are ready"):  # the leased rows are not served again
        other.get_meta(["x"], 1, partition_id="p", task_name="t", timeout=0.3)
    assert owner.extend_lease(leased, 60.0) == {"extended": 2}
    owner.ack(leased)
    with pytest.raises(NotLeased, match=r"already acknowledged: \[" + str(leased.global_indexes[0])):
        owner.ack(leased)
    with controller.lock:
        counts = row_state_counts(controller.state.table.known("p"), "t")
    assert counts["acknowledged"] == 2 and counts["leased"] == 2  # the other consumer's two


def test_a_lease_that_expires_while_the_controller_is_down_is_rearmed_from_the_restart(local: Local) -> None:
    """A lease's deadline is re-armed its full duration from the replay (a monotonic clock does not carry over to a
    new process): its rows are not served again before it, then go back to ready as any expired lease's do."""
    local.start()
    owner = local.client("owner")
    owner.put(rows(1.0, 2), partition_id="p")
    owner.set_task_options("t", ack="explicit", lease_s=0.5)
    leased = owner.get_meta(["x"], 2, partition_id="p", task_name="t")
    port = local.crash()
    time.sleep(0.6)  # the lease's deadline passes while no controller runs
    restarted = time.monotonic()
    controller = local.start(port)
    lease = lease_of(controller, leased)
    assert lease is not None and lease.deadline >= restarted + 0.5  # type: ignore[attr-defined]
    again = local.client("other").get_meta(["x"], 2, partition_id="p", task_name="t", timeout=10)  # waits for it
    assert sorted(again.global_indexes.tolist()) == sorted(leased.global_indexes.tolist())
    assert time.monotonic() >= lease.deadline  # type: ignore[attr-defined]
    with pytest.raises(NotLeased, match="leased to another client"):
        owner.ack(leased)


# ---- snapshots written off the serving thread -------------------------------------------------------------------
class BlockedWriter:
    """``write_snapshot`` held until ``release`` is set (``begun``: a snapshot's write was reached); ``fail``: the
    process died in the middle of it (half of the temporary file written, never renamed)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False):
        self.begun, self.release = threading.Event(), threading.Event()
        self.fail = fail
        real = journal_module.write_snapshot

        def write(directory: str, pieces: list[bytes]) -> None:
            self.begun.set()
            assert self.release.wait(60.0)
            if self.fail:
                blob = b"".join(pieces)
                Path(directory, SNAPSHOT + ".tmp").write_bytes(blob[: len(blob) // 2])
                raise OSError("the process died here")
            real(directory, pieces)

        monkeypatch.setattr(journal_module, "write_snapshot", write)


def test_the_serving_thread_answers_while_a_snapshot_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot is written by the journal's thread: with its write held, puts and reads are answered, records go
    to a new log segment, and no second snapshot begins; once written, a restart replays every row."""
    queue = Local(tmp_path / "journal", journal_snapshot_bytes=4096)
    controller = queue.start()
    writer = BlockedWriter(monkeypatch)  # after the first snapshot (the empty journal's)
    try:
        client = queue.client("c")
        puts = 0
        while not writer.begun.is_set():
            client.put(rows(float(puts)), partition_id="p")
            puts += 1
        for i in range(10):  # the log passes the bound again: no second snapshot while one is written
            client.put(rows(100.0 + i), partition_id="p")
        assert client.get_production_status(partition_id="p")["rows"] == 2 * (puts + 10)
        journal = controller.journal
        assert journal is not None and not writer.release.is_set()
        with controller.lock:
            assert journal.stats["snapshots"] == 2 and journal.writing() is not None
            assert journal.log_bytes > 4096 and not journal.snapshot_due()
        ((sealed_at, _),) = journal_module.sealed_segments(journal.directory)  # the log the snapshot holds
        assert sealed_at < journal.seq
        writer.release.set()
        with controller.lock:
            journal.wait()
        assert journal.stats["snapshots_written"] == 2
        assert journal_module.sealed_segments(journal.directory) == []  # its records are in the snapshot
        queue.start(queue.crash())
        assert queue.client("r").get_production_status(partition_id="p")["rows"] == 2 * (puts + 10)
    finally:
        writer.release.set()
        queue.close()


def filled(tmp_path: Path) -> tuple[QueueState, Journal, QueueHarness]:
    config = QueueConfig(global_batch_size=4, num_storage_units=2, journal_dir=str(tmp_path))
    state, journal, _ = open_journal(config)
    q = QueueHarness(state)
    q.ok(p.SetTaskOptions("t", ack="explicit"))
    for i in range(6):
        q.put("p", 3)
        if i % 2:
            got = q.ok(p.GetMeta("p", ["x"], 2, "t", owner="o")).to_meta()
            q.ok(p.Ack(got.partition_uid, "t", p.pack_indexes(got.global_indexes), owner="o", explicit=True))
        journal.record(state, None)
    return state, journal, q


def more(state: QueueState, journal: Journal, q: QueueHarness) -> None:
    """Records after the snapshot began: changes of the state it holds (rows, acks, a lease, a new partition)."""
    for i in range(3):
        q.put("p", 2)
        q.put(f"q{i}", 1)
        journal.record(state, None)
    got = q.ok(p.GetMeta("p", ["x"], 2, "t", owner="o")).to_meta()
    q.ok(p.Ack(got.partition_uid, "t", p.pack_indexes(got.global_indexes[:1]), owner="o", explicit=True))
    journal.record(state, None)


def replayed_is_live(directory: Path, state: QueueState) -> dict:
    snapshot, _ = load(str(directory))
    assert snapshot is not None
    assert {d["key"]: arrays_of(d) for d in snapshot["partitions"]} == {
        key: arrays_of(partition_snapshot(part)) for key, part in state.partitions.items()
    }
    assert snapshot["leases"] == state.delivery.journaled_leases(changed=False)
    return snapshot


def test_a_snapshot_half_written_is_ignored_the_old_one_and_every_segment_replayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, journal, q = filled(tmp_path)
    writer = BlockedWriter(monkeypatch, fail=True)
    journal.snapshot(state, wait=False)
    sealed_at = journal.seq
    more(state, journal, q)  # the serving thread goes on while the snapshot is written
    writer.release.set()
    journal.close()  # the write "died": the temporary file is half there, the sealed segment stays
    assert journal.stats["snapshot_failures"] == 1 and (tmp_path / (SNAPSHOT + ".tmp")).exists()
    assert [s for s, _ in journal_module.sealed_segments(str(tmp_path))] == [sealed_at]
    assert replayed_is_live(tmp_path, state)["seq"] == journal.seq
    monkeypatch.undo()
    config = QueueConfig(global_batch_size=4, num_storage_units=2, journal_dir=str(tmp_path))
    _, again, replayed = open_journal(config)  # a snapshot written again at once; the segments removed
    assert replayed and journal_module.sealed_segments(str(tmp_path)) == [] and again.stats["snapshots_written"] == 1
    again.close()
    assert load(str(tmp_path))[0]["seq"] == journal.seq  # type: ignore[index]
    replayed_is_live(tmp_path, state)


def test_a_snapshot_written_before_its_segment_was_removed_skips_the_records_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, journal, q = filled(tmp_path)
    writer = BlockedWriter(monkeypatch)
    journal.snapshot(state, wait=False)
    ((sealed_at, segment),) = journal_module.sealed_segments(str(tmp_path))
    kept = Path(segment).read_bytes()
    more(state, journal, q)
    writer.release.set()
    journal.wait()
    assert journal_module.sealed_segments(str(tmp_path)) == []
    Path(segment).write_bytes(kept)  # the process died between the snapshot's rename and the segment's removal
    journal.close()
    snapshot = replayed_is_live(tmp_path, state)
    assert snapshot["seq"] == journal.seq and sealed_at < journal.seq


def test_a_lost_segment_is_journal_corrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state, journal, q = filled(tmp_path)
    writer = BlockedWriter(monkeypatch, fail=True)
    journal.snapshot(state, wait=False)
    more(state, journal, q)
    writer.release.set()
    journal.close()
    ((sealed_at, segment),) = journal_module.sealed_segments(str(tmp_path))
    os.remove(segment)
    with pytest.raises(
        JournalCorrupt, match=rf"record {sealed_at + 1} follows record 0: the records between are missing"
    ):
        load(str(tmp_path))


# ---- registered samplers ------------------------------------------------------------------------------------------
class CountingSampler(SequentialSampler):
    """A sampler with a field given at registration (``tag``) and a state (``served``)."""

    def __init__(self, tag: str):
        super().__init__()
        self.tag, self.served = tag, 0

    def state_dict(self) -> dict:
        return {"served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.served = int(state["served"])


def test_a_registered_sampler_survives_a_restart(local: Local) -> None:
    controller = local.start()
    controller.register_sampler("t", CountingSampler("mine"))  # written before it returns
    local.start(local.crash())
    assert local.controller is not None
    sampler = local.controller.state.samplers["t"]
    assert isinstance(sampler, CountingSampler) and sampler.tag == "mine"


@pytest.mark.parametrize("snapshot", [False, True])
def test_a_registered_sampler_is_replayed_with_its_state(tmp_path: Path, snapshot: bool) -> None:
    config = QueueConfig(global_batch_size=4, num_storage_units=2, journal_dir=str(tmp_path))
    state, journal, _ = open_journal(config)
    state.register_sampler("t", CountingSampler("a"))
    state.register_sampler("u", lambda: CountingSampler("from a callable"))
    assert journal.record(state, set())  # the registrations alone make a record
    state.samplers["t"].served = 5  # type: ignore[attr-defined]
    journal.record(state, set(), counters=True)
    if snapshot:
        journal.snapshot(state)
    journal.close()
    restarted, again, replayed = open_journal(config)
    again.close()
    t, u = restarted.samplers["t"], restarted.samplers["u"]
    assert replayed and isinstance(t, CountingSampler) and isinstance(u, CountingSampler)
    assert (t.tag, t.served, u.tag, u.served) == ("a", 5, "from a callable", 0)
    assert restarted.pending_sampler_states == {}


def test_a_sampler_that_does_not_pickle_is_served_but_not_journaled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = QueueConfig(global_batch_size=4, num_storage_units=2, journal_dir=str(tmp_path))
    state, journal, _ = open_journal(config)
    sampler = CountingSampler("locked")
    sampler.lock = threading.Lock()  # type: ignore[attr-defined]
    state.register_sampler("t", sampler)
    assert state.samplers["t"] is sampler and "does not pickle" in caplog.text
    journal.record(state, set(), counters=True)
    journal.close()
    restarted, again, _ = open_journal(config)
    again.close()
    assert "t" not in restarted.samplers  # its clients register it again


def test_a_dp_rounds_shares_survive_a_restart_each_rank_acks_its_own(local: Local) -> None:
    """A DP round's lease is kept with its round (a GRPO run's trainer ranks: tests/e2e/test_kill_anything_soak.py):
    after the restart no other consumer is served the round's rows, a rank asking for its share again gets the same
    rows, and each rank acknowledges its share (before: the rows were ready again and the acks raised NotLeased)."""
    local.start()
    rank0, rank1 = local.client("rank0"), local.client("rank1")
    rank0.put(rows(1.0, 6), partition_id="p")
    rank0.set_task_options("t", ack="explicit")

    def share(client: TransferQueueClient, rank: int) -> Any:
        params = {"dp_size": 2, "dp_rank": rank, "dp_group_id": "round-0"}
        return client.get_meta(["x"], 2, partition_id="p", task_name="t", sampler_params=params)

    first, second = share(rank0, 0), share(rank1, 1)
    round_rows = set(first.global_indexes.tolist()) | set(second.global_indexes.tolist())
    assert len(round_rows) == 4  # two disjoint shares of the round
    controller = local.start(local.crash())
    other = local.client("other")
    served = other.get_meta(["x"], 2, partition_id="p", task_name="t", timeout=3)
    assert sorted(served.global_indexes.tolist()) == sorted(set(range(6)) - round_rows)  # the two rows no round holds
    with pytest.raises(GetMetaTimeout, match="0 rows are ready"):  # the round's rows are not served again
        other.get_meta(["x"], 1, partition_id="p", task_name="t", timeout=0.3)
    assert share(rank1, 1).global_indexes.tolist() == second.global_indexes.tolist()
    rank0.ack(first)
    rank1.ack(second)
    with controller.lock:
        counts = row_state_counts(controller.state.table.known("p"), "t")
    assert counts["acknowledged"] == 4 and counts["leased"] == 2  # the other consumer's two


def test_a_dp_rank_that_released_its_share_before_a_restart_may_not_fetch_it_after(local: Local) -> None:
    """A rank's release is journaled with its round's lease: after the restart its share of that round is refused,
    as before the restart, and its peer's ack of its own share works."""
    local.start()
    rank0, rank1 = local.client("rank0"), local.client("rank1")
    rank0.put(rows(1.0, 4), partition_id="p")
    rank0.set_task_options("t", ack="explicit")
    params = [{"dp_size": 2, "dp_rank": r, "dp_group_id": "round-0"} for r in range(2)]
    first = rank0.get_meta(["x"], 2, partition_id="p", task_name="t", sampler_params=params[0])
    second = rank1.get_meta(["x"], 2, partition_id="p", task_name="t", sampler_params=params[1])
    rank1.release(second)
    local.start(local.crash())
    with pytest.raises(InvalidRequest, match="the share of dp_rank=1 in dp_group_id 'round-0' was released"):
        rank1.get_meta(["x"], 2, partition_id="p", task_name="t", sampler_params=params[1], timeout=3)
    rank0.ack(first)


def test_the_rows_of_a_client_gone_for_good_are_ready_again_after_a_restart_at_once(local: Local) -> None:
    """A lease restored from the journal has an owner that never connected to the new controller: no disconnect
    grace runs for it. ``clients_gone`` (a supervisor saw the owner's process die) hands its rows back at the next
    tick, not at the lease's deadline (an hour here)."""
    local.start()
    dead = local.client("dead")
    dead.put(rows(1.0, 2), partition_id="p")
    dead.set_task_options("t", ack="explicit", lease_s=3600.0)
    leased = dead.get_meta(["x"], 2, partition_id="p", task_name="t")
    controller = local.start(local.crash())
    other = local.client("other")
    with pytest.raises(GetMetaTimeout, match="0 rows are ready"):  # held for the dead owner
        other.get_meta(["x"], 1, partition_id="p", task_name="t", timeout=0.3)
    with controller.lock:
        controller.state.clients_gone([dead.owner])
    again = other.get_meta(["x"], 2, partition_id="p", task_name="t", timeout=3)
    assert sorted(again.global_indexes.tolist()) == sorted(leased.global_indexes.tolist())


def test_an_ack_applied_before_a_crash_and_asked_again_after_the_restart_is_no_error(local: Local) -> None:
    """The controller died after writing an ack's record and before its reply: the client asks again (``again``) and
    the replayed rows, acknowledged with no holder kept, are no error; a plain second ack still is NotLeased. (With
    ``again`` any acknowledged row counts: an owner's id may be forgotten between its ack and the retry, so the
    rows cannot say whose ack it was.)"""
    local.start()
    owner = local.client("owner")
    owner.put(rows(1.0, 4), partition_id="p")
    owner.set_task_options("t", ack="explicit")
    leased = owner.get_meta(["x"], 2, partition_id="p", task_name="t")
    owner.ack(leased)  # its record written; the reply lost with the controller
    controller = local.start(local.crash())
    other = local.client("other")
    theirs = other.get_meta(["x"], 2, partition_id="p", task_name="t")
    other.ack(theirs)
    delivery = controller.state.delivery
    with controller.lock:
        uid = controller.state.table.known("p").uid
        mine = np.asarray(leased.global_indexes, dtype=np.int64)
        assert delivery.ack(uid, "t", mine, owner.owner, explicit=True, again=True) == {"acknowledged": 0}  # type: ignore[attr-defined]
        with pytest.raises(NotLeased, match=r"already acknowledged: \[" + str(mine[0])):
            delivery.ack(uid, "t", mine, owner.owner, explicit=True)  # type: ignore[attr-defined]
        with pytest.raises(NotLeased, match="already acknowledged"):  # another client's, acknowledged since
            delivery.ack(uid, "t", np.asarray(theirs.global_indexes), owner.owner, explicit=True)  # type: ignore[attr-defined]


def fail_opening_a_new_log(monkeypatch: pytest.MonkeyPatch, times: int = 1) -> list[int]:
    """The next ``times`` opens of a new log (a seal's) fail with ENOSPC; returns the list of failures counted."""
    real_open, failed = os.open, []

    def flaky_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(os.sep + LOG) and flags & os.O_TRUNC and len(failed) < times:
            failed.append(1)
            raise OSError(28, "No space left on device")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(journal_module.os, "open", flaky_open)
    return failed


def test_a_snapshot_that_cannot_begin_fails_no_reply_and_a_later_one_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass's record is written before its snapshot begins: a snapshot that cannot (its new log not opened) fails
    no reply, is counted, and leaves the log as it was; a later pass's snapshot is written, and a restart replays
    every row."""
    queue = Local(tmp_path / "journal", journal_snapshot_bytes=4096)
    try:
        controller = queue.start()
        journal = controller.journal
        assert journal is not None
        failed = fail_opening_a_new_log(monkeypatch)
        client = queue.client("c")
        puts = 0
        while not failed:
            client.put(rows(float(puts)), partition_id="p")  # never JournalError
            puts += 1
        client.put(rows(-1.0), partition_id="p")  # the next pass seals the log and begins the snapshot again
        with controller.lock:
            journal.wait()
            assert journal.stats["snapshot_failures"] == 1
            assert journal.stats["snapshots_written"] == journal.stats["snapshots"] >= 2
            assert journal_module.sealed_segments(str(journal.directory)) == []
        queue.start(queue.crash())
        assert queue.client("r").get_production_status(partition_id="p")["rows"] == 2 * (puts + 1)
    finally:
        queue.close()


def test_a_catch_up_snapshot_that_fails_at_start_is_logged_and_the_replayed_state_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal replayed over sealed segments writes a snapshot at once; one that cannot be written (a full disk)
    does not keep the controller from starting: the segments stay, and the next start replays them again."""
    state, journal, q = filled(tmp_path)
    writer = BlockedWriter(monkeypatch, fail=True)
    journal.snapshot(state, wait=False)
    more(state, journal, q)
    writer.release.set()
    journal.close()  # a sealed segment the snapshot never replaced
    monkeypatch.undo()

    def full_disk(directory: str, pieces: list[bytes]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal_module, "write_snapshot", full_disk)
    config = QueueConfig(global_batch_size=4, num_storage_units=2, journal_dir=str(tmp_path))
    restarted, again, replayed = open_journal(config)
    assert replayed and again.stats["snapshot_failures"] == 1 and again.stats["snapshots_written"] == 0
    assert len(journal_module.sealed_segments(str(tmp_path))) == 2  # the log was sealed too: both replayed
    again.close()
    assert restarted.table.known("p").num_rows == state.table.known("p").num_rows
    monkeypatch.undo()
    replayed_is_live(tmp_path, state)


def test_a_registered_sampler_is_fsynced_before_register_sampler_returns(tmp_path: Path) -> None:
    """journal_fsync="interval" leaves a pass's record to the next fsync; a registered sampler's is fsynced at once."""
    queue = Local(tmp_path / "journal", journal_fsync="interval")
    try:
        controller = queue.start()
        journal = controller.journal
        assert journal is not None
        with controller.lock:  # the interval never runs out: only an fsync of register_sampler's own counts
            journal.clock, journal._synced_at = (lambda: 0.0), 0.0
            fsyncs = journal.stats["fsyncs"]
        controller.register_sampler("t", CountingSampler("a"))
        with controller.lock:
            assert journal.stats["fsyncs"] == fsyncs + 1 and not journal._unsynced
    finally:
        queue.close()


# ---- a get_meta asked again after ServerGone (restart_retry_s) ---------------------------------------------------
def journaled(tmp_path: Path) -> tuple[QueueConfig, QueueState, Journal, QueueHarness]:
    config = QueueConfig(global_batch_size=4, num_storage_units=2, journal_dir=str(tmp_path))
    state, journal, _ = open_journal(config)
    q = QueueHarness(state)
    q.ok(p.SetTaskOptions("t", ack="explicit", lease_s=3600.0))
    q.put("p", 6)
    journal.record(state, None)
    return config, state, journal, q


def test_a_get_meta_whose_reply_died_with_the_controller_is_answered_with_its_journaled_lease(tmp_path: Path) -> None:
    """The controller leased rows to get_meta call 7, journaled the lease and died before its reply went out: the
    client asks again under the same call id (restart_retry_s) and the replayed controller answers with the rows of
    that lease, not new ones (before: two more rows, the first two leased for an hour to a client that never learned
    which they were). A new call id is served new rows; the owner acknowledges what it was told."""
    config, state, journal, q = journaled(tmp_path)
    lost = q.ok(p.GetMeta("p", ["x"], 2, "t", owner="o", call_id=7)).to_meta()  # its reply never arrives
    journal.record(state, None)
    journal.close()
    state, journal, replayed = open_journal(config)
    q = QueueHarness(state)
    assert replayed
    again = q.ok(p.GetMeta("p", ["x"], 2, "t", owner="o", call_id=7)).to_meta()
    assert sorted(again.global_indexes.tolist()) == sorted(lost.global_indexes.tolist())
    new = q.ok(p.GetMeta("p", ["x"], 2, "t", owner="o", call_id=8)).to_meta()
    assert not set(new.global_indexes.tolist()) & set(lost.global_indexes.tolist())
    for meta in (again, new):
        q.ok(p.Ack(meta.partition_uid, "t", p.pack_indexes(meta.global_indexes), owner="o", explicit=True))
    other = q.ok(p.GetMeta("p", ["x"], 2, "t", owner="other", call_id=7)).to_meta()  # the last two
    assert not set(other.global_indexes.tolist()) & {*lost.global_indexes, *new.global_indexes}
    assert row_state_counts(state.table.known("p"), "t")["acknowledged"] == 4
    journal.close()


def test_a_get_meta_asked_again_on_the_same_controller_gets_the_rows_it_was_served(tmp_path: Path) -> None:
    """The reply was lost with the connection, the controller lived on: the call asked again gets the same rows (the
    lease is its own still); once they are acknowledged or handed back, the call id names no lease and is served as
    a new call."""
    _, state, journal, q = journaled(tmp_path)
    first = q.ok(p.GetMeta("p", ["x"], 2, "t", owner="o", call_id=3)).to_meta()
    again = q.ok(p.GetMeta("p", ["x"], 2, "t", owner="o", call_id=3)).to_meta()
    assert again.global_indexes.tolist() == first.global_indexes.tolist()
    assert row_state_counts(state.table.known("p"), "t")["leased"] == 2
    q.ok(p.Release(first.partition_uid, "t", p.pack_indexes(first.global_indexes), owner="o"))
    assert len(q.ok(p.GetMeta("p", ["x"], 4, "t", owner="o", call_id=3)).to_meta()) == 4
    journal.close()


def test_a_get_meta_parked_when_the_controller_died_leaves_nothing_leased_and_is_served_once_asked_again(
    tmp_path: Path,
) -> None:
    """A parked get_meta leased nothing: the replayed controller holds no lease for it, and the call asked again
    waits as any new one and is served rows no other call holds."""
    config, state, journal, q = journaled(tmp_path)
    waiting = q.send(p.GetMeta("q", ["x"], 2, "t", owner="o", call_id=5))
    assert not waiting.done
    journal.record(state, None)
    journal.close()
    state, journal, _ = open_journal(config)
    q = QueueHarness(state)
    assert state.delivery.leases.leases == {}
    again = q.send(p.GetMeta("q", ["x"], 2, "t", owner="o", call_id=5))
    assert not again.done
    q.put("q", 2)
    assert again.done and again.result().to_meta().global_indexes.tolist() == [0, 1]
    assert row_state_counts(state.table.known("q"), "t")["leased"] == 2
    journal.close()


# ---- removing a journal (the queue shut down) -------------------------------------------------------------------
class Died(BaseException):
    """The process died here."""


@pytest.mark.parametrize("cut", range(6))
def test_a_journal_removal_cut_at_any_step_is_finished_by_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: int
) -> None:
    """The queue's shutdown removes its journal one file at a time; the process dies after ``cut`` of them (the
    marker ``removing`` written first). The next start finds no journal: it starts empty, presents no old identity,
    and leaves no marker (before: a snapshot removed and a log not was JournalCorrupt)."""
    fill(tmp_path)
    journal_module.write_identity(str(tmp_path), SESSION, SECRET, 5555)
    Path(tmp_path / f"{journal_module.SEALED}1").write_bytes(b"")  # a sealed segment too: every kind of file
    removed: list[str] = []
    real_remove = os.remove

    def remove(path: str) -> None:
        if len(removed) == cut:
            raise Died(path)
        real_remove(path)
        removed.append(os.path.basename(path))

    monkeypatch.setattr(os, "remove", remove)
    try:
        journal_module.remove_journal(str(tmp_path))
    except Died:
        pass
    monkeypatch.undo()
    if cut >= 5:  # every file removed (those that exist: snapshot, log, identity, the segment), then the marker
        assert os.listdir(tmp_path) == []
    else:
        assert journal_module.REMOVING in os.listdir(tmp_path) and len(removed) == cut
    assert journal_module.read_identity(str(tmp_path)) is None
    config = QueueConfig(global_batch_size=4, num_storage_units=2, journal_dir=str(tmp_path))
    state, journal, replayed = open_journal(config)
    assert not replayed and state.partitions == {}
    assert sorted(os.listdir(tmp_path)) == [LOG, SNAPSHOT]  # a new journal: no marker, no old identity
    journal.close()


# ---- automatic DP round numbers (no dp_group_id) ------------------------------------------------------------------
def auto_share(q: QueueHarness, rank: int, call_id: int, world_rank: bool, peer: object = None) -> Any:
    """Rank ``rank``'s next share of an automatic round (numbered per ``world_rank``, else per connection ``peer``)."""
    params: dict[str, Any] = {"dp_size": 2, "dp_rank": rank}
    if world_rank:
        params["world_rank"] = rank
    reply = q.send(p.GetMeta("p", ["x"], 1, "t", params, owner=f"rank{rank}", call_id=call_id), peer)
    assert reply.done
    return reply.result().to_meta()


@pytest.mark.parametrize("world_rank", [True, False], ids=["per-world-rank", "per-connection"])
def test_automatic_dp_round_numbers_go_on_after_a_restart(tmp_path: Path, world_rank: bool) -> None:
    """Rank 0 opened round auto-0 before the crash, rank 1 asks after the replay: rank 1 gets its share of that round,
    and rank 0's next call (on a new connection) opens auto-1 with new rows (before: the numbering began again at
    auto-0, so rank 0 was served its auto-0 share a second time)."""
    config, state, journal, q = journaled(tmp_path)
    first = auto_share(q, 0, 1, world_rank, peer=object())
    assert first.extra["dp_group_id"] == "auto-0"
    journal.record(state, None)
    journal.close()
    state, journal, _ = open_journal(config)
    q = QueueHarness(state)
    peer = auto_share(q, 1, 1, world_rank, peer=object())
    assert peer.extra["dp_group_id"] == "auto-0"
    assert not set(peer.global_indexes.tolist()) & set(first.global_indexes.tolist())
    rank0 = object()
    following = auto_share(q, 0, 2, world_rank, peer=rank0)
    assert following.extra["dp_group_id"] == "auto-1"
    assert not set(following.global_indexes.tolist()) & {*first.global_indexes, *peer.global_indexes}
    assert auto_share(q, 0, 3, world_rank, peer=rank0).extra["dp_group_id"] == "auto-2"
    journal.record(state, None)
    journal.close()
    state, journal, _ = open_journal(config)  # and again: the counters written by a record, not only a snapshot
    q = QueueHarness(state)
    assert auto_share(q, 1, 2, world_rank, peer=object()).extra["dp_group_id"] == "auto-1"
    q.put("p", 2)  # rows for round auto-3
    assert auto_share(q, 0, 4, world_rank, peer=object()).extra["dp_group_id"] == "auto-3"
    journal.close()


@pytest.mark.parametrize("world_rank", [True, False], ids=["per-world-rank", "per-connection"])
def test_an_automatic_dp_round_call_asked_again_keeps_its_round(tmp_path: Path, world_rank: bool) -> None:
    """A call of an automatic round asked again after ServerGone (the same owner and call id) is numbered as the
    first time, on the same controller and on a replayed one (a new connection): the rank stays in step with its
    peers (before: the retry took the next round, skipping the one whose share it was served)."""
    config, state, journal, q = journaled(tmp_path)
    conn = object()
    first = auto_share(q, 0, 1, world_rank, peer=conn)
    again = auto_share(q, 0, 1, world_rank, peer=conn)  # the reply was lost
    assert again.extra["dp_group_id"] == "auto-0" and again.global_indexes.tolist() == first.global_indexes.tolist()
    journal.record(state, None)
    journal.close()
    state, journal, _ = open_journal(config)
    q = QueueHarness(state)
    conn = object()
    replayed = auto_share(q, 0, 1, world_rank, peer=conn)
    assert replayed.extra["dp_group_id"] == "auto-0"
    assert replayed.global_indexes.tolist() == first.global_indexes.tolist()
    assert auto_share(q, 0, 2, world_rank, peer=conn).extra["dp_group_id"] == "auto-1"
    journal.close()


def test_after_a_restart_a_tp_peer_gets_the_share_of_the_round_its_peer_opened(tmp_path: Path) -> None:
    """TP peers A and B of dp_rank 0 are separate clients on their own connections: both fetched auto-0..2, A then
    fetched auto-3 and the controller died before B asked. After the replay B's next call gets A's share of auto-3
    (the same rows) and A's next call opens auto-4 with other rows (before: B's next call opened auto-4, B never
    fetched round 3, and A and B trained on different batches)."""
    config, state, journal, q = journaled(tmp_path)
    q.put("p", 4)  # rows for rounds auto-0..4 (two rows each)

    def share(owner: str, call_id: int, peer: object) -> Any:
        reply = q.send(p.GetMeta("p", ["x"], 1, "t", {"dp_size": 2, "dp_rank": 0}, owner=owner, call_id=call_id), peer)
        assert reply.done
        return reply.result().to_meta()

    conn_a, conn_b = object(), object()
    for call_id in (1, 2, 3):
        a, b = share("A", call_id, conn_a), share("B", call_id, conn_b)
        assert a.extra["dp_group_id"] == b.extra["dp_group_id"] == f"auto-{call_id - 1}"
    ahead = share("A", 4, conn_a)
    assert ahead.extra["dp_group_id"] == "auto-3"
    journal.record(state, None)
    journal.close()
    state, journal, _ = open_journal(config)
    q = QueueHarness(state)
    behind = share("B", 4, object())
    assert behind.extra["dp_group_id"] == "auto-3"
    assert behind.global_indexes.tolist() == ahead.global_indexes.tolist()
    following = share("A", 5, object())
    assert following.extra["dp_group_id"] == "auto-4"
    assert not set(following.global_indexes.tolist()) & set(ahead.global_indexes.tolist())
    journal.close()


def test_after_a_restart_a_client_gone_for_good_no_longer_decides_where_a_new_tp_peer_begins(tmp_path: Path) -> None:
    """TP peers A and B of dp_rank 0: both fetched auto-0 and auto-1, A went on to auto-3, and the controller died;
    B died while it was down. A goes on at auto-4. Once the supervisor says B is gone (``clients_gone``), B's
    replacement C (a client not seen before) joins A at auto-5, and the journal keeps that (before: C began at B's
    stale counter, auto-2, a round A had left behind, and was served rows A was trained on alone)."""
    config, state, journal, q = journaled(tmp_path)
    q.put("p", 8)

    def share(owner: str, call_id: int, peer: object) -> Any:
        reply = q.send(p.GetMeta("p", ["x"], 1, "t", {"dp_size": 2, "dp_rank": 0}, owner=owner, call_id=call_id), peer)
        assert reply.done
        return reply.result().to_meta()

    conn_a, conn_b = object(), object()
    for call_id in (1, 2):
        share("A", call_id, conn_a), share("B", call_id, conn_b)
    for call_id in (3, 4):
        share("A", call_id, conn_a)
    journal.record(state, None)
    journal.close()
    state, journal, _ = open_journal(config)
    q = QueueHarness(state)
    conn_a = object()
    assert share("A", 5, conn_a).extra["dp_group_id"] == "auto-4"
    state.clients_gone(["B"])
    a_next = share("A", 6, conn_a)
    c_first = share("C", 1, object())
    assert a_next.extra["dp_group_id"] == c_first.extra["dp_group_id"] == "auto-5"
    assert a_next.global_indexes.tolist() == c_first.global_indexes.tolist()  # TP peers: the same share
    journal.record(state, None)
    journal.close()
    state, journal, _ = open_journal(config)  # a second restart
    q = QueueHarness(state)
    assert share("D", 1, object()).extra["dp_group_id"] == "auto-6"  # from A's and C's counters, B's nowhere
    journal.close()


def test_a_client_whose_get_meta_reply_died_with_the_controller_asks_again_and_gets_the_same_rows(
    tmp_path: Path,
) -> None:
    """End to end, over sockets: the controller leases rows to a client's get_meta, writes the record and dies before
    the reply goes out; a new controller replays the journal on the same port; the client (``restart_retry_s``)
    asks again under the same call id and is answered with the rows of that lease, which it acknowledges; nothing
    else stays leased (before: two new rows, the first two leased for an hour to nobody who knew)."""
    queue = Local(tmp_path / "journal", restart_retry_s=30.0)
    try:
        controller = queue.start()
        client = queue.client("c")
        client.put(rows(1.0, 4), partition_id="p")
        client.set_task_options("t", ack="explicit", lease_s=3600.0)
        served: list[list[int]] = []
        died = threading.Event()
        send = controller._send_reply

        def lost(reply: Any, request_id: int, value: Any, error: BaseException | None) -> None:
            if isinstance(value, p.MetaWire) and not died.is_set():  # its record is written: the reply is lost
                served.append(value.to_meta().global_indexes.tolist())
                died.set()
                return
            send(reply, request_id, value, error)

        controller._send_reply = lost  # type: ignore[method-assign]
        restarted: list[ControllerServer] = []

        def restart() -> None:
            died.wait(30)
            restarted.append(queue.start(queue.crash()))

        thread = threading.Thread(target=restart)
        thread.start()
        meta = client.get_meta(["x"], 2, partition_id="p", task_name="t", timeout=10)
        thread.join(30)
        assert restarted and meta.global_indexes.tolist() in (served[0], sorted(served[0]))
        with restarted[0].lock:
            counts = row_state_counts(restarted[0].state.table.known("p"), "t")
        assert counts["leased"] == 2 and counts["ready"] == 2
        client.ack(meta)
    finally:
        queue.close()


@pytest.mark.parametrize("snapshot", [False, True])
def test_a_retired_unit_s_moved_copies_survive_a_restart_of_the_controller(tmp_path: Path, snapshot: bool) -> None:
    """replicas=2: where a retired unit's copies were moved and how far the move went are journaled (a record of the
    units' book, as a refill's progress is) and replayed, from the log or a snapshot: a replayed controller tells its
    clients the same holders and goes on from there."""
    from transfer_queue.state.lost_rows import start_move

    config = QueueConfig(global_batch_size=4, num_storage_units=3, replicas=2, journal_dir=str(tmp_path))
    state, journal, _ = open_journal(config)
    for _ in range(3):  # one put per unit
        QueueHarness(state).put("p", 1)
    journal.record(state, None)
    state.down_units.add(0)
    move = start_move(state, 0, ["", "", ""], {0})
    assert not isinstance(move, str)
    move.below, state.lost.blocks_rereplicated = 3, 2
    assert journal.record(state, set(), counters=True)
    if snapshot:
        journal.snapshot(state)
    journal.close()
    replayed, again, resumed = open_journal(config)
    try:
        assert resumed
        assert replayed.lost.moves == [move] and move.to == {1: 2, 2: 1}
        assert replayed.lost.move_of(0) == move and replayed.lost.retired == {0}
        assert replayed.lost.blocks_rereplicated == 2 and replayed.ledger.moved_to == {1, 2}
    finally:
        again.close()


def test_a_journal_of_moves_without_their_unit_s_restart_count_is_read_as_of_now() -> None:
    """A units' book journaled before a move kept its unit's restart count (four fields): the move is the unit's move
    as it stands (its restart count now)."""
    from transfer_queue.state.lost_rows import CopiesMoved
    from transfer_queue.state.snapshot import restore_units_book, units_book

    state = QueueState(QueueConfig(global_batch_size=4, num_storage_units=3, replicas=2))
    state.lost.restarts[0] = 2
    book = units_book(state)
    book["moves"] = [[0, {1: 2, 2: 1}, 6, 3]]
    restore_units_book(state, book)
    assert state.lost.moves == [CopiesMoved(0, {1: 2, 2: 1}, 6, 3, restart=2)] and state.lost.move_of(0) is not None


def test_the_identity_keeps_where_each_unit_listens_and_the_replica_pairs(tmp_path: Path) -> None:
    """A controller started again must know where a unit dead for good listened (it is left out of the start) and the
    pairs fixed at the queue's start (a unit Ray restarted on another node keeps its partner); an identity written
    before they were kept reads without them."""
    units = [["tcp://10.0.0.1:5000", None, "h1", "n1"], ["tcp://10.0.0.2:5001", "/tmp/s.sock", "h2", "n2"]]
    journal_module.write_identity(str(tmp_path), SESSION, SECRET, 5555, units, [1, 0])
    identity = journal_module.read_identity(str(tmp_path))
    assert identity is not None
    assert (identity["units"], identity["replica_of"], identity["port"]) == (units, [1, 0], 5555)
    journal_module.write_identity(str(tmp_path), SESSION, SECRET, 5555)
    identity = journal_module.read_identity(str(tmp_path))
    assert identity is not None and "units" not in identity and "replica_of" not in identity
