"""The sampling control plane: a durable task ledger (SQLite or PostgreSQL) with claims and leases, the
``AsyncSampler`` that claims tasks and writes records, the ``SamplingScheduler`` that writes tasks epoch by epoch
and runs samplers, and the ``InferenceService`` registry. See docs/sampling.md.

AgentRL's imports map onto ours as ``from databases import register_new_model, Task`` ->
``from workers.ledger import register_new_model, Task``; ``rollout.sampler`` / ``rollout.scheduler`` -> ``workers.ledger``.
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
    # models
    "Task",
    "register_new_model",
    "DispatchedSamplingTask",
    "Record",
    "DBRecordData",
    "InferenceService",
    # the store
    "Ledger",
    "parse_connection_string",
    # errors
    "LedgerError",
    "MalformedConnectionString",
    "UnregisteredTaskType",
    "NotATask",
    "SchemaVersionMismatch",
    "LedgerUnavailable",
    "ClaimLost",
    "NoTaskAvailable",
    "NoInferenceService",
    "InferenceFailed",
    "LockNotAcquired",
]
