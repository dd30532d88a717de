"""Inference servers that share their devices with training (colocated): each training step frees their memory.

Both runs that start their own servers use these: the ledger flow (orchestration/ledger_run.py, the samplers'
``InferenceClient``) and the Ray GRPO run (orchestration/grpo_run.py, its rollout workers). Per training step:

    colocation.release()          # hold new requests back, wait for those in flight, free the servers' memory
    ...train...
    colocation.resume(sync)       # the servers back, sync() loads the new weights, then the held requests go on

:class:`RequestGate` is where a producer's requests to the servers pass (``with gate.passing():`` around each one,
or ``async with gate.passing_async():``); ``drain`` and ``resume`` may be called from another thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Protocol, TypeVar

logger = logging.getLogger(__name__)

#: seconds a colocated step waits for the requests in flight before it releases the servers under them
COLOCATE_DRAIN_S = 120.0

T = TypeVar("T")


class RequestGate:
    """Requests pass while the gate is open; :meth:`drain` closes it and waits for those in flight, :meth:`resume`
    opens it again. Requests that arrive while it is closed wait (they are held, not refused)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.paused = False  # set by drain(): new requests wait until resume()
        self.active = 0  # requests past the gate and not finished yet

    def _enter(self) -> bool:
        with self._cond:
            if self.paused:
                return False
            self.active += 1
            return True

    def _leave(self) -> None:
        with self._cond:
            self.active -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def passing(self) -> Iterator[None]:
        """One request (a blocking call): waits while the gate is closed, counted in flight until the block ends."""
        with self._cond:
            self._cond.wait_for(lambda: not self.paused)
            self.active += 1
        try:
            yield
        finally:
            self._leave()

    @contextlib.asynccontextmanager
    async def passing_async(self, poll_s: float = 0.02) -> AsyncIterator[None]:
        """One request of an event loop: as :meth:`passing`, polling every ``poll_s`` (the loop is never blocked)."""
        while not self._enter():
            await asyncio.sleep(poll_s)
        try:
            yield
        finally:
            self._leave()

    def drain(self, timeout_s: float) -> bool:
        """Hold new requests back and wait up to ``timeout_s`` for those in flight; whether none is left."""
        with self._cond:
            self.paused = True
            return self._cond.wait_for(lambda: self.active == 0, timeout_s)

    def resume(self) -> None:
        """Let the requests :meth:`drain` held back go on."""
        with self._cond:
            self.paused = False
            self._cond.notify_all()


class Drainable(Protocol):
    """Where a run's requests to its servers pass: a :class:`RequestGate`, or one that drains several (each rollout
    worker's)."""

    @property
    def active(self) -> int: ...

    def drain(self, timeout_s: float) -> bool: ...

    def resume(self) -> None: ...


class MemoryReleasing(Protocol):
    """The servers (``workers.engines.manager.InferenceManager``): free their memory, take it back."""

    def release_memory(self) -> list[str]: ...

    def resume_memory(self) -> list[str]: ...


class ColocatedServers:
    """The colocated cycle of a run's ``servers`` around each training step, its ``requests`` held meanwhile: no
    request is in flight while they are released, and none reaches them before the new weights."""

    def __init__(self, servers: MemoryReleasing, requests: Drainable, drain_s: float = COLOCATE_DRAIN_S):
        self.servers, self.requests, self.drain_s = servers, requests, drain_s

    def release(self) -> None:
        """Hold the requests back, wait up to ``drain_s`` for those in flight (a warning names those still in flight
        after it), then free the servers' memory."""
        if not self.requests.drain(self.drain_s):
            logger.warning(
                "%d requests still in flight after %g s: the servers are released under them",
                self.requests.active,
                self.drain_s,
            )
        self.servers.release_memory()

    def resume(self, sync: Callable[[], T]) -> T:
        """Bring the servers back, ``sync()`` (the new weights into them), then let the held requests go on (also
        when ``sync`` raised); returns what ``sync`` returned."""
        self.servers.resume_memory()
        try:
            return sync()
        finally:
            self.requests.resume()
