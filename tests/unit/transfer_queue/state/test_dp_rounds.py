"""DPRounds alone (no QueueState, no Ray): automatic round numbers, one round's shares, a failing split."""

from __future__ import annotations

import numpy as np
import pytest

from transfer_queue.errors import InvalidRequest, SamplerError
from transfer_queue.samplers import SequentialSampler
from transfer_queue.state.dp_rounds import DPRounds, GetMetaJob, end_round, mark_released
from transfer_queue.state.partition import PartitionState


def job(rank: int, group: str = "g", *, size: int = 2, batch: int = 2, sampler=None, auto=None) -> GetMetaJob:
    sampler = sampler or SequentialSampler()
    return GetMetaJob("s", ["x"], batch, "train", sampler, {}, False, size, rank, group, auto_round=auto)


def partition() -> PartitionState:
    return PartitionState("s", 1, None, 1, 0)


class Leases:
    """Records the leases a round takes."""

    def __init__(self) -> None:
        self.taken: list[tuple[list[int], tuple[str, str]]] = []

    def __call__(self, rows: np.ndarray, round_key: tuple[str, str]) -> tuple[int, float]:
        self.taken.append((rows.tolist(), round_key))
        return len(self.taken), 60.0


def test_every_rank_gets_its_share_of_one_selection_however_often_it_asks():
    rounds, part, leases, selected = DPRounds(), partition(), Leases(), []

    def select(count: int) -> np.ndarray:
        selected.append(count)
        return np.arange(count, dtype=np.int64)

    share0, extra = rounds.serve(part, job(0), select, leases)
    share1, _ = rounds.serve(part, job(1), select, leases)
    again, _ = rounds.serve(part, job(1), select, leases)  # a TP peer of rank 1
    assert share0.tolist() == [0, 1] and share1.tolist() == again.tolist() == [2, 3]
    assert selected == [4] and leases.taken == [([0, 1, 2, 3], ("train", "g"))]
    assert extra == {"dp_rank": 0, "dp_size": 2, "dp_group_id": "g", "round_rows": 4, "round_max_share": 2}


def test_a_round_waits_until_its_rows_are_selected():
    rounds, part, leases = DPRounds(), partition(), Leases()
    assert rounds.serve(part, job(0), lambda count: None, leases) is None
    assert leases.taken == [] and part.rounds[("train", "g")].shares is None


def test_a_call_that_does_not_match_its_round_is_refused():
    rounds, part = DPRounds(), partition()
    rounds.serve(part, job(0), lambda count: np.arange(count), Leases())
    with pytest.raises(InvalidRequest, match="dp_group_id 'g' was opened with dp_size=2, batch_size=2"):
        rounds.serve(part, job(0, batch=3), lambda count: np.arange(count), Leases())


def test_a_split_that_raises_fails_only_that_call_and_forgets_the_round():
    class BadSplit(SequentialSampler):
        def split(self, rows, dp_size, lengths, group):
            raise RuntimeError("boom")

    rounds, part = DPRounds(), partition()
    dp_group_id, auto = rounds.number("s", "train", 0, "conn")
    assert dp_group_id == "auto-0" and rounds.auto_rounds == {("s", "train", 0, "conn"): 1}
    with pytest.raises(SamplerError, match=r"BadSplit.split raised RuntimeError: boom; the 4 rows it was given"):
        rounds.serve(part, job(0, dp_group_id, sampler=BadSplit(), auto=auto), lambda c: np.arange(c), Leases())
    assert part.rounds == {}
    assert rounds.number("s", "train", 0, "conn")[0] == "auto-0"  # the rank stays in step with its peers


def test_released_and_expired_rounds_refuse_their_ranks():
    rounds, part = DPRounds(), partition()
    rounds.serve(part, job(0), lambda count: np.arange(count), Leases())
    mark_released(part, "train", np.asarray([3]))
    with pytest.raises(InvalidRequest, match="the share of dp_rank=1 in dp_group_id 'g' was released"):
        rounds.serve(part, job(1), lambda count: np.arange(count), Leases())
    end_round(part, ("train", "g"), lease_id=1)
    with pytest.raises(InvalidRequest, match=r"the lease of dp_group_id 'g' expired \(60 s\)"):
        rounds.serve(part, job(0), lambda count: np.arange(count), Leases())


def test_automatic_counters_are_forgotten_with_their_caller_or_partition():
    rounds = DPRounds()
    for caller in ("a", "b"):
        rounds.number("s", "train", 0, caller)
    rounds.number("t", "eval", 0, "a")
    rounds.drop_caller("a")
    assert list(rounds.auto_rounds) == [("s", "train", 0, "b")]
    rounds.drop_partition("s", "eval")
    assert list(rounds.auto_rounds) == [("s", "train", 0, "b")]
    rounds.drop_partition("s")
    assert rounds.auto_rounds == {}


def test_replayed_counters_are_forgotten_with_their_partition():
    """What a journal's replay gave (a world_rank's counter, a rank's base for new connections, a call's number)
    goes with its partition, as live counters do: nothing of a cleared partition is journaled again."""
    rounds = DPRounds()
    saved = [["s", "train", 0, 3, 2, "o", 7], ["s", "train", 1, None, 5, "o", 9], ["gone", "train", 0, None, 1, "", 0]]
    rounds.restore(saved, live={"s"})
    assert rounds.number("s", "train", 1, "conn")[0] == "auto-5"  # a new connection of rank 1: past every number
    assert rounds.number("s", "train", 1, "conn2", ("o", 9))[0] == "auto-4"  # the call asked again: its number
    assert rounds.number("s", "train", 0, 3, ("o", 7))[0] == "auto-1"  # world_rank 3's call asked again
    rounds.drop_partition("s")
    assert rounds.journaled() == [] and rounds.number("s", "train", 1, "conn")[0] == "auto-0"
