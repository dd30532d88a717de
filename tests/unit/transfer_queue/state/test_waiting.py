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
