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
"""

from __future__ import annotations

import argparse
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
    ok(table, p.SetTaskOptions("t", ack="explicit"))
    record_s: list[float] = []
    started = time.perf_counter()
    for part in range(rows // partition_rows):
        name = f"p{part}"
        for _ in range(partition_rows // put_rows):
            put(table, name, put_rows)
            t = time.perf_counter()
            journal.record(state, {name})
            if journal.snapshot_due():
                journal.snapshot(state)
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
        for held in (1_000, 100_000, 1_000_000):
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
