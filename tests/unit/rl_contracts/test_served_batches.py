"""The RL workers' consumer loop (``rl_contracts.lost_rows.served_batches``) on a fake client, without Ray: the rollout,
reward and agent workers all read their step's batches through it, so a storage unit that died and came back empty
costs each of them one batch handed back, never the step."""

from __future__ import annotations

import pytest

from rl_contracts.lost_rows import served_batches, write_or_release
from rl_contracts.queue_clock import QueueClock
from transfer_queue.errors import RowsLost, StorageUnavailable


class Meta:
    def __init__(self, rows: list[int], fields: list[str]):
        self.rows, self.fields, self.extra = rows, fields, {}

    def __len__(self) -> int:
        return len(self.rows)

    def select_fields(self, fields: list[str]) -> Meta:
        return Meta(self.rows, fields)


class Client:
    """Serves the given batches then an empty one; reads of ``lost`` rows raise ``RowsLost``."""

    def __init__(self, batches: list[list[int]], lost: set[int] = frozenset(), put_fails: int = 0):
        self.batches, self.lost, self.put_fails = list(batches), lost, put_fails
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
        self.puts.append(metadata.rows)


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
    assert write_or_release(client, {"x": 1}, Meta([0, 1], ["x"])) is False
    assert client.released == [[0, 1]] and client.puts == []
    client = Client([], put_fails=2)
    assert write_or_release(client, {"x": 1}, Meta([0, 1], ["x"])) is True
    assert client.puts == [[0, 1]]
    client = Client([], put_fails=10)
    with pytest.raises(StorageUnavailable, match="unit 0 died mid-put"):
        write_or_release(client, {"x": 1}, Meta([0, 1], ["x"]))
