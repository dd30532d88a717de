"""``TransferQueueClient``: the blocking face of :class:`~transfer_queue.client.AsyncTransferQueueClient`, one line
a method."""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from transfer_queue.client.async_client import AsyncTransferQueueClient
from transfer_queue.client.lease_keeper import LeaseHeartbeat, beat_schedule
from transfer_queue.config import QueueConfig
from transfer_queue.errors import (
    InvalidRequest,
)
from transfer_queue.metadata import BatchMeta
from transfer_queue.wire import protocol as p
from transfer_queue.wire.transport import BlockingTransport, run_sync

P = ParamSpec("P")
R = TypeVar("R")


def _sync(
    method: Callable[Concatenate[AsyncTransferQueueClient, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[TransferQueueClient, P], R]:
    @functools.wraps(method)
    def call(self: TransferQueueClient, *args: P.args, **kwargs: P.kwargs) -> R:
        return run_sync(method(self._client, *args, **kwargs))

    return call


class TransferQueueClient:
    """The sync client: the same methods as :class:`AsyncTransferQueueClient`, blocking. It needs no event loop
    and also works when called from inside a running one. Safe to share between threads (each thread uses its own
    sockets; a thread that ends hands them back to the client, which keeps its connections, and so its leases, until
    :meth:`close`).

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
        shm = QueueConfig.from_dict(controller_info.config).shared_memory_bytes
        transport = BlockingTransport(spin_seconds, controller_info.secret, force_tcp, shm)
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

    def keep_leased(
        self, batch_meta: BatchMeta, every: float | None = None, seconds: float | None = None
    ) -> LeaseHeartbeat:
        """A context manager that keeps the rows of ``batch_meta`` leased while its block runs (a thread calls
        :meth:`extend_lease` every ``every`` seconds); see :meth:`AsyncTransferQueueClient.keep_leased`.

        >>> with client.keep_leased(meta):  # doctest: +SKIP
        ...     train_on(meta)  # longer than lease_s
        >>> client.ack(meta)  # doctest: +SKIP
        """
        return LeaseHeartbeat(self.extend_lease, batch_meta, *beat_schedule(self.config, every, seconds))

    put = _sync(AsyncTransferQueueClient.put)
    get_meta = _sync(AsyncTransferQueueClient.get_meta)
    get_data = _sync(AsyncTransferQueueClient.get_data)
    release = _sync(AsyncTransferQueueClient.release)
    ack = _sync(AsyncTransferQueueClient.ack)
    extend_lease = _sync(AsyncTransferQueueClient.extend_lease)
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
