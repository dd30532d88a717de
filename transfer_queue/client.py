"""The client: ``AsyncTransferQueueClient`` holds the logic; ``TransferQueueClient`` is its sync facade.

A client needs only a :class:`~transfer_queue.protocol.ControllerInfo` (it speaks ZeroMQ, not Ray), so it works
in any process: a Ray actor, a torchrun rank, a plain subprocess.

A put is three messages: *reserve* (the controller validates the put against the partition's schema, waits for
room in the step ring if needed, and hands back rows and a placement), *write* (the payload goes straight to the
storage units, in parallel, zero-copy), *commit* (the rows become visible, all at once). A put that fails or dies
in between is aborted: none of its rows ever becomes visible and its bytes are freed.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from transfer_queue import protocol as p
from transfer_queue.columns import (
    Column,
    columns_from_tensordict,
    concat_columns,
    from_row_bytes,
    nbytes_of,
    nframes,
    tensordict_from_columns,
    torch_dtype,
)
from transfer_queue.config import QueueConfig
from transfer_queue.errors import (
    BatchSizeMismatch,
    ClientClosed,
    InvalidRequest,
    ProtocolMismatch,
    QueueClosed,
    RequestTimeout,
    RowsLost,
    ServerGone,
    StaleBatchMeta,
    StorageUnavailable,
    StorageUnitDown,
    TransferQueueError,
    UnknownField,
    UnknownPartition,
    UnsupportedValue,
    error_from_wire,
)
from transfer_queue.metadata import BatchMeta, PartitionKey, as_names
from transfer_queue.partition import describe_partition
from transfer_queue.transport import AsyncioTransport, BlockingTransport, Transport, run_sync

logger = logging.getLogger(__name__)
REPLY_SLACK = 5.0  # seconds a client waits beyond a server-side timeout before calling the server dead
KV_READ_ATTEMPTS = 8  # kv_batch_get looks keys up again when a concurrent kv_put replaced them mid-read
COMMIT_RETRIES = 1  # a commit whose reply did not come is asked again this often (by put id: idempotent)
P = ParamSpec("P")
R = TypeVar("R")


# Sessions of queues this process shut down (``transfer_queue.shutdown``): their clients fail at once.
_closed_sessions: set[str] = set()


def mark_queue_closed(session_id: str) -> None:
    """Tell every client of this process that the queue of ``session_id`` is shut down: they raise QueueClosed."""
    _closed_sessions.add(session_id)


def _partition(global_step: int | None, partition_id: str | None, metadata: BatchMeta | None = None) -> PartitionKey:
    if metadata is not None and global_step is None and partition_id is None:
        return metadata.partition_id
    if (global_step is None) == (partition_id is None):
        raise InvalidRequest(
            f"give exactly one of global_step and partition_id, got global_step={global_step!r}, "
            f"partition_id={partition_id!r}"
        )
    if global_step is not None:
        if isinstance(global_step, bool) or not isinstance(global_step, (int, np.integer)) or global_step < 0:
            raise InvalidRequest(f"global_step must be an int >= 0, got {global_step!r}")
        key: PartitionKey = int(global_step)
    else:
        if not isinstance(partition_id, str) or not partition_id:
            raise InvalidRequest(f"partition_id must be a non-empty str, got {partition_id!r}")
        key = partition_id
    if metadata is not None and metadata.partition_id != key:
        raise InvalidRequest(f"the metadata is of partition {metadata.partition_id!r}, not {key!r}")
    return key


def _kv_partition(partition_id: str) -> str:
    if not isinstance(partition_id, str) or not partition_id:
        raise InvalidRequest(f"a kv partition_id must be a non-empty str, got {partition_id!r}")
    return partition_id


class AsyncTransferQueueClient:
    """A client of one queue; every method is a coroutine. See :class:`TransferQueueClient` for the sync one.

    Args:
        client_id: a name for logs.
        controller_info: from ``ray.get(get_controller().get_info.remote())`` or ``transfer_queue.init``.
        transport: how bytes move (default: asyncio ZeroMQ sockets).
    """

    def __init__(self, client_id: str, controller_info: p.ControllerInfo, *, transport: Transport | None = None):
        if not isinstance(controller_info, p.ControllerInfo):
            raise InvalidRequest(f"controller_info must be a ControllerInfo, got {type(controller_info).__name__}")
        if controller_info.protocol_version != p.PROTOCOL_VERSION:
            raise ProtocolMismatch(
                f"controller_info speaks protocol {controller_info.protocol_version}, this client "
                f"{p.PROTOCOL_VERSION}; install the same transfer_queue version on both sides"
            )
        self.client_id = client_id
        self.controller_info = controller_info
        self.config = QueueConfig.from_dict(controller_info.config)
        self._transport = transport or AsyncioTransport(secret=controller_info.secret)
        self._closed = False
        # who holds this client's leases: unique per client instance (client_id is a name and may repeat)
        self.owner = f"{client_id}#{uuid.uuid4().hex[:12]}"
        self._calls = itertools.count(1)
        # Storage units known to be down, and why: the controller's view (every reply of it carries it) plus the units
        # this client failed to reach since. Reads of rows on them fail at once (StorageUnitDown).
        self._down_units: dict[int, str] = {}
        # Where each storage unit listens now (a unit Ray restarted listens on new ports), and below which block id
        # the blocks of a restarted unit are lost: both from the controller's replies.
        self._unit_endpoints: list[p.Endpoint] = list(controller_info.storage_units)
        self._restarted: dict[int, p.UnitRestart] = {}

    # ---- plumbing ------------------------------------------------------------------------------------------
    def _timeout(self, timeout: float | None) -> float:
        if timeout is None:
            return self.config.default_timeout
        if not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise InvalidRequest(f"timeout must be a finite number of seconds > 0 (or None), got {timeout!r}")
        return float(timeout)

    def _frames(self, body: Any, buffers: Sequence[Any] = ()) -> tuple[list[Any], int]:
        request_id = self._transport.next_request_id()
        envelope = p.Envelope(p.PROTOCOL_VERSION, self.controller_info.session_id, request_id)
        try:
            encoded = p.encode(body)
        except (TypeError, OverflowError) as exc:  # e.g. an object in sampler_params: refused before sending
            raise UnsupportedValue(f"a {type(body).__name__} request cannot be encoded: {exc}") from None
        return [p.encode(envelope), encoded, *buffers], request_id

    async def _call(
        self,
        calls: Sequence[tuple[p.Endpoint, Any, Sequence[Any]]],
        timeout: float,
        who: str,
        into: Sequence[dict[int, Any]] | None = None,
    ) -> list[tuple[Any, list[Any]]]:
        if self._closed:
            raise ClientClosed(f"client {self.client_id!r} is closed")
        if self.controller_info.session_id in _closed_sessions:
            raise QueueClosed(
                f"client {self.client_id!r}: its queue was shut down (transfer_queue.shutdown); "
                "call transfer_queue.init to start a new one"
            )
        wire = []
        for endpoint, body, buffers in calls:
            frames, request_id = self._frames(body, buffers)
            wire.append((endpoint, frames, request_id))
        try:
            replies = await (
                self._transport.call_many(wire, timeout)
                if into is None
                else self._transport.call_many(wire, timeout, into)
            )
        except (RequestTimeout, ServerGone) as exc:
            error = type(exc)(f"{who}: {exc}")
            error.addresses = getattr(exc, "addresses", [])  # type: ignore[union-attr]
            raise error from None
        out = []
        for frames in replies:
            header = p.decode_reply_header(frames[0])
            if header.down_units is not None:  # a controller's reply: its view of the storage units replaces ours
                self._down_units = dict(header.down_units)
            if header.restarted_units:
                self._learn_restarts(header.restarted_units)
            if header.error_type is not None:
                raise error_from_wire(header.error_type, header.error_message or "")
            out.append((frames[1], frames[2:]))
        return out

    def _learn_restarts(self, restarted: dict[int, p.UnitRestart]) -> None:
        """Storage units Ray restarted: talk to them where they are now; their older blocks are lost."""
        for unit, restart in restarted.items():
            known = self._restarted.get(unit)
            if 0 <= unit < len(self._unit_endpoints) and (known is None or restart.restarts > known.restarts):
                self._restarted[unit] = restart
                self._unit_endpoints[unit] = restart.endpoint

    def _rows_lost(self, meta: BatchMeta, units: np.ndarray) -> RowsLost | None:
        """The error for a read of ``meta`` if some of its cells were on a storage unit that restarted empty."""
        for unit, restart in sorted(self._restarted.items()):
            lost = (units == unit) & (meta.blocks >= 0) & (meta.blocks < restart.lost_below)
            if lost.any():
                rows = np.unique(meta.global_indexes[lost.any(axis=1)])
                fields = [name for j, name in enumerate(meta.field_names) if lost[:, j].any()]
                return RowsLost(
                    f"rows {rows[:20].tolist()}{' ...' if len(rows) > 20 else ''} ({len(rows)} of {len(meta)}) of "
                    f"{describe_partition(meta.partition_id)} were lost: storage unit {unit} died and was restarted "
                    f"empty (restart {restart.restarts}), taking fields {fields} of them; put them again as new rows "
                    "(client.lost_rows lists them)"
                )
        return None

    async def _control(self, body: Any, reply_type: Any, timeout: float) -> Any:
        ((reply, _),) = await self._call(
            [(self.controller_info.controller, body, ())],
            timeout,
            f"the controller at {self.controller_info.controller.tcp} did not answer (is it alive?)",
        )
        return p.decode_as(reply, reply_type)

    async def _storage(
        self,
        calls: Sequence[tuple[int, Any, Sequence[Any]]],
        timeout: float,
        into: Sequence[dict[int, Any]] | None = None,
    ) -> list[tuple[Any, list]]:
        units = self._unit_endpoints
        try:
            return await self._call(
                [(units[u], body, bufs) for u, body, bufs in calls],
                timeout,
                f"storage units {[u for u, _, _ in calls]} did not answer",
                into,
            )
        except (RequestTimeout, ServerGone) as exc:
            # After the first failure the unit counts as down for this client (until the controller says otherwise).
            addresses = set(getattr(exc, "addresses", ()))
            called = sorted({u for u, _, _ in calls})
            failed = [u for u in called if {units[u].tcp, units[u].unix} & addresses] or called
            what = "is gone" if isinstance(exc, ServerGone) else f"did not answer within {timeout:.1f} s"
            for u in failed:
                self._down_units[u] = f"{units[u].tcp} {what}"
            error = StorageUnavailable(f"{exc}; a storage unit may have died")
            error.units = failed  # type: ignore[attr-defined]
            raise error from None

    def _unit_down(self, meta: BatchMeta, units: np.ndarray, down: dict[int, str], cause: str = "") -> StorageUnitDown:
        """The error for reads of ``meta``'s rows held by the ``down`` units: names each unit and its rows."""
        parts = []
        for u, why in sorted(down.items()):
            rows = np.unique(meta.global_indexes[np.any(units == u, axis=1)]).tolist()
            parts.append(f"storage unit {u} is down ({why}): it held rows {rows}")
        return StorageUnitDown(
            f"{cause}{'; '.join(parts)} of partition {meta.partition_id!r}, which cannot be read; new puts go to the "
            "live units"
        )

    def _field_lengths(self, columns: dict[str, Column], num_rows: int) -> tuple[bytes | None, list[str] | None]:
        """Per-row lengths of each length-bearing field (jagged, or in ``seqlen_fields``): ``Reserve.lengths`` and
        ``Reserve.length_fields``. Per field, so overwriting a field replaces its share of the row's length."""
        names, per_field = [], []
        for name, column in columns.items():
            if column.schema.kind == "jagged" or name in self.config.seqlen_fields:
                row = column.row_lengths()
                if row is not None:
                    names.append(name)
                    per_field.append(np.asarray(row, dtype=np.int64))
        if not names:
            return None, None
        return p.pack_indexes(np.stack(per_field, axis=1).reshape(-1)), names

    # ---- put -----------------------------------------------------------------------------------------------
    async def put(
        self,
        data: TensorDictBase | dict[str, Any],
        global_step: int | None = None,
        partition_id: str | None = None,
        metadata: BatchMeta | None = None,
        group_ids: Sequence[int] | np.ndarray | torch.Tensor | None = None,
        timeout: float | None = None,
        jagged: Sequence[str] = (),
    ) -> BatchMeta:
        """Store rows: append them to a partition, or (with ``metadata``) write new fields into existing rows.

        Args:
            data: a TensorDict whose first batch dimension counts rows, or a dict of fields with the same number
                of rows (cheaper to build: no TensorDict of nested tensors). Dense tensors, jagged nested tensors and
                non-tensor data (str, bytes, msgpack-encodable values) are accepted; CUDA tensors are copied to host.
            global_step / partition_id: where to put (exactly one; implied by ``metadata``).
            metadata: a BatchMeta from ``get_meta``: write ``data``'s fields into its rows, in its order.
            group_ids: GRPO group of each row (ints scoped to the partition), so a group may arrive over several
                puts. Default: ``row // num_n_samples``, which needs the put to hold whole groups.
            timeout: seconds to wait for room in the step ring and for the storage units (None: the default).
            jagged: dense fields to store as jagged (ragged along their first per-row dimension), so that their
                length may differ between puts; they come back as jagged nested tensors.

        Returns:
            The BatchMeta of the written rows and fields.

        Raises:
            SchemaMismatch, BatchSizeMismatch, PartitionOverfilled, IncompleteGroups, FieldAlreadyProduced,
            QueueFull (no room within the timeout), StorageUnavailable, PartitionCleared.

        >>> meta = client.put(TensorDict({"prompt_ids": ids}, batch_size=[8]), global_step=0)  # doctest: +SKIP
        """
        timeout = self._timeout(timeout)
        if metadata is not None and not isinstance(metadata, BatchMeta):
            raise InvalidRequest(f"put's metadata must be a BatchMeta (from get_meta), got {type(metadata).__name__}")
        key = _partition(global_step, partition_id, metadata)
        num_rows, columns = columns_from_tensordict(data, as_names(jagged))
        target_uid = target_indexes = None
        if metadata is not None:
            if len(metadata) != num_rows:
                raise BatchSizeMismatch(f"the metadata names {len(metadata)} rows; the data has {num_rows}")
            if group_ids is not None:
                raise InvalidRequest("a put with metadata writes into existing rows; their group ids are already set")
            target_uid, target_indexes = metadata.partition_uid, p.pack_indexes(metadata.global_indexes)
        packed_groups = None
        if group_ids is not None:
            groups = np.asarray(group_ids.cpu() if isinstance(group_ids, torch.Tensor) else group_ids).reshape(-1)
            if groups.dtype.kind not in "iu" or len(groups) != num_rows:
                raise InvalidRequest(f"group_ids must be {num_rows} ints, got {len(groups)} of dtype {groups.dtype}")
            packed_groups = p.pack_indexes(groups)
        lengths, length_fields = self._field_lengths(columns, num_rows)
        reserve = p.Reserve(
            key,
            num_rows,
            {name: c.schema for name, c in columns.items()},
            sum(c.nbytes for c in columns.values()),
            packed_groups,
            target_uid,
            target_indexes,
            lengths,
            None,
            timeout,
            length_fields,
        )
        return await self._put(reserve, columns, timeout)

    async def _put(self, reserve: p.Reserve, columns: dict[str, Column], timeout: float) -> BatchMeta:
        started = time.monotonic()
        reservation: p.Reservation = await self._control(reserve, p.Reservation, timeout + REPLY_SLACK)
        try:
            writes = []
            for place in reservation.placements:
                parts = {name: c.slice(place.start, place.stop) for name, c in columns.items()}
                specs = [p.ColumnSpec(n, c.schema, c.num_rows, len(c.buffers())) for n, c in parts.items()]
                buffers = [b for c in parts.values() for b in c.buffers()]
                rows = place.stop - place.start
                body = p.Write(reservation.partition_uid, place.block_id, rows, specs, place.max_bytes, place.token)
                writes.append((place.unit, body, buffers))
            await self._storage(writes, max(1.0, timeout - (time.monotonic() - started)))
            wire = await self._commit(reservation.put_id, started + timeout)
        except BaseException:
            try:
                await self._control(p.Abort(reservation.put_id), Any, 5.0)
            except TransferQueueError:
                pass  # the controller aborts it at its deadline anyway
            raise
        return wire.to_meta()

    async def _commit(self, put_id: int, deadline: float) -> p.MetaWire:
        """Commit a put, waiting until the put's own deadline; a commit whose reply did not come is asked again
        (a commit is idempotent by put id: the controller answers a retry with the same meta, never new rows)."""
        for attempt in range(1 + COMMIT_RETRIES):
            wait = max(1.0, deadline - time.monotonic()) if attempt == 0 else REPLY_SLACK
            try:
                return await self._control(p.Commit(put_id), p.MetaWire, wait)
            except RequestTimeout:
                if attempt == COMMIT_RETRIES:
                    raise
        raise AssertionError("unreachable")

    # ---- get -----------------------------------------------------------------------------------------------
    async def get_meta(
        self,
        data_fields: Sequence[str] | str,
        batch_size: int,
        global_step: int | None = None,
        partition_id: str | None = None,
        task_name: str = "default",
        sampler_params: dict[str, Any] | None = None,
        get_n_samples: bool = False,
        timeout: float | None = None,
        lease_s: float | None = None,
        peek: bool = False,
    ) -> BatchMeta:
        """Rows ready for ``task_name`` (all ``data_fields`` produced, not yet handed to the task), chosen by the
        task's sampler and **leased** to this client: no other consumer of the task gets them while the lease
        lasts. ``get_data`` of the meta acknowledges them (or, for a task with ``ack="explicit"``, ``ack``); a lease
        that runs out (``lease_s``) or whose client goes away hands its rows back, first in line (see
        docs/api.md "Delivery"). ``release`` hands them back at once.

        Waits (up to ``timeout``) until ``batch_size`` rows are ready; returns a shorter batch only when no more
        can come (the partition is closed or its step is full and everything produced), and an empty one at the
        end of the stream. A wait that is cancelled (asyncio) or times out on the client is withdrawn: its rows go
        to nobody.

        Args:
            data_fields: fields the rows must have.
            batch_size: rows to return (per DP rank when ``sampler_params`` holds ``dp_size``).
            global_step / partition_id: where to read (exactly one).
            task_name: the consumer; each task consumes every row once.
            sampler_params: passed to the sampler; ``dp_rank``, ``dp_size``, ``dp_group_id`` make this call part of
                a DP round shared by the ranks of a data-parallel world.
            get_n_samples: serve whole GRPO groups only (``batch_size`` must be a multiple of ``num_n_samples``).
            lease_s: seconds the rows stay leased without an acknowledgement (None: the task's
                ``set_task_options(lease_s=...)``, else the queue's ``lease_s``, 600 s by default).
            peek: a non-consuming read (upstream's ``force_fetch``): the rows stay ready for the task and a later
                ``get_meta`` serves them again. Not within a DP round.

        Raises:
            GetMetaTimeout (naming what was missing), IncompleteGroups, InvalidRequest, PartitionCleared.

        >>> meta = client.get_meta(["prompt_ids"], batch_size=8, global_step=0, task_name="rollout")  # doctest: +SKIP
        """
        timeout = self._timeout(timeout)
        try:
            fields = [data_fields] if isinstance(data_fields, str) else list(data_fields)
        except TypeError:
            fields = [data_fields]  # type: ignore[list-item]
        if not all(isinstance(f, str) for f in fields):
            raise InvalidRequest(f"data_fields must be a field name or a list of them, got {data_fields!r}")
        call_id = next(self._calls)
        request = p.GetMeta(
            _partition(global_step, partition_id),
            fields,
            batch_size,
            task_name,
            sampler_params,
            bool(get_n_samples),
            timeout,
            lease_s,
            self.owner,
            call_id,
            bool(peek),
        )
        try:
            wire: p.MetaWire = await self._control(request, p.MetaWire, timeout + REPLY_SLACK)
        except (asyncio.CancelledError, RequestTimeout, KeyboardInterrupt):
            await self._withdraw(call_id)
            raise
        return wire.to_meta()

    async def _withdraw(self, call_id: int) -> None:
        """Tell the controller this client stopped waiting on get_meta ``call_id`` (best effort: a client that
        cannot reach it is taken for gone anyway once its connections close)."""
        try:
            await self._control(p.CancelGetMeta(self.owner, call_id), Any, 2.0)
        except (TransferQueueError, asyncio.CancelledError):
            pass

    async def get_data(
        self, batch_meta: BatchMeta, device: str | torch.device | None = None, timeout: float | None = None
    ) -> TensorDict:
        """The rows of ``batch_meta`` as a TensorDict, in its order: dense fields as tensors, jagged fields as
        nested tensors, non-tensor fields as NonTensorStack. ``device`` moves the result (e.g. ``"cuda"``).

        Args:
            timeout: seconds to wait for the storage units (None: the default).

        Raises:
            StaleBatchMeta (its partition was cleared), StorageUnitDown (rows on a unit known to be down: at once,
            naming the unit and the rows; or the first read that finds it down), StorageUnavailable.
        """
        if not isinstance(batch_meta, BatchMeta):
            raise InvalidRequest(f"get_data expects a BatchMeta, got {type(batch_meta).__name__}")
        device = _checked_device(device)
        timeout = self._timeout(timeout)
        num_rows = len(batch_meta)
        if num_rows == 0 or not batch_meta.fields:
            td = TensorDict({}, batch_size=[num_rows])
            await self._auto_ack(batch_meta)
            return td.to(device) if device is not None else td
        units = batch_meta.blocks % len(self._unit_endpoints)
        lost = self._rows_lost(batch_meta, units)
        if lost is not None:
            raise lost
        if np.any(batch_meta.blocks < 0):
            row, col = np.argwhere(batch_meta.blocks < 0)[0]
            raise UnknownField(
                f"field {batch_meta.field_names[col]!r} is not produced for global index "
                f"{batch_meta.global_indexes[row]}"
            )
        down = {u: why for u, why in self._down_units.items() if np.any(units == u)}
        if down:
            raise self._unit_down(batch_meta, units, down)
        calls, placed, into = [], [], []
        # Dense fields are assembled in place: each unit's run of rows is received straight into its slice of the
        # output (over Unix sockets), so rows spread over units cost no second copy.
        dense = {
            name: np.empty((num_rows, nbytes_of(torch_dtype(schema.dtype), schema.shape)), dtype=np.uint8)
            for name, schema in batch_meta.fields.items()
            if schema.kind == "dense"
        }
        for unit in np.unique(units).tolist():
            fields, positions, targets = [], [], {}
            frame = 2  # after the reply's header and body
            for j, name in enumerate(batch_meta.field_names):
                pos = np.flatnonzero(units[:, j] == unit)
                if len(pos):
                    blocks, offsets = batch_meta.blocks[pos, j], batch_meta.offsets[pos, j]
                    fields.append(p.ReadField(name, p.pack_indexes(blocks), p.pack_indexes(offsets)))
                    positions.append(pos)
                    if name in dense and int(pos[-1]) - int(pos[0]) == len(pos) - 1:  # ascending: one run
                        targets[frame] = dense[name][int(pos[0]) : int(pos[-1]) + 1].reshape(-1)
                    frame += nframes(batch_meta.fields[name])
            calls.append((unit, p.Read(batch_meta.partition_uid, fields), ()))
            placed.append(positions)
            into.append(targets)
        try:
            replies = await self._storage(calls, timeout, into if any(into) else None)
        except StorageUnavailable as exc:
            failed = {u: self._down_units.get(u, "unreachable") for u in getattr(exc, "units", [])}
            try:  # the controller's view: the unit may have been restarted (empty) meanwhile
                await self._control(p.Hello(self.client_id), Any, min(timeout, 5.0))
            except TransferQueueError:
                pass
            lost = self._rows_lost(batch_meta, units)
            if lost is not None:
                raise lost from None
            raise self._unit_down(batch_meta, units, failed, f"{exc}; ") from None
        parts: dict[str, list[Column]] = {name: [] for name in batch_meta.fields}
        where: dict[str, list[np.ndarray]] = {name: [] for name in batch_meta.fields}
        in_place = set(dense)
        for (body, buffers), positions, targets in zip(replies, placed, into, strict=True):
            reply = p.decode_as(body, p.ReadReply)
            i = 0
            for spec, pos in zip(reply.columns, positions, strict=True):
                frames = buffers[i : i + spec.nframes]
                part = Column.from_buffers(spec.schema, spec.num_rows, frames)
                if batch_meta.fields[spec.name].kind == "jagged":  # stored dense before the field became jagged
                    part = part.as_jagged()
                parts[spec.name].append(part)
                where[spec.name].append(pos)
                if targets.get(2 + i) is not frames[0]:
                    in_place.discard(spec.name)  # not received in place (ZeroMQ, or sizes that disagree)
                i += spec.nframes
        columns = {
            name: (
                Column(schema, num_rows, data=from_row_bytes(dense[name], torch_dtype(schema.dtype), schema.shape))
                if name in in_place
                else concat_columns(parts[name], where[name], num_rows)
            )
            for name, schema in batch_meta.fields.items()
        }
        td = tensordict_from_columns(columns, num_rows)
        await self._auto_ack(batch_meta)
        return td.to(device) if device is not None else td

    async def _auto_ack(self, batch_meta: BatchMeta) -> None:
        """A get_data acknowledges the rows of a get_meta's meta (unless its task acknowledges explicitly). If the
        controller cannot be told, the lease runs out and the rows are delivered again: never lost."""
        if batch_meta.task_name is None or not len(batch_meta):
            return
        request = p.Ack(
            batch_meta.partition_uid, batch_meta.task_name, p.pack_indexes(batch_meta.global_indexes), self.owner
        )
        post = getattr(self._transport, "post", None)
        if post is not None and not self._closed:  # over a Unix socket: sent, not waited for (ordered before the
            request.reply = False  # next request on this connection, delivered even if this process dies next)
            frames, _ = self._frames(request)
            if post(self.controller_info.controller, frames):
                return
            request.reply = True
        try:
            await self._control(request, Any, self.config.default_timeout)
        except TransferQueueError as exc:
            logger.warning("get_data could not acknowledge %d rows (delivered again later): %s", len(batch_meta), exc)

    # ---- delivery ------------------------------------------------------------------------------------------
    async def ack(self, batch_meta: BatchMeta) -> None:
        """Acknowledge the rows of ``batch_meta`` for its task: they are done and never delivered again. Needed
        only for tasks with ``ack="explicit"`` (see :meth:`set_task_options`), e.g. a trainer after its optimizer
        step; other tasks are acknowledged by ``get_data``.

        Raises:
            NotLeased: some rows are not held by this client (leased to another, already acknowledged, or handed
                back because their lease expired or they were released); the message names them. Nothing is
                acknowledged then.
            StaleBatchMeta: the partition was cleared.
        """
        if batch_meta.task_name is None:
            raise InvalidRequest("ack needs a BatchMeta from get_meta (it names the task that leased it)")
        request = p.Ack(
            batch_meta.partition_uid, batch_meta.task_name, p.pack_indexes(batch_meta.global_indexes), self.owner, True
        )
        await self._control(request, Any, self.config.default_timeout)

    async def set_task_options(
        self, task_name: str, ack: str = "auto", lease_s: float | None = None, max_deliveries: int | None = None
    ) -> None:
        """How ``task_name`` is delivered, for every client of the queue (set it before the task's first get_meta).

        Args:
            ack: ``"auto"`` (default): ``get_data`` of a meta acknowledges its rows; ``"explicit"``: only
                :meth:`ack` does (get_data leaves them leased).
            lease_s: seconds a lease of this task lasts (None: the queue's ``lease_s``); a get_meta's own
                ``lease_s`` wins over it.
            max_deliveries: deliveries after which rows coming back go to the dead letters (None: the queue's).

        >>> client.set_task_options("train", ack="explicit", lease_s=120)  # doctest: +SKIP
        """
        request = p.SetTaskOptions(task_name, ack, lease_s, max_deliveries)
        await self._control(request, Any, self.config.default_timeout)

    async def dead_letters(
        self, global_step: int | None = None, partition_id: str | None = None, task_name: str = "default"
    ) -> list[dict[str, Any]]:
        """Rows of a partition that ``task_name`` gave up on after ``max_deliveries``: a list of
        ``{"global_index", "deliveries", "reason"}`` (the last reason they came back: ``"lease expired"``,
        ``"client disconnected"``, ``"released"``, ``"cancelled"``). Raises UnknownPartition."""
        request = p.DeadLetters(_partition(global_step, partition_id), task_name)
        return await self._control(request, Any, self.config.default_timeout)

    # ---- consumption and lifecycle -------------------------------------------------------------------------
    async def release(self, batch_meta: BatchMeta) -> None:
        """Hand the rows of ``batch_meta`` back to the task that got them (e.g. its consumer failed): they are
        served again. Only rows this client holds (leased or acknowledged by it, or held by a DP round) go back;
        others, and rows named twice or released before, are ignored. A DP share handed back this way is not
        served to its rank again under the same round."""
        if batch_meta.task_name is None:
            raise InvalidRequest("release needs a BatchMeta from get_meta (it names the task that consumed it)")
        request = p.Release(
            batch_meta.partition_uid, batch_meta.task_name, p.pack_indexes(batch_meta.global_indexes), self.owner
        )
        await self._control(request, Any, self.config.default_timeout)

    async def clear(self, global_step: int | None = None, partition_id: str | None = None) -> None:
        """Drop a partition's rows and payload. Idempotent. Returns once the storage units dropped the payload (a
        unit that does not acknowledge is waited for at most half the default timeout): from then on every BatchMeta
        of the partition is stale."""
        request = p.Clear(_partition(global_step, partition_id))
        await self._control(request, Any, self.config.default_timeout + REPLY_SLACK)

    async def reset_consumption(
        self, task_name: str | None = None, global_step: int | None = None, partition_id: str | None = None
    ) -> None:
        """Make rows unconsumed again for ``task_name`` (None: every task), in one partition or (no partition
        given) all of them, e.g. to train on the same data again."""
        key = None if global_step is None and partition_id is None else _partition(global_step, partition_id)
        await self._control(p.ResetConsumption(key, task_name), Any, self.config.default_timeout)

    async def get_production_status(self, global_step: int | None = None, partition_id: str | None = None) -> dict:
        """Rows, capacity, bytes and per-field produced counts of a partition. Raises UnknownPartition."""
        request = p.ProductionStatus(_partition(global_step, partition_id))
        return await self._control(request, Any, self.config.default_timeout)

    async def get_consumption_status(
        self, global_step: int | None = None, partition_id: str | None = None, task_name: str | None = None
    ) -> dict:
        """Rows consumed per task (one task or all) in a partition. Raises UnknownPartition."""
        request = p.ConsumptionStatus(_partition(global_step, partition_id), task_name)
        return await self._control(request, Any, self.config.default_timeout)

    async def list_partitions(self) -> list[PartitionKey]:
        """The live partitions: int global steps and str partition ids."""
        return await self._control(p.ListPartitions(), Any, self.config.default_timeout)

    async def status(self, run_history: bool = False) -> dict:
        """The whole queue in one controller request, consistent with itself even while partitions are cleared:
        live partitions with production and consumption per task, rows by delivery state per task, waiting
        requests, storage units (bytes, budget, health), request counts, errors, the RL run's last metrics
        (``run_history``: every step kept) and the HTTP endpoints. See docs/operations.md.

        >>> client.status()["tasks"]["train"]["acknowledged"]  # doctest: +SKIP
        """
        return await self._control(p.QueueStatus(bool(run_history)), Any, self.config.default_timeout)

    async def lost_rows(self, global_step: int | None = None, partition_id: str | None = None) -> list[dict]:
        """The rows of a partition lost with a storage unit that died and was restarted empty (see docs/api.md
        "Lost rows"): one dict per row with ``global_index``, ``group_id``, ``custom_meta`` (tags), ``key`` (kv),
        ``unit``, ``fields`` (those that were on the unit; empty: lost with the rest of its group) and ``tasks``
        (each task's delivery state of it now: ``ready``, ``leased``, ``acknowledged``, ``dead_lettered``). A producer
        puts the rows it still needs again, as new rows (e.g. ``group_ids=[group_id] * n``). Raises UnknownPartition.

        >>> [row["group_id"] for row in client.lost_rows(global_step=3)]  # doctest: +SKIP
        """
        request = p.LostRows(_partition(global_step, partition_id))
        return await self._control(request, Any, self.config.default_timeout)

    async def close_partition(self, global_step: int | None = None, partition_id: str | None = None) -> None:
        """No more puts to this partition: readers get the final short batch, then the end of the stream."""
        await self._control(p.ClosePartition(_partition(global_step, partition_id)), Any, self.config.default_timeout)

    async def ping(self) -> dict:
        """A round trip to the controller; raises SessionMismatch if the controller_info is stale."""
        return await self._control(p.Hello(self.client_id), Any, self.config.default_timeout)

    async def save_checkpoint(self, directory: str, timeout: float | None = None) -> str:
        """Save the whole queue under ``directory``: the controller's state (partitions, schemas, production,
        consumption with leases turned back to ready, groups, DP rounds, kv keys, samplers' ``state_dict``) and every
        storage unit's payload, each unit writing its own files. Nothing is served while it saves. A save that fails
        or crashes half-way leaves the previous checkpoint current and whole. ``directory`` must be reachable by the
        controller and every storage unit (a shared filesystem across hosts).

        Returns:
            The committed checkpoint's directory (under ``directory``); ``transfer_queue.init(...,
            restore_from=directory)`` starts a queue from it.

        Raises:
            CheckpointError: a unit or the disk failed (the previous checkpoint stays current).
        """
        request = p.SaveCheckpoint(os.path.abspath(directory))
        return await self._control(request, Any, self._timeout(timeout) + REPLY_SLACK)

    def close(self) -> None:
        """Close the sockets; the client cannot be used afterwards."""
        self._closed = True
        self._transport.close()

    # ---- per-row custom meta, per-row clears, status in one word -------------------------------------------
    async def set_custom_meta(
        self, batch_meta: BatchMeta, values: Sequence[dict[str, Any] | None] | None = None
    ) -> None:
        """Give each row of ``batch_meta`` a small dict of custom meta (``None`` or ``{}`` removes it).

        Values must be msgpack-encodable and at most 4 KiB each, encoded. They come back with every later
        ``get_meta`` of the rows (``meta.custom_meta``) and are dropped with the rows. ``values=None`` sends the
        meta's own ``custom_meta`` (as upstream: ``meta.update_custom_meta(values)`` then ``set_custom_meta(meta)``).
        """
        values = list(batch_meta.custom_meta if values is None else values)
        if len(values) != len(batch_meta):
            raise BatchSizeMismatch(f"set_custom_meta: the meta has {len(batch_meta)} rows, got {len(values)} values")
        Column.from_objects("custom_meta", values, len(values))  # UnsupportedValue naming the row, before sending
        request = p.SetCustomMeta(batch_meta.partition_uid, p.pack_indexes(batch_meta.global_indexes), values)
        await self._control(request, Any, self.config.default_timeout)

    async def get_custom_meta(self, batch_meta: BatchMeta) -> list[dict[str, Any]]:
        """The current custom meta of each row of ``batch_meta`` (``{}`` where none is set), in its order."""
        request = p.GetCustomMeta(batch_meta.partition_uid, p.pack_indexes(batch_meta.global_indexes))
        return await self._control(request, Any, self.config.default_timeout)

    async def clear_samples(self, batch_meta: BatchMeta) -> None:
        """Forget the rows of ``batch_meta`` (any partition; by key it also forgets their keys); their payload is
        freed once no row references its block. Rows already gone are skipped; a cleared partition is a no-op."""
        request = p.ClearSamples(batch_meta.partition_uid, p.pack_indexes(batch_meta.global_indexes))
        await self._control(request, Any, self.config.default_timeout + REPLY_SLACK)

    async def check_production_status(
        self, data_fields: Sequence[str] | str, partition_id: str | None = None, *, global_step: int | None = None
    ) -> bool:
        """True when every row of the partition has every field of ``data_fields`` (a step: all its rows are
        committed) and no put into it is open; False otherwise, also for a partition not opened yet."""
        try:
            status = await self.get_production_status(global_step, partition_id)
        except UnknownPartition:
            return False
        rows, fields = status["rows"], status["fields"]
        if not rows or status["rows_in_flight"] or (status["capacity"] is not None and rows != status["capacity"]):
            return False
        return all(name in fields and fields[name]["produced"] == rows for name in as_names(data_fields))

    async def check_consumption_status(
        self, task_name: str, partition_id: str | None = None, *, global_step: int | None = None
    ) -> bool:
        """True when ``task_name`` consumed every row of the partition (a step: all its rows are committed)."""
        try:
            status = await self.get_consumption_status(global_step, partition_id, task_name)
            production = await self.get_production_status(global_step, partition_id)
        except UnknownPartition:
            return False
        task, capacity = status["tasks"][task_name], production["capacity"]
        return bool(task["rows"]) and task["consumed"] == task["rows"] and capacity in (None, task["rows"])

    # ---- by key (upstream TransferQueue's kv_* names) -------------------------------------------------------
    async def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: TensorDictBase | dict[str, Any] | None = None,
        tags: Sequence[dict[str, Any] | None] | None = None,
        timeout: float | None = None,
        jagged: Sequence[str] = (),
    ) -> BatchMeta:
        """Insert or update rows by key: new keys get new rows, existing keys get their fields overwritten.

        ``tags`` (one small dict per key) become the rows' custom meta (see :meth:`set_custom_meta`); with no
        ``fields`` only the tags are set (new keys are created with no fields yet). The meta returned names the
        fields written; :meth:`kv_batch_get_by_meta` reads every field of its keys.
        """
        timeout = self._timeout(timeout)
        keys = as_names(keys)
        partition_id = _kv_partition(partition_id)
        if tags is not None and len(tags) != len(keys):
            raise BatchSizeMismatch(f"{len(keys)} keys but {len(tags)} tags")
        if fields is None or len(fields.keys()) == 0:  # None or {}: a tag-only update
            if tags is None:
                raise InvalidRequest("kv_put needs fields or a tag; got neither")
            return await self._kv_tag(keys, partition_id, list(tags))
        num_rows, columns = columns_from_tensordict(fields, as_names(jagged))
        if num_rows != len(keys):
            raise BatchSizeMismatch(f"{len(keys)} keys but {num_rows} rows of fields")
        lengths, length_fields = self._field_lengths(columns, num_rows)
        reserve = p.Reserve(
            partition_id,
            num_rows,
            {name: c.schema for name, c in columns.items()},
            sum(c.nbytes for c in columns.values()),
            lengths=lengths,
            keys=keys,
            timeout=timeout,
            length_fields=length_fields,
        )
        meta = await self._put(reserve, columns, timeout)
        if tags is not None:
            tagged = await self._kv_tag(keys, partition_id, list(tags))
            meta.extra["custom_meta"] = tagged.custom_meta
        return meta

    async def _kv_tag(self, keys: list[str], partition_id: str, tags: list[Any]) -> BatchMeta:
        Column.from_objects("tags", tags, len(tags))  # UnsupportedValue naming the row, before sending
        request = p.KvTag(partition_id, keys, tags)
        wire: p.MetaWire = await self._control(request, p.MetaWire, self.config.default_timeout)
        return wire.to_meta()

    async def kv_put(
        self,
        key: str,
        partition_id: str,
        fields: TensorDictBase | dict[str, Any] | None = None,
        tag: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> BatchMeta:
        """``kv_batch_put`` of one key. ``fields`` holds one row: a dict of tensors without the batch dimension
        (and non-tensor values), or a TensorDict of batch size 1. ``fields=None`` (or ``{}``) updates the tag only.
        """
        if isinstance(fields, TensorDictBase):
            if list(fields.batch_size[:1]) != [1]:
                got = list(fields.batch_size)
                raise BatchSizeMismatch(f"kv_put takes one row: a TensorDict of batch size [1], got {got}")
            row: Any = fields
        elif fields is None or isinstance(fields, dict):
            row = {
                name: value.unsqueeze(0) if isinstance(value, torch.Tensor) and not value.is_nested else [value]
                for name, value in (fields or {}).items()
            }
        else:
            raise InvalidRequest(f"kv_put fields must be a dict, a TensorDict or None, got {type(fields).__name__}")
        return await self.kv_batch_put([key], partition_id, row, None if tag is None else [tag], timeout)

    async def kv_batch_get(
        self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str] | None = None
    ) -> TensorDict:
        """The rows of ``keys`` (in that order) with ``select_fields`` (default: every field all of them have)."""
        request = p.KvLookup(
            _kv_partition(partition_id),
            as_names(keys),
            None if select_fields is None else as_names(select_fields),
        )
        for attempt in range(KV_READ_ATTEMPTS):
            wire: p.MetaWire = await self._control(request, p.MetaWire, self.config.default_timeout)
            try:
                return await self.get_data(wire.to_meta())
            except StaleBatchMeta:
                # a kv_put of one of the keys committed between the lookup and the read and its old payload was
                # dropped: look the keys up again and read their new values (each value comes back whole)
                if attempt == KV_READ_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    async def kv_batch_get_by_meta(
        self, batch_meta: BatchMeta, select_fields: Sequence[str] | None = None
    ) -> TensorDict:
        """The rows of a kv put's meta with every field their keys have now (or ``select_fields``), not only the
        fields that put wrote."""
        if batch_meta.keys is None:
            raise InvalidRequest("kv_batch_get_by_meta needs the meta of a kv put or lookup (it names keys)")
        return await self.kv_batch_get(batch_meta.keys, str(batch_meta.partition_id), select_fields)

    async def kv_list(self, partition_id: str | None = None, with_tags: bool = False) -> Any:
        """The keys of a partition used by key, in insertion order (an unknown partition has none); with no
        ``partition_id``, ``{partition_id: keys}`` for every partition used by key. ``with_tags``: each key's tag
        (custom meta) instead, as ``{key: tag}``."""
        partition = None if partition_id is None else _kv_partition(partition_id)
        return await self._control(p.KvList(partition, bool(with_tags)), Any, self.config.default_timeout)

    async def kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        """Forget ``keys`` (a str is one key; None: the whole partition) and free their payload. Unknown keys are
        ignored."""
        request = p.KvClear(_kv_partition(partition_id), None if keys is None else as_names(keys))
        await self._control(request, Any, self.config.default_timeout + REPLY_SLACK)  # answered as clear is


