"""The client side of the queue: :class:`AsyncTransferQueueClient` and its sync facade :class:`TransferQueueClient`."""

from transfer_queue.client.async_client import AsyncTransferQueueClient
from transfer_queue.client.channel import mark_queue_closed
from transfer_queue.client.sync import TransferQueueClient, default_client_id

__all__ = ["AsyncTransferQueueClient", "TransferQueueClient", "default_client_id", "mark_queue_closed"]
