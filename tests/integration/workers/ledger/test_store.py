"""The ledger's store, the same suite on SQLite and on a real PostgreSQL: tasks round-trip as their own class,
claims and leases, max_attempts, exactly one record per (task, epoch, sample), services, locks, schema version."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import inspect, select, text, update

from workers.ledger import (
    ClaimLost,
    InferenceService,
    Ledger,
    MalformedConnectionString,
    NotATask,
    Record,
    SchemaVersionMismatch,
    Task,
    UnregisteredTaskType,
    parse_connection_string,
    register_new_model,
    schema,
)
from workers.ledger.models import check_registered


@register_new_model
class StoredTask(Task):
    inputs: list[dict]
    target: str


class UnregisteredTask(Task):
    question: str


def rft(i: int) -> StoredTask:
    return StoredTask(id=str(i), inputs=[{"role": "user", "content": f"{i}+1"}], target=str(i + 1))


def test_tasks_round_trip_as_their_own_class(ledger_url):
    ledger = Ledger(ledger_url)
    assert ledger.write_epoch("train", 0, [rft(1), Task(id="plain")], owner="s1")
    back = ledger.tasks("train")
    assert [type(t) for t in back] == [StoredTask, Task]
    assert back[0].inputs == [{"role": "user", "content": "1+1"}] and back[0].target == "2"
    assert (back[0].split, back[0].epoch, back[0].status) == ("train", 0, "pending")


def test_an_epoch_is_written_once(ledger_url):
    ledger = Ledger(ledger_url)
    assert ledger.write_epoch("train", 0, [rft(i) for i in range(3)], owner="a")
    assert not ledger.write_epoch("train", 0, [rft(i) for i in range(3)], owner="b")
    assert ledger.write_epoch("train", 1, [rft(i) for i in range(3)], owner="b")
    assert ledger.written_epochs("train") == [0, 1]
    assert len(ledger.tasks("train")) == 6


def test_claim_heartbeat_complete(ledger_url):
    ledger = Ledger(ledger_url)
    ledger.write_epoch("train", 0, [rft(0), rft(1)], owner="s")
    claim, task = ledger.claim("train", owner="w1", lease_s=30)
    assert isinstance(task, StoredTask) and task.id == "0" and claim.attempt == 1 and claim.owner == "w1"
    assert ledger.heartbeat(claim.id, lease_s=60) > claim.lease_deadline
    ledger.complete(claim.id)
    assert ledger.task_counts("train") == {"done": 1, "pending": 1}
    assert [c.status for c in ledger.claims("train")] == ["done"]
    with pytest.raises(
        ClaimLost, match=rf"claim {claim.id} of task \S+ \(owner \S+\) is no longer the task's live claim"
    ):
        ledger.complete(claim.id)


def test_an_expired_lease_makes_the_task_claimable_again(ledger_url):
    ledger = Ledger(ledger_url)
    ledger.write_epoch("train", 0, [rft(0)], owner="s")
    first, _ = ledger.claim("train", owner="dead", lease_s=0.2)
    assert ledger.claim("train", owner="w2", lease_s=30) is None  # the lease is live
    time.sleep(0.3)
    second, task = ledger.claim("train", owner="w2", lease_s=30)
    assert task.id == "0" and second.attempt == 2
    with pytest.raises(ClaimLost):
        ledger.heartbeat(first.id)
    with pytest.raises(ClaimLost):
        ledger.complete(first.id)
    ledger.complete(second.id)
    statuses = {c.owner: (c.status, c.last_error) for c in ledger.claims()}
    assert statuses["w2"] == ("done", None)
    assert statuses["dead"][0] == "expired" and "lease ended" in statuses["dead"][1]


def test_after_max_attempts_the_task_fails_with_its_last_error(ledger_url):
    ledger = Ledger(ledger_url, max_attempts=2)
    ledger.write_epoch("train", 0, [rft(0)], owner="s")
    claim, _ = ledger.claim("train", owner="w", lease_s=30)
    assert ledger.fail(claim.id, "ValueError: bad trajectory") == "pending"
    claim, _ = ledger.claim("train", owner="w", lease_s=0.1)
    time.sleep(0.2)
    assert ledger.claim("train", owner="w") is None  # the second expiry used up max_attempts
    (task,) = ledger.tasks("train")
    assert task.status == "failed" and task.attempts == 2 and "expired" in task.last_error


def test_fail_then_fail_again_keeps_the_error(ledger_url):
    ledger = Ledger(ledger_url, max_attempts=1)
    ledger.write_epoch("train", 0, [rft(0)], owner="s")
    claim, _ = ledger.claim("train", owner="w")
    assert ledger.fail(claim.id, "RuntimeError: engine died") == "failed"
    (task,) = ledger.tasks("train")
    assert (task.status, task.last_error) == ("failed", "RuntimeError: engine died")


def test_release_returns_the_task_without_spending_an_attempt(ledger_url):
    ledger = Ledger(ledger_url, max_attempts=1)
    ledger.write_epoch("train", 0, [rft(0)], owner="s")
    claim, _ = ledger.claim("train", owner="w")
    ledger.release(claim.id, "cancelled")
    again, task = ledger.claim("train", owner="w")
    assert task.attempts == 1 and again.attempt == 1


def test_exactly_one_record_per_task_epoch_sample(ledger_url):
    ledger = Ledger(ledger_url)
    ledger.write_epoch("train", 0, [rft(0)], owner="s")
    ledger.write_epoch("train", 1, [rft(0)], owner="s")
    claim, _ = ledger.claim("train", owner="w")
    record = Record(
        task_key=claim.task_key,
        task_id="0",
        split="train",
        epoch=0,
        sample_index=0,
        score=1.0,
        messages=[{"role": "assistant", "content": "1"}],
        global_indexes=[3],
        group_id="g0",
    )
    first, written = ledger.write_record(record)
    assert written and first.id is not None and first.epoch == 0 and first.global_indexes == [3]
    again, written = ledger.write_record(record.model_copy(update={"score": 0.0}))
    assert not written and again.id == first.id and again.score == 1.0
    ledger.complete(claim.id)
    claim, _ = ledger.claim("train", owner="w")  # epoch 1, same task id: a record of its own
    _, written = ledger.write_record(record.model_copy(update={"task_key": claim.task_key, "epoch": 1}))
    assert written
    assert [(r.epoch, r.sample_index) for r in ledger.records("train")] == [(0, 0), (1, 0)]


def test_trainable_records_respect_max_trained_count_and_retrained_interval(ledger_url):
    ledger = Ledger(ledger_url)
    ledger.write_epoch("train", 0, [rft(0)], owner="s")
    claim, _ = ledger.claim("train", owner="w")
    for i in range(2):
        ledger.write_record(Record(task_key=claim.task_key, task_id="0", split="train", epoch=0, sample_index=i))
    ids = [r.record_id for r in ledger.trainable("train", step=0)]
    assert len(ids) == 2
    ledger.mark_trained(ids[:1], step=5)
    assert [r.record_id for r in ledger.trainable("train", step=5)] == ids[1:]
    # trained once at step 5; twice allowed, but only 3 steps later
    assert [r.record_id for r in ledger.trainable("train", 7, max_trained_count=2, retrained_interval=3)] == ids[1:]
    assert [r.record_id for r in ledger.trainable("train", 8, max_trained_count=2, retrained_interval=3)] == ids
    (trained,) = [r for r in ledger.trainable("train", step=8, max_trained_count=2) if r.record_id == ids[0]]
    assert (trained.trained_count, trained.last_trained_step) == (1, 5)


def test_services_least_loaded_first_and_stale_ones_down(ledger_url):
    ledger = Ledger(ledger_url)
    ledger.register_service(InferenceService(name="a", url="http://127.0.0.1:1/v1", load=3))
    ledger.register_service(InferenceService(name="b", url="http://127.0.0.1:2/v1", load=1))
    assert [s.name for s in ledger.services(healthy_only=True)] == ["b", "a"]
    time.sleep(0.3)
    ledger.service_heartbeat("a", load=0.5, policy_version=4)
    assert ledger.mark_stale_services(stale_after_s=0.2) == 1
    (up,) = ledger.services(healthy_only=True)
    assert (up.name, up.load, up.policy_version) == ("a", 0.5, 4)
    assert {s.name: s.status for s in ledger.services()} == {"a": "up", "b": "down"}
    with pytest.raises(KeyError, match="no inference service named 'c'"):
        ledger.service_heartbeat("c")


def test_locks(ledger_url):
    ledger = Ledger(ledger_url)
    assert ledger.acquire_lock("epochs:train", "s1", ttl_s=0.2)
    assert not ledger.acquire_lock("epochs:train", "s2", ttl_s=10)
    assert ledger.acquire_lock("epochs:train", "s1", ttl_s=0.2)  # renew
    time.sleep(0.3)
    assert ledger.acquire_lock("epochs:train", "s2", ttl_s=10)  # expired: taken over
    ledger.release_lock("epochs:train", "s2")
    assert ledger.acquire_lock("epochs:train", "s1", ttl_s=10)


def test_schema_version_is_checked(ledger_url):
    ledger = Ledger(ledger_url)
    with ledger._tx() as conn:
        conn.execute(update(schema.meta).where(schema.meta.c.key == "schema_version").values(value="99"))
    with pytest.raises(SchemaVersionMismatch, match="has schema version 99; this code expects 2"):
        Ledger(ledger_url)


def test_a_ledger_of_schema_version_1_is_migrated_when_opened(ledger_url):
    ledger = Ledger(ledger_url)
    ledger.write_epoch("train", 0, [rft(0), rft(1)], owner="s")
    claim, _ = ledger.claim("train", owner="w", lease_s=60)
    with ledger._tx() as conn:  # as version 1 left it: no index on the leases
        conn.execute(text("DROP INDEX ix_tasks_leases"))
        conn.execute(update(schema.meta).where(schema.meta.c.key == "schema_version").values(value="1"))
    ledger.close()
    reopened = Ledger(ledger_url, create=False)
    with reopened._tx() as conn:
        assert "ix_tasks_leases" in {index["name"] for index in inspect(conn).get_indexes("ledger_tasks")}
        assert conn.execute(select(schema.meta.c.value).where(schema.meta.c.key == "schema_version")).scalar() == "2"
    reopened.complete(claim.id)  # what was written before is all there
    _, task = reopened.claim("train", owner="w", lease_s=60)
    assert task.id == "1" and reopened.task_counts("train") == {"done": 1, "running": 1}


def test_bad_input_is_a_typed_error_naming_expected_and_got(ledger_url):
    ledger = Ledger(ledger_url)
    with pytest.raises(UnregisteredTaskType, match="UnregisteredTask is not registered: decorate it with"):
        ledger.write_epoch("train", 0, [UnregisteredTask(id="0", question="?")], owner="s")
    with pytest.raises(NotATask, match=r"expected a Task instance .* got dict"):
        ledger.write_epoch("train", 0, [{"id": "0"}], owner="s")  # type: ignore[list-item]
    assert ledger.written_epochs("train") == []  # all or nothing


def test_a_stored_type_this_process_does_not_know_is_a_typed_error(ledger_url):
    ledger = Ledger(ledger_url)
    ledger.write_epoch("train", 0, [rft(0)], owner="s")
    with ledger._tx() as conn:
        conn.execute(update(schema.tasks).values(type="nowhere.module:GoneTask"))
    with pytest.raises(UnregisteredTaskType, match=r"tasks of type nowhere\.module:GoneTask, which is not registered"):
        ledger.tasks("train")


@pytest.mark.parametrize(
    "value",
    ["mongodb://localhost:27017", "sqlite://relative.db", "sqlite:///:memory:", "postgresql:/x", "", None, 5],
)
def test_malformed_connection_strings(value):
    with pytest.raises(MalformedConnectionString, match=r"expected 'sqlite:///PATH' or 'postgresql://.*, got"):
        parse_connection_string(value)


def test_a_type_is_known_by_its_name_and_two_different_types_of_one_name_are_refused():
    script_copy = type("StoredTask", (Task,), {"__annotations__": {"inputs": list[dict], "target": str}})
    script_copy.__module__ = "__main__"  # a script that defines the same task type as an importable module
    assert register_new_model(script_copy) is script_copy
    assert check_registered(script_copy(id="0", inputs=[], target="1")) and check_registered(rft(0))
    with pytest.raises(UnregisteredTaskType, match=r"task type StoredTask is registered twice with different fields"):
        register_new_model(type("StoredTask", (Task,), {"__annotations__": {"target": int}}))
    register_new_model(StoredTask)


def test_register_new_model_rejects_non_tasks():
    with pytest.raises(NotATask, match="expects a subclass of Task, got <class 'dict'>"):
        register_new_model(dict)  # type: ignore[type-var]


def test_mark_trained_marks_only_what_is_still_trainable_and_says_which(ledger_url):
    ledger = Ledger(ledger_url)
    ledger.write_epoch("train", 0, [rft(0)], owner="s")
    claim, _ = ledger.claim("train", owner="w")
    stored = ledger.write_records(
        [Record(task_key=claim.task_key, task_id="0", split="train", epoch=0, sample_index=i) for i in range(3)]
    )
    ids = [r.id for r, written in stored if written]
    assert len(ids) == 3
    assert ledger.mark_trained(ids[:2], step=1, max_trained_count=1) == ids[:2]
    # a second consumer (or a resumed run) offered the same rows trains only the one never trained
    assert ledger.mark_trained(ids, step=2, max_trained_count=1) == ids[2:]
    assert ledger.mark_trained(ids, step=3, max_trained_count=2, retrained_interval=2) == ids[:2]
    assert {r.id: r.trained_count for r in ledger.records("train")} == {ids[0]: 2, ids[1]: 2, ids[2]: 1}


def test_replace_unqueued_swaps_a_sample_that_never_reached_the_queue(ledger_url):
    ledger = Ledger(ledger_url)
    ledger.write_epoch("train", 0, [rft(0)], owner="s")
    claim, _ = ledger.claim("train", owner="w")
    base = Record(task_key=claim.task_key, task_id="0", split="train", epoch=0, sample_index=0, score=0.0)
    ledger.write_record(base)
    [(swapped, written)] = ledger.write_records([base.model_copy(update={"score": 1.0})], replace_unqueued=True)
    assert written and swapped.score == 1.0
    ledger.set_record_locations([swapped.id], "p", [5])
    [(kept, written)] = ledger.write_records([base.model_copy(update={"score": 0.5})], replace_unqueued=True)
    assert not written and kept.score == 1.0 and kept.global_indexes == [5]
    assert len(ledger.records("train")) == 1


def test_with_retry_backs_off_on_unavailable_and_gives_up_at_its_deadline():
    from workers.ledger import LedgerUnavailable
    from workers.ledger.retry import backoff_delays, with_retry

    delays = backoff_delays(0.1, 0.4)
    for base in (0.1, 0.2, 0.4, 0.4):  # doubling, capped, with up to 25 % jitter
        assert base <= next(delays) <= base * 1.25
    calls, seen = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise LedgerUnavailable("ledger x unavailable: connection refused")
        return "ok"

    assert with_retry(flaky, on_retry=seen.append) == "ok" and len(seen) == 2

    def down():
        raise LedgerUnavailable("ledger x unavailable: connection refused")

    with pytest.raises(LedgerUnavailable, match="connection refused"):
        with_retry(down, deadline_s=0.3)
