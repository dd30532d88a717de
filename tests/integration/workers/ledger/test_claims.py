"""Claims on PostgreSQL under concurrency: claimers (threads and processes, one task or a batch at a time) never get
the same task and together claim all of them; a claim is one statement, outside an explicit transaction; batched
claims keep the order and the semantics of single ones; the scheduler's lock never fails on a concurrent release."""

from __future__ import annotations

import json
import multiprocessing
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import event, update

from tests.integration.workers.ledger.claimers import claim_batches
from workers.ledger import Ledger, Task, schema, store

CTX = multiprocessing.get_context("spawn")


@pytest.fixture
def pg_url(postgres_server) -> str:
    return postgres_server.create_database()


@contextmanager
def round_trips(ledger: Ledger) -> Iterator[list[str]]:
    """What the ledger's connections send inside the block: each statement, and ``BEGIN``/``COMMIT``/``ROLLBACK``
    where the driver sends them (a connection in autocommit sends neither)."""
    sent: list[str] = []

    def statement(conn, cursor, text, parameters, context, executemany) -> None:
        sent.append(" ".join(text.split())[:60])

    def tx(name: str) -> Callable[..., None]:
        def record(conn, *args) -> None:
            if not conn.connection.dbapi_connection.autocommit:
                sent.append(name)

        return record

    hooks = [("before_cursor_execute", statement)] + [(name, tx(name.upper())) for name in ("commit", "rollback")]
    for name, hook in hooks:
        event.listen(ledger._engine, name, hook)
    try:
        yield sent
    finally:
        for name, hook in hooks:
            event.remove(ledger._engine, name, hook)


def test_a_claim_is_one_statement_without_begin_or_commit(pg_url):
    ledger = Ledger(pg_url)
    ledger.write_epoch("train", 0, [Task(id=str(i)) for i in range(10)], owner="test")
    with round_trips(ledger) as sent:
        claim, _ = ledger.claim("train", owner="w", lease_s=60)
    assert len(sent) == 1 and sent[0].startswith("WITH expired AS"), sent
    with ledger._tx() as conn:  # its lease ran out: the next claim ends that claim and takes the task again
        conn.execute(update(schema.tasks).where(schema.tasks.c.key == claim.task_key).values(lease_deadline=1.0))
    with round_trips(ledger) as sent:
        again, _ = ledger.claim("train", owner="w2", lease_s=60)
    assert len(sent) == 1 and again.task_key == claim.task_key and again.attempt == 2
    with round_trips(ledger) as sent:
        batch = ledger.claim_many("train", "w3", 5, lease_s=60)
    assert len(sent) == 1 and len(batch) == 5
    with round_trips(ledger) as sent:
        rest = ledger.claim_many("train", "w3", 5, lease_s=60)
    assert len(sent) == 1 and len(rest) == 4  # all that is left


def test_a_batch_claims_in_the_order_single_claims_do(ledger_url):
    ledger = Ledger(ledger_url, max_attempts=2)
    for epoch in range(2):
        ledger.write_epoch("train", epoch, [Task(id=str(i)) for i in range(3)], owner="test")
    first = [ledger.claim("train", owner=f"w{i}", lease_s=60) for i in range(3)]
    ledger.complete(first[0][0].id)
    with ledger._tx() as conn:  # w2's lease ended long ago, w1's just now; w1's task is on its last attempt
        tasks = schema.tasks
        conn.execute(update(tasks).where(tasks.c.key == first[2][0].task_key).values(lease_deadline=1.0))
        key = first[1][0].task_key
        conn.execute(update(tasks).where(tasks.c.key == key).values(lease_deadline=2.0, attempts=2))
    got = ledger.claim_many("train", "batch", 3, lease_s=60)
    # the longest-expired lease first; w1's task failed (max_attempts used up), so two pending tasks follow
    assert [(task.id, task.epoch, claim.attempt) for claim, task in got] == [("2", 0, 2), ("0", 1, 1), ("1", 1, 1)]
    assert all(claim.owner == "batch" and claim.status == "running" for claim, _ in got)
    assert ledger.task_counts("train") == {"done": 1, "failed": 1, "running": 3, "pending": 1}
    (failed,) = [t for t in ledger.tasks("train") if t.status == "failed"]
    assert failed.id == "1" and failed.epoch == 0 and "expired: lease ended" in (failed.last_error or "")
    ended = {c.id: c for c in ledger.claims("train")}
    assert ended[first[1][0].id].status == "expired" and ended[first[2][0].id].status == "expired"
    assert [t.id for _, t in ledger.claim_many("train", "batch", 10, lease_s=60)] == ["2"]
    assert ledger.claim_many("train", "batch", 10, lease_s=60) == []
    with pytest.raises(ValueError, match="n must be >= 1"):
        ledger.claim_many("train", "batch", 0)


