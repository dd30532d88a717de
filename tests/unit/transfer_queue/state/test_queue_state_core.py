"""QueueState edge paths of issue 8 section 2: abandoned puts (4), automatic DP rounds of TP peers (6), idempotent
commits (13) and row lengths of overwritten keys (17). Driven without Ray through ``handle`` on a fake clock (see
tests/unit/conftest.py); a connection is any hashable ``peer``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from transfer_queue.errors import InvalidRequest, PutExpired, SamplerError
from transfer_queue.metadata import FieldSchema
from transfer_queue.samplers import DPSampler
from transfer_queue.wire import protocol as p

F32 = FieldSchema("dense", "float32", ())
X = {"x": F32}


class Reply:
    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.calls = 0

    @property
    def done(self) -> bool:
        return self.calls > 0

    def result(self) -> Any:
        assert self.calls == 1, f"expected one answer, got {self.calls}"
        if self.error is not None:
            raise self.error
        return self.value


def send(q, request: Any, peer: Any = None) -> Reply:
    """``q.send`` from connection ``peer``."""
    reply = Reply()

    def respond(value: Any, error: BaseException | None) -> None:
        reply.value, reply.error = value, error
        reply.calls += 1

    q.table.handle(request, respond, peer)
    return reply


def indexes(meta) -> list[int]:
    return meta.global_indexes.tolist()


# ---- defect 4: reservations of dead producers ------------------------------------------------------------------
def test_a_reservation_lives_at_most_max_reservation_s_plus_grace_whatever_the_timeout(make_queue):
    q = make_queue(max_reservation_s=10.0, put_grace=2.0)
    reservation = q.reserve(0, 4, X, timeout=1e6)
    assert q.state.bytes_held == 16
    q.advance(11.9)
    assert reservation.put_id in q.state.open_puts
    q.advance(0.2)
    assert not q.state.open_puts and q.state.bytes_held == 0
    with pytest.raises(PutExpired, match=f"put {reservation.put_id} expired"):
        q.commit(reservation)
    assert indexes(q.put(0, 4, X)) == [0, 1, 2, 3]  # the rows it held are free again


def test_the_open_puts_of_a_closed_connection_are_aborted_after_the_disconnect_grace(make_queue):
    q = make_queue(disconnect_grace=1.0)
    dead = send(q, q.reserve_request(0, 2, X, timeout=1e5), peer="producer-a").result()
    alive = send(q, q.reserve_request(0, 2, X, timeout=1e5), peer="producer-b").result()
    q.state.on_disconnect("producer-a")
    q.advance(0.5)
    assert dead.put_id in q.state.open_puts  # it may still commit over a new connection
    q.advance(0.6)
    assert list(q.state.open_puts) == [alive.put_id]
    assert q.state.bytes_held == 8
    with pytest.raises(PutExpired):
        q.commit(dead)
    assert indexes(q.commit(alive)) == [2, 3]
    assert indexes(q.put(0, 2, X)) == [0, 1]  # the dead producer's rows are taken by the next put


def test_a_connection_that_closes_may_still_commit_within_the_grace(make_queue):
    q = make_queue(disconnect_grace=5.0)
    reservation = send(q, q.reserve_request(0, 4, X), peer="p").result()
    q.state.on_disconnect("p")
    q.advance(1.0)
    assert indexes(q.commit(reservation)) == [0, 1, 2, 3]


def test_a_waiting_put_of_a_closed_connection_is_dropped(make_queue):
    q = make_queue(num_global_batch=1)
    q.put(0, 4, X)
    waiting = send(q, q.reserve_request(1, 4, X), peer="gone")
    assert not waiting.done
    q.state.on_disconnect("gone")
    q.clear(0)
    assert not q.state.open_puts and not q.state.putters and q.ok(p.ListPartitions()) == []


# ---- defect 6: automatic DP rounds shared by TP peers ----------------------------------------------------------
def dp(rank: int, **extra: Any) -> dict[str, Any]:
    return {"dp_rank": rank, "dp_size": 2, **extra}


def test_tp_peers_of_one_dp_rank_get_the_same_share_of_each_automatic_round(make_queue):
    q = make_queue(global_batch_size=8)
    q.put(0, 8, X)

    def get(rank: int, peer: str):
        return send(q, q.get_request(0, "x", 2, sampler_params=dp(rank)), peer=peer).result().to_meta()

    rounds = []
    for _ in range(2):
        shares = {peer: indexes(get(rank, peer)) for rank, peer in [(0, "r0-tp0"), (0, "r0-tp1"), (1, "r1-tp0")]}
        shares["r1-tp1"] = indexes(get(1, "r1-tp1"))
        assert shares["r0-tp0"] == shares["r0-tp1"] and shares["r1-tp0"] == shares["r1-tp1"]
        assert not set(shares["r0-tp0"]) & set(shares["r1-tp0"])
        rounds.append(shares)
    assert rounds[0]["r0-tp0"] == [0, 1] and rounds[1]["r0-tp0"] == [4, 5]


def test_world_rank_names_the_caller_of_an_automatic_round(make_queue):
    q = make_queue(global_batch_size=8)
    q.put(0, 8, X)
    first = q.get(0, "x", 2, sampler_params=dp(0, world_rank=0))
    peer = q.get(0, "x", 2, sampler_params=dp(0, world_rank=1))  # same connection, another TP rank
    assert indexes(first) == indexes(peer) == [0, 1]
    assert indexes(q.get(0, "x", 2, sampler_params=dp(0, world_rank=0))) == [4, 5]
    with pytest.raises(InvalidRequest, match=r"sampler_params\['world_rank'\] must be an int, got 'a'"):
        q.get(0, "x", 2, sampler_params=dp(0, world_rank="a"))


def test_the_round_a_thread_names_is_checked_and_numbers_a_new_connection(make_queue):
    q = make_queue(global_batch_size=8)
    q.put(0, 8, X)
    request = q.get_request(0, "x", 2, sampler_params=dp(0))
    request.next_auto_round = 1  # a thread that took auto-0 before its connection closed
    assert q.ok(request).to_meta().extra["dp_group_id"] == "auto-1"
    request.next_auto_round = -1
    with pytest.raises(InvalidRequest, match=r"next_auto_round must be an int >= 0 or None, got -1"):
        q.send(request, peer="another connection").result()


def test_a_call_that_raises_takes_no_automatic_round(make_queue):
    class Failing(DPSampler):
        fail = True

        def split(self, rows, dp_size, lengths, group_size):
            if Failing.fail:
                raise RuntimeError("boom")
            return super().split(rows, dp_size, lengths, group_size)

    q = make_queue(global_batch_size=8)
    q.state.register_sampler("train", Failing(0, 2))
    q.put(0, 8, X)
    with pytest.raises(SamplerError, match="boom"):
        q.get(0, "x", 1)
    Failing.fail = False
    mine = q.get(0, "x", 1)
    other = q.get(0, "x", 1, sampler_params={"dp_rank": 1})
    assert mine.extra["dp_group_id"] == other.extra["dp_group_id"] == "auto-0"
    # a mismatching call (another batch size for the same round) fails and does not advance the counter either
    assert q.get(0, "x", 1).extra["dp_group_id"] == "auto-1"
    with pytest.raises(InvalidRequest, match="was opened with dp_size=2, batch_size=1"):
        q.get(0, "x", 2, sampler_params={"dp_rank": 1})
    assert q.get(0, "x", 1, sampler_params={"dp_rank": 1}).extra["dp_group_id"] == "auto-1"


# ---- defect 13: idempotent commits -----------------------------------------------------------------------------
def test_a_retried_commit_returns_the_same_meta_and_adds_no_rows(make_queue):
    q = make_queue()
    reservation = q.reserve(0, 2, X)
    first = q.ok(p.Commit(reservation.put_id))
    again = q.ok(p.Commit(reservation.put_id))  # its reply was lost: the client asks again
    assert again == first
    status = q.ok(p.ProductionStatus(0))
    assert status["rows"] == 2
    assert indexes(q.get(0, "x", 2)) == [0, 1]
    assert indexes(q.put(0, 2, X)) == [2, 3]


def test_a_remembered_commit_is_forgotten_when_its_partition_is_cleared_or_its_time_is_up(make_queue):
    q = make_queue(max_reservation_s=10.0, put_grace=1.0)
    cleared = q.reserve(0, 4, X)
    q.commit(cleared)
    kept = q.reserve(1, 4, X)
    q.commit(kept)
    q.clear(0)
    with pytest.raises(PutExpired):
        q.ok(p.Commit(cleared.put_id))
    q.ok(p.Commit(kept.put_id))
    q.advance(12.5)  # remembered put_grace past the deadline: the final ask of a client gets the truth
    assert not q.state.committed
    with pytest.raises(PutExpired):
        q.ok(p.Commit(kept.put_id))


# ---- defect 17: lengths of overwritten keys --------------------------------------------------------------------
def row_length(q, partition: str, key: str) -> int:
    part = q.state.partitions[partition]
    return int(part.length[part.keys[key]])


def test_a_repeated_kv_put_of_one_key_replaces_its_length(make_queue):
    q = make_queue()
    q.kv_put("kv", ["a", "b"], X, lengths=[5, 7])
    q.kv_put("kv", ["a"], X, lengths=[3])
    q.kv_put("kv", ["a"], X, lengths=[3])
    assert row_length(q, "kv", "a") == 3
    assert row_length(q, "kv", "b") == 7


def test_overwriting_one_field_replaces_only_that_fields_share_of_the_length(make_queue):
    q = make_queue()
    xy = {"x": F32, "y": F32}
    request = q.reserve_request("kv", 1, xy, keys=["a"], lengths=[4, 6])
    request.length_fields = ["x", "y"]
    q.commit(q.ok(request))
    assert row_length(q, "kv", "a") == 10
    request = q.reserve_request("kv", 1, {"y": F32}, keys=["a"], lengths=[1])
    request.length_fields = ["y"]
    q.commit(q.ok(request))
    assert row_length(q, "kv", "a") == 5
    bad = q.reserve_request("kv", 1, {"y": F32}, keys=["a"], lengths=[1])
    bad.length_fields = ["z"]
    with pytest.raises(InvalidRequest, match=r"length_fields \['z'\] must name distinct fields of the put \['y'\]"):
        q.ok(bad)
    bad.length_fields, bad.lengths = ["y"], p.pack_indexes(np.array([1, 2]))
    with pytest.raises(InvalidRequest, match="lengths has 2 entries; 1 rows x 1 length_fields need 1"):
        q.ok(bad)


def test_the_client_sends_lengths_per_length_bearing_field():
    from types import SimpleNamespace

    import torch

    from transfer_queue.client import AsyncTransferQueueClient
    from transfer_queue.config import QueueConfig
    from transfer_queue.wire.columns import columns_from_tensordict

    jagged = torch.nested.nested_tensor([torch.zeros(n) for n in (1, 3)], layout=torch.jagged)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    _, columns = columns_from_tensordict({"responses": jagged, "attention_mask": mask, "score": torch.zeros(2)})
    owner = SimpleNamespace(config=QueueConfig(4))
    lengths, names = AsyncTransferQueueClient._field_lengths(owner, columns, 2)
    assert names == ["responses", "attention_mask"]
    assert p.unpack_indexes(lengths).reshape(2, 2).tolist() == [[1, 2], [3, 1]]
    _, plain = columns_from_tensordict({"score": torch.zeros(2)})
    assert AsyncTransferQueueClient._field_lengths(owner, plain, 2) == (None, None)
