"""Our exception types.

Every error is a :class:`TransferQueueError` and also derives from the matching built-in (``ValueError``,
``KeyError``, ``TimeoutError``, ...), so ``except ValueError`` keeps working for callers that do not know us.
An error raised inside the controller or a storage unit travels back over the wire by name and is raised in the
caller as the same type with the same message (see :func:`error_from_wire`): every subclass is registered by name when
it is defined, and every error of this package is defined here, so a process that imported only this module rebuilds
each of them (tests/unit/transfer_queue/test_errors.py walks them all).
"""

from __future__ import annotations

# name -> error type, for error_from_wire: filled by TransferQueueError.__init_subclass__ as the classes are defined
_BY_NAME: dict[str, type[TransferQueueError]] = {}


class TransferQueueError(Exception):
    """Base class of every error this package raises on purpose."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        _BY_NAME.setdefault(cls.__name__, cls)  # the first class of a name keeps it: ours, defined below

    def __str__(self) -> str:
        # KeyError quotes its argument; an error message is API, so print it as written.
        return str(self.args[0]) if self.args else ""


class InvalidRequest(TransferQueueError, ValueError):
    """An argument is malformed or inconsistent (wrong type, negative size, both step and partition given, ...)."""


class SchemaMismatch(TransferQueueError, ValueError):
    """A field's dtype, per-row shape or kind differs from what the partition already stores for it."""


class BatchSizeMismatch(TransferQueueError, ValueError):
    """Fields of one put (or a put and its metadata) disagree on the number of rows."""


class PartitionOverfilled(TransferQueueError, ValueError):
    """A put would hold more rows than its step partition has room for (global_batch_size x num_n_samples)."""


class IncompleteGroups(TransferQueueError, ValueError):
    """Rows do not form whole GRPO groups, or a batch size is not a multiple of the group size."""


class FieldAlreadyProduced(TransferQueueError, ValueError):
    """A put would rewrite a field that is already produced for a row (only kv partitions upsert)."""


class UnsupportedValue(TransferQueueError, TypeError):
    """A value cannot travel through the queue (non-tensor columns hold str, bytes or msgpack-encodable values)."""


class InvalidSampler(InvalidRequest, TypeError):
    """A sampler spec is not a BaseSampler, a BaseSampler class or a callable returning one."""


class UnknownTask(InvalidRequest):
    """A queue that declares its ``task_names`` was asked for another task (a typo would start a new consumer that is
    served every row again); the message names the known tasks and the closest one."""


class UnknownTaskWarning(UserWarning):
    """``get_meta`` named a task never seen before that starts a new consumer of a partition known tasks already
    consume (it is served every row again): a typo, or a task to declare in the queue's ``task_names``."""


class UnknownPartition(TransferQueueError, KeyError):
    """A status query or operation names a partition that was never opened."""


class UnknownField(TransferQueueError, KeyError):
    """A field is asked for that the batch or partition does not have."""


class UnknownKey(TransferQueueError, KeyError):
    """A kv key is not present in its partition."""


class PartitionCleared(TransferQueueError, LookupError):
    """The step or partition was cleared, or lies behind the live window of steps."""


class StaleBatchMeta(TransferQueueError, LookupError):
    """A BatchMeta from before a clear of its partition was used; its rows no longer exist."""


class SamplerError(TransferQueueError, RuntimeError):
    """A sampler broke its contract (returned rows that are not ready, already served, or split a group)."""


class NotLeased(TransferQueueError, LookupError):
    """``ack`` names rows the caller does not hold for the task (leased to another client, already acknowledged,
    or handed back: their lease expired, their client was taken for gone, or they were released)."""


class GetMetaTimeout(TransferQueueError, TimeoutError):
    """``get_meta`` waited its whole timeout for rows that did not become ready; the message names what is missing."""


class QueueFull(TransferQueueError, TimeoutError):
    """A put waited its whole timeout for room in the step ring or the storage byte budget."""


class PutExpired(TransferQueueError, TimeoutError):
    """A put's reservation expired before it was committed; none of its rows became visible."""


class RequestTimeout(TransferQueueError, TimeoutError):
    """The controller or a storage unit did not answer within the timeout (it may have died)."""


class StorageUnavailable(TransferQueueError, ConnectionError):
    """A storage unit did not answer; its rows cannot be read or written."""


