"""Parked get_metas at scale (issue 23, "Scale"), through QueueState without Ray: a change re-evaluates only the
waiters it can serve, a disconnect touches only its own waiters; and what the indexes must keep: FIFO among the
waiters a change retries, waiters of partitions not opened yet, the end of a stream, timeouts, cancels.

Default shape of ``make_queue``: global_batch_size=4, num_global_batch=2, num_n_samples=1 (a step holds 4 rows)."""

from __future__ import annotations

from typing import Any

import pytest

from transfer_queue.errors import GetMetaTimeout
from transfer_queue.metadata import FieldSchema
from transfer_queue.wire import protocol as p

F32 = FieldSchema("dense", "float32", ())
X, Y, Z = {"x": F32}, {"y": F32}, {"z": F32}
XY = {"x": F32, "y": F32}


def served(reply: Any) -> list[int]:
    """The global indexes a parked get_meta was answered with."""
    return reply.result().to_meta().global_indexes.tolist()


class Evaluations:
    """Records the parked get_metas the queue re-evaluates (its ``MetaReader.serve`` calls)."""

    def __init__(self, q: Any) -> None:
        self.seen: list[tuple[Any, str, tuple[str, ...]]] = []
        serve = q.state.reader.serve

        def counted(job: Any) -> Any:
            self.seen.append((job.partition, job.task_name, tuple(job.fields)))
            return serve(job)

        q.state.reader.serve = counted

    def take(self) -> list[tuple[Any, str, tuple[str, ...]]]:
        seen, self.seen = self.seen, []
        return seen


class Connection:
    """A connection id that counts how often it is compared: looking it up in an index compares nothing, scanning
    every parked request compares it with each."""

    compared = 0

    def __init__(self, n: int) -> None:
        self.n = n

    def __hash__(self) -> int:
        return hash(("connection", self.n))

    def __eq__(self, other: object) -> bool:
        Connection.compared += 1
        return isinstance(other, Connection) and other.n == self.n


def test_a_commit_reevaluates_only_the_waiters_its_rows_can_serve(make_queue):
    q = make_queue()
    prompts = q.put(0, 4, X)
    q.put(1, 4, X)
    reward = [q.get_async(0, "y", 1, "reward") for _ in range(3)]
    train = [q.get_async(0, ["y", "z"], 1, "train") for _ in range(3)]
    other_step = [q.get_async(1, "y", 1, "reward") for _ in range(3)]
    seen = Evaluations(q)
    q.put(0, 1, Y, metadata=prompts.select_samples([0]))
    # one row got y: the first reward waiter of step 0 takes it, the second finds nothing left, and the third (it
    # waits for the same) is not tried; train waits for z too; step 1 did not change
    assert seen.take() == [(0, "reward", ("y",))] * 2
    assert [w.done for w in reward] == [True, False, False] and served(reward[0]) == [0]
    assert not any(w.done for w in train + other_step)
    q.put(0, 1, Z, metadata=prompts.select_samples([0]))  # row 0 now has y and z: train's first waiter takes it
    assert seen.take() == [(0, "train", ("y", "z"))] * 2
    assert [w.done for w in train] == [True, False, False]


@pytest.mark.parametrize("how", ["release", "lease expiry"])
def test_rows_handed_back_reevaluate_only_the_waiters_of_their_task(make_queue, how):
    q = make_queue(lease_s=5.0)
    q.put("s", 4, X)
    meta = q.get("s", "x", 4, "train")
    train = [q.get_async("s", "x", 1, "train") for _ in range(2)]
    others = [q.get_async("s", "x", 8, "eval") for _ in range(2)] + [q.get_async("s", "y", 1, "reward")]
    seen = Evaluations(q)
    if how == "release":
        q.release(meta)
    else:
        q.advance(5.0)
    assert seen.take() == [("s", "train", ("x",))] * 2
    assert all(w.done for w in train) and not any(w.done for w in others)


