"""On a real PostgreSQL, the plans of a claim, a heartbeat, a completion and the scheduler's poll read index ranges,
never the tasks table: no sequential scan of ``ledger_tasks`` and no sort, with 20,000 analysed tasks (SQLite's
plans, and the work per call on a ledger ten times larger: tests/unit/workers/ledger/test_query_plans.py)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event

from tests.ledger_states import fill_with_claim_states
from workers.ledger import AsyncSampler, Ledger, Record, SamplingConfig, SamplingScheduler

FULL_SCAN = re.compile(r"Seq Scan on ledger_tasks|\bSort\b")


def full_scans(ledger: Ledger, run: Callable[[], Any]) -> list[str]:
    """Each statement on ledger_tasks that ``run`` executes whose plan scans the table or sorts, with its plan."""
    seen: list[tuple[str, Any]] = []

    def capture(conn, cursor, statement, parameters, context, executemany) -> None:
        if (
            not executemany
            and statement.lstrip().startswith(("SELECT", "UPDATE", "WITH"))
            and "ledger_tasks" in statement
        ):
            seen.append((statement, parameters))

    event.listen(ledger._engine, "before_cursor_execute", capture)
    try:
        run()
    finally:
        event.remove(ledger._engine, "before_cursor_execute", capture)
    assert seen, "the call ran no statement on ledger_tasks"
    found = []
    with ledger._engine.connect() as conn:
        for statement, parameters in seen:
            plan = "\n".join(row[0] for row in conn.exec_driver_sql("EXPLAIN " + statement, parameters))
            if FULL_SCAN.search(plan):
                found.append(f"{' '.join(statement.split())}\n{plan}")
    return found


class Idle(AsyncSampler):
    async def run(self) -> None:
        pass

    async def evaluate_record(self, record: Record) -> float:
        return 0.0


@pytest.fixture
def ledger(postgres_server) -> Ledger:
    """Two epochs of 10,000 tasks, analysed; in epoch 0 one done, one running, one on an expired lease."""
    ledger = fill_with_claim_states(Ledger(postgres_server.create_database()), 10_000)
    with ledger._engine.connect() as conn:  # what autovacuum does after a bulk write
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("ANALYZE")
    return ledger


def test_claims_heartbeats_and_completions_read_index_ranges_never_the_tasks_table(ledger):
    assert full_scans(ledger, lambda: ledger.claim("train", owner="w3", lease_s=60)) == []  # the expired one
    assert full_scans(ledger, lambda: ledger.claim("train", owner="w3", lease_s=60, epoch=1)) == []
    claim, task = ledger.claim("train", owner="w3", lease_s=60)
    record = Record(task_key=claim.task_key, task_id=task.id, split="train", epoch=task.epoch, claim_id=claim.id)
    assert full_scans(ledger, lambda: ledger.heartbeat(claim.id, lease_s=60)) == []
    assert full_scans(ledger, lambda: ledger.write_records([record])) == []
    assert full_scans(ledger, lambda: ledger.complete(claim.id)) == []


def test_the_scheduler_s_poll_reads_index_ranges_never_the_tasks_table(ledger, tmp_path):
    cfg = SamplingConfig(output_dir=str(tmp_path), db_connection_string=ledger.connection_string)
    scheduler = SamplingScheduler(cfg, Idle, dataset=[], split="train", ledger=ledger)
    assert full_scans(ledger, lambda: scheduler.epoch_progress(0)) == []
