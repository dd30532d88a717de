"""Delivery alone (no QueueState, no wire format, no Ray): leases, acknowledgements, releases, expiry, dead letters
over a partition's per-row arrays. tests/unit/transfer_queue/state/test_delivery.py drives the same rules through
QueueState."""

from __future__ import annotations

import numpy as np
import pytest

from transfer_queue.config import QueueConfig
from transfer_queue.errors import InvalidRequest, NotLeased, StaleBatchMeta
from transfer_queue.metadata import FieldSchema
from transfer_queue.state.delivery import Delivery, TaskOptions
from transfer_queue.state.partition import PartitionState
from transfer_queue.state.partition_status import dead_letters
from transfer_queue.state.partition_table import PartitionTable
from transfer_queue.state.ready_index import AVAILABLE, CONSUMED, DEAD, LEASED

F32 = FieldSchema("dense", "float32", ())


class World:
    """One string partition ``s`` with ``rows`` committed rows of field ``x``, and a Delivery over it."""

    def __init__(self, rows: int = 4, **config):
        self.now = [0.0]
        self.woken: list[float] = []
        self.back: list[object] = []
        self.table = PartitionTable(QueueConfig(**{"global_batch_size": 4, **config}))
        part = self.table.open("s", keyed=False)
        assert part is not None
        self.part: PartitionState = part
        taken = part.allocate(rows, None)
        part.add_fields({"x": F32})
        mask = part.begin_write(taken, ["x"], upsert=False)
        part.end_write(taken, mask)
        part.commit(taken, ["x"], np.zeros(rows, np.int64), np.arange(rows), None, np.ones(rows, dtype=bool))
        self.delivery = Delivery(
            self.table.config,
            self.table,
            lambda: self.now[0],
            self.woken.append,
            lambda key, task: self.back.append(key),
        )

    def lease(self, rows, owner="alice", lease_s=10.0, call_id=1):
        return self.delivery.lease(self.part, "train", np.asarray(rows, np.int64), owner, lease_s, call_id)

    def states(self) -> list[int]:
        return self.part.task("train").consumption[: self.part.num_rows].tolist()


def test_a_lease_is_acknowledged_by_its_owner_only():
    w = World()
    lease = w.lease([0, 1])
    assert w.states() == [LEASED, LEASED, AVAILABLE, AVAILABLE] and w.woken == [10.0]
    with pytest.raises(NotLeased, match=r"leased to another client: \[0, 1\]"):
        w.delivery.ack(w.part.uid, "train", np.asarray([0, 1]), "bob", explicit=True)
    assert w.delivery.ack(w.part.uid, "train", np.asarray([0, 1, 1]), "alice", explicit=True) == {"acknowledged": 2}
    assert w.states()[:2] == [CONSUMED, CONSUMED]
    assert lease.lease_id not in w.delivery.leases.leases  # every row settled: the lease is forgotten
    with pytest.raises(NotLeased, match=r"already acknowledged: \[0\]"):
        w.delivery.ack(w.part.uid, "train", np.asarray([0]), "alice", explicit=True)


