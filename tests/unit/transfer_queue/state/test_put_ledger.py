"""PutLedger alone (no QueueState, no wire format, no Ray): reserve / commit / abort, idempotent commits by put id,
expiry of abandoned puts, and the bytes and blocks puts hold."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from transfer_queue.config import QueueConfig
from transfer_queue.errors import (
    IncompleteGroups,
    InvalidRequest,
    PutExpired,
    QueueFull,
    RequestTimeout,
    StaleBatchMeta,
)
from transfer_queue.metadata import FieldSchema
from transfer_queue.state import put_ledger
from transfer_queue.state.partition_table import PartitionTable
from transfer_queue.state.put_ledger import PutLedger, PutRequest

X = {"x": FieldSchema("dense", "float32", ())}


@dataclass
class Books:
    """A ledger over a partition table, on a fake clock, recording what it asks of the rest of the queue."""

    config: QueueConfig
    now: list[float] = field(default_factory=lambda: [0.0])
    woken: list[float] = field(default_factory=list)
    changed: list[object] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    drops: list[tuple[int, int, list[int], int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.table = PartitionTable(self.config)
        self.ledger = PutLedger(
            self.config,
            self.table,
            lambda: self.now[0],
            self.woken.append,
            lambda key, rows, fields: self.changed.append(key),
            lambda: self.freed.append(1),
            lambda *drop: self.drops.append(drop),
        )

    def reserve(self, partition, num_rows, nbytes=None, **kw):
        req = PutRequest(partition, num_rows, X, 4 * num_rows if nbytes is None else nbytes, **kw)
        return self.ledger.try_reserve(self.ledger.validate(req))


def books(**config) -> Books:
    return Books(QueueConfig(**{"global_batch_size": 4, **config}))


def test_a_reservation_is_invisible_until_its_commit():
    b = books()
    reserved = b.reserve(0, 4)
    assert reserved.global_indexes.tolist() == [0, 1, 2, 3]
    part = b.table.partitions[0]
    assert part.num_committed == 0 and b.ledger.bytes_held == 16 and b.ledger.in_flight(part.uid)
    assert [(start, stop) for _, _, start, stop in reserved.placements] == [(0, 4)]
    meta = b.ledger.commit(reserved.put_id)
    assert meta.global_indexes.tolist() == [0, 1, 2, 3] and list(meta.fields) == ["x"]
    assert part.num_committed == 4 and not b.ledger.in_flight(part.uid)
    assert b.changed == [0]  # the partition's waiting getters are retried


def test_a_retried_commit_gets_the_same_meta_and_never_doubles_rows():
    b = books(global_batch_size=8)
    reserved = b.reserve(0, 4)
    first = b.ledger.commit(reserved.put_id)
    again = b.ledger.commit(reserved.put_id)
    assert again is first
    assert b.table.partitions[0].num_committed == 4
    b.now[0] = 10_000.0  # past the put's reservation deadline: the commit is forgotten
    b.ledger.expire(b.now[0])
    with pytest.raises(PutExpired, match=f"put {reserved.put_id} expired, was aborted"):
        b.ledger.commit(reserved.put_id)


def test_a_retried_commit_forgotten_for_want_of_room_is_told_its_outcome_is_unknown(monkeypatch):
    monkeypatch.setattr(put_ledger, "COMMITS_REMEMBERED", 2)
    b = books(global_batch_size=8)
    puts = [b.reserve(0, 2).put_id for _ in range(3)]
    for put_id in puts:
        b.ledger.commit(put_id)
    assert b.table.partitions[0].num_committed == 6
    # the first commit was applied, then forgotten: saying "none of its rows are visible" would be a lie
    with pytest.raises(RequestTimeout, match=f"put {puts[0]}: its commit is no longer remembered .* is unknown"):
        b.ledger.commit(puts[0])
    assert b.ledger.commit(puts[2]).global_indexes.tolist() == [4, 5]  # the recent ones are still answered


def test_an_abort_frees_rows_bytes_and_blocks():
    b = books()
    reserved = b.reserve("s", 3, nbytes=30)
    b.ledger.abort(reserved.put_id)
    part = b.table.partitions["s"]
    assert b.ledger.bytes_held == 0 and part.nbytes == 0 and not b.ledger.open_puts
    assert sorted(block for _, _, blocks, _ in b.drops for block in blocks) == sorted(
        block for _, block, _, _ in reserved.placements
    )
    assert b.freed  # waiting putters are retried
    with pytest.raises(PutExpired, match="none of its rows are visible"):
        b.ledger.commit(reserved.put_id)
    assert b.reserve("s", 3).global_indexes.tolist() == [0, 1, 2]  # the rows are free again


def test_an_abandoned_put_is_aborted_at_its_capped_deadline():
    b = books(max_reservation_s=5.0, put_grace=1.0)
    reserved = b.reserve(0, 4, timeout=1e6)  # a huge timeout does not hold the rows for long
    assert b.woken == [6.0]
    b.ledger.expire(5.9)
    assert reserved.put_id in b.ledger.open_puts
    b.ledger.expire(6.0)
    assert not b.ledger.open_puts and b.ledger.bytes_held == 0


def test_a_closed_connection_brings_its_puts_deadline_forward():
    b = books()
    reserved = b.reserve(0, 4)
    b.ledger.open_puts[reserved.put_id].owner = "conn"
    b.ledger.peer_closed("other", 2.0)
    assert b.ledger.deadlines() == [30.0 + 30.0]
    b.ledger.peer_closed("conn", 2.0)
    assert b.ledger.deadlines() == [2.0] and b.woken[-1] == 2.0


def test_a_put_waits_for_bytes_and_for_a_slot_in_the_step_ring():
    b = books(storage_unit_bytes=10, num_storage_units=1)
    assert b.reserve(0, 4, nbytes=8) is not None
    assert b.reserve("s", 1, nbytes=4) is None  # 8 + 4 > 10 bytes: wait
    req = PutRequest("s", 1, X, 4)
    assert b.ledger.timeout_error(req, 2.0).args[0] == (
        "put to partition_id='s' waited 2.0 s for storage space: 8 of 10 bytes are held and the put needs 4"
    )
    assert b.reserve(1, 4, nbytes=0) is None  # num_global_batch=1 step is live
    assert "for a free slot in the step ring" in str(b.ledger.timeout_error(PutRequest(1, 4, X, 0), 1.0))
    with pytest.raises(QueueFull, match="a put of 11 bytes can never fit: the storage units hold 10 bytes"):
        b.reserve("s", 1, nbytes=11)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_rows": 0}, InvalidRequest, "a put needs at least one row, got num_rows=0"),
        ({"timeout": float("inf")}, InvalidRequest, "timeout must be a finite number of seconds > 0"),
        ({"keys": ["a", "a"]}, InvalidRequest, "a put by key needs 2 distinct keys"),
        ({"lengths": np.arange(3)}, InvalidRequest, "lengths has 3 entries; the put has 2 rows"),
        ({"num_n": 4}, IncompleteGroups, "must hold whole groups of num_n_samples=4"),
    ],
)
def test_a_bad_put_is_refused_before_it_takes_anything(kwargs, error, match):
    b = books(num_n_samples=kwargs.pop("num_n", 1))
    req = PutRequest("s", kwargs.pop("num_rows", 2), X, 8, **kwargs)
    with pytest.raises(error, match=match):
        b.ledger.validate(req)
    assert b.table.partitions == {} and b.ledger.bytes_held == 0


def test_a_put_with_metadata_from_before_a_clear_is_stale():
    b = books()
    reserved = b.reserve("s", 2)
    b.ledger.commit(reserved.put_id)
    uid = reserved.partition_uid
    b.table.remove("s")
    b.ledger.commit(b.reserve("s", 2).put_id)  # a put opens the name again, as a new partition
    req = PutRequest("s", 2, {"y": X["x"]}, 8, target_uid=uid, target_indexes=np.arange(2))
    with pytest.raises(StaleBatchMeta, match="from before a clear of partition_id='s'"):
        b.ledger.try_reserve(b.ledger.validate(req))


def test_committed_blocks_carry_the_puts_bytes_and_the_floor_follows_open_puts():
    b = books()
    first = b.reserve("s", 4, nbytes=10)
    second = b.reserve("s", 2, nbytes=6)
    b.ledger.commit(first.put_id)
    part = b.table.partitions["s"]
    assert sum(part.block_nbytes.values()) == 10  # split over its blocks by rows, summing exactly
    assert b.ledger.block_floor() == min(block for _, block, _, _ in second.placements)
    b.ledger.commit(second.put_id)
    assert b.ledger.block_floor() == b.ledger.next_block * b.config.num_storage_units
    b.ledger.drop_blocks(part, list(part.block_nbytes))
    assert b.ledger.bytes_held == 0 and part.nbytes == 0


def test_a_commit_that_arrives_after_the_puts_deadline_is_refused_even_before_the_timer_aborts_it(make_queue) -> None:
    # the controller's serving thread was busy past the deadline: the commit is read before the timer runs, and the
    # client has given up by then, so the rows must stay invisible (issue 23 defect 1)
    q = make_queue(put_grace=1.0)
    reservation = q.reserve(0, 4, timeout=2.0)
    q.now[0] += 3.5  # past 2.0 + 1.0, no tick yet
    with pytest.raises(PutExpired, match=f"put {reservation.put_id} was not committed within its deadline"):
        q.commit(reservation)
    assert not q.state.ledger.open_puts and not q.state.ledger.committed  # aborted: rows and bytes freed
    with pytest.raises(PutExpired):  # a retry is refused the same way
        q.commit(reservation)


def test_a_reservation_tells_the_client_how_long_its_commit_is_accepted(make_queue) -> None:
    q = make_queue(put_grace=1.5)
    reservation = q.reserve(0, 4, timeout=2.0)
    assert reservation.commit_within == pytest.approx(3.5)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_put_that_cannot_be_placed_takes_no_row_and_marks_no_field(replicas: int) -> None:
    """Every unit it could go on is down (replicas=2 over two units: one down leaves no unit whose partner lives): the
    put is refused, StorageUnavailable, and the same put once a unit is back is served; before, the refused put into
    existing rows left their fields marked as being written (the retry: FieldAlreadyProduced) and a put of new rows
    left its rows taken."""
    from transfer_queue.errors import StorageUnavailable

    b = books(num_storage_units=2, replicas=replicas)
    created = b.ledger.commit(b.reserve("p", 4).put_id)
    b.ledger.down_units |= {0, 1} if replicas == 1 else {0}
    y = {"y": FieldSchema("dense", "float32", ())}
    into = PutRequest("p", 4, y, 16, target_uid=created.partition_uid, target_indexes=created.global_indexes)
    with pytest.raises(StorageUnavailable, match="no put can be placed"):
        b.ledger.try_reserve(b.ledger.validate(into))
    with pytest.raises(StorageUnavailable, match="no put can be placed"):
        b.reserve("p", 4)
    b.ledger.down_units.clear()
    assert b.ledger.try_reserve(b.ledger.validate(into)) is not None  # the same fields of the same rows
    assert b.reserve("p", 4).global_indexes.tolist() == [4, 5, 6, 7]  # the refused put took no row
