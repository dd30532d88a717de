"""The ledger's hot paths read index ranges, never the tasks table: every statement a claim, a heartbeat, a
completion and the scheduler's poll run is put through SQLite's ``EXPLAIN QUERY PLAN``; the work each does (SQLite
virtual-machine steps, counted by a progress handler: no clock) is the same on a ledger ten times larger. (PostgreSQL's
plans, and the migration of a version-1 ledger: tests/integration/workers/ledger/.)"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event

from tests.ledger_states import fill_with_claim_states
from workers.ledger import AsyncSampler, Ledger, Record, SamplingConfig, SamplingScheduler

FULL_SCANS = ("SCAN ledger_tasks", "USE TEMP B-TREE")  # the whole table (or a whole index), or a sort of it


@contextmanager
def statements(ledger: Ledger) -> Iterator[list[tuple[str, Any]]]:
    """The SELECTs and UPDATEs that touch ledger_tasks, with their parameters, run inside the block."""
    seen: list[tuple[str, Any]] = []

    def capture(conn, cursor, statement, parameters, context, executemany) -> None:
        if not executemany and statement.lstrip().startswith(("SELECT", "UPDATE")) and "ledger_tasks" in statement:
            seen.append((statement, parameters))

    event.listen(ledger._engine, "before_cursor_execute", capture)
    try:
        yield seen
    finally:
        event.remove(ledger._engine, "before_cursor_execute", capture)


def full_scans(ledger: Ledger, run: Callable[[], object]) -> list[str]:
    """Each statement ``run`` executes whose plan scans the tasks table (or sorts it), with that plan line."""
    with statements(ledger) as seen:
        run()
    assert seen, "the call ran no statement on ledger_tasks"
    found = []
    with ledger._engine.connect() as conn:
        for statement, parameters in seen:
            for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters):
                if row.detail.startswith(FULL_SCANS):
                    found.append(f"{row.detail}: {' '.join(statement.split())}")
    return found


def vm_steps(ledger: Ledger, run: Callable[[], Any]) -> tuple[int, Any]:
    """SQLite virtual-machine steps (in tens) the statements of ``run()`` took, and what it returned."""
    steps = 0

    def tick() -> int:
        nonlocal steps
        steps += 1
        return 0  # go on

    def checkout(dbapi_connection, record, proxy) -> None:
        dbapi_connection.set_progress_handler(tick, 10)

    def checkin(dbapi_connection, record) -> None:
        dbapi_connection.set_progress_handler(None, 10)

    event.listen(ledger._engine, "checkout", checkout)
    event.listen(ledger._engine, "checkin", checkin)
    try:
        returned = run()
    finally:
        event.remove(ledger._engine, "checkout", checkout)
        event.remove(ledger._engine, "checkin", checkin)
    return steps, returned


def make_ledger(path, tasks: int) -> Ledger:
    return fill_with_claim_states(Ledger(f"sqlite:///{path}/ledger.db"), tasks)


@pytest.fixture
def ledger(tmp_path) -> Ledger:
    return make_ledger(tmp_path, 200)


class Idle(AsyncSampler):
    async def run(self) -> None:
        pass

    async def evaluate_record(self, record: Record) -> float:
        return 0.0


def test_a_claim_reads_index_ranges_never_the_tasks_table(ledger):
    assert full_scans(ledger, lambda: ledger.claim("train", owner="w3", lease_s=60)) == []  # the expired one
    assert full_scans(ledger, lambda: ledger.claim("train", owner="w3", lease_s=60)) == []  # a pending one
    assert full_scans(ledger, lambda: ledger.claim("train", owner="w3", lease_s=60, epoch=1)) == []


def test_heartbeat_complete_fail_and_release_find_the_task_by_primary_keys(ledger):
    claim, task = ledger.claim("train", owner="w3", lease_s=60)
    record = Record(task_key=claim.task_key, task_id=task.id, split="train", epoch=task.epoch, claim_id=claim.id)
    assert full_scans(ledger, lambda: ledger.heartbeat(claim.id, lease_s=60)) == []
    assert full_scans(ledger, lambda: ledger.write_records([record])) == []
    assert full_scans(ledger, lambda: ledger.complete(claim.id)) == []
    failed, _ = ledger.claim("train", owner="w3", lease_s=60)
    assert full_scans(ledger, lambda: ledger.fail(failed.id, "RuntimeError: x")) == []
    released, _ = ledger.claim("train", owner="w3", lease_s=60)
    assert full_scans(ledger, lambda: ledger.release(released.id)) == []


def test_the_scheduler_s_poll_reads_index_ranges_never_the_tasks_table(ledger, tmp_path):
    cfg = SamplingConfig(output_dir=str(tmp_path / "run"), db_connection_string=ledger.connection_string)
    scheduler = SamplingScheduler(cfg, Idle, dataset=[], split="train", ledger=ledger)
    assert full_scans(ledger, lambda: scheduler.epoch_progress(0)) == []
    unfinished, claimable = scheduler.epoch_progress(0)
    assert (unfinished, claimable) == (8, 8)  # 199 unfinished, 198 claimable: each counted up to the 8 it can use
    assert full_scans(ledger, lambda: ledger.claimable_count("train", limit=8)) == []


def test_the_scheduler_s_poll_counts_what_is_left_of_an_epoch(ledger, tmp_path):
    cfg = SamplingConfig(output_dir=str(tmp_path / "run"), db_connection_string=ledger.connection_string)
    scheduler = SamplingScheduler(cfg, Idle, dataset=[], split="train", ledger=ledger)
    while (got := ledger.claim("train", owner="w3", lease_s=60, epoch=0)) is not None:
        claim, _ = got
        if claim.task_key % 50 != 0:  # all but a few finish; those stay running on live leases
            ledger.complete(claim.id)
    assert tuple(scheduler.epoch_progress(0)) == (5, 0)  # w1's live claim and four of w3's
    assert ledger.claimable_count("train") == 200 and ledger.claimable_count("train", epoch=0) == 0


def test_an_expired_lease_is_claimed_before_pending_tasks(ledger):
    claim, task = ledger.claim("train", owner="w3", lease_s=60)
    assert (task.id, task.epoch, claim.attempt) == ("2", 0, 2)  # w2's, expired: back first in line
    claim, task = ledger.claim("train", owner="w3", lease_s=60)
    assert (task.id, task.epoch, claim.attempt) == ("3", 0, 1)  # then the oldest pending one
    assert time.time() < claim.lease_deadline


def hot_calls(ledger: Ledger, scheduler: SamplingScheduler) -> dict[str, int]:
    """The VM steps of each call a sampler or the scheduler makes over and over."""
    steps = {}
    steps["claim an expired task"], (claim, task) = vm_steps(ledger, lambda: ledger.claim("train", "w", 60))
    steps["claim a pending task"], (claim, task) = vm_steps(ledger, lambda: ledger.claim("train", "w", 60))
    steps["claim in epoch 1"], _ = vm_steps(ledger, lambda: ledger.claim("train", "w", 60, epoch=1))
    steps["heartbeat"], _ = vm_steps(ledger, lambda: ledger.heartbeat(claim.id, lease_s=60))
    record = Record(task_key=claim.task_key, task_id=task.id, split="train", epoch=task.epoch, claim_id=claim.id)
    steps["write_records"], _ = vm_steps(ledger, lambda: ledger.write_records([record]))
    steps["complete"], _ = vm_steps(ledger, lambda: ledger.complete(claim.id))
    steps["scheduler poll"], _ = vm_steps(ledger, lambda: scheduler.epoch_progress(0))
    return steps


def test_no_hot_call_does_more_work_on_a_ten_times_larger_ledger(tmp_path):
    steps = []
    for tasks in (200, 2000):
        ledger = make_ledger(tmp_path / str(tasks), tasks)
        cfg = SamplingConfig(output_dir=str(tmp_path / str(tasks)), db_connection_string=ledger.connection_string)
        steps.append(hot_calls(ledger, SamplingScheduler(cfg, Idle, dataset=[], split="train", ledger=ledger)))
    small, large = steps
    # an index seek is one step whatever the table's size; a scan of the split would take ten times the steps
    grew = {call: (small[call], large[call]) for call in small if large[call] > small[call] + 5}
    assert grew == {}
