"""Delivery on QueueState with a fake clock: leases, acknowledgements, expiry, disconnects, dead letters, cancels.

A row of a task is ready -> leased (owner, deadline, deliveries) -> acknowledged; a lease that expires or whose
client goes away hands its rows back first in line, and after ``max_deliveries`` to the dead letters.
Default shape (tests/unit/conftest.py): a step holds 4 rows, two steps live.
"""

from __future__ import annotations

import numpy as np
import pytest

from transfer_queue.errors import InvalidRequest, NotLeased
from transfer_queue.metadata import BatchMeta
from transfer_queue.samplers import GRPOSampler
from transfer_queue.state.partition_status import row_state_counts
from transfer_queue.state.ready_index import ReadyIndex
from transfer_queue.wire import protocol as p


def indexes(meta: BatchMeta) -> list[int]:
    return meta.global_indexes.tolist()


def get(q, owner: str, batch: int, task: str = "train", partition=0, peer=None, **kw) -> BatchMeta:
    reply = q.send(get_request(owner, batch, task, partition, **kw), peer)
    assert reply.done, "get_meta is waiting"
    return reply.result().to_meta()


def get_request(owner: str, batch: int, task: str = "train", partition=0, *, lease_s=None, call_id=0, **kw):
    return p.GetMeta(partition, ["x"], batch, task, kw.get("sampler_params"), kw.get("get_n_samples", False),
                     kw.get("timeout", 10.0), lease_s, owner, call_id)  # fmt: skip


def ack(q, meta: BatchMeta, owner: str, explicit: bool = True):
    """The Ack a client sends for ``meta`` (naming its DP round, if any)."""
    group = meta.extra.get("dp_group_id")
    return q.ok(p.Ack(meta.partition_uid, meta.task_name, p.pack_indexes(meta.global_indexes), owner, explicit,
                      dp_group_id=group))  # fmt: skip


def release(q, meta: BatchMeta, owner: str) -> None:
    group = meta.extra.get("dp_group_id")
    q.ok(p.Release(meta.partition_uid, meta.task_name, p.pack_indexes(meta.global_indexes), owner, group))


def states(q, task: str = "train", partition=0) -> dict[str, int]:
    return row_state_counts(q.state.partitions[partition], task)


@pytest.fixture
def make(make_queue):
    return make_queue


# ---- lease, then acknowledge ---------------------------------------------------------------------------------
def test_get_meta_leases_and_get_datas_ack_acknowledges(make):
    q = make()
    q.put(0, 4)
    meta = get(q, "a", 3)
    assert indexes(meta) == [0, 1, 2]
    assert states(q) == {"ready": 1, "leased": 3, "acknowledged": 0, "dead_lettered": 0}
    assert ack(q, meta, "a", explicit=False) == {"acknowledged": 3}
    assert states(q) == {"ready": 1, "leased": 0, "acknowledged": 3, "dead_lettered": 0}
    assert q.ok(p.ConsumptionStatus(0, "train"))["tasks"]["train"]["acknowledged"] == 3
    assert q.state.leases.leases == {}  # a lease whose every row is settled is forgotten
    q.advance(q.config.lease_s + 1)  # acknowledged rows never come back
    assert indexes(get(q, "b", 4)) == [3]


def test_an_implicit_ack_skips_rows_it_does_not_hold_and_an_explicit_one_names_them(make):
    q = make()
    q.put(0, 4)
    mine, theirs = get(q, "a", 2), get(q, "b", 2)
    both = BatchMeta.concat([mine, theirs])
    assert ack(q, both, "a", explicit=False) == {"acknowledged": 2}  # get_data of a mixed meta: only a's rows
    with pytest.raises(
        NotLeased,
        match=r"ack of 4 rows of task 'train' in global_step=0 that this client does not hold "
        r"\(global indexes \[0, 1, 2, 3\]\): leased to another client: \[2, 3\]; already acknowledged: \[0, 1\]",
    ):
        ack(q, both, "a")
    assert states(q)["leased"] == 2  # a refused ack changes nothing
    assert ack(q, theirs, "b") == {"acknowledged": 2}


