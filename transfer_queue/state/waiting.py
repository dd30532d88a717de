"""WaitingRoom: requests that cannot be served yet, parked until something changes or their deadline passes.

Plain Python (no Ray, no sockets, no wire format). A get_meta whose rows are not ready, or a put that waits for a
slot in the step ring or for storage space, is parked here with the callback that answers it. Whoever changes what
a request waits for (a commit, a clear, a release, freed bytes) asks the room to retry; the room calls back the
attempt function it is given. Nothing here blocks, so one waiting reader never stalls another client.

Indexed so that 10k parked requests cost a change only the ones it can serve (issue 23, "Scale"): getters by
partition, then by :class:`Topic` (task, fields, what they ask for), so a retry picks the topics a change concerns and
stops a line of identical waiters at the first that must wait; every request by its connection and by its client's
call id, so a disconnect or a cancel finds its own requests without scanning the others; deadlines in a heap, so a
tick looks only at the requests due. Among the getters a retry tries, the order they came is kept.

Every retry runs inside ONE exception boundary (:meth:`WaitingRoom._attempt`): a typed error answers that request
with it; any other exception (a bug in a user's sampler, say) is logged and answers only that request, with the
error ``describe_failure`` makes of it; the other parked requests keep waiting and the queue keeps serving.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from transfer_queue.errors import QueueBusy, TransferQueueError

logger = logging.getLogger(__name__)

Respond = Callable[[Any, BaseException | None], None]
WAIT = object()  # an attempt's answer: not possible yet, retry later


@dataclass
class Wait:
    """A handler's answer: park ``job`` and retry it when something changes."""

    job: Any


@dataclass(frozen=True)
class Topic:
    """What a parked getter waits for, as far as a retry tells getters apart (the queue makes it from the job).

    ``task_name``, ``fields``: a change to other tasks' rows, or to rows that lack these fields, cannot serve it.
    ``in_line``: every getter of the topic waits for the same thing (``shape``: the same batch size, the same built-in
    sampler, no DP round), so once the first in line must wait, so must every one behind it: a retry stops there.
    ``custom``: a user's sampler decides; any change to the partition may serve it.
    """

    task_name: str
    fields: frozenset[str]
    in_line: bool = False
    custom: bool = False
    shape: tuple[Any, ...] = ()


@dataclass
class Parked:
    """A parked request: what to retry (``job``), how to answer it, and since / until when it waits."""

    job: Any
    respond: Respond
    started: float
    deadline: float
    peer: Any = None  # the connection it came on: a parked request whose connection closed is dropped
    call: Hashable = None  # the client's name for the call (a cancel names it); None: none
    # set when parked: where the room keeps it
    key: Hashable = None  # the partition a getter waits on (None: a putter)
    topic: Topic | None = None
    seq: int = 0  # the order requests came in


@dataclass
class _Failed:
    """An attempt raised: the error its request is answered with."""

    error: BaseException


Attempt = Callable[[Parked], Any]  # the answer, or WAIT
Forget = Callable[[Any], None]  # a parked job is dropped unanswered or answered with an error: undo what it took
Wanted = Callable[[Topic], bool]  # which topics of a partition a change may serve


