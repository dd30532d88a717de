"""StreamingDataset / StreamingDataLoader against a live queue: every DP rank yields the same number of batches
when the stream ends on a short round (drop_last, or empty padding batches), and worker processes yield rounds in
order without holding a ready round's micro-batches back behind a later round."""

from __future__ import annotations

import queue as stdlib_queue
import threading
import time
from typing import Any

import pytest
from tensordict import TensorDict

from transfer_queue import StreamingDataLoader, StreamingDataset
from transfer_queue.errors import InvalidRequest


def put_rows(queue: Any, partition: str, start: int, count: int) -> None:
    texts = [f"row{start + i}" for i in range(count)]
    queue.client.put(TensorDict({"text": texts}, batch_size=[count]), partition_id=partition)


def dataset(queue: Any, partition: str, **kwargs: Any) -> StreamingDataset:
    return StreamingDataset(["text"], partition_id=partition, controller_info=queue.info, **kwargs)


def texts(batch: tuple[TensorDict, Any]) -> list[str]:
    data, meta = batch
    assert len(data) == len(meta)
    return data.get("text").tolist() if len(meta) else []


def test_a_short_last_round_is_dropped_on_every_rank(queue: Any) -> None:
    """11 rows, 4 ranks x 2: the last round has 3 rows, split [1, 1, 0, 1]; no rank yields a batch of it."""
    partition = queue.partition("short")
    put_rows(queue, partition, 0, 11)
    queue.client.close_partition(partition_id=partition)
    per_rank = [
        [texts(b) for b in dataset(queue, partition, batch_size=2, task_name="t", dp_rank=r, dp_size=4)]
        for r in range(4)
    ]
    assert per_rank == [[[f"row{2 * r}", f"row{2 * r + 1}"]] for r in range(4)]


def test_without_drop_last_every_rank_yields_the_short_round_padded_with_empty_batches(queue: Any) -> None:
    partition = queue.partition("pad")
    put_rows(queue, partition, 0, 11)
    queue.client.close_partition(partition_id=partition)
    per_rank = [
        [
            texts(b)
            for b in dataset(
                queue, partition, batch_size=2, task_name="t", dp_rank=r, dp_size=4, micro_batch_size=1, drop_last=False
            )
        ]
        for r in range(4)
    ]
    # Full round: two micro-batches of one row each; the short round [1, 1, 0, 1]: one micro-batch per rank,
    # rank 2's empty (zero rows).
    assert [len(batches) for batches in per_rank] == [3, 3, 3, 3]
    assert [batches[2] for batches in per_rank] == [["row8"], ["row9"], [], ["row10"]]
    assert sorted(s for batches in per_rank for b in batches for s in b) == sorted(f"row{i}" for i in range(11))


def test_drop_last_must_be_a_bool(queue: Any) -> None:
    with pytest.raises(InvalidRequest, match="drop_last must be a bool, got 'no'"):
        dataset(queue, queue.partition(), batch_size=2, drop_last="no")


def test_persistent_workers_are_refused(queue: Any) -> None:
    with pytest.raises(InvalidRequest, match="does not keep workers between passes"):
        StreamingDataLoader(dataset(queue, queue.partition(), batch_size=2), num_workers=1, persistent_workers=True)


@pytest.mark.timeout(120)
def test_workers_yield_rounds_in_order_and_never_hold_a_ready_round_back(queue: Any) -> None:
    """Two workers, rounds of 4 rows in micro-batches of 2: round 0's rows are put, round 1's only once round 0's
    both micro-batches arrived (before the fix the second waited behind round 1). Rows come in put order."""
    partition = queue.partition("order")
    loader = StreamingDataLoader(
        dataset(queue, partition, batch_size=4, task_name="t", micro_batch_size=2, timeout=60.0), num_workers=2
    )
    got: stdlib_queue.Queue[Any] = stdlib_queue.Queue()

    def consume() -> None:
        try:
            for batch in loader:
                got.put(texts(batch))
        except Exception as exc:  # reported to the test thread
            got.put(exc)
        got.put(None)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    put_rows(queue, partition, 0, 4)
    first = [got.get(timeout=45), got.get(timeout=20)]
    assert first == [["row0", "row1"], ["row2", "row3"]]
    time.sleep(0.2)
    assert got.empty()
    for start in range(4, 16, 4):
        put_rows(queue, partition, start, 4)
    queue.client.close_partition(partition_id=partition)
    rest = []
    while (item := got.get(timeout=60)) is not None:
        rest.append(item)
    thread.join(timeout=10)
    assert rest == [[f"row{i}", f"row{i + 1}"] for i in range(4, 16, 2)]


# Held by the test while the loader's workers start: a lock some thread of the loader's process holds at the fork.
HELD_AT_FORK = threading.Lock()


class LockingDataset(StreamingDataset):
    """Takes ``HELD_AT_FORK`` where a worker starts, as a worker takes the locks of the libraries it calls."""

    def _client(self) -> Any:
        with HELD_AT_FORK:
            return super()._client()


@pytest.mark.timeout(120)
def test_workers_inherit_no_lock_the_loaders_process_held(queue: Any) -> None:
    """A worker forked while the loader's process held a lock (Ray's, ZeroMQ's and torch's threads hold theirs at any
    moment) waited on it forever: CI saw a worker hang. Workers start from a forkserver, with the locks unheld."""
    partition = queue.partition("held")
    put_rows(queue, partition, 0, 4)
    queue.client.close_partition(partition_id=partition)
    loader = StreamingDataLoader(
        LockingDataset(["text"], 2, partition_id=partition, task_name="t", controller_info=queue.info),
        num_workers=1,
        timeout=60,  # a hung worker fails the test with the DataLoader's timeout, not pytest's
    )
    with HELD_AT_FORK:
        assert [s for batch in loader for s in texts(batch)] == ["row0", "row1", "row2", "row3"]
    assert loader.multiprocessing_context.get_start_method() == "forkserver"


def test_a_context_the_caller_names_is_kept(queue: Any) -> None:
    loader = StreamingDataLoader(
        dataset(queue, queue.partition(), batch_size=2), num_workers=1, multiprocessing_context="spawn"
    )
    assert loader.multiprocessing_context.get_start_method() == "spawn"