def test_an_ack_asked_again_after_server_gone_takes_acknowledged_rows_as_done():
    """``again`` (the client's retry after ServerGone: its first ack may have been applied, its reply lost): rows
    acknowledged already are no error, even once the owner's id was forgotten (its connections closed holding no
    lease: the first ack's rows no longer name it; the default tier's journal test failed so); whoever acknowledged
    them (a holder is not kept across a journal replay either). A plain second ack is NotLeased as before."""
    w = World()
    w.lease([0, 1])
    w.lease([2, 3], owner="bob", call_id=2)
    assert w.delivery.ack(w.part.uid, "train", np.asarray([0, 1]), "alice", explicit=True) == {"acknowledged": 2}
    assert w.delivery.ack(w.part.uid, "train", np.asarray([2, 3]), "bob", explicit=True) == {"acknowledged": 2}
    assert w.delivery.ack(w.part.uid, "train", np.asarray([0, 1]), "alice", True, None, True) == {"acknowledged": 0}
    w.delivery.leases.forget_owners(np.zeros(0, dtype=bool))  # nobody holds a live row: every id forgotten
    assert w.delivery.leases.holder_of("alice") == -1
    assert w.delivery.ack(w.part.uid, "train", np.asarray([0, 1]), "alice", True, None, True) == {"acknowledged": 0}
    assert w.delivery.ack(w.part.uid, "train", np.asarray([2]), "alice", True, None, True) == {"acknowledged": 0}
    with pytest.raises(NotLeased, match=r"already acknowledged: \[0\]"):  # without again: as before
        w.delivery.ack(w.part.uid, "train", np.asarray([0]), "alice", explicit=True)


def test_a_get_data_ack_is_ignored_for_explicit_tasks_and_stale_metas():
    w = World()
    w.lease([0])
    w.delivery.set_options("train", TaskOptions(ack="explicit"))
    assert w.delivery.ack(w.part.uid, "train", np.asarray([0]), "alice", explicit=False) is None
    assert w.delivery.ack(w.part.uid + 1, "other", np.asarray([0]), "alice", explicit=False) is None
    with pytest.raises(StaleBatchMeta, match=r"ack of a BatchMeta whose partition \(uid 2\) was cleared"):
        w.delivery.ack(w.part.uid + 1, "train", np.asarray([0]), "alice", explicit=True)
    with pytest.raises(InvalidRequest, match="task_name must be a non-empty str, got ''"):
        w.delivery.set_options("", TaskOptions())


def test_expired_leases_come_back_first_in_line_and_are_dead_lettered_at_the_limit():
    w = World(max_deliveries=2)
    for attempt in range(2):
        w.lease([2, 3], lease_s=1.0)
        w.now[0] += 1.0
        w.delivery.expire(w.now[0])
        assert w.back == ["s"] * (attempt + 1)  # the partition's waiting getters retry
    assert w.states() == [AVAILABLE, AVAILABLE, DEAD, DEAD]
    assert w.delivery.events.lease_expiries == {"train": 4} and w.delivery.events.redeliveries == {"train": 2}
    assert [d["reason"] for d in dead_letters(w.part, "train")] == ["lease expired", "lease expired"]


def test_a_release_hands_back_only_the_callers_distinct_rows():
    w = World()
    w.lease([0, 1], owner="alice")
    w.lease([2], owner="bob", call_id=2)
    w.delivery.release(w.part.uid, "train", np.asarray([0, 0, 2]), "alice")  # a repeat and a row of bob's
    assert w.states() == [AVAILABLE, LEASED, LEASED, AVAILABLE]
    assert w.part.task("train").deliveries[0] == 1


def test_a_cancel_and_a_vanished_client_hand_their_leases_back():
    w = World()
    w.lease([0], call_id=7)
    w.lease([1], call_id=8)
    w.delivery.cancel("alice", 7)
    assert w.states()[:2] == [AVAILABLE, LEASED]
    w.delivery.leases.connected("alice", "conn")
    assert w.delivery.leases.disconnected("conn", 5.0) == "alice"
    w.delivery.expire(4.9)
    assert w.states()[1] == LEASED
    w.delivery.expire(5.0)
    assert w.states()[1] == AVAILABLE


def test_lease_length_comes_from_the_call_then_the_task_then_the_queue():
    w = World(lease_s=99.0)
    assert w.delivery.lease_s("train", None) == 99.0
    w.delivery.set_options("train", TaskOptions(lease_s=5.0, max_deliveries=3))
    assert w.delivery.lease_s("train", None) == 5.0 and w.delivery.lease_s("train", 1.5) == 1.5
    assert w.delivery.max_deliveries("train") == 3 and w.delivery.max_deliveries("eval") == 5