class WaitingRoom:
    """Parked getters (per partition and topic) and putters, bounded by ``max_waiting`` in all.

    Args:
        max_waiting: requests parked at once; one more is refused with QueueBusy instead of parked.
        describe_failure: the typed error a request gets when its retry raised a non-queue exception.
    """

    def __init__(self, max_waiting: int, describe_failure: Callable[[Any, Exception], BaseException]):
        self.max_waiting = max_waiting
        self.describe_failure = describe_failure
        self._parked: dict[int, Parked] = {}  # seq -> every parked request
        self._getters: dict[Hashable, dict[Topic | None, dict[int, Parked]]] = {}  # partition -> topic -> seq -> it
        self._putters: dict[int, Parked] = {}
        self._by_peer: dict[Any, dict[int, Parked]] = {}
        self._by_call: dict[Hashable, dict[int, Parked]] = {}
        self._deadlines: list[tuple[float, int]] = []  # (deadline, seq); entries of requests gone are skipped
        self._next_seq = 1
        self.num_getters = 0

    def __len__(self) -> int:
        return len(self._parked)

    @property
    def getters(self) -> dict[Hashable, list[Parked]]:
        """The parked getters per partition, in the order they came (a copy: status pages and tests read it)."""
        return {
            key: sorted((w for line in topics.values() for w in line.values()), key=lambda w: w.seq)
            for key, topics in self._getters.items()
        }

    @property
    def putters(self) -> list[Parked]:
        """The parked putters, in the order they came (a copy)."""
        return list(self._putters.values())

    def waited_on(self) -> list[Hashable]:
        """The partitions getters wait on."""
        return list(self._getters)

    # ---- parking ------------------------------------------------------------------------------------------
    def park(
        self, parked: Parked, key: Hashable | None, what: str, topic: Topic | None = None, call: Hashable = None
    ) -> bool:
        """Park a getter of partition ``key`` (None: a putter); False (and answered with QueueBusy) when full.

        ``topic``: what the getter waits for (None: tried on every retry of its partition); ``call``: the client's
        name for it, for :meth:`withdraw`."""
        waiting = len(self)
        if waiting >= self.max_waiting:
            parked.respond(
                None,
                QueueBusy(
                    f"{waiting} requests are waiting in the controller (max_waiting_requests={self.max_waiting}); "
                    f"this {what} was refused, not parked"
                ),
            )
            return False
        parked.seq, self._next_seq = self._next_seq, self._next_seq + 1
        parked.key, parked.topic = key, topic
        if call is not None:
            parked.call = call
        self._parked[parked.seq] = parked
        if key is None:
            self._putters[parked.seq] = parked
        else:
            self._getters.setdefault(key, {}).setdefault(topic, {})[parked.seq] = parked
            self.num_getters += 1
        if parked.peer is not None:
            self._by_peer.setdefault(parked.peer, {})[parked.seq] = parked
        if parked.call is not None:
            self._by_call.setdefault(parked.call, {})[parked.seq] = parked
        heapq.heappush(self._deadlines, (parked.deadline, parked.seq))
        if len(self._deadlines) > 2 * len(self._parked) + 64:  # entries of requests gone: rebuild, stay bounded
            self._deadlines = [(w.deadline, w.seq) for w in self._parked.values()]
            heapq.heapify(self._deadlines)
        return True

    def _remove(self, parked: Parked) -> None:
        """Forget ``parked`` in every index (O(1))."""
        seq = parked.seq
        if self._parked.pop(seq, None) is None:
            return
        if parked.key is None:
            del self._putters[seq]
        else:
            topics = self._getters[parked.key]
            line = topics[parked.topic]
            del line[seq]
            if not line:
                del topics[parked.topic]
                if not topics:
                    del self._getters[parked.key]
            self.num_getters -= 1
        for index, at in ((self._by_peer, parked.peer), (self._by_call, parked.call)):
            if at is not None:
                mine = index[at]
                del mine[seq]
                if not mine:
                    del index[at]

    # ---- retrying -----------------------------------------------------------------------------------------
    def retry_getters(self, key: Hashable, attempt: Attempt, forget: Forget, wanted: Wanted | None = None) -> None:
        """Retry the getters waiting on partition ``key`` whose topic ``wanted`` (None: every topic), in the order
        they came; a line (:attr:`Topic.in_line`) is left at its first getter that must wait."""
        topics = self._getters.get(key)
        if not topics:
            return
        # one iterator per topic tried, merged by arrival: FIFO among every getter tried
        heads: list[tuple[int, int, Parked, Iterator[Parked], bool]] = []
        for n, (topic, line) in enumerate(topics.items()):
            if topic is not None and wanted is not None and not wanted(topic):
                continue
            waiters = iter(line.values())
            first = next(waiters)
            heads.append((first.seq, n, first, waiters, topic is not None and topic.in_line))
        heapq.heapify(heads)
        answered: list[tuple[Parked, Any]] = []
        while heads:
            _, n, parked, waiters, in_line = heads[0]
            result = self._attempt(parked, attempt)
            if result is WAIT and in_line:  # the ones behind it wait for the same: not tried
                heapq.heappop(heads)
                continue
            if result is not WAIT:
                answered.append((parked, result))
            following = next(waiters, None)
            if following is None:
                heapq.heappop(heads)
            else:
                heapq.heapreplace(heads, (following.seq, n, following, waiters, in_line))
        # the indexes change only after the iteration over them, and answers go out once they are consistent
        for parked, _ in answered:
            self._remove(parked)
        self._answer(answered, forget)

    def retry_putters(self, attempt: Attempt) -> None:
        """Retry every waiting putter, in the order they came."""
        answered = []
        for parked in list(self._putters.values()):
            result = self._attempt(parked, attempt)
            if result is not WAIT:
                self._remove(parked)
                answered.append((parked, result))
        self._answer(answered, None)

    def _attempt(self, parked: Parked, attempt: Attempt) -> Any:
        """THE exception boundary of retries: the answer, WAIT, or the error the request gets."""
        try:
            return attempt(parked)
        except TransferQueueError as exc:
            return _Failed(exc)
        except Exception as exc:  # a bug (e.g. in a task's sampler): only this request hears of it
            logger.exception("retrying a parked %s failed", type(parked.job).__name__)
            return _Failed(self.describe_failure(parked.job, exc))

    @staticmethod
    def _answer(answered: list[tuple[Parked, Any]], forget: Forget | None) -> None:
        for parked, result in answered:
            if isinstance(result, _Failed):
                if forget is not None:
                    forget(parked.job)
                parked.respond(None, result.error)
            else:
                parked.respond(result, None)

    # ---- leaving ------------------------------------------------------------------------------------------
    def expire(
        self,
        now: float,
        get_timeout: Callable[[Parked], BaseException],
        put_timeout: Callable[[Parked], BaseException],
        forget: Forget,
    ) -> None:
        """Answer every request whose deadline passed with its timeout error, earliest deadline first."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq = heapq.heappop(self._deadlines)
            parked = self._parked.get(seq)
            if parked is None:
                continue
            self._remove(parked)
            if parked.key is None:
                parked.respond(None, put_timeout(parked))
            else:
                forget(parked.job)
                parked.respond(None, get_timeout(parked))

    def next_deadline(self) -> float:
        """The earliest deadline of a parked request (inf: none parked)."""
        while self._deadlines and self._deadlines[0][1] not in self._parked:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else float("inf")

    def drop_getters(self, drop: Callable[[Parked], bool], forget: Forget) -> None:
        """Drop, unanswered, the getters for which ``drop`` is true (nobody reads their answer); O(all getters):
        :meth:`withdraw` and :meth:`drop_peer` find theirs through an index."""
        for parked in [w for topics in self._getters.values() for line in topics.values() for w in line.values()]:
            if drop(parked):
                self._remove(parked)
                forget(parked.job)

    def withdraw(self, call: Hashable, forget: Forget) -> None:
        """The client gave up call ``call``: its parked getters are dropped unanswered."""
        for parked in list(self._by_call.get(call, {}).values()):
            if parked.key is not None:
                self._remove(parked)
                forget(parked.job)

    def drop_peer(self, peer: Any, forget: Forget) -> None:
        """Connection ``peer`` closed: its parked requests are dropped unanswered."""
        for parked in list(self._by_peer.get(peer, {}).values()):
            self._remove(parked)
            if parked.key is not None:
                forget(parked.job)

    def take_getters(self, key: Hashable) -> list[Parked]:
        """Remove and return the getters waiting on ``key`` (their partition was cleared), in the order they came."""
        topics = self._getters.get(key, {})
        taken = sorted((w for line in topics.values() for w in line.values()), key=lambda w: w.seq)
        for parked in taken:
            self._remove(parked)
        return taken

    def deadlines(self) -> list[float]:
        """Every parked request's deadline (O(parked); :meth:`next_deadline` is what a timer needs)."""
        return [w.deadline for w in self._parked.values()]
