"""The ledger's exception types (all :class:`~transfer_queue.errors.TransferQueueError`, each also the matching
built-in), kept next to the ledger so that this package merges without touching ``transfer_queue/errors.py``."""

from __future__ import annotations

from transfer_queue.errors import TransferQueueError


class LedgerError(TransferQueueError):
    """Base class of the ledger's errors."""


class MalformedConnectionString(LedgerError, ValueError):
    """``db_connection_string`` (or ``oss_connection_string``) is not one of the accepted forms."""


class UnsupportedBackend(MalformedConnectionString):
    """``db_connection_string`` names a database the ledger has no backend for (AgentRL's MongoDB)."""


class UnregisteredTaskType(LedgerError, TypeError):
    """A ``Task`` subclass was written or read that was never decorated with ``@register_new_model``."""


class NotATask(LedgerError, TypeError):
    """A dataset item (or an argument) is not a ``Task`` instance."""


class SchemaVersionMismatch(LedgerError, RuntimeError):
    """The database was created by another version of the ledger schema."""


class LedgerUnavailable(LedgerError, ConnectionError):
    """The database cannot be reached (server stopped, network gone); retry with backoff."""


class ClaimLost(LedgerError, LookupError):
    """A claim is no longer the task's live claim (its lease expired and another worker took it, or it ended)."""


class NoTaskAvailable(LedgerError, LookupError):
    """No task of the split can be claimed now (all done, failed, or held by live claims)."""


class NoInferenceService(LedgerError, LookupError):
    """No healthy ``InferenceService`` is registered for the model asked for."""


class InferenceFailed(LedgerError, RuntimeError):
    """An inference service answered with an error or not at all."""


class InvalidRecordConverter(LedgerError, ValueError):
    """A ``convert_record_to_data_func`` that is not a callable, or a dotted name that does not import one."""


class InvalidRecordData(LedgerError, TypeError):
    """A ``convert_record_to_data_func`` returned something other than a record's training data (or None to skip)."""


class LockNotAcquired(LedgerError, TimeoutError):
    """A distributed lock held by another owner was not released within the wait."""


class LedgerNotFound(LedgerError, LookupError):
    """A ledger was opened for reading where none was created (no file, or no ledger tables)."""


class InvalidSamplingConfig(LedgerError):
    """A ``SamplingConfig`` whose settings contradict each other (e.g. ``heartbeat_s >= lease_s``), or one given a
    setting it does not know (named with the closest valid ones).

    Deliberately not a ``ValueError``: pydantic would fold one into a ``ValidationError``; this one reaches the
    caller as itself."""


class MultiModalError(LedgerError, ValueError):
    """A multi-modal message (OpenAI content parts) that cannot be stored or sent (``workers/ledger/multimodal.py``)."""


class UnknownContentPart(MultiModalError):
    """A content part whose ``type`` is none of ``text``, ``image_url``, ``image_ref`` (or that lacks its fields)."""


class ImageNotFound(MultiModalError, FileNotFoundError):
    """An image named by a local path, an ``image_ref`` blob key or an http(s) URL that cannot be read."""


class UnsupportedImageType(MultiModalError):
    """Image bytes that are not PNG, JPEG, GIF or WebP (by their magic bytes), or an image source of no known form."""
