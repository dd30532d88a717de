"""transfer_queue: a streaming data plane for RL post-training on Ray.

A controller actor tracks which fields of which rows are produced and which tasks consumed them; storage actors
hold the tensors; clients ``put``, ``get_meta``, ``get_data`` and ``clear`` with zero-copy frames (a Unix socket
on the same host, ZeroMQ across hosts).

>>> import transfer_queue as tq
>>> client = tq.init(global_batch_size=8, num_n_samples=4, sampler=tq.GRPOSampler(4))  # doctest: +SKIP

Names are imported on first use: the controller actor's process imports ``transfer_queue.controller.actor`` (and so
this package) and never needs torch, which the client side pulls in; importing it there costs seconds per actor.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transfer_queue import errors, interop
    from transfer_queue.client import AsyncTransferQueueClient, TransferQueueClient
    from transfer_queue.config import QueueConfig
    from transfer_queue.dataloader import StreamingDataLoader, StreamingDataset
    from transfer_queue.interface import (
        async_kv_batch_get,
        async_kv_batch_get_by_meta,
        async_kv_batch_put,
        async_kv_clear,
        async_kv_list,
        async_kv_put,
        default_client,
        kv_batch_get,
        kv_batch_get_by_meta,
        kv_batch_put,
        kv_clear,
        kv_list,
        kv_put,
        register_sampler,
        set_default_client,
    )
    from transfer_queue.metadata import BatchMeta, FieldSchema
    from transfer_queue.runtime import TransferQueueController, get_client, get_controller, init, shutdown
    from transfer_queue.samplers import (
        BaseSampler,
        DPSampler,
        GroupSampler,
        GRPOSampler,
        SeqlenBalancedSampler,
        SequentialSampler,
    )
    from transfer_queue.storage.unit import StorageUnit
    from transfer_queue.wire.protocol import ControllerInfo

__version__ = "0.1.0"

_WHERE = {
    # Starting and finding a queue
    "init": "transfer_queue.runtime",
    "shutdown": "transfer_queue.runtime",
    "get_controller": "transfer_queue.runtime",
    "get_client": "transfer_queue.runtime",
    "QueueConfig": "transfer_queue.config",
    "errors": "transfer_queue.errors",
    "register_sampler": "transfer_queue.interface",
    # Upstream TransferQueue's module-level calls, on this process's default client
    "set_default_client": "transfer_queue.interface",
    "default_client": "transfer_queue.interface",
    "kv_put": "transfer_queue.interface",
    "kv_batch_put": "transfer_queue.interface",
    "kv_batch_get": "transfer_queue.interface",
    "kv_batch_get_by_meta": "transfer_queue.interface",
    "kv_list": "transfer_queue.interface",
    "kv_clear": "transfer_queue.interface",
    "async_kv_put": "transfer_queue.interface",
    "async_kv_batch_put": "transfer_queue.interface",
    "async_kv_batch_get": "transfer_queue.interface",
    "async_kv_batch_get_by_meta": "transfer_queue.interface",
    "async_kv_list": "transfer_queue.interface",
    "async_kv_clear": "transfer_queue.interface",
    # verl's DataProto in and out (from_dataproto / to_dataproto)
    "interop": "transfer_queue.interop",
    # Clients and what they exchange
    "TransferQueueClient": "transfer_queue.client",
    "AsyncTransferQueueClient": "transfer_queue.client",
    "BatchMeta": "transfer_queue.metadata",
    "FieldSchema": "transfer_queue.metadata",
    "ControllerInfo": "transfer_queue.wire.protocol",
    # Streaming into torch
    "StreamingDataset": "transfer_queue.dataloader",
    "StreamingDataLoader": "transfer_queue.dataloader",
    # Samplers
    "BaseSampler": "transfer_queue.samplers",
    "SequentialSampler": "transfer_queue.samplers",
    "GRPOSampler": "transfer_queue.samplers",
    "GroupSampler": "transfer_queue.samplers",
    "DPSampler": "transfer_queue.samplers",
    "SeqlenBalancedSampler": "transfer_queue.samplers",
    # The actors, for wiring them by hand
    "TransferQueueController": "transfer_queue.runtime",
    "StorageUnit": "transfer_queue.storage.unit",
}

__all__ = [
    "AsyncTransferQueueClient",
    "BaseSampler",
    "BatchMeta",
    "ControllerInfo",
    "DPSampler",
    "FieldSchema",
    "GRPOSampler",
    "GroupSampler",
    "QueueConfig",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "StorageUnit",
    "StreamingDataLoader",
    "StreamingDataset",
    "TransferQueueClient",
    "TransferQueueController",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "default_client",
    "errors",
    "get_client",
    "get_controller",
    "init",
    "interop",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "register_sampler",
    "set_default_client",
    "shutdown",
]
assert sorted(__all__) == sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'transfer_queue' has no attribute {name!r}")
    value = importlib.import_module(module)
    if name != module.rsplit(".", 1)[-1]:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
