"""What the controller's journal (``journal_dir``) costs at scale, and how long a restarted controller takes to
replay it.

    .venv/bin/python benchmarks/journal_recovery.py                 # 100k and 1M rows
    .venv/bin/python benchmarks/journal_recovery.py --rows 100000

No Ray, no sockets: a QueueState in this process, filled by puts of ``--put-rows`` rows into partitions of
``--partition-rows`` rows each, half of every partition consumed and acknowledged by a task, the journal written
after every put and every get_meta as the serving loop does (one record per pass: the rows of the partitions it
touched that changed; a snapshot once the log outgrows ``journal_snapshot_bytes`` and the last snapshot). Then the
journal is opened again, as a controller restarted over it does (snapshot loaded, log replayed, state rebuilt):
that time is the recovery time. Also: the cost of one record for a put into a partition that already holds N rows
(a record holds the rows the put changed and their groups' and blocks' entries, whatever the partition's size).

The serving pause of a snapshot: the replayed state is served by a ControllerServer (two StorageServers, a client
over TCP, all in this process); a thread pings it (``list_partitions``) in a loop, a snapshot is made due, and the
longest gap between two answered pings while it is taken (from the pass that begins it until it is written) is the
pause, next to the longest gap of as many pings with no snapshot.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

from transfer_queue.config import QueueConfig  # noqa: E402
from transfer_queue.controller.requests import RequestTable  # noqa: E402
from transfer_queue.metadata import FieldSchema  # noqa: E402
from transfer_queue.state.journal import LOG, SNAPSHOT, open_journal  # noqa: E402
from transfer_queue.wire import protocol as p  # noqa: E402

FIELDS = {"x": FieldSchema("dense", "float32", (4,)), "y": FieldSchema("dense", "int64", ())}


def ok(table: RequestTable, request: object) -> object:
    out: list[tuple[object, BaseException | None]] = []
    table.handle(request, lambda value, error: out.append((value, error)))
    ((value, error),) = out
    if error is not None:
        raise error
    return value


def put(table: RequestTable, partition: str, rows: int) -> None:
    reservation = ok(table, p.Reserve(partition, rows, FIELDS, 24 * rows, None, None, None, None, None, 30.0))
    ok(table, p.Commit(reservation.put_id))  # type: ignore[attr-defined]


def fill(directory: str, rows: int, put_rows: int, partition_rows: int, fsync: str) -> dict[str, float]:
    config = QueueConfig(
        global_batch_size=64,
        num_storage_units=2,
        journal_dir=directory,
        journal_fsync=fsync,
        storage_unit_bytes=1 << 40,
    )
    state, journal, _ = open_journal(config)
    table = RequestTable(state)
    wait = {"wait": False} if "wait" in inspect.signature(journal.snapshot).parameters else {}
    ok(table, p.SetTaskOptions("t", ack="explicit"))
    record_s: list[float] = []
    started = time.perf_counter()
    for part in range(rows // partition_rows):
        name = f"p{part}"
        for _ in range(partition_rows // put_rows):
            put(table, name, put_rows)
            t = time.perf_counter()
            journal.record(state, {name})
            if journal.snapshot_due():  # as the serving loop does (a build without wait= writes it in place)
                journal.snapshot(state, **wait)
            record_s.append(time.perf_counter() - t)
        meta = ok(table, p.GetMeta(name, ["x"], partition_rows // 2, "t", timeout=1.0, owner="bench"))
        uid, indexes = meta.partition_uid, meta.global_indexes  # type: ignore[attr-defined]
        ok(table, p.Ack(uid, "t", indexes, owner="bench", explicit=True))
        journal.record(state, {name})
    filled = time.perf_counter() - started
    journal.close()
    return {
        "fill_s": filled,
        "record_ms_median": 1e3 * statistics.median(record_s),
        "record_ms_max": 1e3 * max(record_s),
        "snapshots": journal.stats["snapshots"],
        "snapshot_mb": os.path.getsize(os.path.join(directory, SNAPSHOT)) / 1e6,
        "log_mb": os.path.getsize(os.path.join(directory, LOG)) / 1e6,
        "committed": sum(part.num_committed for part in state.partitions.values()),
    }


def recover(directory: str) -> tuple[float, int]:
    config = QueueConfig(global_batch_size=64, num_storage_units=2, journal_dir=directory, storage_unit_bytes=1 << 40)
    t = time.perf_counter()
    state, journal, replayed = open_journal(config)
    took = time.perf_counter() - t
    assert replayed
    journal.close()
    return took, sum(part.num_committed for part in state.partitions.values())


def serving_pause(directory: str, quiet_s: float = 1.0) -> dict[str, float]:
    """The longest gap between answered pings while a snapshot of the journal under ``directory`` is taken by the
    serving controller, the snapshot's time from due to written, and the longest gap of ``quiet_s`` without one."""
    import threading

    from transfer_queue.client import TransferQueueClient
    from transfer_queue.controller.server import ControllerServer
    from transfer_queue.storage.unit import BlockStore, StorageServer

    session, secret = "b" * 32, b"s" * 32
    config = QueueConfig(global_batch_size=64, num_storage_units=2, journal_dir=directory, storage_unit_bytes=1 << 40)
    state, journal, _ = open_journal(config)
    journal.snapshot_bytes = 1 << 40  # no snapshot until the pings have run a while
    units = [StorageServer(BlockStore(u, 2, secret), "127.0.0.1", session, secret) for u in range(2)]
    endpoints = [u.endpoint for u in units]
    controller = ControllerServer(state, session, endpoints, "127.0.0.1", secret, journal=journal)
    info = p.ControllerInfo(p.PROTOCOL_VERSION, session, controller.endpoint, endpoints, config.to_dict(), secret)
    client = TransferQueueClient("pinger", info, force_tcp=True)
    answered: list[float] = []
    stop = threading.Event()

    def pinger() -> None:
        while not stop.is_set():
            client.list_partitions()
            answered.append(time.perf_counter())

    def written() -> float:  # this build counts snapshots written apart from begun; an older one writes them in place
        return journal.stats.get("snapshots_written", journal.stats["snapshots"])

    thread = threading.Thread(target=pinger, daemon=True)
    thread.start()
    try:
        time.sleep(quiet_s)
        quiet = list(answered)
        before = written()
        with controller.lock:  # due now: the log is longer than a bound of 0 B (the next pass begins it)
            journal.snapshot_bytes, journal.snapshot_size = 0, 0
            journal.log_bytes = max(journal.log_bytes, 1)
            due = time.perf_counter()
        while written() == before:
            time.sleep(0.001)
        done = time.perf_counter()
        with controller.lock:
            journal.snapshot_bytes = 1 << 40
        time.sleep(0.2)
    finally:
        stop.set()
        thread.join()
        client.close()
        controller.stop()
        for unit in units:
            unit.stop()

    def longest(times: list[float]) -> float:
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    # from the last ping answered before the snapshot was due to the first answered after it was written
    during = [max((t for t in answered if t < due), default=due), *[t for t in answered if due <= t <= done]]
    during.append(min((t for t in answered if t > done), default=done))
    return {
        "pause_s": longest(during),
        "quiet_s": longest(quiet),
        "snapshot_s": done - due,
        "pings": len(answered),
        "encode_s": journal.stats.get("snapshot_pause_s", float("nan")),  # this build: the serving thread's part
    }


