"""Rows by key, under upstream TransferQueue's ``kv_*`` names: a key is a row of a kv partition."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from transfer_queue.client.channel import KV_READ_ATTEMPTS, REPLY_SLACK, _kv_partition
from transfer_queue.client.rows import RowCalls
from transfer_queue.errors import (
    BatchSizeMismatch,
    InvalidRequest,
    StaleBatchMeta,
)
from transfer_queue.metadata import BatchMeta, as_names
from transfer_queue.wire import protocol as p
from transfer_queue.wire.columns import (
    Column,
    columns_from_tensordict,
)


class KVCalls(RowCalls):
    """kv_put, kv_batch_put, kv_batch_get, kv_list, kv_clear and kv_batch_get_by_meta."""

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