def _checked_device(device: str | torch.device | None) -> torch.device | None:
    """``device`` as a torch.device, checked before any byte moves: a typed error instead of torch's."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidRequest(f"get_data: device={device!r} is not a torch device ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(f"get_data: device={device!r} asked for, but torch.cuda.is_available() is False here")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InvalidRequest(f"get_data: device={device!r} asked for; this process sees {torch.cuda.device_count()}")
    return dev


def _sync(
    method: Callable[Concatenate[AsyncTransferQueueClient, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[TransferQueueClient, P], R]:
    @functools.wraps(method)
    def call(self: TransferQueueClient, *args: P.args, **kwargs: P.kwargs) -> R:
        return run_sync(method(self._client, *args, **kwargs))

    return call


class TransferQueueClient:
    """The sync client: the same methods as :class:`AsyncTransferQueueClient`, blocking. It needs no event loop
    and also works when called from inside a running one. Safe to share between threads (sockets are per thread).

    Args:
        client_id: a name for logs.
        controller_info: from ``ray.get(get_controller().get_info.remote())`` or ``transfer_queue.init``.
        spin_seconds: poll without sleeping for up to this long while waiting for a reply (lower latency for
            small requests at the price of some CPU); 0 disables it.
        force_tcp: talk ZeroMQ over TCP even to servers on this host, instead of their Unix sockets (the path
            clients on other hosts take). Default: the ``TRANSFER_QUEUE_TRANSPORT`` environment variable
            (``tcp`` forces it, ``auto``, the default, does not).

    >>> client = TransferQueueClient(client_id="trainer-0", controller_info=info)  # doctest: +SKIP
    """

    def __init__(
        self,
        client_id: str,
        controller_info: p.ControllerInfo,
        *,
        spin_seconds: float = 0.0,
        force_tcp: bool | None = None,
    ):
        if not isinstance(controller_info, p.ControllerInfo):
            raise InvalidRequest(f"controller_info must be a ControllerInfo, got {type(controller_info).__name__}")
        transport = BlockingTransport(spin_seconds, controller_info.secret, force_tcp)
        self._client = AsyncTransferQueueClient(client_id, controller_info, transport=transport)

    @property
    def client_id(self) -> str:
        return self._client.client_id

    @property
    def controller_info(self) -> p.ControllerInfo:
        return self._client.controller_info

    @property
    def config(self) -> QueueConfig:
        return self._client.config

    @property
    def owner(self) -> str:
        """Who holds this client's leases (unique per client instance)."""
        return self._client.owner

    def close(self) -> None:
        self._client.close()

    put = _sync(AsyncTransferQueueClient.put)
    get_meta = _sync(AsyncTransferQueueClient.get_meta)
    get_data = _sync(AsyncTransferQueueClient.get_data)
    release = _sync(AsyncTransferQueueClient.release)
    ack = _sync(AsyncTransferQueueClient.ack)
    set_task_options = _sync(AsyncTransferQueueClient.set_task_options)
    dead_letters = _sync(AsyncTransferQueueClient.dead_letters)
    clear = _sync(AsyncTransferQueueClient.clear)
    reset_consumption = _sync(AsyncTransferQueueClient.reset_consumption)
    get_production_status = _sync(AsyncTransferQueueClient.get_production_status)
    get_consumption_status = _sync(AsyncTransferQueueClient.get_consumption_status)
    save_checkpoint = _sync(AsyncTransferQueueClient.save_checkpoint)
    list_partitions = _sync(AsyncTransferQueueClient.list_partitions)
    close_partition = _sync(AsyncTransferQueueClient.close_partition)
    lost_rows = _sync(AsyncTransferQueueClient.lost_rows)
    status = _sync(AsyncTransferQueueClient.status)
    ping = _sync(AsyncTransferQueueClient.ping)
    kv_put = _sync(AsyncTransferQueueClient.kv_put)
    kv_batch_put = _sync(AsyncTransferQueueClient.kv_batch_put)
    kv_batch_get = _sync(AsyncTransferQueueClient.kv_batch_get)
    kv_list = _sync(AsyncTransferQueueClient.kv_list)
    kv_clear = _sync(AsyncTransferQueueClient.kv_clear)
    kv_batch_get_by_meta = _sync(AsyncTransferQueueClient.kv_batch_get_by_meta)
    set_custom_meta = _sync(AsyncTransferQueueClient.set_custom_meta)
    get_custom_meta = _sync(AsyncTransferQueueClient.get_custom_meta)
    clear_samples = _sync(AsyncTransferQueueClient.clear_samples)
    check_production_status = _sync(AsyncTransferQueueClient.check_production_status)
    check_consumption_status = _sync(AsyncTransferQueueClient.check_consumption_status)


def default_client_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"
