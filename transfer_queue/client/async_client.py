"""The client: ``AsyncTransferQueueClient`` holds the logic; ``TransferQueueClient`` (``sync.py``) is its sync
facade.

A client needs only a :class:`~transfer_queue.wire.protocol.ControllerInfo` (it speaks ZeroMQ, not Ray), so it works
in any process: a Ray actor, a torchrun rank, a plain subprocess. Its calls live in files by what they touch:
``channel.py`` (the plumbing), ``rows.py`` (put and get), ``kv.py`` (rows by key), and here the task options, the
partitions' lifecycle and the status calls.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from transfer_queue.client.channel import REPLY_SLACK, _partition
from transfer_queue.client.kv import KVCalls
from transfer_queue.errors import (
    BatchSizeMismatch,
    UnknownPartition,
)
from transfer_queue.metadata import BatchMeta, PartitionKey, as_names
from transfer_queue.wire import protocol as p
from transfer_queue.wire.columns import (
    Column,
)


class AsyncTransferQueueClient(KVCalls):
    """A client of one queue; every method is a coroutine. See :class:`TransferQueueClient` for the sync one.

    Args:
        client_id: a name for logs.
        controller_info: from ``ray.get(get_controller().get_info.remote())`` or ``transfer_queue.init``.
        transport: how bytes move (default: asyncio ZeroMQ sockets).
    """

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
        self._task_options[task_name] = request  # set again after a controller restart (restart_retry_s)

    async def dead_letters(
        self, global_step: int | None = None, partition_id: str | None = None, task_name: str = "default"
    ) -> list[dict[str, Any]]:
        """Rows of a partition that ``task_name`` gave up on after ``max_deliveries``: a list of
        ``{"global_index", "deliveries", "reason"}`` (the last reason they came back: ``"lease expired"``,
        ``"client disconnected"``, ``"released"``, ``"cancelled"``). Raises UnknownPartition."""
        request = p.DeadLetters(_partition(global_step, partition_id), task_name)
        return await self._control(request, Any, self.config.default_timeout)

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
        storage unit's payload, each unit writing its own files. It holds the committed rows at the moment the
        controller took its snapshot; every other client is served while the files are written, and this call is
        answered once the checkpoint is committed. A save that fails, crashes half-way, or has a storage unit that
        does not finish within ``checkpoint_timeout`` (QueueConfig) leaves the previous checkpoint current and whole.
        ``directory`` must be reachable by the controller and every storage unit (a shared filesystem across hosts).

        Args:
            timeout: seconds to wait for the answer (None: the default); at least ``checkpoint_timeout`` is waited.

        Returns:
            The committed checkpoint's directory (under ``directory``); ``transfer_queue.init(...,
            restore_from=directory)`` starts a queue from it.

        Raises:
            CheckpointError: a unit or the disk failed, a unit did not finish within ``checkpoint_timeout`` (the
                message names it), or another save is in progress (the previous checkpoint stays current).
        """
        request = p.SaveCheckpoint(os.path.abspath(directory))
        wait = max(self._timeout(timeout), self.config.checkpoint_timeout + 1.0)
        return await self._control(request, Any, wait + REPLY_SLACK)

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
