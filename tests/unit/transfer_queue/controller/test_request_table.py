"""The controller's request table (issue 8 section 6, layering rule 1): QueueState answers with domain values and
knows no wire format; RequestTable translates both ways, for answers given at once and for parked ones."""

from __future__ import annotations

import numpy as np

from transfer_queue.config import QueueConfig
from transfer_queue.controller.requests import RequestTable, storage_message, to_wire
from transfer_queue.metadata import BatchMeta, FieldSchema
from transfer_queue.state.put_ledger import PutRequest, Reserved
from transfer_queue.state.queue_state import DropPartition, QueueState
from transfer_queue.state.waiting import Wait
from transfer_queue.wire import protocol as p

X = {"x": FieldSchema("dense", "float32", ())}


def answers(out: list) -> object:
    assert len(out) == 1, f"expected one answer, got {out}"
    value, error = out[0]
    assert error is None, error
    return value


def test_the_state_answers_with_domain_values_and_queues_domain_orders():
    state = QueueState(QueueConfig(4, num_global_batch=2, num_storage_units=2))
    reserved = state.reserve(PutRequest(0, 4, X, 16))
    assert isinstance(reserved, Reserved) and reserved.global_indexes.tolist() == [0, 1, 2, 3]
    assert isinstance(state.get_meta(0, ["x"], 2, "train"), Wait)  # not committed yet: the caller would be parked
    meta = state.ledger.commit(reserved.put_id)
    assert isinstance(meta, BatchMeta)
    got = state.get_meta(0, ["x"], 2, "train")
    assert isinstance(got, BatchMeta) and got.global_indexes.tolist() == [0, 1]
    state.clear(0)
    assert [unit for unit, _ in state.outbox] == [0, 1]
    assert all(isinstance(order, DropPartition) for _, order in state.outbox)


def test_the_table_packs_answers_now_and_later_and_the_orders_for_storage_units():
    now = [0.0]
    table = RequestTable(QueueState(QueueConfig(4, num_global_batch=2, num_storage_units=2), clock=lambda: now[0]))
    out: list = []
    table.handle(p.Reserve(0, 4, X, 16), lambda value, error: out.append((value, error)))
    reservation = answers(out)
    assert isinstance(reservation, p.Reservation)
    assert p.unpack_indexes(reservation.global_indexes).tolist() == [0, 1, 2, 3]
    parked: list = []
    table.handle(p.GetMeta(0, ["x"], 4, "train", timeout=5.0), lambda value, error: parked.append((value, error)))
    assert parked == []  # nothing committed yet: it waits
    now[0] = 1.5
    out.clear()
    table.handle(p.Commit(reservation.put_id), lambda value, error: out.append((value, error)))
    assert isinstance(answers(out), p.MetaWire)
    served = answers(parked)
    assert isinstance(served, p.MetaWire)  # the parked getter's answer is packed too
    assert served.extra["wait_s"] == 1.5
    assert p.unpack_indexes(served.global_indexes).tolist() == [0, 1, 2, 3]
    out.clear()
    table.handle(p.Clear(0), lambda value, error: out.append((value, error)))
    uid = served.partition_uid
    assert table.outbox == [(0, p.DropPartition(uid, [], uid, 2)), (1, p.DropPartition(uid, [], uid, 2))]
    assert table.take_outbox() and table.outbox == [] and table.state.outbox == []


def test_values_without_a_wire_form_pass_as_they_are():
    assert to_wire({"a": 1}) == {"a": 1} and to_wire(None) is None
    meta = BatchMeta(0, 3, np.array([5]), np.array([5]), X, np.array([[2]]), np.array([[0]]), "t", {"k": 1})
    assert to_wire(meta).to_meta().global_indexes.tolist() == [5]
    assert storage_message(DropPartition(3, [4], 5, 6)) == p.DropPartition(3, [4], 5, 6)