def test_threads_claiming_at_once_never_get_the_same_task_and_claim_them_all(pg_url):
    ledger = Ledger(pg_url)
    for epoch in range(2):
        ledger.write_epoch("train", epoch, [Task(id=str(i)) for i in range(150)], owner="test")
    start = threading.Barrier(8)
    claimed: list[list[tuple[str, int]]] = [[] for _ in range(8)]
    errors: list[BaseException] = []

    def claimer(i: int) -> None:
        mine = Ledger(pg_url)  # a ledger (and connection pool) of its own, as a process would have
        start.wait()
        try:
            while got := mine.claim_many("train", f"t{i}", 1 + i % 3, lease_s=3600):
                claimed[i] += [(task.id, task.epoch) for _, task in got]
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            mine.close()

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    counts = Counter(task for mine in claimed for task in mine)
    assert len(counts) == 300 and set(counts.values()) == {1}
    assert ledger.task_counts("train") == {"running": 300}
    assert len(ledger.claims("train", status="running")) == 300


def test_processes_claiming_at_once_never_get_the_same_task_and_claim_them_all(pg_url, tmp_path):
    ledger = Ledger(pg_url)
    ledger.write_epoch("train", 0, [Task(id=str(i)) for i in range(400)], owner="test")
    start = CTX.Event()
    outs = [tmp_path / f"p{i}.json" for i in range(6)]
    procs = [  # half of them claim one task at a time (Ledger.claim), half four (Ledger.claim_many)
        CTX.Process(target=claim_batches, args=(pg_url, "train", f"p{i}", 1 + 3 * (i % 2), start, str(outs[i])))
        for i in range(6)
    ]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(180)
        assert p.exitcode == 0, f"claimer {p.name} exited with {p.exitcode}"
    keys = [key for out in outs for key in json.loads(out.read_text())["keys"]]
    assert len(keys) == 400 and len(set(keys)) == 400
    assert ledger.task_counts("train") == {"running": 400}


def test_acquire_lock_survives_a_release_between_its_statements(pg_url):
    """The holder releases the lock while another ledger is taking it. Before, ``acquire_lock`` saw the lock held
    (its ``INSERT`` conflicted), then read the row, gone by then: ``NoResultFound``. Now it is one upsert."""
    holder, taker = Ledger(pg_url), Ledger(pg_url)
    assert holder.acquire_lock("epochs:train", "holder", ttl_s=60)
    seen: list[str] = []

    def release_after_the_first(conn, cursor, statement, parameters, context, executemany) -> None:
        if "ledger_locks" in statement:
            seen.append(statement)
            if len(seen) == 2:  # between the taker's first and second statement on the lock
                holder.release_lock("epochs:train", "holder")

    event.listen(taker._engine, "before_cursor_execute", release_after_the_first)
    try:
        assert not taker.acquire_lock("epochs:train", "taker", ttl_s=60)  # held when it asked
    finally:
        event.remove(taker._engine, "before_cursor_execute", release_after_the_first)
    holder.release_lock("epochs:train", "holder")  # (a no-op if released above)
    assert taker.acquire_lock("epochs:train", "taker", ttl_s=60)
    assert not holder.acquire_lock("epochs:train", "holder", ttl_s=60)


def test_acquire_lock_under_concurrent_acquires_and_releases(pg_url):
    """Threads take, hold and release one lock over and over: never an error, never two holders at once."""
    holders: list[str] = []
    errors: list[BaseException] = []
    taken = Counter[str]()
    start = threading.Barrier(6)

    def worker(i: int) -> None:
        ledger = Ledger(pg_url)
        me = f"w{i}"
        start.wait()
        try:
            for _ in range(60):
                if ledger.acquire_lock("epochs:train", me, ttl_s=60):
                    holders.append(me)
                    assert len(holders) == 1, f"two holders at once: {holders}"
                    taken[me] += 1
                    holders.remove(me)
                    ledger.release_lock("epochs:train", me)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            ledger.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    assert sum(taken.values()) > 0


def test_a_connection_is_pinged_only_after_it_sat_idle(pg_url, monkeypatch):
    """Back-to-back claims send no ``SELECT 1`` before their statement; one after ``PING_AFTER_IDLE_S`` does, and a
    server that dropped the connection meanwhile costs a fresh connection, not an error."""
    ledger = Ledger(pg_url)
    ledger.write_epoch("train", 0, [Task(id=str(i)) for i in range(10)], owner="test")
    pings = []
    ping = ledger._engine.dialect.do_ping
    monkeypatch.setattr(ledger._engine.dialect, "do_ping", lambda c: pings.append(1) or ping(c))
    for _ in range(3):
        ledger.claim("train", owner="w", lease_s=60)
    assert pings == []
    monkeypatch.setattr(store, "PING_AFTER_IDLE_S", 0.0)
    with ledger._tx() as conn:  # the server ends the ledger's pooled connections
        conn.exec_driver_sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
            "AND datname = current_database()"
        )
    assert ledger.claim("train", owner="w", lease_s=60) is not None
    assert pings
