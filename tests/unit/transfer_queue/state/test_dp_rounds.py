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


def replayed(rounds: DPRounds) -> DPRounds:
    """The counters a controller restarted from its journal has (its connections are gone)."""
    again = DPRounds()
    again.restore(rounds.journaled(), live={"s"})
    return again


def test_after_a_replay_a_tp_peer_of_another_client_gets_the_round_its_peer_opened():
    """TP peers A and B of dp_rank 0 are separate clients (owners), each on its connection: both took auto-0..2, A
    then took auto-3, and the controller restarted before B asked. B's next call joins auto-3 (A's round: its share)
    and A's next call opens auto-4 (before: a connection's counter was kept per rank, the largest, so B's next call
    got auto-4 and B skipped round 3 while A trained on it: TP collectives ran on different batches)."""
    rounds = DPRounds()
    for call_id in (1, 2, 3):
        for owner in ("A", "B"):
            rounds.number("s", "train", 0, f"conn-{owner}", (owner, call_id))
    assert rounds.number("s", "train", 0, "conn-A", ("A", 4))[0] == "auto-3"
    rounds = replayed(rounds)
    assert rounds.number("s", "train", 0, "new-B", ("B", 4))[0] == "auto-3"
    assert rounds.number("s", "train", 0, "new-A", ("A", 5))[0] == "auto-4"
    assert rounds.number("s", "train", 0, "new-B", ("B", 5))[0] == "auto-4"


def test_after_a_replay_a_call_asked_again_keeps_its_round_and_a_new_client_starts_at_the_smallest():
    """A's call 4 (auto-3) asked again after the restart gets auto-3 again; a client not seen before (its owner is
    new) starts at the rank's smallest counter, so it skips no round its rank's peers still have to meet in."""
    rounds = DPRounds()
    for owner, calls in (("A", 4), ("B", 3)):
        for call_id in range(1, calls + 1):
            rounds.number("s", "train", 0, f"conn-{owner}", (owner, call_id))
    rounds = replayed(rounds)
    assert rounds.number("s", "train", 0, "new-A", ("A", 4))[0] == "auto-3"  # asked again: its round
    assert rounds.number("s", "train", 0, "new-A", ("A", 5))[0] == "auto-4"
    assert rounds.number("s", "train", 0, "conn-C", ("C", 1))[0] == "auto-3"
    assert rounds.number("s", "train", 0, "conn-B", ("B", 4))[0] == "auto-3"


def test_after_a_replay_a_client_gone_for_good_no_longer_decides_where_a_new_client_begins():
    """A took auto-0..4 and B auto-0..2, then the controller restarted; B died while it was down. Once B's
    supervisor says so (``owners_gone``), a client not seen before (B's replacement, a TP peer of A) begins at A's
    next round, not at B's stale one (before: auto-3, a round A had left behind), and B's kept call is forgotten.
    With every old client of the rank gone, a new one begins past every round they were served."""
    rounds = DPRounds()
    for owner, calls in (("A", 5), ("B", 3)):
        for call_id in range(1, calls + 1):
            rounds.number("s", "train", 0, f"conn-{owner}", (owner, call_id))
    rounds = replayed(rounds)
    assert rounds.number("s", "train", 0, "new-A", ("A", 6))[0] == "auto-5"  # A goes on
    rounds.owners_gone(["B"])
    assert rounds.changed
    assert all(entry[5] != "B" for entry in rounds.journaled())
    assert rounds.number("s", "train", 0, "conn-C", ("C", 1))[0] == "auto-6"  # with A: its next round
    assert rounds.number("s", "train", 0, "new-B", ("B", 3))[0] == "auto-6"  # B's call is not known any more
    # every old client of the rank gone, none connected since: past the rounds they took
    rounds = DPRounds()
    for owner, calls in (("A", 5), ("B", 3)):
        for call_id in range(1, calls + 1):
            rounds.number("s", "train", 0, f"conn-{owner}", (owner, call_id))
    rounds = replayed(rounds)
    rounds.owners_gone(["A", "B"])
    assert rounds.number("s", "train", 0, "conn-C", ("C", 1))[0] == "auto-5"
    # and the base survives a second restart (journaled)
    rounds = DPRounds()
    rounds.restore([["s", "train", 0, None, 5, "A", 0], ["s", "train", 0, None, 3, "B", 0]], live={"s"})
    rounds.owners_gone(["B"])
    assert replayed(rounds).number("s", "train", 0, "conn-C", ("C", 1))[0] == "auto-5"