def test_explicit_tasks_ignore_get_datas_ack_and_need_ack(make):
    q = make()
    q.ok(p.SetTaskOptions("train", ack="explicit"))
    q.put(0, 4)
    meta = get(q, "a", 4)
    assert ack(q, meta, "a", explicit=False) is None
    assert states(q)["leased"] == 4
    assert ack(q, meta.select_samples([0, 1]), "a") == {"acknowledged": 2}
    q.advance(q.config.lease_s)
    assert states(q) == {"ready": 2, "leased": 0, "acknowledged": 2, "dead_lettered": 0}
    with pytest.raises(NotLeased, match=r"not leased \(never handed out, or handed back: lease expired.*\): \[2, 3\]"):
        ack(q, meta, "a")


def test_task_options_are_validated(make):
    q = make()
    with pytest.raises(InvalidRequest, match=r"ack must be one of \['auto', 'explicit'\], got 'later'"):
        q.ok(p.SetTaskOptions("train", ack="later"))
    with pytest.raises(InvalidRequest, match=r"lease_s must be a finite number of seconds > 0 \(or None\), got -1"):
        q.ok(p.SetTaskOptions("train", lease_s=-1))
    with pytest.raises(InvalidRequest, match=r"max_deliveries must be an int >= 1 \(or None\), got 0"):
        q.ok(p.SetTaskOptions("train", max_deliveries=0))
    q.put(0, 1)
    with pytest.raises(InvalidRequest, match=r"lease_s must be a finite number of seconds > 0 \(or None\), got inf"):
        get(q, "a", 1, lease_s=float("inf"))


# ---- expiry --------------------------------------------------------------------------------------------------
def test_an_expired_lease_comes_back_first_in_line_with_one_more_delivery(make):
    q = make()
    q.put(0, 4)
    lost = get(q, "a", 2, lease_s=5.0)
    q.advance(4.9)
    assert states(q)["leased"] == 2
    q.advance(0.1)
    assert states(q)["leased"] == 0
    part = q.state.partitions[0]
    assert part.tasks["train"].deliveries[:4].tolist() == [1, 1, 0, 0]
    again = get(q, "b", 3)
    assert indexes(again) == [*indexes(lost), 2]  # the rows that came back are served before rows 2, 3
    assert part.tasks["train"].deliveries[:4].tolist() == [2, 2, 1, 0]
    assert ack(q, lost, "a", explicit=False) == {"acknowledged": 0}  # a's late get_data acknowledges nothing of b's


def test_lease_s_per_call_then_task_then_queue(make):
    q = make(lease_s=100.0)
    q.ok(p.SetTaskOptions("t", lease_s=10.0))
    q.put(0, 4)
    by_call = get(q, "a", 1, task="t", lease_s=1.0)
    by_task = get(q, "a", 1, task="t")
    by_queue = get(q, "a", 1, task="u")
    leases = {lease.rows.tolist()[0]: lease.deadline for lease in q.state.leases.leases.values()}
    assert leases == {indexes(by_call)[0]: 1.0, indexes(by_task)[0]: 10.0, indexes(by_queue)[0]: 100.0}


def test_a_waiting_get_meta_is_served_by_an_expiring_lease(make):
    q = make()
    q.put("p", 4)
    get(q, "a", 4, partition="p", lease_s=2.0)
    waiting = q.send(get_request("b", 2, partition="p", timeout=10.0))
    assert not waiting.done
    q.advance(2.0)
    assert indexes(waiting.result().to_meta()) == [0, 1]


def test_the_end_of_a_stream_does_not_wait_for_rows_leased_to_others(make):
    q = make()
    q.put(0, 4)
    get(q, "a", 4)
    assert indexes(get(q, "b", 2)) == []  # a full step with nothing ready: the end of the stream for now
    q.advance(q.config.lease_s)
    assert indexes(get(q, "b", 2)) == [0, 1]  # a's rows came back: a later get_meta gets them