def test_disconnecting_one_client_among_many_touches_only_its_own_waiters(make_queue):
    q = make_queue()
    q.put(0, 4, X)
    connections = [Connection(n) for n in range(60)]
    for n, connection in enumerate(connections):
        owner = f"client-{n}"
        for call_id, (partition, params) in enumerate([(0, None), (1, None), ("s", {"dp_size": 2, "dp_rank": n % 2})]):
            request = p.GetMeta(partition, ["y"], 1, "t", params, timeout=10.0, owner=owner, call_id=call_id + 1)
            assert not q.send(request, connection).done
    assert len(q.state.waiting) == 180 and len(q.state.auto_rounds) == 60
    Connection.compared = 0
    q.state.on_disconnect(connections[7])
    assert Connection.compared == 0  # its waiters were found through the index, not by comparing every one
    assert len(q.state.waiting) == 177 and len(q.state.auto_rounds) == 59
    assert all(w.peer is not connections[7] for ws in q.state.getters.values() for w in ws)


def test_cancelling_one_call_drops_only_that_waiter(make_queue):
    q = make_queue()
    mine = q.send(p.GetMeta(0, ["x"], 1, "t", owner="me", call_id=1))
    kept = [
        q.send(p.GetMeta(0, ["x"], 1, "t", owner="me", call_id=2)),
        q.send(p.GetMeta(0, ["x"], 1, "t", owner="you", call_id=1)),
    ]
    q.ok(p.CancelGetMeta("me", 1))
    q.put(0, 4, X)
    assert not mine.done  # dropped unanswered: its client stopped listening
    assert all(w.done for w in kept) and len(q.state.waiting) == 0


def test_waiters_of_partitions_not_opened_yet_wake_on_their_first_commit(make_queue):
    q = make_queue()
    step, name = q.get_async(1, "x", 2, "t"), q.get_async("later", "x", 2, "t")
    q.put(0, 4, X)
    assert not step.done and not name.done
    q.put(1, 2, X)
    q.put("later", 2, X)
    assert served(step) == [4, 5] and len(served(name)) == 2


def test_a_commit_that_ends_a_stream_answers_the_waiters_of_fields_it_did_not_write(make_queue):
    q = make_queue()
    prompts = q.put("val", 4, X)
    q.ok(p.ClosePartition("val"))
    writing = q.reserve("val", 4, Z, metadata=prompts)  # "val" is closed, but a put into its rows is in flight
    short = q.get_async("val", "x", 8, "t")
    assert not short.done
    q.commit(writing)  # nothing more can come: the waiter gets what there is
    assert served(short) == [0, 1, 2, 3]


def test_a_change_retries_its_waiters_in_the_order_they_came_across_fields_and_batch_sizes(make_queue):
    q = make_queue()
    first = q.get_async("s", "x", 1, "t")
    second = q.get_async("s", ["x", "y"], 1, "t")
    third = q.get_async("s", "x", 1, "t")
    fourth = q.get_async("s", "x", 2, "t")
    q.put("s", 2, XY)  # two rows for four waiters of one task: the first two that came get them
    assert served(first) == [0] and served(second) == [1]
    assert not third.done and not fourth.done
    q.put("s", 2, X)
    assert served(third) == [2] and not fourth.done


def test_waiters_time_out_in_deadline_order_and_a_tick_before_any_is_due_answers_none(make_queue):
    q = make_queue()
    waits = [q.get_async(0, "x", 1, "t", timeout=float(t)) for t in (3, 1, 2)]
    q.advance(0.5)
    assert not any(w.done for w in waits) and q.state.tick() == 1.0
    q.advance(1.5)
    assert [w.done for w in waits] == [False, True, True] and isinstance(waits[1].error, GetMetaTimeout)
    assert q.state.tick() == 3.0
    q.advance(1.0)
    assert waits[0].done and len(q.state.waiting) == 0 and q.state.tick() is None