def test_a_client_gone_that_a_replay_kept_nothing_of_changes_nothing():
    """Without a replay (or for owners it kept nothing of) ``owners_gone`` leaves the counters as they are: live
    connections' counters go with their connections (``drop_caller``)."""
    rounds = DPRounds()
    for call_id in range(1, 4):
        rounds.number("s", "train", 0, "c1", ("A", call_id))
    rounds.changed = False
    rounds.owners_gone(["A", "Z"])
    assert not rounds.changed
    assert rounds.number("s", "train", 0, "c1", ("A", 4))[0] == "auto-3"
    assert rounds.number("s", "train", 0, "c2", ("C", 1))[0] == "auto-0"


def threads_a_round_apart() -> DPRounds:
    """Two threads of one client "O" (connections t1, t2) of dp_rank 0: both took auto-0..2, t1 then auto-3 (call
    7)."""
    rounds = DPRounds()
    call_ids = iter(range(1, 100))
    for _ in range(3):
        for conn in ("t1", "t2"):
            rounds.number("s", "train", 0, conn, ("O", next(call_ids)))
    assert rounds.number("s", "train", 0, "t1", ("O", 7))[0] == "auto-3"
    return rounds


def test_after_a_replay_the_threads_of_one_client_take_over_its_connections_furthest_behind_first():
    """Two threads of one client (one owner, a connection each) as TP peers: the first took auto-3, the second had
    not asked yet. After the restart the client's first new connection goes on from the one behind (auto-3: it
    skips nothing), the next from the one ahead (auto-4); a further connection starts at the rank's smallest. What
    no new connection took over yet survives a second restart, with the call that may still be asked again."""
    rounds = replayed(threads_a_round_apart())
    assert rounds.number("s", "train", 0, "n2", ("O", 8))[0] == "auto-3"  # the thread behind asks first
    rounds = replayed(rounds)  # a second restart before the thread ahead asked: its call 7 is still known
    assert rounds.number("s", "train", 0, "n1", ("O", 7))[0] == "auto-3"  # asked again
    assert rounds.number("s", "train", 0, "n1", ("O", 9))[0] == "auto-4"
    rounds = DPRounds()
    rounds.restore([["s", "train", 0, None, 4, "O", 7], ["s", "train", 0, None, 3, "O", 6]], live={"s"})
    assert [rounds.number("s", "train", 0, f"n{i}", ("O", 10 + i))[0] for i in range(3)] == [
        "auto-3",
        "auto-4",
        "auto-3",
    ]


def test_after_a_replay_a_thread_that_names_its_next_round_goes_on_from_it_whatever_the_order():
    """Two threads of one client (one owner, a connection each), a round apart: the first took auto-3, the second
    auto-2. After the restart the thread ahead asks first; it names the round it expects (its last + 1, the client
    sends it) and gets auto-4, then the thread behind gets auto-3 (before: the first new connection took over the
    counter furthest behind, auto-3, and the thread ahead was served its round 3 share a second time)."""
    rounds = replayed(threads_a_round_apart())
    assert rounds.number("s", "train", 0, "n1", ("O", 8), next_round=4)[0] == "auto-4"
    assert rounds.number("s", "train", 0, "n2", ("O", 9), next_round=3)[0] == "auto-3"
    assert rounds.number("s", "train", 0, "n1", ("O", 10), next_round=5)[0] == "auto-5"  # the counter is kept
    assert rounds.journaled() and not rounds._left  # both old connections were taken over


def test_a_thread_whose_connection_closed_goes_on_from_the_round_it_names():
    """A thread's connection closed and it reconnected to the same controller (no restart): its counter went with
    the connection, so its next call began again at auto-0, a round its rank was served long ago (before); the
    round it names goes on where it stopped."""
    rounds = DPRounds()
    for call_id in range(1, 4):
        rounds.number("s", "train", 0, "c1", ("O", call_id))
    rounds.drop_caller("c1")
    assert rounds.number("s", "train", 0, "c2", ("O", 4), next_round=3)[0] == "auto-3"
    assert rounds.number("s", "train", 0, "c3", ("O", 5))[0] == "auto-0"  # naming none: as before
