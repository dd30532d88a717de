"""A SQLite ledger closed at a normal end leaves its ``.db`` file alone: the write-ahead log is checkpointed into it
and truncated, and the ``-wal`` and ``-shm`` files go with the last connection (issue 25, §3)."""

from __future__ import annotations

import os
import sqlite3

from workers.ledger import Ledger, Task


def _busy_ledger(path) -> Ledger:
    ledger = Ledger(f"sqlite:///{path}")
    ledger.write_epoch("train", 0, [Task(id=str(i)) for i in range(50)], owner="test")
    claim, _ = ledger.claim("train", owner="w1", lease_s=30)
    ledger.complete(claim.id)
    return ledger


def test_a_closed_ledger_leaves_only_its_db_file(tmp_path):
    ledger = _busy_ledger(tmp_path / "ledger.db")
    assert sorted(os.listdir(tmp_path)) == ["ledger.db", "ledger.db-shm", "ledger.db-wal"]
    ledger.close()
    assert os.listdir(tmp_path) == ["ledger.db"]
    reopened = sqlite3.connect(tmp_path / "ledger.db")
    assert reopened.execute("SELECT count(*) FROM ledger_tasks").fetchone() == (50,)
    reopened.close()


def test_closing_beside_another_reader_folds_the_log_into_the_db_file(tmp_path):
    # another process still has the ledger open (``python -m workers.ledger status``): the files stay while it does,
    # but the log is empty, everything is in ledger.db; they go when that reader closes
    ledger = _busy_ledger(tmp_path / "ledger.db")
    reader = sqlite3.connect(tmp_path / "ledger.db")
    assert reader.execute("SELECT count(*) FROM ledger_tasks").fetchone() == (50,)
    assert os.path.getsize(tmp_path / "ledger.db-wal") > 0
    ledger.close()
    assert os.path.getsize(tmp_path / "ledger.db-wal") == 0
    assert reader.execute("SELECT count(*) FROM ledger_tasks WHERE status = 'done'").fetchone() == (1,)
    reader.close()
    assert os.listdir(tmp_path) == ["ledger.db"]
