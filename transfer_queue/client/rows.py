"""Rows in and out: ``put`` (reserve, write to the storage units, commit), ``get_meta``, ``get_data``, ``ack`` and
``release``.

A put is three messages: *reserve* (the controller validates the put against the partition's schema, waits for
room in the step ring if needed, and hands back rows and a placement), *write* (the payload goes straight to the
storage units, in parallel, zero-copy), *commit* (the rows become visible, all at once). A put that fails or dies
in between is aborted: none of its rows ever becomes visible and its bytes are freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from transfer_queue.client.channel import REPLY_SLACK, QueueChannel, _partition
from transfer_queue.client.lease_keeper import AsyncLeaseHeartbeat, beat_schedule
from transfer_queue.errors import (
    BatchSizeMismatch,
    InvalidRequest,
    RequestTimeout,
    StorageUnavailable,
    TransferQueueError,
    UnknownField,
    UnknownTaskWarning,
)
from transfer_queue.metadata import BatchMeta, as_names
from transfer_queue.wire import protocol as p
from transfer_queue.wire.columns import (
    Column,
    columns_from_tensordict,
    concat_columns,
    from_row_bytes,
    nbytes_of,
    nframes,
    pinned_empty,
    tensordict_from_columns,
    torch_dtype,
)
from transfer_queue.wire.shm import device_buffer_of, device_target

logger = logging.getLogger(__name__)


class RowCalls(QueueChannel):
    """put, get_meta, get_data, ack and release."""

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
        # the controller applies the commit until commit_within after it reserved, so until this (or later) here
        commit_by = time.monotonic() + reservation.commit_within if reservation.commit_within else started + timeout
        try:
            writes = []
            for place in reservation.placements:
                parts = {name: c.slice(place.start, place.stop) for name, c in columns.items()}
                specs = [p.ColumnSpec(n, c.schema, c.num_rows, len(c.buffers())) for n, c in parts.items()]
                buffers = [b for c in parts.values() for b in c.buffers()]
                rows = place.stop - place.start
                body = p.Write(reservation.partition_uid, place.block_id, rows, specs, place.max_bytes, place.token)
                writes.append((place.unit, body, buffers))
                if self._replica_of is not None:  # the second copy, in parallel: the commit waits for both
                    writes.append((self._replica_of[place.unit], body, buffers))
            await self._storage(writes, max(1.0, timeout - (time.monotonic() - started)))
            wire = await self._commit(reservation.put_id, commit_by)
        except BaseException:
            try:
                await self._control(p.Abort(reservation.put_id), Any, 5.0)
            except TransferQueueError:
                pass  # the controller aborts it at its deadline anyway
            raise
        return wire.to_meta()

    async def _commit(self, put_id: int, deadline: float) -> p.MetaWire:
        """Commit a put. ``deadline`` is at or after the last moment the controller applies the commit; a commit
        whose reply did not come is asked again (idempotent by put id: a retry gets the same meta, never new rows)
        until then, and once more after it, when the controller answers for sure: the meta (it was applied) or
        PutExpired (it never will be). So a put never reports failure for rows that became visible."""
        while True:
            last = time.monotonic() >= deadline
            wait = REPLY_SLACK if last else max(1.0, deadline - time.monotonic())
            try:
                return await self._control(p.Commit(put_id), p.MetaWire, wait)
            except RequestTimeout as exc:
                if last:
                    raise RequestTimeout(
                        f"put {put_id}: the controller did not answer its commit by the put's deadline nor after it "
                        f"({exc}); the commit is refused from now on, but whether it was applied before is unknown"
                    ) from exc

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
            GetMetaTimeout (naming what was missing), IncompleteGroups, InvalidRequest, PartitionCleared,
            UnknownTask (a queue that declares its ``task_names`` was asked for another one).

        Warns:
            UnknownTaskWarning: ``task_name`` was never seen before and starts a new consumer of a partition known
            tasks already consume (it is served every row again): a typo? (queues without ``task_names`` only)

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
        partition = _partition(global_step, partition_id)
        dp_rank = sampler_params.get("dp_rank", 0) if isinstance(sampler_params, dict) else 0
        auto_key = (partition, task_name, dp_rank) if isinstance(dp_rank, int) and isinstance(task_name, str) else None
        request = p.GetMeta(
            partition,
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
            None if auto_key is None else self._next_auto_round(auto_key),
        )
        try:
            wire: p.MetaWire = await self._control(request, p.MetaWire, timeout + REPLY_SLACK)
        except (asyncio.CancelledError, RequestTimeout, KeyboardInterrupt):
            await self._withdraw(call_id)
            raise
        meta = wire.to_meta()
        if auto_key is not None:
            self._note_auto_round(auto_key, meta)
        warning = meta.extra.pop("warning", None)
        if warning:  # a task name never seen before (transfer_queue.state.task_names): the caller hears of it
            warnings.warn(warning, UnknownTaskWarning, stacklevel=3)
        return meta

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
            return _moved(td, device)
        units = self._read_units(batch_meta)
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
        started, failed_units = time.monotonic(), list[int]()
        while True:
            try:
                left = max(1.0, timeout - (time.monotonic() - started)) if failed_units else timeout
                td = await self._read(batch_meta, units, left, device)
                break
            except StorageUnavailable as exc:
                failed_units += getattr(exc, "units", [])
                if self._replica_of is not None:  # replicas=2: the cells of the failed units from their other copy
                    again = self._read_units(batch_meta, failed_units)
                    if not np.array_equal(again, units) and not np.isin(again, failed_units).any():
                        units = again
                        continue
                failed = {u: self._down_units.get(u, "unreachable") for u in getattr(exc, "units", [])}
                try:  # the controller's view: the unit may have been restarted (empty) meanwhile
                    await self._control(p.Hello(self.client_id), Any, min(timeout, 5.0))
                except TransferQueueError:
                    pass
                lost = self._rows_lost(batch_meta, units)
                if lost is not None:
                    raise lost from None
                raise self._unit_down(batch_meta, units, failed, f"{exc}; ") from None
        await self._auto_ack(batch_meta)
        return _moved(td, device)

    async def _read(
        self, batch_meta: BatchMeta, units: np.ndarray, timeout: float, device: torch.device | None = None
    ) -> TensorDict:
        """Read the cells of ``batch_meta`` from ``units`` (per cell) in one round of parallel calls. For a GPU
        ``device``, dense fields land on it: by DMA straight from the shared memory of a unit on this host (its
        segments page-locked for CUDA once), else received into page-locked host memory (their copy to the GPU is
        then a DMA at full speed too)."""
        num_rows = len(batch_meta)
        calls, placed, into = [], [], []
        gpu = device is not None and device.type == "cuda"
        direct = gpu and getattr(self._transport, "shared_memory", False)
        # Dense fields are assembled in place: each unit's run of rows is received straight into its slice of the
        # output (over Unix sockets), so rows spread over units cost no second copy.
        # with DMA, the host arrays take only what arrives in-band (np.empty: pages never touched cost nothing);
        # for a GPU otherwise, page-locked; else the transport's (pooled with shared memory)
        empty = None if direct else pinned_empty if gpu else getattr(self._transport, "empty", None)
        dense = {
            name: _empty(empty, num_rows, nbytes_of(torch_dtype(schema.dtype), schema.shape))
            for name, schema in batch_meta.fields.items()
            if schema.kind == "dense"
        }
        on_device = (
            {name: torch.empty(a.size, dtype=torch.uint8, device=device) for name, a in dense.items()} if direct else {}
        )
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
                        first, end, row = int(pos[0]), int(pos[-1]) + 1, dense[name].shape[1]
                        targets[frame] = dense[name][first:end].reshape(-1)
                        if name in on_device:
                            targets[frame] = device_target(targets[frame], on_device[name][first * row : end * row])
                    frame += nframes(batch_meta.fields[name])
            calls.append((unit, p.Read(batch_meta.partition_uid, fields), ()))
            placed.append(positions)
            into.append(targets)
        replies = await self._storage(calls, timeout, into if any(into) else None)
        received: dict[str, list[tuple[Any, np.ndarray, list[Any], Any]]] = {name: [] for name in batch_meta.fields}
        in_place = set(dense)
        for (body, buffers), positions, targets in zip(replies, placed, into, strict=True):
            reply = p.decode_as(body, p.ReadReply)
            i = 0
            for spec, pos in zip(reply.columns, positions, strict=True):
                frames, target = buffers[i : i + spec.nframes], targets.get(2 + i)
                if frames[0] is not target and frames[0] is not device_buffer_of(target):
                    in_place.discard(spec.name)  # not received in place (ZeroMQ, or sizes that disagree)
                received[spec.name].append((spec, pos, frames, target))
                i += spec.nframes
        columns = {}
        for name, schema in batch_meta.fields.items():
            if name in in_place and name in on_device:
                for _, _, frames, target in received[name]:
                    if frames[0] is target:  # sent in-band: received into host memory
                        target.device_buffer.copy_(torch.from_numpy(np.asarray(target)))
                data = on_device[name].view(torch_dtype(schema.dtype)).reshape(num_rows, *schema.shape)
                columns[name] = Column(schema, num_rows, data=data)
            elif name in in_place:
                data = from_row_bytes(dense[name], torch_dtype(schema.dtype), schema.shape)
                columns[name] = Column(schema, num_rows, data=data)
            else:
                parts = []
                for spec, _, frames, target in received[name]:
                    if frames[0] is device_buffer_of(target):  # rare: on the GPU, the rest of the field not in place
                        frames = [frames[0].cpu().numpy()]
                    part = Column.from_buffers(spec.schema, spec.num_rows, frames)
                    if schema.kind == "jagged":  # stored dense before the field became jagged
                        part = part.as_jagged()
                    parts.append(part)
                columns[name] = concat_columns(parts, [pos for _, pos, _, _ in received[name]], num_rows)
        return tensordict_from_columns(columns, num_rows)

    async def _auto_ack(self, batch_meta: BatchMeta) -> None:
        """A get_data acknowledges the rows of a get_meta's meta (unless its task acknowledges explicitly). If the
        controller cannot be told, the lease runs out and the rows are delivered again: never lost."""
        if batch_meta.task_name is None or not len(batch_meta):
            return
        request = p.Ack(
            batch_meta.partition_uid,
            batch_meta.task_name,
            p.pack_indexes(batch_meta.global_indexes),
            self.owner,
            dp_group_id=_dp_group_id(batch_meta),
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
        request = p.Ack(
            *_held_rows(batch_meta, "ack", "leased"), self.owner, True, dp_group_id=_dp_group_id(batch_meta)
        )
        await self._control(request, Any, self.config.default_timeout)

    async def extend_lease(self, batch_meta: BatchMeta, seconds: float) -> dict[str, int]:
        """Keep the rows of ``batch_meta`` leased to this client ``seconds`` from now (Redis ``XCLAIM``, SQS
        ``ChangeMessageVisibility``): a consumer whose work outlasts ``lease_s`` extends before it runs out (or
        lets :meth:`keep_leased` do it). The deadline is set, not added to (it may move sooner), and is per
        ``get_meta``: rows of the same ``get_meta`` not in ``batch_meta`` move with them. Returns
        ``{"extended": rows}``.

        Raises:
            InvalidRequest: ``seconds`` is not a number in (0, ``QueueConfig.max_lease_s``].
            NotLeased: some rows are not leased to this client any more (their lease expired, they were
                acknowledged, released, or leased to another client); the message names them. Nothing is extended
                then.
            StaleBatchMeta: the partition was cleared.
        """
        rows = _held_rows(batch_meta, "extend_lease", "leased")
        self.config.check_extension(seconds)
        request = p.ExtendLease(*rows, self.owner, float(seconds), _dp_group_id(batch_meta))
        return dict(await self._control(request, Any, self.config.default_timeout))

    def keep_leased(
        self, batch_meta: BatchMeta, every: float | None = None, seconds: float | None = None
    ) -> AsyncLeaseHeartbeat:
        """An async context manager that keeps the rows of ``batch_meta`` leased while its block runs: it calls
        :meth:`extend_lease` ``(batch_meta, seconds)`` on entry and then every ``every`` seconds (defaults: the
        queue's ``lease_s``, at most ``max_lease_s``, and a third of it), until the block exits. A beat that fails
        stops the heartbeat; it is logged and kept in the heartbeat's ``error``.

        >>> async with client.keep_leased(meta):  # doctest: +SKIP
        ...     await train_on(meta)
        >>> await client.ack(meta)  # doctest: +SKIP
        """
        every, seconds = beat_schedule(self.config, every, seconds)
        return AsyncLeaseHeartbeat(self.extend_lease, batch_meta, every, seconds)

    # ---- consumption and lifecycle -------------------------------------------------------------------------
    async def release(self, batch_meta: BatchMeta) -> None:
        """Hand the rows of ``batch_meta`` back to the task that got them (e.g. its consumer failed): they are
        served again. Only rows this client holds (leased or acknowledged by it, or held by a DP round) go back;
        others, and rows named twice or released before, are ignored. A DP share handed back this way is not
        served to its rank again under the same round."""
        request = p.Release(*_held_rows(batch_meta, "release", "consumed"), self.owner, _dp_group_id(batch_meta))
        await self._control(request, Any, self.config.default_timeout)


def _empty(empty: Any, num_rows: int, row_bytes: int) -> np.ndarray:
    """A ``[num_rows, row_bytes]`` uint8 array a read lands in: the transport's (pooled) or ``np.empty``."""
    if empty is None or not num_rows * row_bytes:
        return np.empty((num_rows, row_bytes), dtype=np.uint8)
    return empty(num_rows * row_bytes).reshape(num_rows, row_bytes)


def _moved(td: TensorDict, device: torch.device | None) -> TensorDict:
    """``td`` on ``device``. To a GPU the copies are queued without waiting (from page-locked buffers they overlap
    nothing else but skip the driver's staging copy), then waited for once: the host buffers go back to torch's
    pinned-memory cache when dropped, and must not be reused while a copy still reads them."""
    if device is None:
        return td
    if device.type != "cuda":
        return td.to(device)
    moved = td.to(device, non_blocking=True)
    torch.cuda.current_stream(device).synchronize()
    return moved


def _held_rows(batch_meta: BatchMeta, call: str, how: str) -> tuple[int, str, bytes]:
    """The partition uid, task and packed indexes that name ``batch_meta``'s rows to the controller, for ``call``."""
    if batch_meta.task_name is None:
        raise InvalidRequest(f"{call} needs a BatchMeta from get_meta (it names the task that {how} it)")
    return batch_meta.partition_uid, batch_meta.task_name, p.pack_indexes(batch_meta.global_indexes)


def _dp_group_id(batch_meta: BatchMeta) -> str | None:
    """The DP round a meta's rows were leased to (acks and releases name it: rows a later round took are not its)."""
    group = batch_meta.extra.get("dp_group_id")
    return None if group is None else str(group)


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