class StorageUnitDown(StorageUnavailable):
    """A storage unit is known to be down (its actor or node died, or the connection to it is lost): reads of the rows
    it held fail at once, naming the unit and the rows; new puts go to the live units."""


class RowsLost(StorageUnitDown):
    """Rows whose payload was on a storage unit that died and was restarted empty by Ray: they can never be read. The
    message names the partition, the rows (global indexes) and the unit. ``client.lost_rows`` lists them for producers,
    who put them again as new rows (see docs/architecture.md "Lost rows")."""


class AuthenticationFailed(TransferQueueError, ConnectionError):
    """A connection did not prove the queue's secret (a stale or foreign controller_info, or not a client at all)."""


class ProtocolMismatch(TransferQueueError, RuntimeError):
    """Client and controller speak different protocol versions."""


class SessionMismatch(TransferQueueError, RuntimeError):
    """The controller_info belongs to a previous session (the controller was restarted or replaced)."""


class ConfigMismatch(TransferQueueError, ValueError):
    """``transfer_queue.init`` found a running queue with a different configuration."""


class QueueNotFound(TransferQueueError, LookupError):
    """No queue runs on this Ray cluster (call ``transfer_queue.init`` first)."""


class ClusterUnreachable(TransferQueueError, ConnectionError):
    """The status command (or another observer) found no Ray cluster answering at the address it was to join; the
    message names the address, what happened, and what to pass instead."""


class ClusterRefused(TransferQueueError, ConnectionError):
    """The Ray cluster at the address answered but refused this process (token authentication): the message names
    the environment variables that carry the cluster's token."""


class ClientClosed(TransferQueueError, RuntimeError):
    """The client was closed; create a new one."""


class QueueClosed(TransferQueueError, ConnectionError):
    """The queue this client talks to was shut down (``transfer_queue.shutdown``); ``init`` starts a new one."""


class ServerGone(TransferQueueError, ConnectionError):
    """A server (the controller or a storage unit) closed its connection or no longer listens: its process died or
    it was shut down. Raised as soon as the transport sees it, not after the request's timeout."""


class QueueBusy(TransferQueueError, RuntimeError):
    """Too many requests are waiting in the controller already (``max_waiting_requests``); this one was refused
    rather than parked. Retry later, or raise the limit."""


class MalformedMessage(TransferQueueError, ValueError):
    """A frame received over ZeroMQ could not be decoded; the server replied with this and kept serving."""


class CheckpointError(TransferQueueError, RuntimeError):
    """A checkpoint is missing, of another format version, or damaged (the message names the file), or a save failed
    (a storage unit that did not finish in time is named); the previous checkpoint stays current."""


class SnapshotError(TransferQueueError, RuntimeError):
    """A controller snapshot of another format, or one that does not decode (``transfer_queue.state.snapshot``)."""


class PortInUse(TransferQueueError, OSError):
    """A server that must listen on a fixed port (a controller restarted from its journal: its clients know the port)
    found it taken for longer than the process before it takes to let go of it."""


class JournalError(TransferQueueError, RuntimeError):
    """The controller's journal (``journal_dir``) could not be written or read back."""


class JournalCorrupt(JournalError):
    """The controller's journal (``journal_dir``) does not read back: a record in the middle of its log fails its
    checksum, or its snapshot does not decode (the message names the file and the offset). A torn last record (the
    process died while writing it) is not an error: it is dropped."""


_BY_NAME[TransferQueueError.__name__] = TransferQueueError


def error_to_wire(exc: BaseException) -> tuple[str, str]:
    """Name and message of an error, for a reply frame. Errors that are not ours travel as their base type."""
    if isinstance(exc, TransferQueueError):
        return type(exc).__name__, str(exc)
    for builtin, ours in ((KeyError, UnknownField), (TimeoutError, RequestTimeout)):
        if isinstance(exc, builtin):
            return ours.__name__, str(exc)
    return InvalidRequest.__name__ if isinstance(exc, (ValueError, TypeError)) else "TransferQueueError", (
        f"{type(exc).__name__}: {exc}"
    )


def error_from_wire(name: str, message: str) -> TransferQueueError:
    """Rebuild the typed error a server sent, falling back to the base class for names we do not know."""
    return _BY_NAME.get(name, TransferQueueError)(message)