def test_grpo_groups_come_back_whole_and_first(make):
    q = make(num_n_samples=2, sampler=GRPOSampler(2))
    q.put(0, 8)
    first = get(q, "a", 4, lease_s=1.0)
    q.advance(1.0)
    assert indexes(get(q, "b", 4)) == indexes(first) == [0, 1, 2, 3]
    assert indexes(get(q, "b", 4)) == [4, 5, 6, 7]


def test_ready_index_add_front_keeps_order_and_groups():
    group_of = np.arange(16) // 2
    index = ReadyIndex(1, 2)
    index.add(np.arange(2, 8), group_of)
    index.remove(np.array([2, 3]), group_of)
    index.add_front(np.array([0, 1, 3, 2]), group_of)
    assert index.rows == [0, 1, 3, 2, 4, 5, 6, 7]
    assert index.first_groups(4) == [0, 1, 2, 3]
    index.add_front(np.array([9]), group_of)  # half a group: ready, but its group is not complete
    assert index.rows[:2] == [9, 0] and index.first_groups(1) == [0]


# ---- dead letters --------------------------------------------------------------------------------------------
def test_after_max_deliveries_rows_are_dead_lettered_with_their_last_reason(make):
    q = make(max_deliveries=2)
    q.put(0, 4)
    get(q, "a", 2, lease_s=1.0)
    q.advance(1.0)
    meta = get(q, "a", 2, lease_s=1.0)
    assert indexes(meta) == [0, 1]
    q.advance(1.0)
    assert states(q) == {"ready": 2, "leased": 0, "acknowledged": 0, "dead_lettered": 2}
    assert q.ok(p.DeadLetters(0, "train")) == [
        {"global_index": 0, "deliveries": 2, "reason": "lease expired"},
        {"global_index": 1, "deliveries": 2, "reason": "lease expired"},
    ]
    assert indexes(get(q, "b", 4)) == [2, 3]  # dead letters are never served again
    assert q.ok(p.DeadLetters(0, "other")) == []
    q.ok(p.ResetConsumption(0, "train"))  # a reset makes them ready again
    assert states(q)["dead_lettered"] == 0


def test_a_task_may_allow_more_deliveries(make):
    q = make(max_deliveries=1)
    q.ok(p.SetTaskOptions("train", max_deliveries=3))
    q.put(0, 1)
    for _ in range(2):
        get(q, "a", 1, lease_s=1.0)
        q.advance(1.0)
    assert states(q)["dead_lettered"] == 0
    get(q, "a", 1, lease_s=1.0)
    q.advance(1.0)
    assert q.ok(p.DeadLetters(0, "train"))[0]["deliveries"] == 3


# ---- clients that go away ------------------------------------------------------------------------------------
def test_a_disconnected_clients_leases_come_back_after_the_grace(make):
    q = make(disconnect_grace=2.0)
    q.put(0, 4)
    held = get(q, "a", 2, peer="conn-a")
    get(q, "a", 1, peer="conn-a2")  # a second connection of the same client (another thread)
    q.state.on_disconnect("conn-a")
    q.advance(5.0)
    assert states(q)["leased"] == 3  # one connection of client a is still open
    q.state.on_disconnect("conn-a2")
    q.advance(1.9)
    assert states(q)["leased"] == 3
    q.advance(0.1)
    assert states(q)["leased"] == 0
    assert indexes(get(q, "b", 4)) == [*indexes(held), 2, 3]


