"""StreamingDataset / StreamingDataLoader: a partition as a torch ``IterableDataset`` of this DP rank's batches.

Batches are yielded as ``(TensorDict, BatchMeta)`` as soon as they are ready, and the iteration ends at the end of
the stream (the partition closed, or its step full, and everything consumed). Every rank of a data-parallel world
iterates its own dataset with its own ``dp_rank``; round ``k`` of every rank is one DP round of the queue, so the
ranks share rows without overlap, and every rank yields the same number of batches (a collective in the training
step never waits for a rank that stopped early): the last round, when the stream ends short of a full one, is
dropped on every rank (``drop_last=True``: every rank acknowledges its share of it, so its rows are not served to the
task again, as a consumer group commits what it skips) or yielded by every rank with empty batches where a rank's
share has no rows (``drop_last=False``).

With ``num_workers > 0`` (:class:`StreamingDataLoader`), worker ``w`` takes rounds ``w, w + W, ...``; the workers
ask the queue for their rounds strictly in round order (a turn shared between them), fetch the data in parallel,
and hand each round over whole, so the loader yields batches in round order and a round's micro-batches are never
held back behind a later round that is still waiting for rows. The workers are started by a ``forkserver`` (not
forked from the loader's process, whose Ray, ZeroMQ and torch threads may hold locks at the fork that the child then
waits on forever); like ``spawn``, that needs the dataset to be picklable and a script's top level guarded by
``if __name__ == "__main__":``. Pass ``multiprocessing_context="fork"`` to fork anyway.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from transfer_queue.client import TransferQueueClient, default_client_id
from transfer_queue.client.channel import _partition
from transfer_queue.errors import InvalidRequest, NotLeased, StaleBatchMeta
from transfer_queue.metadata import BatchMeta
from transfer_queue.wire.protocol import ControllerInfo

logger = logging.getLogger(__name__)


class RoundTurns:
    """Whose turn it is to ask the queue for a round, shared by the worker processes of one pass: the worker of
    round ``r`` asks only once round ``r - 1`` was asked (and answered), so the rounds take rows in round order.

    Created in the loader's process before its workers start (they inherit it, fork or spawn alike)."""

    def __init__(self, context: Any = None):
        ctx = context if context is not None else multiprocessing.get_context()
        self._next = ctx.Value("q", 0, lock=False)
        self._changed = ctx.Condition()

    @contextmanager
    def turn(self, round_index: int) -> Iterator[None]:
        """Wait for round ``round_index``'s turn, and pass it on when the block ends (also when it raises)."""
        with self._changed:
            while self._next.value < round_index:
                self._changed.wait(timeout=1.0)
        try:
            yield
        finally:
            with self._changed:
                self._next.value = max(self._next.value, round_index + 1)
                self._changed.notify_all()


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
        drop_last: what happens to the last round when the stream ends short of ``dp_size * batch_size`` rows
            (its shares are uneven, some may be empty). ``True`` (default): every rank drops it, so every rank
            yields only full rounds; each rank acknowledges its dropped share, so its rows count as served to the
            task (as ``torch``'s ``drop_last`` drops them for the epoch): they are not served to the task again when
            the round's lease runs out, only after ``reset_consumption`` (a new pass over the partition).
            ``False``: every rank yields it as ``ceil(largest share / micro_batch_size)`` batches (one without
            micro-batches), padding with batches of **zero rows** where its own share runs out; a training step
            must then accept an empty batch (weight its loss by the rows it has, e.g. sum / global row count).
            Either way every rank yields the same number of batches.
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
        drop_last: bool = True,
    ):
        super().__init__()
        self.partition = _partition(global_step, partition_id)
        if not isinstance(dp_size, int) or dp_size < 1 or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise InvalidRequest(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank!r}, dp_size={dp_size!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidRequest(f"batch_size must be an int >= 1, got {batch_size!r}")
        if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
            raise InvalidRequest(f"micro_batch_size must be an int >= 1, got {micro_batch_size!r}")
        if not isinstance(drop_last, bool):
            raise InvalidRequest(f"drop_last must be a bool, got {drop_last!r}")
        self.data_fields = list(data_fields)
        self.batch_size = batch_size
        self.task_name = task_name
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.micro_batch_size = micro_batch_size
        self.drop_last = drop_last
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
        self.turns: RoundTurns | None = None  # set by StreamingDataLoader for its workers: rounds asked in order

    def _client(self) -> TransferQueueClient:
        return TransferQueueClient(f"{default_client_id()}-dataset-rank{self.dp_rank}", self.controller_info)

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        worker_id, num_workers = (0, 1) if worker is None else (worker.id, worker.num_workers)
        if worker is None:  # iterated directly; StreamingDataLoader bumps the epoch before its workers copy us
            self.epoch += 1
        client = self._client()
        try:
            for round_index in range(worker_id, 1 << 62, num_workers):
                if self.turns is None:
                    meta = self._round_meta(client, round_index)
                else:
                    with self.turns.turn(round_index):
                        meta = self._round_meta(client, round_index)
                pieces = self._pieces(meta)
                if not pieces:  # the end of the stream (or its short last round, dropped on every rank)
                    self._drop(client, meta)
                    return
                batches = [(client.get_data(piece, device=self.device), piece) for piece in pieces]
                if self.turns is not None:  # StreamingDataLoader's worker: the whole round is one item
                    yield batches
                else:
                    yield from batches
        finally:
            client.close()

    def _round_meta(self, client: TransferQueueClient, round_index: int) -> BatchMeta:
        key = self.partition
        step = {"global_step": key} if isinstance(key, int) else {"partition_id": key}
        return client.get_meta(
            self.data_fields,
            self.batch_size,
            task_name=self.task_name,
            sampler_params={
                "dp_rank": self.dp_rank,
                "dp_size": self.dp_size,
                "dp_group_id": f"stream/{self.task_name}/{self.partition}/e{self.epoch}/{round_index}",
            },
            get_n_samples=self.get_n_samples,
            timeout=self.timeout,
            **step,
        )

    def _drop(self, client: TransferQueueClient, meta: BatchMeta) -> None:
        """Acknowledge this rank's share of a round dropped by ``drop_last``: its rows count as served to the task,
        so they are not served to it again when the round's lease runs out (only after ``reset_consumption``)."""
        if not len(meta):
            return
        try:
            client.ack(meta)
        except (NotLeased, StaleBatchMeta) as exc:  # the round's lease ran out first, or the partition was cleared
            logger.warning("the %d rows of a round dropped by drop_last were not acknowledged: %s", len(meta), exc)

    def _pieces(self, meta: BatchMeta) -> list[BatchMeta]:
        """This rank's batches of one round: as many as every other rank yields for it (none: the stream ended)."""
        round_rows = meta.extra.get("round_rows", len(meta))
        if round_rows == 0:
            return []
        short = round_rows < self.dp_size * self.batch_size
        if short and self.drop_last:
            return []
        largest = meta.extra.get("round_max_share", len(meta)) if short else max(len(meta), self.batch_size)
        count = -(-largest // self.micro_batch_size) if self.micro_batch_size else 1
        if not len(meta):
            return [meta] * count
        pieces = meta.chunk(-(-len(meta) // self.micro_batch_size)) if self.micro_batch_size else [meta]
        return pieces + [meta.select_samples([])] * (count - len(pieces))


def _identity(batch: Any) -> Any:
    return batch


def _flatten(rounds: Iterator[list[Any]], turns: RoundTurns) -> Iterator[Any]:
    """The batches of the workers' rounds, in order. ``turns`` stays referenced (in this frame) while the pass lasts:
    a worker that is not forked opens its semaphores by name, and they are unlinked once this process drops them."""
    for batches in rounds:
        yield from batches


def worker_context() -> multiprocessing.context.BaseContext:
    """Where :class:`StreamingDataLoader` starts its workers by default: a ``forkserver`` that has imported this
    module (and so torch) once, so a worker starts in milliseconds and inherits none of the loader's threads."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])  # takes effect when the server starts (once per process)
    return context


class StreamingDataLoader(DataLoader):
    """A DataLoader over a :class:`StreamingDataset`, yielding ``(TensorDict, BatchMeta)`` tuples; ``num_workers``
    and ``prefetch_factor`` fetch rounds ahead in worker processes, and batches still come in round order.

    The workers start from a ``forkserver`` unless ``multiprocessing_context`` says otherwise (see the module's
    docstring): a worker forked from a process that runs Ray and ZeroMQ threads can wait forever on a lock one of
    them held at the fork."""

    def __init__(
        self, dataset: StreamingDataset, num_workers: int = 0, prefetch_factor: int | None = None, **kwargs: Any
    ):
        if not isinstance(dataset, StreamingDataset):
            raise InvalidRequest(f"StreamingDataLoader needs a StreamingDataset, got {type(dataset).__name__}")
        if kwargs.get("persistent_workers"):
            raise InvalidRequest(
                "StreamingDataLoader does not keep workers between passes (persistent_workers=True): every pass "
                "takes new DP rounds, which the workers learn when they start"
            )
        if num_workers > 0 and kwargs.get("multiprocessing_context") is None:
            kwargs["multiprocessing_context"] = worker_context()
        super().__init__(
            dataset,
            batch_size=None,
            collate_fn=_identity,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            **kwargs,
        )

    def __iter__(self) -> Any:
        if self.num_workers == 0:
            return super().__iter__()
        # Workers copy the dataset as it is now: give this pass its own rounds, and one turn for its workers.
        assert isinstance(self.dataset, StreamingDataset)
        self.dataset.epoch += 1
        turns = self.dataset.turns = RoundTurns(self.multiprocessing_context)
        try:
            rounds = super().__iter__()
        finally:
            self.dataset.turns = None  # the workers have their copy; a direct iteration must not wait on it
        return _flatten(rounds, turns)
