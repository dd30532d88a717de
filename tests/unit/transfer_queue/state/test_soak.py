"""A long run's memory stays flat (issue 8 defect 8): put / consume / clear cycles driven through QueueState and
two storage BlockStores directly (no Ray, no sockets).

Each cycle touches everything that used to grow: a fresh global step (put by a connection that then closes, a
get_meta parked before the put, an automatic DP round of two TP peers, a clear), a fresh string partition (put,
get, clear: a cleared name), a kv upsert in a long-lived partition (a dropped block: a storage tombstone), and a
new task name on that partition (per-task state). The structures are measured against their bounds and the
process's resident memory is compared between the end of the warm-up and the end.

How long the slow soak runs: each bounded structure reaches its bound within 2,600 cycles (a new task name every 20
cycles against 128 tasks per partition is the last; with idle tasks never forgotten the soak fails at cycle ~2,580,
with cleared names or commits unbounded sooner), so 16,000 cycles cross every bound several times. Resident memory
may grow by LEAK_BYTES_PER_CYCLE per measured cycle (200 bytes: what 16 MiB over 80,000 cycles allowed when the soak
ran 100,000); a leak of 290 bytes a cycle in no measured structure grew it by 3.6 MiB over 12,000 cycles (2.3 MiB
allowed), a run without one by 0.1 MiB.
"""

from __future__ import annotations

import ctypes
import gc
import os
from typing import Any

import numpy as np
import pytest
import torch

from transfer_queue.config import QueueConfig
from transfer_queue.controller.requests import RequestTable
from transfer_queue.metadata import FieldSchema
from transfer_queue.state import partition, partition_table, put_ledger
from transfer_queue.state.queue_state import QueueState
from transfer_queue.storage.unit import BlockStore
from transfer_queue.wire import protocol as p
from transfer_queue.wire.columns import columns_from_tensordict

X = {"x": FieldSchema("dense", "float32", ())}
UNITS = 2
SOAK_CYCLES, SOAK_WARMUP = 16_000, 4_000
LEAK_BYTES_PER_CYCLE = 200


def rss_bytes() -> int:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Soak:
    """A QueueState wired to its storage units by hand: writes, reads and the controller's drop messages."""

    def __init__(self) -> None:
        self.now = [0.0]
        config = QueueConfig(4, num_global_batch=2, num_storage_units=UNITS, disconnect_grace=0.5)
        self.state = QueueState(config, clock=lambda: self.now[0])
        self.table = RequestTable(self.state)
        self.stores = [BlockStore(u, UNITS) for u in range(UNITS)]
        _, columns = columns_from_tensordict({"x": torch.arange(4, dtype=torch.float32)})
        self.column = columns["x"]

    def call(self, request: Any, peer: Any = None) -> Any:
        out: list[Any] = []
        self.table.handle(request, lambda value, error: out.append((value, error)), peer)
        self.deliver()
        if not out:
            return None  # parked
        value, error = out[0]
        if error is not None:
            raise error
        return value

    def deliver(self) -> None:
        for unit, message in self.table.take_outbox():
            if isinstance(message, p.DropBlocks):
                self.stores[unit].drop_blocks(message.partition_uid, message.block_ids, message.block_floor)
            else:
                self.stores[unit].drop_partition(
                    message.partition_uid, message.live_uids, message.max_uid, message.block_floor
                )

    def put(self, partition: Any, rows: int, peer: Any = None, keys: list[str] | None = None) -> p.MetaWire:
        reserve = p.Reserve(partition, rows, X, 4 * rows, keys=keys, timeout=5.0)
        reservation: p.Reservation = self.call(reserve, peer)
        for place in reservation.placements:
            part = self.column.slice(place.start, place.stop) if rows == 4 else self.column.slice(0, rows)
            spec = p.ColumnSpec("x", part.schema, part.num_rows, len(part.buffers()))
            frames = [np.frombuffer(bytearray(bytes(memoryview(b))), dtype=np.uint8) for b in part.buffers()]
            write = p.Write(reservation.partition_uid, place.block_id, place.stop - place.start, [spec])
            self.stores[place.unit].write(write, frames)
        return self.call(p.Commit(reservation.put_id), peer)

    def read(self, wire: p.MetaWire) -> int:
        blocks, offsets = p.unpack_indexes(wire.blocks), p.unpack_indexes(wire.offsets)
        got = 0
        for unit in range(UNITS):
            mine = blocks % UNITS == unit
            if mine.any():
                field = p.ReadField("x", p.pack_indexes(blocks[mine]), p.pack_indexes(offsets[mine]))
                reply, _ = self.stores[unit].read(p.Read(wire.partition_uid, [field]))
                got += reply.columns[0].num_rows
        return got

    def cycle(self, i: int) -> None:
        # a step: a reader parked before the put, a producer whose connection then closes, TP peers of a DP round
        parked: list[Any] = []
        waiting = p.GetMeta(i, ["x"], 2, "reader", timeout=5.0)
        self.table.handle(waiting, lambda value, error: parked.append((value, error)), f"reader-{i}")
        self.put(i, 4, peer=f"producer-{i}")
        self.state.on_disconnect(f"producer-{i}")
        assert parked and parked[0][1] is None and self.read(parked[0][0]) == 2
        dp = {"dp_size": 2, "dp_rank": 0}
        shares = [self.call(p.GetMeta(i, ["x"], 1, "dp", dp), peer) for peer in ("tp0", "tp1")]
        assert shares[0].global_indexes == shares[1].global_indexes
        self.call(p.Clear(i))
        # a fresh string partition: put, get, clear (its name is remembered as cleared, boundedly)
        self.put(f"s{i}", 4)
        assert self.read(self.call(p.GetMeta(f"s{i}", ["x"], 4, "train"))) == 4
        self.call(p.Clear(f"s{i}"))
        # a long-lived kv partition: an upsert drops the old value's block; every 20th cycle a new task name reads
        # and gives back
        self.put("kv", 1, keys=[f"k{i % 8}"])
        task = f"task-{i // 20}"
        meta = self.call(p.GetMeta("kv", ["x"], 1, task))
        self.call(p.Release(meta.partition_uid, task, meta.global_indexes))
        self.now[0] += 0.01
        self.state.tick()
        self.deliver()

    def sizes(self) -> dict[str, int]:
        kv = self.state.partitions["kv"]
        return {
            "partitions": len(self.state.partitions),
            "cleared_names": len(self.state.cleared_names),
            "committed": len(self.state.committed),
            "auto_rounds": len(self.state.auto_rounds),
            "open_puts": len(self.state.open_puts),
            "parked": len(self.state.putters) + sum(map(len, self.state.getters.values())),
            "kv_tasks": len(kv.tasks),
            "kv_rounds": len(kv.rounds),
            "dead_partitions": sum(len(s.dead_partitions) for s in self.stores),
            "dead_blocks": sum(len(b) for s in self.stores for b in s.dead_blocks.values()),
            "blocks": sum(len(s.blocks) for s in self.stores),
            "by_partition": sum(len(s.by_partition) for s in self.stores),
        }


