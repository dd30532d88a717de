"""StreamingDataset's rounds against a QueueState on a fake clock: the dataset's client is a stand-in that speaks
the protocol to the harness of tests/unit/conftest.py (get_meta, get_data's acknowledgement, ack), no Ray."""

from __future__ import annotations

from typing import Any

from transfer_queue.dataloader import StreamingDataset
from transfer_queue.metadata import BatchMeta
from transfer_queue.state.partition_status import row_state_counts
from transfer_queue.wire import protocol as p


class HarnessClient:
    """What StreamingDataset calls on its client, answered by a QueueHarness (each rank its own owner)."""

    def __init__(self, q: Any, owner: str):
        self.q, self.owner = q, owner

    def get_meta(self, fields, batch_size, *, task_name, sampler_params, get_n_samples, timeout, partition_id):
        request = p.GetMeta(partition_id, list(fields), batch_size, task_name, sampler_params, get_n_samples,
                            timeout or 10.0, None, self.owner)  # fmt: skip
        return self.q.ok(request).to_meta()

    def _ack(self, meta: BatchMeta, explicit: bool) -> Any:
        indexes = p.pack_indexes(meta.global_indexes)
        group = meta.extra.get("dp_group_id")
        return self.q.ok(p.Ack(meta.partition_uid, meta.task_name, indexes, self.owner, explicit, dp_group_id=group))

    def get_data(self, meta: BatchMeta, device: Any = None) -> list[int]:
        self._ack(meta, explicit=False)  # as the client's get_data acknowledges
        return meta.global_indexes.tolist()

    def ack(self, meta: BatchMeta) -> None:
        self._ack(meta, explicit=True)

    def close(self) -> None:
        pass


def rank_dataset(q: Any, dp_rank: int, **kwargs: Any) -> StreamingDataset:
    dataset = StreamingDataset(["x"], 2, partition_id="s", task_name="t", dp_rank=dp_rank, dp_size=4,
                               controller_info=object(), **kwargs)  # fmt: skip
    dataset._client = lambda: HarnessClient(q, f"rank{dp_rank}")
    return dataset


def test_the_rows_of_a_round_dropped_by_drop_last_are_never_served_to_the_task_again(make_queue):
    """11 rows, 4 ranks x 2: round 0 takes 8, the short last round 3 ([1, 1, 0, 1]); every rank drops it."""
    q = make_queue(lease_s=5.0)
    q.put("s", 11)
    q.ok(p.ClosePartition("s"))
    per_rank = [[rows for rows, _ in rank_dataset(q, r)] for r in range(4)]
    assert per_rank == [[[2 * r, 2 * r + 1]] for r in range(4)]
    q.advance(5.0)  # past the dropped round's lease
    counts = row_state_counts(q.state.partitions["s"], "t")
    assert counts == {"ready": 0, "leased": 0, "acknowledged": 11, "dead_lettered": 0}
    assert q.get("s", ["x"], 4, "t").global_indexes.tolist() == []  # the end of the stream for the task