def record_cost(directory: str, held: int, reps: int = 20) -> tuple[float, int]:
    """Median ms and bytes of one record after a 64-row put into a partition already holding ``held`` rows."""
    config = QueueConfig(global_batch_size=64, num_storage_units=2, journal_dir=directory, journal_fsync="never")
    state, journal, _ = open_journal(config)
    table = RequestTable(state)
    put(table, "big", held)
    journal.record(state, {"big"})
    times, sizes = [], []
    for _ in range(reps):
        put(table, "big", 64)
        t = time.perf_counter()
        sizes.append(journal.record(state, {"big"}))
        times.append(time.perf_counter() - t)
    journal.close()
    return 1e3 * statistics.median(times), int(statistics.median(sizes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, action="append", default=[])
    parser.add_argument("--put-rows", type=int, default=1000)
    parser.add_argument("--partition-rows", type=int, default=10_000)
    parser.add_argument("--fsync", default="never", choices=("always", "interval", "never"))
    parser.add_argument("--dir", default=None, help="where to write the journals (default: a temporary directory)")
    parser.add_argument("--no-record-cost", action="store_true", help="skip the one-record costs")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="tq-journal-", dir=args.dir)
    try:
        for rows in args.rows or [100_000, 1_000_000]:
            directory = os.path.join(base, f"rows{rows}")
            filled = fill(directory, rows, args.put_rows, args.partition_rows, args.fsync)
            took, committed = recover(directory)
            assert committed == filled["committed"] == rows, (committed, filled["committed"], rows)
            print(
                f"{rows:>9} rows ({rows // args.partition_rows} partitions, puts of {args.put_rows}, fsync="
                f"{args.fsync}): recovery {took:.3f} s; journal {filled['snapshot_mb']:.1f} MB snapshot + "
                f"{filled['log_mb']:.1f} MB log, {filled['snapshots']} snapshots while filling; record per put "
                f"median {filled['record_ms_median']:.3f} ms, max {filled['record_ms_max']:.1f} ms",
                flush=True,
            )
            pause = serving_pause(directory)
            print(
                f"{rows:>9} rows: serving pause of a snapshot (longest gap between answered pings) "
                f"{1e3 * pause['pause_s']:.1f} ms; the snapshot took {1e3 * pause['snapshot_s']:.0f} ms from due to "
                f"written (the serving thread's part: {1e3 * pause['encode_s']:.0f} ms); longest gap with no snapshot "
                f"{1e3 * pause['quiet_s']:.1f} ms ({pause['pings']} pings)",
                flush=True,
            )
        for held in () if args.no_record_cost else (1_000, 100_000, 1_000_000):
            ms, size = record_cost(os.path.join(base, f"held{held}"), held)
            print(
                f"one record for a 64-row put into a partition of {held:>9} rows: {ms:.3f} ms, {size} bytes",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    _ = np  # numpy is what the state is made of; imported here so its import time is not in the figures


if __name__ == "__main__":
    main()
