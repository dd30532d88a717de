"""StreamingDataset / StreamingDataLoader: a partition as a torch ``IterableDataset`` of this DP rank's batches.

Batches are yielded as ``(TensorDict, BatchMeta)`` as soon as they are ready, and the iteration ends at the end of
the stream (the partition closed, or its step full, and everything consumed). Every rank of a data-parallel world
iterates its own dataset with its own ``dp_rank``; round ``k`` of every rank is one DP round of the queue, so the
ranks share rows without overlap. With ``num_workers > 0``, worker ``w`` of every rank takes rounds
``w, w + W, ...`` and the DataLoader yields them in round order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from transfer_queue.client import TransferQueueClient, _partition, default_client_id
from transfer_queue.errors import InvalidRequest
from transfer_queue.metadata import BatchMeta
from transfer_queue.protocol import ControllerInfo


class StreamingDataset(IterableDataset):
    """This DP rank's batches of one partition, as they become ready.

    Args:
        data_fields: fields every row must have.
        batch_size: rows per DP rank per round.
        global_step / partition_id: the partition (exactly one).
        task_name: the consumer; every row is served once per task.
        dp_rank, dp_size: this rank and the DP world size (every rank must use the same ``batch_size``).
        micro_batch_size: yield each round's rows in micro-batches of this size (default: the whole share).
        controller_info: the queue to read (default: the one ``transfer_queue.init`` started on this cluster,
            looked up now).
        get_n_samples: whole GRPO groups only.
        timeout: seconds to wait for one round.
        device: where tensors are delivered.
    """

    def __init__(
        self,
        data_fields: Sequence[str],
        batch_size: int,
        global_step: int | None = None,
        partition_id: str | None = None,
        task_name: str = "default",
        dp_rank: int = 0,
        dp_size: int = 1,
        micro_batch_size: int | None = None,
        controller_info: ControllerInfo | None = None,
        get_n_samples: bool = False,
        timeout: float | None = None,
        device: str | torch.device | None = None,
    ):
        super().__init__()
        self.partition = _partition(global_step, partition_id)
        if not isinstance(dp_size, int) or dp_size < 1 or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise InvalidRequest(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank!r}, dp_size={dp_size!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidRequest(f"batch_size must be an int >= 1, got {batch_size!r}")
        if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
            raise InvalidRequest(f"micro_batch_size must be an int >= 1, got {micro_batch_size!r}")
        self.data_fields = list(data_fields)
        self.batch_size = batch_size
        self.task_name = task_name
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.micro_batch_size = micro_batch_size
        if controller_info is None:
            # Looked up here, in the process that builds the dataset: DataLoader workers are forked from it, and a
            # forked process cannot use Ray (the lookup there hangs).
            import ray

            from transfer_queue.runtime import get_controller

            controller_info = ray.get(get_controller().get_info.remote())
        self.controller_info = controller_info
        self.get_n_samples = get_n_samples
        self.timeout = timeout
        self.device = device
        self.epoch = 0  # passes over the stream so far: each pass's DP rounds are its own

    def _client(self) -> TransferQueueClient:
        return TransferQueueClient(f"{default_client_id()}-dataset-rank{self.dp_rank}", self.controller_info)

    def __iter__(self) -> Iterator[tuple[TensorDict, BatchMeta]]:
        worker = get_worker_info()
        worker_id, num_workers = (0, 1) if worker is None else (worker.id, worker.num_workers)
        if worker is None:  # iterated directly; StreamingDataLoader bumps the epoch before its workers copy us
            self.epoch += 1
        epoch = self.epoch
        client = self._client()
        key = self.partition
        step = {"global_step": key} if isinstance(key, int) else {"partition_id": key}
        try:
            for round_index in range(worker_id, 1 << 62, num_workers):
                meta = client.get_meta(
                    self.data_fields,
                    self.batch_size,
                    task_name=self.task_name,
                    sampler_params={
                        "dp_rank": self.dp_rank,
                        "dp_size": self.dp_size,
                        "dp_group_id": f"stream/{self.task_name}/{key}/e{epoch}/{round_index}",
                    },
                    get_n_samples=self.get_n_samples,
                    timeout=self.timeout,
                    **step,
                )
                if len(meta) == 0:
                    return
                pieces = meta.chunk(-(-len(meta) // self.micro_batch_size)) if self.micro_batch_size else [meta]
                for piece in pieces:
                    yield client.get_data(piece, device=self.device), piece
        finally:
            client.close()


def _identity(batch: Any) -> Any:
    return batch


class StreamingDataLoader(DataLoader):
    """A DataLoader over a :class:`StreamingDataset`, yielding ``(TensorDict, BatchMeta)`` tuples; ``num_workers``
    and ``prefetch_factor`` fetch rounds ahead in worker processes."""

    def __init__(
        self, dataset: StreamingDataset, num_workers: int = 0, prefetch_factor: int | None = None, **kwargs: Any
    ):
        if not isinstance(dataset, StreamingDataset):
            raise InvalidRequest(f"StreamingDataLoader needs a StreamingDataset, got {type(dataset).__name__}")
        super().__init__(
            dataset,
            batch_size=None,
            collate_fn=_identity,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            **kwargs,
        )

    def __iter__(self) -> Any:
        if self.num_workers > 0:  # workers copy the dataset as it is now: give this pass its own rounds
            assert isinstance(self.dataset, StreamingDataset)
            self.dataset.epoch += 1
        return super().__iter__()
