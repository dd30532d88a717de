"""The ledger's tables (SQLAlchemy Core), the schema version and the connection-string rules: the only place that
knows column names besides ``store.py``.

    tasks       one row per (split, epoch, task id): payload, status, attempts, the live claim and its lease
    claims      DispatchedSamplingTask: every claim ever made (owner, attempt, lease, status, last error)
    records     Record: one per (task row, sample_index), enforced by a unique constraint
    services    InferenceService: registered endpoints, load, heartbeat
    epochs      which (split, epoch) the scheduler has written (so two schedulers never write one twice)
    locks       named leases (the scheduler's distributed lock)
    meta        schema_version

A claim reads two index ranges of ``tasks``, never the table: ``ix_tasks_claimable`` (split, status, epoch, key)
gives the oldest pending task and ``ix_tasks_leases`` (split, status, lease_deadline) the longest-expired running
one, each in O(log n); the scheduler's poll counts on the same ranges. A live claim is found from its id through
``claims``' primary key. ``MIGRATIONS`` brings an older ledger up to ``SCHEMA_VERSION`` when it is opened.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import (
    JSON,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

from workers.ledger.errors import MalformedConnectionString, UnsupportedBackend

SCHEMA_VERSION = 2

metadata = MetaData()

meta = Table("ledger_meta", metadata, Column("key", String(64), primary_key=True), Column("value", Text))

tasks = Table(
    "ledger_tasks",
    metadata,
    Column("key", Integer, primary_key=True, autoincrement=True),
    Column("task_id", String(256), nullable=False),
    Column("split", String(64), nullable=False),
    Column("epoch", Integer, nullable=False),
    Column("type", String(256), nullable=False),
    Column("payload", JSON, nullable=False),
    Column("status", String(16), nullable=False),
    Column("attempts", Integer, nullable=False, default=0),
    Column("claim_id", Integer),
    Column("lease_deadline", Float),
    Column("last_error", Text),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    UniqueConstraint("split", "epoch", "task_id", name="uq_task_split_epoch_id"),
    Index("ix_tasks_claimable", "split", "status", "epoch", "key"),
    Index("ix_tasks_leases", "split", "status", "lease_deadline"),
)

claims = Table(
    "ledger_claims",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("task_key", Integer, ForeignKey("ledger_tasks.key"), nullable=False),
    Column("owner", String(256), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("lease_deadline", Float, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("last_error", Text),
    Index("ix_claims_task", "task_key"),
)

records = Table(
    "ledger_records",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("task_key", Integer, ForeignKey("ledger_tasks.key"), nullable=False),
    Column("sample_index", Integer, nullable=False),
    Column("claim_id", Integer),
    Column("messages", JSON, nullable=False),
    Column("prompt_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("score", Float),
    Column("policy_version", Integer, nullable=False),
    Column("partition_id", String(256)),
    Column("global_indexes", JSON, nullable=False),
    Column("group_id", String(256)),
    Column("blobs", JSON, nullable=False),
    Column("trained_count", Integer, nullable=False, default=0),
    Column("last_trained_step", Integer),
    Column("created_at", Float, nullable=False),
    UniqueConstraint("task_key", "sample_index", name="uq_record_task_sample"),
)

services = Table(
    "ledger_services",
    metadata,
    Column("name", String(256), primary_key=True),
    Column("kind", String(32), nullable=False),
    Column("url", Text),
    Column("actor", String(256)),
    Column("model", String(256), nullable=False),
    Column("policy_version", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("load", Float, nullable=False),
    Column("last_heartbeat", Float, nullable=False),
)

epochs = Table(
    "ledger_epochs",
    metadata,
    Column("split", String(64), primary_key=True),
    Column("epoch", Integer, primary_key=True),
    Column("num_tasks", Integer, nullable=False),
    Column("written_by", String(256), nullable=False),
    Column("written_at", Float, nullable=False),
)

locks = Table(
    "ledger_locks",
    metadata,
    Column("name", String(256), primary_key=True),
    Column("owner", String(256), nullable=False),
    Column("expires_at", Float, nullable=False),
)

# what opening a ledger of schema version v (the key) adds to bring it to v + 1: only additions, so that a ledger is
# migrated in one transaction while nothing else changes shape
MIGRATIONS: dict[int, list[Index]] = {
    1: [next(index for index in tasks.indexes if index.name == "ix_tasks_leases")],  # expired leases, indexed
}


@dataclass(frozen=True)
class ConnectionTarget:
    """A parsed ``db_connection_string``: the backend and the SQLAlchemy URL to open."""

    backend: str  # "sqlite" | "postgresql"
    url: str
    path: str | None = None  # the SQLite file


_SQLITE = re.compile(r"^sqlite:///(?P<path>[^?]+)$")
_POSTGRES = re.compile(r"^postgres(?:ql)?(?:\+psycopg)?://(?P<rest>[^/\s]+(?:/[^\s]*)?)$")
_MONGODB = re.compile(r"^mongodb(?:\+srv)?://", re.IGNORECASE)
EXPECTED = "'sqlite:///PATH' or 'postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE'"


def parse_connection_string(value: object) -> ConnectionTarget:
    """Which backend ``value`` names, or :class:`MalformedConnectionString` saying what was expected.

    >>> parse_connection_string("sqlite:///run/ledger.db").backend
    'sqlite'
    >>> parse_connection_string("postgresql://postgres@127.0.0.1:5432/ledger").url
    'postgresql+psycopg://postgres@127.0.0.1:5432/ledger'
    """
    if not isinstance(value, str):
        raise MalformedConnectionString(f"db_connection_string: expected {EXPECTED}, got {type(value).__name__}")
    if match := _SQLITE.match(value):
        path = match["path"]
        if path == ":memory:":
            raise MalformedConnectionString(
                f"db_connection_string: expected {EXPECTED} with a file path (several processes share it), got "
                f"{redact(value)!r}"
            )
        return ConnectionTarget("sqlite", f"sqlite:///{path}", path)
    if match := _POSTGRES.match(value):
        return ConnectionTarget("postgresql", f"postgresql+psycopg://{match['rest']}")
    if _MONGODB.match(value):
        raise UnsupportedBackend(
            f"db_connection_string: MongoDB (AgentRL's database) is not a ledger backend: expected {EXPECTED}, got "
            f"{redact(value)!r}; docs/sampling.md maps AgentRL's MongoDB collections onto the ledger's tables"
        )
    raise MalformedConnectionString(f"db_connection_string: expected {EXPECTED}, got {redact(value)!r}")


_CREDENTIALS = re.compile(r"^(?P<head>[A-Za-z][\w+.-]*://[^:@/]*):.*@", re.DOTALL)


def redact(connection_string: str) -> str:
    """``connection_string`` with its password (everything between ``USER:`` and the last ``@``) shown as ``***``:
    what every error or log line shows of a connection string.

    >>> redact("postgresql://alice:s3cret@db:5432/ledger")
    'postgresql://alice:***@db:5432/ledger'
    >>> redact("sqlite:///run/ledger.db")
    'sqlite:///run/ledger.db'
    """
    return _CREDENTIALS.sub(r"\g<head>:***@", connection_string)
