"""DP rounds: one fetch shared by every rank of a data-parallel world (docs/samplers.md, "DP rounds work with every
sampler").

Plain Python (no Ray, no sockets, no wire format). The first call of a round (``dp_group_id``) selects
``dp_size x batch_size`` ready rows (whole groups under GRPO), leases them to the round, and splits them into
``dp_size`` shares with the task sampler's ``split`` (checked: disjoint shares of the rows it was given); every call
of that round with a ``dp_rank`` gets that rank's share, however many TP/PP peers ask. A round's state lives in its
partition (:class:`~transfer_queue.state.partition.DPRound`, so a clear forgets it); :class:`DPRounds` keeps the
automatic round numbers of calls that name no ``dp_group_id``: the k-th call of a ``dp_rank`` (per ``world_rank``,
else per connection) joins round ``auto-k``, so the TP peers of one rank meet in the same
round. A journaled controller keeps the counters (:meth:`DPRounds.journaled`), each connection's with its client
(owner): after a restart a new connection of that client goes on where one of its old connections stopped (the one
furthest behind first, so no TP peer skips a round), a client not seen before starts at its rank's smallest counter
(of the clients not said gone for good: :meth:`DPRounds.owners_gone`),
and a call asked again (the same owner and call id, after ServerGone) is numbered as it was the first time.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer_queue.errors import InvalidRequest, SamplerError, TransferQueueError
from transfer_queue.metadata import PartitionKey
from transfer_queue.samplers import BaseSampler
from transfer_queue.state.partition import DPRound, PartitionState
from transfer_queue.state.selection import checked_shares

MAX_DP_SIZE = 1 << 16  # bounds the shares one DP round is split into
# A DP round forgotten (defect 8): a peer that lags more than this many rounds behind opens it anew (and gets other
# rows).
MAX_ROUNDS_PER_PARTITION = 1024

# An automatic DP round counter: (partition, task, dp_rank, caller), the caller being ``world_rank`` when given,
# else the connection: the TP peers of one dp_rank count their own calls, so their k-th calls meet in round k.
AutoRoundCounter = tuple[PartitionKey, str, int, Any]


@dataclass
class GetMetaJob:
    """A validated get_meta, retried until it is served or times out."""

    partition: PartitionKey
    fields: list[str]
    batch_size: int
    task_name: str
    sampler: BaseSampler
    params: dict[str, Any]
    whole_groups: bool
    dp_size: int
    dp_rank: int
    dp_group_id: str | None
    lease_s: float | None = None  # None: the task's or the queue's default
    owner: str = ""
    call_id: int = 0
    peek: bool = False
    auto_round: tuple[AutoRoundCounter, int] | None = None  # (counter, round) when numbered for it
    warning: str = ""  # for the caller, with its meta (a task name never seen before: transfer_queue.state.task_names)


class DPRounds:
    """The automatic round numbers, and serving a call of a round from its partition."""

    def __init__(self) -> None:
        self.auto_rounds: dict[AutoRoundCounter, int] = {}
        self._of_caller: dict[Any, set[AutoRoundCounter]] = {}  # a closed connection forgets its own counters only
        # the call (owner, call id) that took each counter's last number: asked again, it is numbered the same
        self._last_call: dict[AutoRoundCounter, tuple[str, int]] = {}
        self._owner_of: dict[AutoRoundCounter, str] = {}  # the client (owner) of each connection's counter
        # A replayed journal (its connections are gone with the controller that died): per (partition, task, dp_rank,
        # owner), the counters its connections had (a new connection of the owner takes one over, the smallest first);
        # per (partition, task, dp_rank), the counter a client not seen before begins at (the rank's smallest); and
        # the number each call that took one kept (owner, call id: asked again on a new connection, it gets it again).
        self._left: dict[tuple[PartitionKey, str, int, str], list[int]] = {}
        self._base: dict[tuple[PartitionKey, str, int], int] = {}
        self._replayed_calls: dict[tuple[PartitionKey, str, int, str, int], int] = {}
        self.changed = False  # the counters changed since the journal's last record (journal_dir)

    # ---- automatic round numbers ------------------------------------------------------------------------------
    def number(
        self,
        key: PartitionKey,
        task_name: str,
        dp_rank: int,
        caller: Any,
        call: tuple[str, int] | None = None,
        owner: str = "",
        next_round: int | None = None,
    ) -> tuple[str, Any]:
        """The next automatic round of this caller: ``(dp_group_id, auto_round)`` for the job. ``call``: the client's
        (owner, call id); the call asked again (ServerGone: its first reply was lost) gets the number it took.
        ``owner``: the client the connection ``caller`` belongs to (default: ``call``'s). ``next_round``: the round
        the calling thread of the client expects (its last automatic round + 1, None before its first): a connection
        new to this controller (it restarted, or the thread's old connection closed) goes on from it."""
        counter = (key, task_name, dp_rank, caller)
        number = self.auto_rounds.get(counter)
        if number is None:  # the caller's first call (a connection's: perhaps since the controller restarted)
            rank = (key, task_name, dp_rank)
            owner = owner or ("" if call is None else call[0])
            left = None if _journaled_caller(caller) or not owner else self._left.get((*rank, owner))
            taken = None if call is None else self._replayed_calls.pop((*rank, *call), None)
            if taken is not None:
                number = taken
                if left and taken + 1 in left:  # the old connection whose last call this was: taken over
                    left.remove(taken + 1)
            elif _journaled_caller(caller):
                number = 0
            elif next_round is not None and next_round >= 0:  # the thread says where it stopped
                number = next_round
                if left and next_round in left:  # its old connection: taken over
                    left.remove(next_round)
            elif left:  # the owner's old connection furthest behind (threads of one client: none skips a round)
                number = left.pop(0)
            else:  # a client not seen before the restart (or one with more connections than before)
                number = self._base.get(rank, 0)
            if left is not None and not left:
                del self._left[(*rank, owner)]
            if owner and not _journaled_caller(caller):
                self._owner_of[counter] = owner
        elif call is not None and number and self._last_call.get(counter) == call:
            return f"auto-{number - 1}", (counter, number - 1)
        self.auto_rounds[counter] = number + 1
        if call is not None:
            self._last_call[counter] = call
        else:
            self._last_call.pop(counter, None)
        self._of_caller.setdefault(caller, set()).add(counter)
        self.changed = True
        return f"auto-{number}", (counter, number)

    def forget(self, job: GetMetaJob) -> None:
        """A rank's auto-numbered round failed or timed out: its next call takes the same round number again, so
        the rank stays in step with its peers."""
        if job.auto_round is not None:
            counter, number = job.auto_round
            if self.auto_rounds.get(counter) == number + 1:
                self.auto_rounds[counter] = number
                self._last_call.pop(counter, None)
                self.changed = True

    def drop_caller(self, caller: Any) -> None:
        """Connection ``caller`` closed: forget its counters."""
        for counter in self._of_caller.pop(caller, ()):
            self.auto_rounds.pop(counter, None)
            self._last_call.pop(counter, None)
            self._owner_of.pop(counter, None)
            self.changed = True

    def owners_gone(self, owners: Collection[str]) -> None:
        """Clients ``owners`` died for good (their supervisor says so: ``QueueState.clients_gone``): the counters a
        replayed journal kept for their old connections go, and where a client not seen before begins follows from
        the clients left: the smallest next number of the rank's other old connections and live connections, else
        (none left) the largest the gone ones had, past every round their rank was served. Before, a dead client's
        counter, behind its peers', kept new clients starting at a round the rank's peers had left behind (TP peers
        out of step). An owner that speaks again later is a client not seen before."""
        gone = set(owners)
        ranks: dict[tuple[PartitionKey, str, int], int] = {}  # each rank whose old connections went: their largest
        for slot in [s for s in self._left if s[3] in gone]:
            rank = slot[:3]
            ranks[rank] = max(ranks.get(rank, 0), *self._left.pop(slot))
        for call in [c for c in self._replayed_calls if c[3] in gone]:
            del self._replayed_calls[call]
            self.changed = True
        for rank, furthest in ranks.items():
            left = [n for slot, numbers in self._left.items() if slot[:3] == rank for n in numbers]
            live = [
                number
                for counter, number in self.auto_rounds.items()
                if counter[:3] == rank and not _journaled_caller(counter[3]) and self._owner_of.get(counter) not in gone
            ]
            self._base[rank] = min(left + live, default=furthest)
            self.changed = True

    def drop_partition(self, key: PartitionKey, task_name: str | None = None) -> None:
        """Forget the counters of partition ``key`` (of one task; None: every task)."""
        for counter in [c for c in self.auto_rounds if c[0] == key and task_name in (None, c[1])]:
            del self.auto_rounds[counter]
            self._last_call.pop(counter, None)
            self._owner_of.pop(counter, None)
            self.changed = True
            mine = self._of_caller.get(counter[3])
            if mine is not None:
                mine.discard(counter)
                if not mine:
                    del self._of_caller[counter[3]]
        for base in [e for e in self._base if e[0] == key and task_name in (None, e[1])]:
            del self._base[base]
            self.changed = True
        for left in [e for e in self._left if e[0] == key and task_name in (None, e[1])]:
            del self._left[left]
            self.changed = True
        for call in [e for e in self._replayed_calls if e[0] == key and task_name in (None, e[1])]:
            del self._replayed_calls[call]
            self.changed = True

    # ---- the journal (journal_dir) ----------------------------------------------------------------------------
    def journaled(self) -> list[list[Any]]:
        """The counters as the journal keeps them: ``[partition, task, dp_rank, caller, next number, owner, call id]``.
        A ``world_rank``'s counter is kept as it is (``caller``: the world rank; ``owner``, ``call id``: the call that
        took the number before it, or ``["", 0]``). A connection's (it ends with the controller) with ``caller`` None,
        ``owner`` its client and ``call id`` the call that took its last number (0: none): a replay hands it to a new
        connection of that client, and the call that took its last number gets that number again. An entry with no
        owner only sets where the rank's clients not seen before begin."""
        out: list[list[Any]] = []
        ranks = set()  # ranks with a connection's counter: where a new client begins follows from them
        for counter, number in self.auto_rounds.items():
            key, task_name, dp_rank, caller = counter
            if _journaled_caller(caller):
                owner, call_id = self._last_call.get(counter, ("", 0))
                out.append([key, task_name, dp_rank, caller, number, owner, call_id])
                continue
            owner = self._owner_of.get(counter, "")
            last = self._last_call.get(counter)
            call_id = last[1] if last is not None and last[0] == owner else 0
            out.append([key, task_name, dp_rank, None, number, owner, call_id])
            ranks.add((key, task_name, dp_rank))
        # the old connections no new one took over yet, each with the call that took its last number if it was not
        # asked again yet (a call whose old connection a new call took over is not kept again: a thread of its client
        # went on past it)
        calls: dict[tuple[Any, ...], list[int]] = {}
        for (*slot, call_id), number in self._replayed_calls.items():
            calls.setdefault((*slot, number + 1), []).append(call_id)
        for (key, task_name, dp_rank, owner), left in self._left.items():
            for number in left:
                ids = calls.get((key, task_name, dp_rank, owner, number))
                call_id = ids.pop() if ids else 0
                out.append([key, task_name, dp_rank, None, number, owner, call_id])
                ranks.add((key, task_name, dp_rank))
        out.extend(
            [key, task_name, dp_rank, None, number, "", 0]
            for (key, task_name, dp_rank), number in self._base.items()
            if (key, task_name, dp_rank) not in ranks
        )
        return out

    def restore(self, saved: list[list[Any]], live: Any) -> None:
        """Take the counters :meth:`journaled` kept, of the partitions in ``live`` (keys)."""
        for key, task_name, dp_rank, caller, number, owner, call_id in saved:
            if key not in live:
                continue
            rank = (key, str(task_name), int(dp_rank))
            if caller is not None:  # a world_rank's
                counter = (*rank, caller)
                self.auto_rounds[counter] = int(number)
                if owner and call_id:
                    self._last_call[counter] = (str(owner), int(call_id))
                self._of_caller.setdefault(caller, set()).add(counter)
                continue
            self._base[rank] = min(self._base.get(rank, int(number)), int(number))
            if owner:
                self._left.setdefault((*rank, str(owner)), []).append(int(number))
            if owner and call_id and int(number):
                self._replayed_calls[(*rank, str(owner), int(call_id))] = int(number) - 1
        for left in self._left.values():
            left.sort()

    # ---- serving a round ------------------------------------------------------------------------------------
    def serve(
        self,
        part: PartitionState,
        job: GetMetaJob,
        select: Callable[[int], np.ndarray | None],
        lease: Callable[[np.ndarray, tuple[str, str]], tuple[int, float]],
    ) -> tuple[np.ndarray, dict[str, Any]] | None:
        """This rank's share and the meta's ``extra``, or ``None`` to wait.

        ``select(count)``: rows to hand out (None: wait); ``lease(rows, round_key)``: lease them to the round,
        returning ``(lease_id, lease_s)``.
        """
        assert job.dp_group_id is not None
        round_key = (job.task_name, job.dp_group_id)
        dp_round = part.rounds.get(round_key)
        if dp_round is None:
            dp_round = part.rounds[round_key] = DPRound(job.dp_size, job.batch_size, tuple(job.fields))
            while len(part.rounds) > MAX_ROUNDS_PER_PARTITION:  # the oldest rounds go first
                del part.rounds[next(iter(part.rounds))]
        elif (dp_round.dp_size, dp_round.batch_size, dp_round.fields) != (
            job.dp_size,
            job.batch_size,
            tuple(job.fields),
        ):
            raise InvalidRequest(
                f"dp_group_id {job.dp_group_id!r} was opened with dp_size={dp_round.dp_size}, "
                f"batch_size={dp_round.batch_size}, fields={list(dp_round.fields)}; this call has dp_size="
                f"{job.dp_size}, batch_size={job.batch_size}, fields={job.fields}"
            )
        if dp_round.shares is None:
            rows = select(job.dp_size * job.batch_size)
            if rows is None:
                return None
            self._split(part, job, dp_round, round_key, rows)
            if len(rows):  # the round holds the shares until every rank acknowledged its own, or its lease expires
                dp_round.lease_id, dp_round.lease_s = lease(rows, round_key)
        if dp_round.expired:
            raise InvalidRequest(
                f"the lease of dp_group_id {job.dp_group_id!r} expired ({dp_round.lease_s:g} s) before every rank "
                "acknowledged its share; its unacknowledged rows are ready again: ask again with a new dp_group_id"
            )
        if job.dp_rank in dp_round.released:
            raise InvalidRequest(
                f"the share of dp_rank={job.dp_rank} in dp_group_id {job.dp_group_id!r} was released; "
                "ask again with a new dp_group_id"
            )
        shares = dp_round.shares
        assert shares is not None
        extra = {
            "dp_rank": job.dp_rank,
            "dp_size": job.dp_size,
            "dp_group_id": job.dp_group_id,
            # what every rank of the round needs to yield the same number of batches (a short last round)
            "round_rows": int(sum(len(share) for share in shares)),
            "round_max_share": int(max(len(share) for share in shares)),
        }
        return shares[job.dp_rank], extra

    def _split(
        self, part: PartitionState, job: GetMetaJob, dp_round: DPRound, round_key: tuple[str, str], rows: np.ndarray
    ) -> None:
        """Split the round's rows into checked shares; a split that fails forgets the round (no row was leased)."""
        group = part.group_size if job.whole_groups else 1
        try:
            shares = job.sampler.split(rows, job.dp_size, part.length[rows], group)
            group_of = part.group if job.whole_groups else None
            dp_round.shares = checked_shares(shares, rows, job.dp_size, group_of, type(job.sampler).__name__)
        except Exception as exc:
            # no row was leased yet and the round is forgotten: only this call fails
            del part.rounds[round_key]
            self.forget(job)
            if isinstance(exc, TransferQueueError):
                raise
            raise SamplerError(
                f"{type(job.sampler).__name__}.split raised {type(exc).__name__}: {exc}; "
                f"the {len(rows)} rows it was given are ready again"
            ) from exc


def mark_released(part: PartitionState, task_name: str, rows: np.ndarray) -> None:
    """Rows of ``task_name`` were released: the rank whose share holds any of them may not fetch it again."""
    released = set(rows.tolist())
    for (round_task, _), dp_round in part.rounds.items():
        if round_task == task_name and dp_round.shares is not None:
            for rank, share in enumerate(dp_round.shares):
                if not released.isdisjoint(share.tolist()):
                    dp_round.released.add(rank)


def end_round(part: PartitionState, round_key: tuple[str, str], lease_id: int) -> None:
    """The round's lease ``lease_id`` ended (expired, its rows handed back): the round is over."""
    dp_round = part.rounds.get(round_key)
    if dp_round is not None and dp_round.lease_id == lease_id:
        dp_round.expired = True


def _journaled_caller(caller: Any) -> bool:
    """Whether a counter's caller outlives the controller: a ``world_rank`` (an int), not a connection."""
    return isinstance(caller, int) and not isinstance(caller, bool)
