"""The wire format, on one page.

A message is a list of ZeroMQ frames: ``[envelope, body, *buffers]``.

- ``envelope`` (requests) is an :class:`Envelope`: protocol version, session id, request id.
  ``envelope`` (replies) is a :class:`ReplyHeader`: the request id and, on failure, the error's type and message.
- ``body`` is one msgpack-encoded struct of the unions below, decoded with a typed msgspec decoder; anything else
  is answered with ``MalformedMessage`` and dropped.
- ``buffers`` are raw tensor bytes (dense data, jagged values and offsets, msgpack-encoded object columns),
  sent and received without copies and described by :class:`ColumnSpec` entries in the body.

Nothing received over ZeroMQ is unpickled. Index arrays travel as little-endian ``int64`` bytes.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import msgspec
import numpy as np

from transfer_queue.errors import MalformedMessage
from transfer_queue.metadata import BatchMeta, FieldSchema

PROTOCOL_VERSION = 1
Partition = int | str


def pack_indexes(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


def unpack_indexes(raw: bytes | None) -> np.ndarray:
    if raw is None:
        return np.zeros(0, dtype=np.int64)
    if len(raw) % 8:
        raise MalformedMessage(f"an index array must be a multiple of 8 bytes long, got {len(raw)} bytes")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64, copy=False)


def ray_node_id() -> str:
    """The Ray node id of this process ("" outside Ray). Ray is not imported here: a process that uses it has it."""
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            return ray.get_runtime_context().get_node_id() or ""
    except Exception:  # a Ray that is shutting down
        pass
    return ""


class Endpoint(msgspec.Struct, frozen=True, array_like=True):
    """Where a server listens: a ZeroMQ TCP address (any host) and a Unix socket path (clients on its host).

    ``hostname`` and ``node_id`` (the server's Ray node, "" outside Ray) decide whether a client is on the server's
    host (see :meth:`local_path`).
    """

    tcp: str
    unix: str | None = None
    hostname: str = ""
    node_id: str = ""

    def address(self) -> str:
        """The ZeroMQ address."""
        return self.tcp

    def local_path(self) -> str | None:
        """The Unix socket path when this process runs on the server's host, else None.

        Same host means the same Ray node when both sides know theirs (two Ray nodes never share a Unix socket, even
        on one machine or with one hostname), else the same hostname; and the socket file must exist. The transport
        then probes the socket before using it (:meth:`BlockingTransport._local_path`).
        """
        if not self.unix:
            return None
        here = ray_node_id()
        same = self.node_id == here if self.node_id and here else self.hostname == socket.gethostname()
        return self.unix if same and os.path.exists(self.unix) else None


# ---- envelopes ------------------------------------------------------------------------------------------------
class Envelope(msgspec.Struct, array_like=True, frozen=True):
    protocol_version: int
    session_id: str
    request_id: int


class UnitRestart(msgspec.Struct, array_like=True, frozen=True):
    """A storage unit that Ray restarted (empty): where it listens now, and that every block id below ``lost_below``
    on it is lost (its previous incarnations held them). ``restarts`` counts its restarts. With replicas=2 the
    controller copies those blocks back onto it from their other copy, in block id order: every block below
    ``refilled_below`` is on it again (those in ``[refilled_below, lost_below)`` are not, yet)."""

    endpoint: Endpoint
    lost_below: int
    restarts: int
    refilled_below: int = 0
    # replicas=2: (unit, lo, hi) per unit that had not got back every copy it lost when this one restarted, or was
    # retired with copies its move had not reached (then, or later while this one had not got [lo, hi) back): the
    # blocks the two held then in [lo, hi) had both copies gone (lost), whatever refills or moves since
    lost_with: tuple[tuple[int, int, int], ...] = ()
    # per lost_with entry, how far each move had gone then (``below``, in the order of the moves; a move started since
    # is not listed): the two held a block then as the moves stood then, not as they stand now
    lost_with_moved: tuple[tuple[int, ...], ...] = ()


class UnitMove(msgspec.Struct, array_like=True, frozen=True):
    """replicas=2: storage unit ``unit`` was retired (down for good) and the controller copies each block that had a
    copy on it onto another unit, in block id order: every such block below ``below`` whose other copy is on unit
    ``s`` has its copy on unit ``to[s]`` now (``transfer_queue.state.placement.current_holders``)."""

    unit: int
    to: dict[int, int]
    below: int = 0


class ReplyHeader(msgspec.Struct, array_like=True, frozen=True):
    request_id: int
    error_type: str | None = None
    error_message: str | None = None
    # The controller's replies: the storage units it knows are down, and why ({} when none; None from a storage unit).
    down_units: dict[int, str] | None = None
    # The controller's replies: the storage units restarted since the queue started (None: none, or a storage unit).
    restarted_units: dict[int, UnitRestart] | None = None
    # The controller's replies (replicas=2): the retired units whose copies were moved, in the order they were retired
    # (None: none, or a storage unit)
    moved_units: list[UnitMove] | None = None


# ---- controller requests --------------------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello"):
    client_id: str


class Reserve(msgspec.Struct, tag="reserve"):
    """Start a put: validate it, make room, and hand back rows and their storage placement."""

    partition: Partition
    num_rows: int
    fields: dict[str, FieldSchema]
    nbytes: int
    group_ids: bytes | None = None
    target_uid: int | None = None  # a put with metadata: write fields into these existing rows
    target_indexes: bytes | None = None
    lengths: bytes | None = None
    keys: list[str] | None = None  # a put by key (kv_*): rows are found or created by key, fields upserted
    timeout: float = 30.0
    # ``lengths`` per field: rows x len(length_fields) values, row-major (None: ``lengths`` is one sum per row)
    length_fields: list[str] | None = None


class Commit(msgspec.Struct, tag="commit"):
    put_id: int


class Abort(msgspec.Struct, tag="abort"):
    put_id: int


class GetMeta(msgspec.Struct, tag="get_meta"):
    """Lease ready rows of a task. ``owner`` names the client instance (its leases go back when its connections
    close); ``call_id`` names this call, so a cancel can find it; ``lease_s`` (None: the task's or the queue's
    default) is how long the rows stay leased without an acknowledgement."""

    partition: Partition
    fields: list[str]
    batch_size: int
    task_name: str
    sampler_params: dict[str, Any] | None = None
    get_n_samples: bool = False
    timeout: float = 30.0
    lease_s: float | None = None
    owner: str = ""
    call_id: int = 0
    peek: bool = False  # a non-consuming read: the rows stay ready for the task (upstream's force_fetch)
    # automatic DP rounds (dp_size > 1, no dp_group_id, no world_rank): the round the calling thread expects next (its
    # last + 1; None before its first), so a connection new to the controller goes on from it (a restart, a reconnect)
    next_auto_round: int | None = None


class Release(msgspec.Struct, tag="release"):
    """Hand back rows the owner holds. ``dp_group_id``: the meta's DP round (its ``extra``), whose rows it may hand
    back."""

    partition_uid: int
    task_name: str
    global_indexes: bytes
    owner: str = ""
    dp_group_id: str | None = None


class Ack(msgspec.Struct, tag="ack"):
    """Acknowledge leased rows. ``explicit``: the user called ``ack`` (rows the owner does not hold are an error);
    otherwise a ``get_data`` sent it (ignored for tasks that acknowledge explicitly, and for rows not held).
    ``dp_group_id``: the meta's DP round (its ``extra``): rows still leased to that round may be acknowledged, not
    rows a later round holds after this round's lease expired."""

    partition_uid: int
    task_name: str
    global_indexes: bytes
    owner: str = ""
    explicit: bool = False
    reply: bool = True  # False: the client does not wait for an answer (get_data's ack over a Unix socket)
    dp_group_id: str | None = None
    # asked again after ServerGone (restart_retry_s): rows this owner acknowledged already are no error (the first
    # ack may have been applied and its reply lost)
    again: bool = False


class ExtendLease(msgspec.Struct, tag="extend_lease"):
    """Set the deadline of leased rows to now + ``seconds`` (``client.extend_lease``): every row named must be
    leased to ``owner`` (or to a DP round), else nothing is extended and the rows are named in NotLeased."""

    partition_uid: int
    task_name: str
    global_indexes: bytes
    owner: str
    seconds: float
    dp_group_id: str | None = None  # the meta's DP round (its ``extra``), as for Ack


class CancelGetMeta(msgspec.Struct, tag="cancel_get_meta"):
    """The client gave up waiting on get_meta ``call_id``: drop it, or hand back what it was served."""

    owner: str
    call_id: int


class SetTaskOptions(msgspec.Struct, tag="set_task_options"):
    task_name: str
    ack: str = "auto"
    lease_s: float | None = None
    max_deliveries: int | None = None


class DeadLetters(msgspec.Struct, tag="dead_letters"):
    partition: Partition
    task_name: str


class Clear(msgspec.Struct, tag="clear"):
    partition: Partition


class ResetConsumption(msgspec.Struct, tag="reset_consumption"):
    partition: Partition | None = None
    task_name: str | None = None


class ProductionStatus(msgspec.Struct, tag="production_status"):
    partition: Partition


class ConsumptionStatus(msgspec.Struct, tag="consumption_status"):
    partition: Partition
    task_name: str | None = None


class ListPartitions(msgspec.Struct, tag="list_partitions"):
    pass


class ClosePartition(msgspec.Struct, tag="close_partition"):
    partition: Partition


class KvLookup(msgspec.Struct, tag="kv_lookup"):
    partition: str
    keys: list[str]
    fields: list[str] | None = None


class KvList(msgspec.Struct, tag="kv_list"):
    partition: str | None = None  # None: every partition used by key
    with_tags: bool = False  # answer {key: custom meta} instead of [key]


class KvTag(msgspec.Struct, tag="kv_tag"):
    """Set the custom meta (tag) of keys, creating keys that do not exist yet (with no fields)."""

    partition: str
    keys: list[str]
    values: list[Any]


class SetCustomMeta(msgspec.Struct, tag="set_custom_meta"):
    """Set the custom meta (a small dict, or None to remove it) of committed rows."""

    partition_uid: int
    global_indexes: bytes
    values: list[Any]


class GetCustomMeta(msgspec.Struct, tag="get_custom_meta"):
    partition_uid: int
    global_indexes: bytes


class ClearSamples(msgspec.Struct, tag="clear_samples"):
    """Forget committed rows of a partition (their payload is freed once no row references its block)."""

    partition_uid: int
    global_indexes: bytes


class KvClear(msgspec.Struct, tag="kv_clear"):
    partition: str
    keys: list[str] | None = None


class SaveCheckpoint(msgspec.Struct, tag="save_checkpoint"):
    """Save the queue (controller state and every storage unit's payload) under ``directory``."""

    directory: str


class LostRows(msgspec.Struct, tag="lost_rows"):
    """The rows of a partition lost with a storage unit that restarted empty (``client.lost_rows``)."""

    partition: Partition


class QueueStatus(msgspec.Struct, tag="queue_status"):
    """The whole-queue summary (``client.status()``), read in one go by the controller."""

    include_run_history: bool = False


ControllerRequest = (
    Hello
    | Reserve
    | Commit
    | Abort
    | GetMeta
    | Release
    | Ack
    | ExtendLease
    | CancelGetMeta
    | SetTaskOptions
    | DeadLetters
    | Clear
    | ResetConsumption
    | ProductionStatus
    | ConsumptionStatus
    | ListPartitions
    | ClosePartition
    | KvLookup
    | KvList
    | KvClear
    | SaveCheckpoint
    | KvTag
    | SetCustomMeta
    | GetCustomMeta
    | ClearSamples
    | QueueStatus
    | LostRows
)


# ---- controller replies ---------------------------------------------------------------------------------------
class Placement(msgspec.Struct, array_like=True, frozen=True):
    """Rows ``[start, stop)`` of a put go to ``unit`` as block ``block_id``."""

    unit: int
    block_id: int
    start: int
    stop: int
    max_bytes: int = 0  # the bytes the put reserved: the unit refuses a write of this block that carries more
    token: bytes = b""  # the controller's HMAC over (partition, block, rows, max_bytes), checked by the unit


class Reservation(msgspec.Struct, array_like=True):
    put_id: int
    partition_uid: int
    global_indexes: bytes
    group_ids: bytes
    placements: list[Placement]
    # seconds from the reservation during which the controller applies its commit; a commit that arrives later is
    # refused (PutExpired), so a client that got no answer by then knows its rows never become visible
    commit_within: float = 0.0


class MetaWire(msgspec.Struct, array_like=True):
    partition: Partition
    partition_uid: int
    global_indexes: bytes
    group_ids: bytes
    fields: dict[str, FieldSchema]
    blocks: bytes
    offsets: bytes
    task_name: str | None = None
    extra: dict[str, Any] = {}

    @classmethod
    def from_meta(cls, meta: BatchMeta) -> MetaWire:
        return cls(
            meta.partition_id,
            meta.partition_uid,
            pack_indexes(meta.global_indexes),
            pack_indexes(meta.group_ids),
            meta.fields,
            pack_indexes(meta.blocks),
            pack_indexes(meta.offsets),
            meta.task_name,
            meta.extra,
        )

    def to_meta(self) -> BatchMeta:
        return BatchMeta(
            self.partition,
            self.partition_uid,
            unpack_indexes(self.global_indexes),
            unpack_indexes(self.group_ids),
            dict(self.fields),
            unpack_indexes(self.blocks),
            unpack_indexes(self.offsets),
            self.task_name,
            dict(self.extra),
        )


# ---- storage requests -----------------------------------------------------------------------------------------
class ColumnSpec(msgspec.Struct, array_like=True, frozen=True):
    """One field's rows in a message: ``nframes`` buffers follow in order (dense: data; jagged: values, offsets;
    object: one msgpack-encoded list)."""

    name: str
    schema: FieldSchema
    num_rows: int
    nframes: int


class Write(msgspec.Struct, tag="write"):
    partition_uid: int
    block_id: int
    num_rows: int
    columns: list[ColumnSpec]
    max_bytes: int = 0  # from the Placement: what was reserved, vouched for by ``token``
    token: bytes = b""
    # replicas=2: the controller copies a block back onto a unit restarted empty (its put finished long ago, so the
    # unit's block floor does not refuse it; a dropped block or a cleared partition still does)
    refill: bool = False


class ReadField(msgspec.Struct, array_like=True):
    name: str
    blocks: bytes
    offsets: bytes


class Read(msgspec.Struct, tag="read"):
    partition_uid: int
    fields: list[ReadField]


class DropBlocks(msgspec.Struct, tag="drop_blocks"):
    partition_uid: int
    block_ids: list[int]
    # every block id below this belongs to a put that committed or was aborted: a write of one is late, refused
    block_floor: int | None = None


class DropPartition(msgspec.Struct, tag="drop_partition"):
    partition_uid: int
    # the controller's live partitions when it was sent: every other uid up to max_uid is dead (writes refused)
    live_uids: list[int] | None = None
    max_uid: int | None = None
    block_floor: int | None = None


class StorageStats(msgspec.Struct, tag="stats"):
    pass


class SaveUnit(msgspec.Struct, tag="save_unit"):
    """The controller's order to write this unit's files of the checkpoint staged under ``staging``. Sent on the
    controller's connection right after it took its snapshot, so it reaches the unit before any drop sent later: the
    unit takes its block table at once (the snapshot's blocks are all in it) and writes it in the background."""

    staging: str
    # replicas=2: write only the blocks placed on these units (each block is saved once, by one of its holders);
    # None: every block this unit holds
    primaries: list[int] | None = None


StorageRequest = Write | Read | DropBlocks | DropPartition | StorageStats | SaveUnit


class ReadReply(msgspec.Struct, array_like=True):
    columns: list[ColumnSpec]


# ---- connecting ----------------------------------------------------------------------------------------------
class ControllerInfo(msgspec.Struct, frozen=True):
    """Everything a client needs to reach a queue: ``TransferQueueClient(client_id=..., controller_info=...)``.

    It travels through Ray (``ray.get(controller.get_info.remote())``), never over a socket. ``session_id``
    identifies one controller's lifetime: a client holding the info of a previous session gets SessionMismatch.
    ``secret`` is the queue's secret: every connection proves it (see :mod:`transfer_queue.wire.auth`); it is left
    out of ``repr`` so that logging an info does not leak it.
    """

    protocol_version: int
    session_id: str
    controller: Endpoint
    storage_units: list[Endpoint]
    config: dict[str, Any]
    secret: bytes = b""
    # replicas=2: the unit holding the second copy of each unit's blocks (None: one copy)
    replica_units: list[int] | None = None

    def to_json(self) -> str:
        """The info as JSON text, for a process outside the Ray cluster (a file, an argument, an environment
        variable you choose). It holds the queue's secret: hand it over like a password."""
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> ControllerInfo:
        """The info back from :meth:`to_json`; ``MalformedMessage`` if the text is not one."""
        try:
            return msgspec.json.decode(text, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedMessage(f"not a ControllerInfo in JSON: {exc}") from None

    def __repr__(self) -> str:
        return (
            f"ControllerInfo(protocol_version={self.protocol_version}, session_id=<hidden>, "
            f"controller={self.controller!r}, storage_units={self.storage_units!r}, config={self.config!r}, "
            "secret=<hidden>)"
        )


# ---- encoding -------------------------------------------------------------------------------------------------
def _encode_numpy_scalar(value: Any) -> Any:
    if isinstance(value, np.generic):  # e.g. sampler_params={"dp_rank": np.int64(0)}: the number it holds
        return value.item()
    raise TypeError(f"Encoding objects of type {type(value).__name__} is unsupported")


_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_numpy_scalar)
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_reply_decoder = msgspec.msgpack.Decoder(ReplyHeader)
_controller_decoder = msgspec.msgpack.Decoder(ControllerRequest)
_storage_decoder = msgspec.msgpack.Decoder(StorageRequest)
_any_decoder = msgspec.msgpack.Decoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode_envelope(raw: bytes | memoryview) -> Envelope:
    return _decode(_envelope_decoder, raw, "envelope")


def decode_reply_header(raw: bytes | memoryview) -> ReplyHeader:
    return _decode(_reply_decoder, raw, "reply header")


def decode_controller_request(raw: bytes | memoryview) -> Any:
    return _decode(_controller_decoder, raw, "controller request")


def decode_storage_request(raw: bytes | memoryview) -> Any:
    return _decode(_storage_decoder, raw, "storage request")


_typed_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def decode_as(raw: bytes | memoryview, type_: Any) -> Any:
    """Decode a reply body into ``type_`` (``Any`` for plain msgpack values)."""
    decoder = _typed_decoders.get(type_)
    if decoder is None:
        decoder = _typed_decoders[type_] = _any_decoder if type_ is Any else msgspec.msgpack.Decoder(type_)
    return _decode(decoder, raw, "reply body")


def _decode(decoder: msgspec.msgpack.Decoder, raw: bytes | memoryview, what: str) -> Any:
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise MalformedMessage(f"malformed {what}: {exc}") from None
