"""transfer_queue: a streaming data plane for RL post-training on Ray.

A controller actor tracks which fields of which rows are produced and which tasks consumed them; storage actors
hold the tensors; clients ``put``, ``get_meta``, ``get_data`` and ``clear`` over ZeroMQ with zero-copy frames.

>>> import transfer_queue as tq
>>> client = tq.init(global_batch_size=8, num_n_samples=4, sampler=tq.GRPOSampler(4))  # doctest: +SKIP
"""

# Starting and finding a queue
from transfer_queue import errors

# Clients and what they exchange
from transfer_queue.client import AsyncTransferQueueClient, TransferQueueClient
from transfer_queue.config import QueueConfig

# The actors, for wiring them by hand
from transfer_queue.controller import TransferQueueController

# Streaming into torch
from transfer_queue.dataloader import StreamingDataLoader, StreamingDataset
from transfer_queue.metadata import BatchMeta, FieldSchema
from transfer_queue.protocol import ControllerInfo
from transfer_queue.runtime import get_client, get_controller, init, shutdown

# Samplers
from transfer_queue.samplers import (
    BaseSampler,
    DPSampler,
    GRPOSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
)
from transfer_queue.storage import StorageUnit

__version__ = "0.1.0"

__all__ = [
    "AsyncTransferQueueClient",
    "BaseSampler",
    "BatchMeta",
    "ControllerInfo",
    "DPSampler",
    "FieldSchema",
    "GRPOSampler",
    "QueueConfig",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "StorageUnit",
    "StreamingDataLoader",
    "StreamingDataset",
    "TransferQueueClient",
    "TransferQueueController",
    "errors",
    "get_client",
    "get_controller",
    "init",
    "shutdown",
]
