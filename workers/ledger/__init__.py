"""The sampling control plane: a durable task ledger (SQLite or PostgreSQL) with claims and leases, the
``AsyncSampler`` that claims tasks and writes records, the ``SamplingScheduler`` that writes tasks epoch by epoch
and runs samplers, and the ``InferenceService`` registry. See docs/sampling.md. ``InferenceManager`` (the run's own
inference services, one per DP group, registered here; workers/engines/manager.py) is importable from here too,
lazily: ``import workers.ledger`` does not import the engines (torch).

AgentRL's imports map onto ours: ``from databases import register_new_model, Task`` becomes
``from workers.ledger import register_new_model, Task``; ``rollout.sampler`` and ``rollout.scheduler`` become
``workers.ledger``.
"""

from typing import Any

from workers.ledger.blobs import BlobStore, DirectoryBlobStore, MemoryBlobStore, S3BlobStore, open_blob_store
from workers.ledger.config import SamplingConfig
from workers.ledger.convert import RecordData, convert_record, resolve_convert_record_to_data_func
from workers.ledger.errors import (
    ClaimLost,
    ImageNotFound,
    InferenceFailed,
    InvalidRecordConverter,
    InvalidRecordData,
    InvalidSamplingConfig,
    LedgerError,
    LedgerNotFound,
    LedgerUnavailable,
    LockNotAcquired,
    MalformedConnectionString,
    MultiModalError,
    NoInferenceService,
    NoTaskAvailable,
    NotATask,
    SchemaVersionMismatch,
    UnknownContentPart,
    UnregisteredTaskType,
    UnsupportedBackend,
    UnsupportedImageType,
)
from workers.ledger.models import (
    DBRecordData,
    DispatchedSamplingTask,
    InferenceService,
    Record,
    Task,
    register_new_model,
)
from workers.ledger.multimodal import (
    preprocess_mm_messages_for_sample,
    store_mm_messages,
    store_mm_payload,
)
from workers.ledger.sampler import AsyncSampler, Sample, TrajectorySink, shared_ledger
from workers.ledger.scheduler import SamplingScheduler
from workers.ledger.schema import parse_connection_string
from workers.ledger.services import InferenceClient, ServiceRegistration
from workers.ledger.store import Ledger

__all__ = [
    "AsyncSampler",
    "BlobStore",
    "ClaimLost",
    "DBRecordData",
    "DirectoryBlobStore",
    "DispatchedSamplingTask",
    "ImageNotFound",
    "InferenceClient",
    "InferenceFailed",
    "InferenceManager",
    "InferenceService",
    "InvalidRecordConverter",
    "InvalidRecordData",
    "InvalidSamplingConfig",
    "Ledger",
    "LedgerError",
    "LedgerNotFound",
    "LedgerUnavailable",
    "LockNotAcquired",
    "MalformedConnectionString",
    "MemoryBlobStore",
    "MultiModalError",
    "NoInferenceService",
    "NoTaskAvailable",
    "NotATask",
    "Record",
    "RecordData",
    "S3BlobStore",
    "Sample",
    "SamplingConfig",
    "SamplingScheduler",
    "SchemaVersionMismatch",
    "ServiceRegistration",
    "Task",
    "TrajectorySink",
    "UnknownContentPart",
    "UnregisteredTaskType",
    "UnsupportedBackend",
    "UnsupportedImageType",
    "convert_record",
    "open_blob_store",
    "parse_connection_string",
    "preprocess_mm_messages_for_sample",
    "register_new_model",
    "resolve_convert_record_to_data_func",
    "shared_ledger",
    "store_mm_messages",
    "store_mm_payload",
]


def __getattr__(name: str) -> Any:
    if name == "InferenceManager":
        from workers.engines.manager import InferenceManager

        return InferenceManager
    raise AttributeError(f"module 'workers.ledger' has no attribute {name!r}")
