"""A ledger in every claim state, for the tests of its query plans (SQLite and PostgreSQL alike)."""

from __future__ import annotations

from sqlalchemy import update

from workers.ledger import Ledger, Task, schema


def fill_with_claim_states(ledger: Ledger, tasks: int) -> Ledger:
    """Two epochs of ``tasks`` tasks; in epoch 0 one done, one running on a live lease, one on an expired lease."""
    for epoch in range(2):
        ledger.write_epoch("train", epoch, [Task(id=str(i)) for i in range(tasks)], owner="test")
    done, _ = ledger.claim("train", owner="w0", lease_s=60)
    ledger.complete(done.id)
    ledger.claim("train", owner="w1", lease_s=60)
    expired, _ = ledger.claim("train", owner="w2", lease_s=60)
    with ledger._tx() as conn:
        conn.execute(update(schema.tasks).where(schema.tasks.c.key == expired.task_key).values(lease_deadline=1.0))
    return ledger
