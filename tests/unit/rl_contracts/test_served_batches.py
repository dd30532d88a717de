"""The RL workers' consumer loop (``rl_contracts.lost_rows.served_batches``) on a fake client, without Ray: the rollout,
reward and agent workers all read their step's batches through it, so a storage unit that died and came back empty
costs each of them one batch handed back, never the step."""

from __future__ import annotations

import pytest
import torch

from rl_contracts.lost_rows import rows_at, served_batches, write_or_release
from rl_contracts.queue_clock import QueueClock
from rl_contracts.rows import float_rows_of, jagged, rows_of
from transfer_queue.errors import FieldAlreadyProduced, RowsLost, ServerGone, StorageUnavailable


class Meta:
    def __init__(self, rows: list[int], fields: list[str]):
        self.rows, self.fields, self.extra = rows, fields, {}

    def __len__(self) -> int:
        return len(self.rows)

    def select_fields(self, fields: list[str]) -> Meta:
        return Meta(self.rows, fields)

    def select_samples(self, positions: list[int]) -> Meta:
        return Meta([self.rows[i] for i in positions], self.fields)


class Client:
    """Serves the given batches then an empty one; reads of ``lost`` rows raise ``RowsLost``."""

    def __init__(
        self,
        batches: list[list[int]],
        lost: set[int] = frozenset(),
        put_fails: int = 0,
        produced: set[int] = frozenset(),
    ):
        self.batches, self.lost, self.put_fails, self.produced = list(batches), lost, put_fails, set(produced)
        self.acked: list[list[int]] = []
        self.get_meta_calls: list[tuple] = []
        self.read: list[tuple[list[int], list[str]]] = []
        self.released: list[list[int]] = []
        self.puts: list[list[int]] = []

    def get_meta(self, fields, rows, **kwargs):
        self.get_meta_calls.append((fields, rows, kwargs))
        return Meta(self.batches.pop(0) if self.batches else [], fields)

    def get_data(self, meta):
        self.read.append((meta.rows, meta.fields))
        if self.lost & set(meta.rows):
            raise RowsLost(f"rows {sorted(self.lost & set(meta.rows))} were lost")
        return {"rows": meta.rows}

    def release(self, meta):
        self.released.append(meta.rows)

    def put(self, fields, metadata):
        if self.put_fails:
            self.put_fails -= 1
            raise StorageUnavailable("unit 0 died mid-put")
        if self.lost & set(metadata.rows):
            raise RowsLost("lost before the write")
        if self.produced & set(metadata.rows):
            raise FieldAlreadyProduced(f"rows {sorted(self.produced & set(metadata.rows))} are already produced")
        self.produced |= set(metadata.rows)
        self.puts.append(metadata.rows)

    def ack(self, meta):
        self.acked.append(meta.rows)


def test_a_batch_with_lost_rows_is_handed_back_and_the_others_are_served_until_the_step_is_empty():
    client = Client([[0, 1], [2, 3], [4, 5]], lost={3})
    clock = QueueClock()
    served = list(served_batches(client, clock, ("a", "b"), 2, step=7, task_name="reward", timeout=3.0, read=["a"]))
    assert [meta.rows for meta, _ in served] == [[0, 1], [4, 5]]
    assert [data for _, data in served] == [{"rows": [0, 1]}, {"rows": [4, 5]}]
    assert client.released == [[2, 3]]  # the live row 2 is served again, the lost row 3 comes back as a new row
    assert client.read == [([0, 1], ["a"]), ([2, 3], ["a"]), ([4, 5], ["a"])]  # only the fields asked for
    assert len(client.get_meta_calls) == 4  # three batches and the empty answer that ends the step
    fields, rows, kwargs = client.get_meta_calls[0]
    assert (fields, rows) == (["a", "b"], 2)
    assert kwargs == {"global_step": 7, "task_name": "reward", "get_n_samples": True, "timeout": 3.0}
    assert clock.queue_s > 0


