"""Extending a lease (``ExtendLease``, ``client.extend_lease``) on QueueState with a fake clock: the rows of a meta
still leased to the caller get the deadline now + seconds (Redis XCLAIM, SQS ChangeMessageVisibility); rows it does
not hold are NotLeased, named; the seconds are checked against ``QueueConfig.max_lease_s``.
Default shape (tests/unit/conftest.py): a step holds 4 rows, two steps live."""

from __future__ import annotations

import pytest

from tests.unit.transfer_queue.state.test_delivery import ack, get, states
from transfer_queue.errors import InvalidRequest, NotLeased
from transfer_queue.metadata import BatchMeta
from transfer_queue.wire import protocol as p


def extend(q, meta: BatchMeta, owner: str, seconds: float):
    indexes = p.pack_indexes(meta.global_indexes)
    group = meta.extra.get("dp_group_id")  # as the client sends it: the meta's DP round
    return q.ok(p.ExtendLease(meta.partition_uid, meta.task_name, indexes, owner, seconds, dp_group_id=group))


def test_an_extended_lease_outlives_its_first_deadline(make_queue):
    q = make_queue(lease_s=10.0)
    q.put(0, 4)
    meta = get(q, "a", 4)
    q.advance(8.0)
    assert extend(q, meta, "a", 30.0) == {"extended": 4}
    q.advance(25.0)  # 33 s after the get_meta: past its lease_s, inside the extension
    assert states(q)["leased"] == 4
    assert len(get(q, "b", 4)) == 0  # another consumer gets nothing (the step is complete: an empty batch)
    assert ack(q, meta, "a") == {"acknowledged": 4}


def test_an_extended_lease_expires_at_its_new_deadline(make_queue):
    q = make_queue(lease_s=10.0)
    q.put(0, 4)
    meta = get(q, "a", 4)
    extend(q, meta, "a", 30.0)
    q.advance(30.0)
    assert states(q) == {"ready": 4, "leased": 0, "acknowledged": 0, "dead_lettered": 0}
    assert get(q, "b", 4).global_indexes.tolist() == [0, 1, 2, 3]


def test_extending_sets_the_deadline_to_now_plus_seconds_even_if_sooner(make_queue):
    q = make_queue(lease_s=100.0)
    q.put(0, 4)
    meta = get(q, "a", 4)
    extend(q, meta, "a", 5.0)
    q.advance(5.0)
    assert states(q)["leased"] == 0


def test_extending_rows_of_another_client_is_not_leased_and_extends_nothing(make_queue):
    q = make_queue(lease_s=10.0)
    q.put(0, 4)
    mine = get(q, "a", 2)
    theirs = get(q, "b", 2)
    both = BatchMeta.concat([mine, theirs])
    with pytest.raises(
        NotLeased, match=r"extend_lease of 2 rows of task 'train' .* leased to another client: \[2, 3\]"
    ):
        extend(q, both, "a", 60.0)
    q.advance(10.0)  # nothing was extended: both leases end at their own deadline
    assert states(q)["leased"] == 0


def test_extending_an_expired_or_acknowledged_lease_is_not_leased(make_queue):
    q = make_queue(lease_s=10.0)
    q.put(0, 4)
    meta = get(q, "a", 4)
    ack(q, meta.select_samples([0]), "a")
    q.advance(10.0)  # rows 1..3 go back
    with pytest.raises(NotLeased, match=r"already acknowledged: \[0\]; not leased .*: \[1, 2, 3\]"):
        extend(q, meta, "a", 60.0)


@pytest.mark.parametrize("seconds", [0, -1.0, float("inf"), float("nan"), True, "60"])
def test_extension_seconds_must_be_positive_and_finite(make_queue, seconds):
    q = make_queue()
    q.put(0, 4)
    meta = get(q, "a", 4)
    with pytest.raises(InvalidRequest, match=r"extend_lease: seconds must be a number in \(0, 3600\.0\] "):
        extend(q, meta, "a", seconds)


def test_extension_seconds_are_bounded_by_max_lease_s(make_queue):
    q = make_queue(max_lease_s=120.0)
    q.put(0, 4)
    meta = get(q, "a", 4)
    with pytest.raises(
        InvalidRequest, match=r"extend_lease: seconds must be a number in \(0, 120\.0\] \(max_lease_s\), got 121\.0"
    ):
        extend(q, meta, "a", 121.0)
    assert extend(q, meta, "a", 120.0) == {"extended": 4}


def test_a_dp_rounds_share_is_extended_by_any_rank_and_a_peers_ack_is_no_error(make_queue):
    q = make_queue(lease_s=10.0)
    q.put(0, 4)
    round_params = {"dp_rank": 0, "dp_size": 2, "dp_group_id": "r"}
    share = get(q, "rank0", 2, sampler_params=round_params)
    peer_share = get(q, "rank0-tp1", 2, sampler_params=round_params)  # a TP peer of rank 0: the same share
    assert peer_share.global_indexes.tolist() == share.global_indexes.tolist()
    assert extend(q, share, "rank0-tp1", 60.0) == {"extended": 2}
    q.advance(30.0)
    assert states(q)["leased"] == 4  # the round holds both ranks' shares under one lease: extended together
    ack(q, share, "rank0")
    assert extend(q, peer_share, "rank0-tp1", 60.0) == {"extended": 0}  # acknowledged by its peer: nothing to do
