"""WaitingRoom alone (no QueueState, no Ray): park, retry, expire, drop; and its one exception boundary."""

from __future__ import annotations

from typing import Any

import pytest

from transfer_queue.errors import InvalidRequest, QueueBusy, SamplerError
from transfer_queue.state.waiting import WAIT, Parked, WaitingRoom


class Answers:
    """What each parked request was answered: ``(value, error)`` per job, in order."""

    def __init__(self) -> None:
        self.got: dict[Any, list[tuple[Any, BaseException | None]]] = {}

    def parked(self, job: Any, deadline: float = 10.0, peer: Any = None) -> Parked:
        return Parked(
            job, lambda value, error: self.got.setdefault(job, []).append((value, error)), 0.0, deadline, peer
        )


def room(max_waiting: int = 100) -> WaitingRoom:
    return WaitingRoom(max_waiting, lambda job, exc: SamplerError(f"job {job} failed: {type(exc).__name__}: {exc}"))


def test_a_full_room_refuses_with_queue_busy():
    r, a = room(max_waiting=2), Answers()
    assert r.park(a.parked("g1"), "p", "GetMeta") and r.park(a.parked("p1"), None, "Reserve")
    assert not r.park(a.parked("g2"), "p", "GetMeta")
    error = a.got["g2"][0][1]
    assert isinstance(error, QueueBusy)
    assert str(error) == (
        "2 requests are waiting in the controller (max_waiting_requests=2); this GetMeta was refused, not parked"
    )
    assert len(r) == 2 and list(r.getters) == ["p"] and len(r.putters) == 1


def test_retries_answer_what_can_be_served_and_keep_the_rest_in_order():
    r, a = room(), Answers()
    for job in ("a", "b", "c"):
        r.park(a.parked(job), "p", "GetMeta")
    r.park(a.parked("other"), "q", "GetMeta")
    r.retry_getters("p", lambda parked: WAIT if parked.job == "b" else parked.job.upper(), lambda job: None)
    assert a.got == {"a": [("A", None)], "c": [("C", None)]}
    assert [parked.job for parked in r.getters["p"]] == ["b"] and [w.job for w in r.getters["q"]] == ["other"]
    r.retry_putters(lambda parked: "never")  # no putter waits: nothing happens
    assert "never" not in str(a.got)


def test_one_failing_retry_answers_only_its_own_request_and_the_others_keep_waiting():
    r, a = room(), Answers()
    forgotten: list[Any] = []
    for job in ("typed", "bug", "waits", "served"):
        r.park(a.parked(job), "p", "GetMeta")

    def attempt(parked: Parked) -> Any:
        if parked.job == "typed":
            raise InvalidRequest("a typed refusal")
        if parked.job == "bug":
            raise ZeroDivisionError("division by zero")
        return WAIT if parked.job == "waits" else "ok"

    r.retry_getters("p", attempt, forgotten.append)
    assert isinstance(a.got["typed"][0][1], InvalidRequest)
    error = a.got["bug"][0][1]
    assert isinstance(error, SamplerError) and str(error) == "job bug failed: ZeroDivisionError: division by zero"
    assert a.got["served"] == [("ok", None)] and "waits" not in a.got
    assert forgotten == ["typed", "bug"]  # what a failed job took (an automatic DP round) is undone
    assert [parked.job for parked in r.getters["p"]] == ["waits"]


def test_a_putter_whose_retry_fails_does_not_take_the_other_putters_with_it():
    r, a = room(), Answers()
    for job in ("first", "second"):
        r.park(a.parked(job), None, "Reserve")
    r.retry_putters(lambda parked: 1 / 0 if parked.job == "first" else WAIT)
    assert isinstance(a.got["first"][0][1], SamplerError)
    assert [parked.job for parked in r.putters] == ["second"]