def test_a_client_that_reconnects_within_the_grace_keeps_its_leases(make):
    q = make(disconnect_grace=2.0)
    q.put(0, 4)
    meta = get(q, "a", 2, peer="old")
    q.state.on_disconnect("old")
    q.advance(1.0)
    assert ack(q, meta.select_samples([0]), "a") == {"acknowledged": 1}  # no peer: not a connection
    q.send(p.Ack(meta.partition_uid, "train", p.pack_indexes(meta.global_indexes[1:]), "a"), "new")
    q.advance(5.0)
    assert states(q) == {"ready": 2, "leased": 0, "acknowledged": 2, "dead_lettered": 0}


def test_a_parked_get_meta_of_a_closed_connection_is_never_served(make):
    q = make()
    waiting = q.send(get_request("a", 4), "gone")
    q.state.on_disconnect("gone")
    q.put(0, 4)
    assert not waiting.done
    assert indexes(get(q, "b", 4)) == [0, 1, 2, 3]


def test_a_cancelled_get_meta_is_withdrawn_and_a_second_consumer_gets_all_rows(make):
    q = make()
    waiting = q.send(get_request("a", 4, call_id=7), "conn")
    q.ok(p.CancelGetMeta("a", 7))
    q.put(0, 4)
    assert not waiting.done
    assert indexes(get(q, "b", 4)) == [0, 1, 2, 3]


def test_a_cancel_that_arrives_after_the_answer_hands_the_rows_back(make):
    q = make()
    q.put(0, 4)
    get(q, "a", 4, call_id=3)
    q.ok(p.CancelGetMeta("a", 3))
    assert indexes(get(q, "b", 4)) == [0, 1, 2, 3]


# ---- release (defect 3) --------------------------------------------------------------------------------------
def test_release_is_idempotent_and_only_hands_back_rows_the_caller_holds(make):
    q = make(num_n_samples=2, sampler=GRPOSampler(2))
    q.put(0, 8)
    meta = get(q, "a", 4)
    release(q, meta.select_samples([0, 0]), "a")  # row 0 named twice: released once, its group stays incomplete
    release(q, meta.select_samples([0]), "a")  # released twice: a no-op
    assert indexes(get(q, "b", 4)) == [4, 5, 6, 7]  # group 0 is not whole: not served
    release(q, meta.select_samples([1]), "a")
    stolen = get(q, "c", 2)
    assert indexes(stolen) == [0, 1]
    release(q, meta, "a")  # a no longer holds rows 0, 1 (c does): only 2, 3 go back
    assert states(q) == {"ready": 2, "leased": 6, "acknowledged": 0, "dead_lettered": 0}
    release(q, meta, "a")
    assert states(q)["ready"] == 2


def test_a_released_row_at_max_deliveries_is_dead_lettered(make):
    q = make(max_deliveries=1)
    q.put(0, 2)
    meta = get(q, "a", 2)
    release(q, meta, "a")
    assert q.ok(p.DeadLetters(0, "train")) == [
        {"global_index": 0, "deliveries": 1, "reason": "released"},
        {"global_index": 1, "deliveries": 1, "reason": "released"},
    ]


def test_clear_and_reset_drop_what_leases_would_hand_back(make):
    q = make()
    q.put(0, 4)
    get(q, "a", 2, lease_s=1.0)
    q.ok(p.ResetConsumption(0, "train"))
    meta = get(q, "b", 4)
    q.advance(1.0)  # a's lease is from before the reset: it hands back nothing of b's
    assert states(q)["leased"] == 4 and indexes(meta) == [0, 1, 2, 3]
    q.clear(0)
    q.advance(q.config.lease_s)
    assert q.state.leases.leases == {}


# ---- DP rounds -----------------------------------------------------------------------------------------------
def dp(rank: int, group: str = "g") -> dict:
    return {"dp_rank": rank, "dp_size": 2, "dp_group_id": group}