def test_without_read_the_whole_batch_is_read():
    client = Client([[0, 1]])
    served = list(served_batches(client, QueueClock(), ["a"], 2, step=0, task_name="rollout", timeout=1.0))
    assert [meta.rows for meta, _ in served] == [[0, 1]] and client.read == [([0, 1], ["a"])]


def test_a_write_to_lost_rows_hands_them_back_and_a_write_to_a_unit_that_died_mid_put_is_tried_again(monkeypatch):
    monkeypatch.setattr("rl_contracts.lost_rows.DOWN_PAUSE_S", 0.0)
    client = Client([], lost={1})
    assert write_or_release(client, {"x": [1, 2]}, Meta([0, 1], ["x"])) == 0
    assert client.released == [[0, 1]] and client.puts == [] and client.acked == []
    client = Client([], put_fails=2)
    assert write_or_release(client, {"x": [1, 2]}, Meta([0, 1], ["x"])) == 2
    assert client.puts == [[0, 1]] and client.acked == [[0, 1]]  # acknowledged once written
    client = Client([], put_fails=10)
    with pytest.raises(StorageUnavailable, match="unit 0 died mid-put"):
        write_or_release(client, {"x": 1}, Meta([0, 1], ["x"]))


def test_rows_served_again_after_a_dead_worker_wrote_them_are_acknowledged_and_the_others_written_group_by_group():
    # rows 2, 3 (one group) were written by a worker that died before its ack; they came back with a fresh group
    client = Client([], produced={2, 3})
    ids = jagged([[1], [2, 2], [3], [4, 4, 4]], torch.int64)
    fields = {"ids": ids, "v": torch.tensor([0, 1, 2, 3]), "s": list("abcd")}
    assert write_or_release(client, fields, Meta([0, 1, 2, 3], ["ids"]), group_size=2) == 2
    assert client.puts == [[0, 1]]  # the fresh group only: nothing is produced twice
    assert client.acked == [[0, 1, 2, 3]]  # all of them: none is served again
    everything_written = Client([], produced={0, 1})
    assert write_or_release(everything_written, {"x": [1, 2]}, Meta([0, 1], ["x"]), group_size=2) == 0
    assert everything_written.puts == [] and everything_written.acked == [[0, 1]]


class CommitLost(Client):
    """The controller dies under the first put's commit (ServerGone); ``landed``: that commit had made the rows
    visible (a journaled controller replays it), else it had not."""

    def __init__(self, landed: bool):
        super().__init__([])
        self.landed, self.died = landed, False

    def put(self, fields, metadata):
        if not self.died:
            self.died = True
            if self.landed:
                super().put(fields, metadata)
            raise ServerGone("the controller at tcp://127.0.0.1:1 did not answer (is it alive?)")
        super().put(fields, metadata)


@pytest.mark.parametrize("landed", [True, False])
def test_a_put_whose_commit_died_with_the_controller_is_made_again_and_produces_each_row_once(monkeypatch, landed):
    monkeypatch.setattr("rl_contracts.lost_rows.DOWN_PAUSE_S", 0.0)
    client = CommitLost(landed)
    written = write_or_release(client, {"x": [1, 2]}, Meta([0, 1], ["x"]), group_size=2)
    assert client.puts == [[0, 1]]  # written once: the second put of a commit that landed is refused
    assert written == (0 if landed else 2) and client.acked == [[0, 1]]


def test_rows_at_takes_the_same_rows_of_every_kind_of_field():
    fields = {
        "ids": jagged([[1], [2, 2], [3]], torch.int64),
        "lp": jagged([[0.5], [0.25, 0.75], []], torch.float32),
        "v": torch.tensor([7, 8, 9]),
        "s": ["a", "b", "c"],
    }
    out = rows_at(fields, [1, 2])
    assert rows_of(out["ids"]) == [[2, 2], [3]] and out["ids"].dtype == torch.int64
    assert float_rows_of(out["lp"]) == [[0.25, 0.75], []]
    assert out["v"].tolist() == [8, 9] and out["s"] == ["b", "c"]
