"""WaitingRoom: requests that cannot be served yet, parked until something changes or their deadline passes.

Plain Python (no Ray, no sockets, no wire format). A get_meta whose rows are not ready, or a put that waits for a
slot in the step ring or for storage space, is parked here with the callback that answers it. Whoever changes what
a request waits for (a commit, a clear, a release, freed bytes) asks the room to retry; the room calls back the
attempt function it is given. Nothing here blocks, so one waiting reader never stalls another client.

Every retry runs inside ONE exception boundary (:meth:`WaitingRoom._attempt`): a typed error answers that request
with it; any other exception (a bug in a user's sampler, say) is logged and answers only that request, with the
error ``describe_failure`` makes of it; the other parked requests keep waiting and the queue keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from transfer_queue.errors import QueueBusy, TransferQueueError

logger = logging.getLogger(__name__)

Respond = Callable[[Any, BaseException | None], None]
WAIT = object()  # an attempt's answer: not possible yet, retry later
_FAILED = object()  # an attempt raised: its request was answered with the error


@dataclass
class Wait:
    """A handler's answer: park ``job`` and retry it when something changes."""

    job: Any


@dataclass
class Parked:
    """A parked request: what to retry (``job``), how to answer it, and since / until when it waits."""

    job: Any
    respond: Respond
    started: float
    deadline: float
    peer: Any = None  # the connection it came on: a parked request whose connection closed is dropped


Attempt = Callable[[Parked], Any]  # the answer, or WAIT
Forget = Callable[[Any], None]  # a parked job is dropped unanswered or answered with an error: undo what it took


class WaitingRoom:
    """Parked getters (per partition) and putters, bounded by ``max_waiting`` in all.

    Args:
        max_waiting: requests parked at once; one more is refused with QueueBusy instead of parked.
        describe_failure: the typed error a request gets when its retry raised a non-queue exception.
    """

    def __init__(self, max_waiting: int, describe_failure: Callable[[Any, Exception], BaseException]):
        self.max_waiting = max_waiting
        self.describe_failure = describe_failure
        self.getters: dict[Hashable, list[Parked]] = {}
        self.putters: list[Parked] = []

    def __len__(self) -> int:
        return len(self.putters) + sum(map(len, self.getters.values()))

    # ---- parking ------------------------------------------------------------------------------------------
    def park(self, parked: Parked, key: Hashable | None, what: str) -> bool:
        """Park a getter of partition ``key`` (None: a putter); False (and answered with QueueBusy) when full."""
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
        if key is None:
            self.putters.append(parked)
        else:
            self.getters.setdefault(key, []).append(parked)
        return True

    # ---- retrying -----------------------------------------------------------------------------------------
    def retry_getters(self, key: Hashable, attempt: Attempt, forget: Forget) -> None:
        """Retry the getters waiting on partition ``key``, in the order they came."""
        still = []
        for parked in self.getters.pop(key, []):
            result = self._attempt(parked, attempt, forget)
            if result is WAIT:
                still.append(parked)
            elif result is not _FAILED:
                parked.respond(result, None)
        if still:
            self.getters.setdefault(key, []).extend(still)

    def retry_putters(self, attempt: Attempt) -> None:
        """Retry every waiting putter, in the order they came."""
        waiting, self.putters = self.putters, []
        for parked in waiting:
            result = self._attempt(parked, attempt, None)
            if result is WAIT:
                self.putters.append(parked)
            elif result is not _FAILED:
                parked.respond(result, None)

    def _attempt(self, parked: Parked, attempt: Attempt, forget: Forget | None) -> Any:
        """THE exception boundary of retries: the answer, WAIT, or _FAILED after answering the error."""
        try:
            return attempt(parked)
        except TransferQueueError as exc:
            error: BaseException = exc
        except Exception as exc:  # a bug (e.g. in a task's sampler): only this request hears of it
            logger.exception("retrying a parked %s failed", type(parked.job).__name__)
            error = self.describe_failure(parked.job, exc)
        if forget is not None:
            forget(parked.job)
        parked.respond(None, error)
        return _FAILED

    # ---- leaving ------------------------------------------------------------------------------------------
    def expire(
        self,
        now: float,
        get_timeout: Callable[[Parked], BaseException],
        put_timeout: Callable[[Parked], BaseException],
        forget: Forget,
    ) -> None:
        """Answer every request whose deadline passed with its timeout error."""
        for key in list(self.getters):
            keep = []
            for parked in self.getters[key]:
                if parked.deadline <= now:
                    forget(parked.job)
                    parked.respond(None, get_timeout(parked))
                else:
                    keep.append(parked)
            self._set_getters(key, keep)
        keep = []
        for parked in self.putters:
            if parked.deadline <= now:
                parked.respond(None, put_timeout(parked))
            else:
                keep.append(parked)
        self.putters = keep

    def drop_getters(self, drop: Callable[[Parked], bool], forget: Forget) -> None:
        """Drop, unanswered, the getters for which ``drop`` is true (nobody reads their answer)."""
        for key in list(self.getters):
            keep = []
            for parked in self.getters[key]:
                if drop(parked):
                    forget(parked.job)
                else:
                    keep.append(parked)
            self._set_getters(key, keep)

    def drop_peer(self, peer: Any, forget: Forget) -> None:
        """Connection ``peer`` closed: its parked requests are dropped unanswered."""
        self.putters = [parked for parked in self.putters if parked.peer != peer]
        self.drop_getters(lambda parked: parked.peer == peer, forget)

    def take_getters(self, key: Hashable) -> list[Parked]:
        """Remove and return the getters waiting on ``key`` (their partition was cleared)."""
        return self.getters.pop(key, [])

    def deadlines(self) -> list[float]:
        return [w.deadline for ws in self.getters.values() for w in ws] + [w.deadline for w in self.putters]

    def _set_getters(self, key: Hashable, keep: list[Parked]) -> None:
        if keep:
            self.getters[key] = keep
        else:
            del self.getters[key]