def run_soak(cycles: int, warmup: int) -> dict[str, Any]:
    soak = Soak()
    for i in range(warmup):
        soak.cycle(i)
    before, sizes_before = rss_bytes(), soak.sizes()
    for i in range(warmup, cycles):
        soak.cycle(i)
        if (i + 1) % 10_000 == 0:
            print(f"soak: {i + 1} cycles, rss {rss_bytes() / 2**20:.1f} MiB, {soak.sizes()}", flush=True)
    after, sizes_after = rss_bytes(), soak.sizes()
    bounds = {
        "partitions": 2,  # the kv partition and at most one live step
        "cleared_names": partition_table.CLEARED_NAMES_REMEMBERED,
        "committed": put_ledger.COMMITS_REMEMBERED,
        "auto_rounds": 0,
        "open_puts": 0,
        "parked": 0,
        "kv_tasks": partition.MAX_TASKS_PER_PARTITION,
        "kv_rounds": 0,
        "dead_partitions": 0,
        "dead_blocks": 0,
        "blocks": UNITS * 8,  # the kv partition's eight live values, at most one block per unit each
        "by_partition": UNITS,
    }
    for name, bound in bounds.items():
        assert sizes_after[name] <= bound, f"{name}: {sizes_after[name]} > {bound} after {cycles} cycles"
    return {"rss_before": before, "rss_after": after, "sizes_before": sizes_before, "sizes_after": sizes_after}


def test_a_short_soak_keeps_every_structure_within_its_bound(monkeypatch):
    # lowered bounds, so that a few hundred cycles cross each of them several times
    monkeypatch.setattr(partition_table, "CLEARED_NAMES_REMEMBERED", 50)
    monkeypatch.setattr(put_ledger, "COMMITS_REMEMBERED", 50)
    monkeypatch.setattr(partition, "MAX_TASKS_PER_PARTITION", 4)
    result = run_soak(600, 100)
    assert result["sizes_after"]["cleared_names"] == 50 and result["sizes_after"]["committed"] == 50


@pytest.mark.slow
@pytest.mark.timeout(1800)  # about 1.5 minutes on a quiet 2-core machine; much longer under load
def test_a_long_soak_keeps_controller_and_storage_memory_flat():
    result = run_soak(SOAK_CYCLES, SOAK_WARMUP)
    grown, measured = result["rss_after"] - result["rss_before"], SOAK_CYCLES - SOAK_WARMUP
    print(
        f"\nsoak: rss {result['rss_before'] / 2**20:.1f} MiB after {SOAK_WARMUP:,} cycles, "
        f"{result['rss_after'] / 2**20:.1f} MiB after {SOAK_CYCLES:,} ({grown / 2**20:+.1f} MiB); "
        f"structures {result['sizes_after']}"
    )
    allowed = LEAK_BYTES_PER_CYCLE * measured
    assert grown < allowed, (
        f"resident memory grew by {grown / 2**20:.2f} MiB over {measured:,} cycles; "
        f"at most {allowed / 2**20:.2f} MiB ({LEAK_BYTES_PER_CYCLE} bytes a cycle) expected"
    )