def test_expiry_answers_each_late_request_with_its_timeout_error():
    r, a = room(), Answers()
    r.park(a.parked("late get", deadline=1.0), "p", "GetMeta")
    r.park(a.parked("early get", deadline=5.0), "p", "GetMeta")
    r.park(a.parked("late put", deadline=1.0), None, "Reserve")
    forgotten: list[Any] = []
    r.expire(
        1.0, lambda parked: TimeoutError(f"get {parked.job}"), lambda parked: TimeoutError("put"), forgotten.append
    )
    assert str(a.got["late get"][0][1]) == "get late get" and str(a.got["late put"][0][1]) == "put"
    assert forgotten == ["late get"] and r.deadlines() == [5.0]


@pytest.mark.parametrize("how", ["peer", "cancel"])
def test_dropped_requests_are_never_answered(how):
    r, a = room(), Answers()
    r.park(a.parked("mine", peer="conn"), "p", "GetMeta")
    r.park(a.parked("my put", peer="conn"), None, "Reserve")
    r.park(a.parked("theirs", peer="other"), "p", "GetMeta")
    forgotten: list[Any] = []
    if how == "peer":
        r.drop_peer("conn", forgotten.append)
        assert r.putters == []
    else:
        r.drop_getters(lambda parked: parked.job == "mine", forgotten.append)
    assert forgotten == ["mine"] and a.got == {}
    assert [parked.job for parked in r.getters["p"]] == ["theirs"]
    assert [parked.job for parked in r.take_getters("p")] == ["theirs"] and r.getters == {}


def test_a_retry_tries_the_wanted_topics_in_arrival_order_and_leaves_a_line_at_its_first_waiter_that_waits():
    from transfer_queue.state.waiting import Topic

    r, a = room(), Answers()
    line = Topic("t", frozenset({"x"}), in_line=True)  # the same ask: once one must wait, all behind it must
    each = Topic("t", frozenset({"x"}), shape=("dp",))  # DP ranks: every one is tried
    other = Topic("u", frozenset({"x"}), in_line=True)
    for job, topic in [("l1", line), ("e1", each), ("l2", line), ("e2", each), ("l3", line), ("o1", other)]:
        r.park(a.parked(job), "p", "GetMeta", topic)
    tried: list[Any] = []

    def attempt(parked: Parked) -> Any:
        tried.append(parked.job)
        return "ok" if parked.job == "l1" else WAIT

    r.retry_getters("p", attempt, lambda job: None, wanted=lambda topic: topic.task_name == "t")
    assert tried == ["l1", "e1", "l2", "e2"]  # l3 waits behind l2; task u's waiter is not concerned
    assert a.got == {"l1": [("ok", None)]}
    assert [parked.job for parked in r.getters["p"]] == ["e1", "l2", "e2", "l3", "o1"]


def test_a_cancel_and_a_closed_connection_drop_only_their_own_requests():
    r, a = room(), Answers()
    r.park(a.parked("mine", peer="conn"), "p", "GetMeta", call=("me", 1))
    r.park(a.parked("my other", peer="conn"), "q", "GetMeta", call=("me", 2))
    r.park(a.parked("my put", peer="conn"), None, "Reserve")
    r.park(a.parked("theirs", peer="other"), "p", "GetMeta", call=("you", 1))
    forgotten: list[Any] = []
    r.withdraw(("me", 1), forgotten.append)
    assert forgotten == ["mine"] and len(r) == 3
    r.drop_peer("conn", forgotten.append)
    assert forgotten == ["mine", "my other"] and r.putters == [] and len(r) == r.num_getters == 1
    assert r.getters == {"p": r.getters["p"]} and [parked.job for parked in r.getters["p"]] == ["theirs"]
    assert a.got == {}


def test_the_deadlines_kept_stay_bounded_by_the_requests_parked():
    r, a = room(), Answers()
    for i in range(1000):  # each served before its deadline: its deadline entry is left behind, then swept
        r.park(a.parked(i, deadline=100.0 + i), "p", "GetMeta")
        r.retry_getters("p", lambda parked: "ok", lambda job: None)
    assert len(r) == 0 and len(r._deadlines) <= 2 * len(r) + 65
    assert r.next_deadline() == float("inf") and r.deadlines() == []
