"""Module-level calls on the process's default client, as upstream TransferQueue's ``interface.py`` offers them.

``tq.kv_put(...)``, ``tq.kv_batch_put(...)``, ``tq.kv_batch_get(...)``, ``tq.kv_batch_get_by_meta(...)``,
``tq.kv_list(...)``, ``tq.kv_clear(...)`` and their ``async_`` forms act on one client per process: the one set
with :func:`set_default_client`, else a client of the queue running on this Ray cluster (made on first use).
A process that is not part of the Ray cluster sets its own: ``set_default_client(TransferQueueClient(client_id=...,
controller_info=ControllerInfo.from_json(text)))``.

>>> import transfer_queue as tq
>>> tq.kv_put("sample-1", "train", {"input_ids": torch.tensor([1, 2, 3])}, tag={"score": 0.9})  # doctest: +SKIP
>>> tq.kv_list()  # doctest: +SKIP
{'train': {'sample-1': {'score': 0.9}}}
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tensordict import TensorDict, TensorDictBase

from transfer_queue.client import AsyncTransferQueueClient, TransferQueueClient, default_client_id
from transfer_queue.client.channel import _closed_sessions
from transfer_queue.errors import InvalidRequest
from transfer_queue.metadata import BatchMeta
from transfer_queue.samplers import SamplerSpec, make_sampler

_defaults: dict[str, Any] = {}  # "sync" / "async" -> (pid, client)


def _usable(kind: str) -> Any | None:
    held = _defaults.get(kind)
    if held is None or held[0] != os.getpid():  # a forked child makes its own sockets
        return None
    client = held[1]
    inner = client._client if isinstance(client, TransferQueueClient) else client
    if inner._closed or client.controller_info.session_id in _closed_sessions:
        return None  # closed, or its queue was shut down: the next call finds the running one
    return client


def set_default_client(client: TransferQueueClient | AsyncTransferQueueClient) -> None:
    """Make ``client`` the one the module-level calls of this process use (a sync client also serves the async
    calls, through an async client on the same controller_info)."""
    if isinstance(client, TransferQueueClient):
        _defaults["sync"] = (os.getpid(), client)
        _defaults.pop("async", None)
    elif isinstance(client, AsyncTransferQueueClient):
        _defaults["async"] = (os.getpid(), client)
    else:
        raise InvalidRequest(f"set_default_client expects a transfer_queue client, got {type(client).__name__}")


def default_client() -> TransferQueueClient:
    """The sync client the module-level calls use (made from the running queue on first use)."""
    client = _usable("sync")
    if client is None:
        from transfer_queue.runtime import get_client

        client = get_client(f"{default_client_id()}-default")
        _defaults["sync"] = (os.getpid(), client)
    return client


def default_async_client() -> AsyncTransferQueueClient:
    """The async client the ``async_`` module-level calls use (same queue as :func:`default_client`)."""
    client = _usable("async")
    if client is None:
        info = default_client().controller_info
        client = AsyncTransferQueueClient(f"{default_client_id()}-default-async", info)
        _defaults["async"] = (os.getpid(), client)
    return client


def register_sampler(task_name: str, sampler: SamplerSpec) -> None:
    """Give ``task_name`` its own sampler on the running queue; a spec that is not a sampler raises
    ``InvalidSampler`` here, before anything is sent through Ray."""
    import ray

    from transfer_queue.runtime import get_controller

    if not isinstance(task_name, str) or not task_name:
        raise InvalidRequest(f"task_name must be a non-empty str, got {task_name!r}")
    make_sampler(sampler)  # raises InvalidSampler for anything else
    ray.get(get_controller().register_sampler.remote(task_name, sampler))


# ---- by key, sync -----------------------------------------------------------------------------------------------
def kv_put(
    key: str, partition_id: str, fields: TensorDictBase | dict[str, Any] | None = None, tag: dict | None = None
) -> BatchMeta:
    """Insert or update one key (see ``TransferQueueClient.kv_put``); ``fields=None`` updates its tag only."""
    return default_client().kv_put(key, partition_id, fields, tag)


def kv_batch_put(
    keys: Sequence[str],
    partition_id: str,
    fields: TensorDictBase | dict[str, Any] | None = None,
    tags: Sequence[dict | None] | None = None,
) -> BatchMeta:
    """Insert or update keys (see ``TransferQueueClient.kv_batch_put``)."""
    return default_client().kv_batch_put(keys, partition_id, fields, tags)


def kv_batch_get(
    keys: Sequence[str] | str, partition_id: str, select_fields: Sequence[str] | str | None = None
) -> TensorDict:
    """The rows of ``keys`` in their order (default fields: every field all of them have)."""
    return default_client().kv_batch_get(keys, partition_id, select_fields)


def kv_batch_get_by_meta(meta: BatchMeta, select_fields: Sequence[str] | str | None = None) -> TensorDict:
    """The rows of a kv put's meta, with every field their keys have (or ``select_fields``)."""
    return default_client().kv_batch_get_by_meta(meta, select_fields)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, dict]]:
    """``{partition_id: {key: tag}}`` for one partition used by key, or for all of them (upstream's shape); an
    unknown partition gives ``{}``."""
    return _listing(default_client().kv_list(partition_id, with_tags=True), partition_id)


def kv_clear(keys: Sequence[str] | str | None, partition_id: str) -> None:
    """Forget keys (``None``: the whole partition) and free their payload; unknown keys are ignored."""
    default_client().kv_clear(keys, partition_id)


# ---- by key, async ----------------------------------------------------------------------------------------------
async def async_kv_put(
    key: str, partition_id: str, fields: TensorDictBase | dict[str, Any] | None = None, tag: dict | None = None
) -> BatchMeta:
    return await default_async_client().kv_put(key, partition_id, fields, tag)


async def async_kv_batch_put(
    keys: Sequence[str],
    partition_id: str,
    fields: TensorDictBase | dict[str, Any] | None = None,
    tags: Sequence[dict | None] | None = None,
) -> BatchMeta:
    return await default_async_client().kv_batch_put(keys, partition_id, fields, tags)


async def async_kv_batch_get(
    keys: Sequence[str] | str, partition_id: str, select_fields: Sequence[str] | str | None = None
) -> TensorDict:
    return await default_async_client().kv_batch_get(keys, partition_id, select_fields)


async def async_kv_batch_get_by_meta(meta: BatchMeta, select_fields: Sequence[str] | str | None = None) -> TensorDict:
    return await default_async_client().kv_batch_get_by_meta(meta, select_fields)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, dict]]:
    return _listing(await default_async_client().kv_list(partition_id, with_tags=True), partition_id)


async def async_kv_clear(keys: Sequence[str] | str | None, partition_id: str) -> None:
    await default_async_client().kv_clear(keys, partition_id)


def _listing(answer: dict[str, Any], partition_id: str | None) -> dict[str, dict[str, dict]]:
    if partition_id is None:
        return answer
    return {partition_id: answer} if answer else {}