def test_a_dp_rounds_unacknowledged_share_comes_back_when_the_round_lease_expires(make):
    q = make(global_batch_size=8)
    q.put(0, 8)
    r0 = get(q, "rank0", 4, sampler_params=dp(0), lease_s=5.0)
    assert states(q)["leased"] == 8  # the round took both shares
    assert ack(q, r0, "rank0", explicit=False) == {"acknowledged": 4}  # rank 0's get_data
    assert ack(q, r0, "rank0-tp-peer") == {"acknowledged": 0}  # its TP peer acknowledging the same share: fine
    q.advance(5.0)  # rank 1 never fetched its share
    assert states(q) == {"ready": 4, "leased": 0, "acknowledged": 4, "dead_lettered": 0}
    with pytest.raises(InvalidRequest, match=r"the lease of dp_group_id 'g' expired \(5 s\) before every rank"):
        get(q, "rank1", 4, sampler_params=dp(1))
    with pytest.raises(InvalidRequest, match="the lease of dp_group_id 'g' expired"):
        get(q, "rank0", 4, sampler_params=dp(0))
    # a new round splits the 4 rows that came back (the step is full: a short last round)
    assert indexes(get(q, "rank1", 4, sampler_params=dp(1, "g2"))) == [6, 7]


def test_a_dp_round_whose_ranks_all_acknowledged_ends_with_nothing_to_hand_back(make):
    q = make(global_batch_size=8)
    q.put(0, 8)
    shares = [get(q, f"rank{r}", 4, sampler_params=dp(r), lease_s=5.0) for r in (0, 1)]
    for r, share in enumerate(shares):
        ack(q, share, f"rank{r}")
    assert q.state.leases.leases == {}
    q.advance(5.0)
    assert states(q) == {"ready": 0, "leased": 0, "acknowledged": 8, "dead_lettered": 0}
    assert indexes(get(q, "rank1", 4, sampler_params=dp(1))) == indexes(shares[1])  # the round is still served


def test_a_late_ack_of_an_expired_round_acknowledges_nothing_of_the_round_that_holds_its_rows_now(make):
    q = make(global_batch_size=8)
    q.put(0, 8)
    late = get(q, "rank0", 4, sampler_params=dp(0, "a"), lease_s=5.0)
    q.advance(5.0)  # round a expires before rank 0's get_data: its rows go back, and round b takes them
    now = [get(q, f"rank{r}", 4, sampler_params=dp(r, "b"), lease_s=5.0) for r in (0, 1)]
    assert sorted(indexes(now[0]) + indexes(now[1])) == list(range(8))
    assert ack(q, late, "rank0", explicit=False) == {"acknowledged": 0}  # rank 0's late get_data of round a
    with pytest.raises(NotLeased, match=r"leased to another DP round: \[0, 1, 2, 3\]"):
        ack(q, late, "rank0")
    assert states(q)["leased"] == 8
    for r, share in enumerate(now):  # round b's ranks acknowledge their own shares
        assert ack(q, share, f"rank{r}") == {"acknowledged": 4}
    assert q.state.leases.leases == {}


def test_a_late_release_of_an_expired_round_hands_back_nothing_of_the_round_that_holds_its_rows_now(make):
    q = make(global_batch_size=8)
    q.put(0, 8)
    late = get(q, "rank0", 4, sampler_params=dp(0, "a"), lease_s=5.0)
    q.advance(5.0)
    now = [get(q, f"rank{r}", 4, sampler_params=dp(r, "b"), lease_s=5.0) for r in (0, 1)]
    release(q, late, "rank0")
    assert states(q)["leased"] == 8
    assert indexes(get(q, "rank0", 4, sampler_params=dp(0, "b"))) == indexes(now[0])  # not taken for released


def test_expiries_and_redeliveries_reach_the_metrics_hook(make_queue):
    q = make_queue(lease_s=5.0)
    q.put(0, 4)
    q.get(0, ["x"], 2)
    q.advance(6.0)
    q.state.tick()
    assert q.state.events.lease_expiries == {"train": 2}
    again = q.get(0, ["x"], 4)
    assert sorted(again.global_indexes.tolist()) == [0, 1, 2, 3]
    assert q.state.events.redeliveries == {"train": 2}
