"""The sampling control plane: a durable task ledger (SQLite or PostgreSQL) with claims and leases, the
``AsyncSampler`` that claims tasks and writes records, the ``SamplingScheduler`` that writes tasks epoch by epoch
and runs samplers, and the ``InferenceService`` registry. See docs/sampling.md.

AgentRL's imports map onto ours: ``from databases import register_new_model, Task`` becomes
``from workers.ledger import register_new_model, Task``; ``rollout.sampler`` and ``rollout.scheduler`` become
``workers.ledger``.
"""

from workers.ledger.errors import (
    ClaimLost,
    InferenceFailed,
    LedgerError,
    LedgerUnavailable,
    LockNotAcquired,
    MalformedConnectionString,
    NoInferenceService,
    NoTaskAvailable,
    NotATask,
    SchemaVersionMismatch,
    UnregisteredTaskType,
)
from workers.ledger.models import (
    DBRecordData,
    DispatchedSamplingTask,
    InferenceService,
    Record,
    Task,
    register_new_model,
)
from workers.ledger.schema import parse_connection_string
from workers.ledger.store import Ledger

__all__ = [
    "ClaimLost",
    "DBRecordData",
    "DispatchedSamplingTask",
    "InferenceFailed",
    "InferenceService",
    "Ledger",
    "LedgerError",
    "LedgerUnavailable",
    "LockNotAcquired",
    "MalformedConnectionString",
    "NoInferenceService",
    "NoTaskAvailable",
    "NotATask",
    "Record",
    "SchemaVersionMismatch",
    "Task",
    "UnregisteredTaskType",
    "parse_connection_string",
    "register_new_model",
]
