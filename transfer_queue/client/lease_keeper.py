"""Lease heartbeats: ``client.keep_leased(meta)`` extends the lease of a meta's rows every ``every`` seconds until
the block exits, so a consumer whose work on a batch outlasts ``lease_s`` (a long trainer step) keeps its rows.

Each beat is one ``extend_lease(meta, seconds)``: the lease then ends ``seconds`` after the last beat, so a consumer
that hangs or dies loses its rows within ``seconds`` (a process that dies also closes its connections: they come
back after ``disconnect_grace``). The first beat runs on entry (a lease already lost raises there, NotLeased);
a later one that fails (the lease expired meanwhile, the partition was cleared, the controller did not answer) stops
the heartbeat, is logged and kept in :attr:`error`: the ``ack`` after the block then says what was lost.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from transfer_queue.config import QueueConfig
from transfer_queue.errors import InvalidRequest, TransferQueueError
from transfer_queue.metadata import BatchMeta

logger = logging.getLogger(__name__)


def beat_schedule(config: QueueConfig, every: float | None, seconds: float | None) -> tuple[float, float]:
    """``(every, seconds)``: by default each beat extends by the queue's ``lease_s`` (at most ``max_lease_s``) and
    beats three times per extension, so two beats may fail or come late before the lease runs out."""
    if seconds is None:
        seconds = min(config.lease_s, config.max_lease_s)
    config.check_extension(seconds)
    if every is None:
        every = seconds / 3
    if isinstance(every, bool) or not isinstance(every, (int, float)) or not 0 < every < seconds or math.isnan(every):
        raise InvalidRequest(
            f"keep_leased: every must be a number of seconds in (0, seconds={seconds!r}) (a beat must come before "
            f"the extension runs out), got {every!r}"
        )
    return float(every), float(seconds)


class _Beats:
    """What both heartbeats share: the meta, the schedule, the first error."""

    def __init__(self, meta: BatchMeta, every: float, seconds: float):
        self.meta = meta
        self.every = every
        self.seconds = seconds
        self.beats = 0  # extensions made, the one on entry included
        self.error: BaseException | None = None  # why the heartbeat stopped early (None: it did not)

    def _failed(self, exc: BaseException) -> None:
        self.error = exc
        logger.warning(
            "keep_leased: extending the lease of %d rows of %r stopped after %d beats: %s",
            len(self.meta),
            self.meta.partition_id,
            self.beats,
            exc,
        )


class LeaseHeartbeat(_Beats):
    """The sync client's heartbeat: a daemon thread calling ``extend(meta, seconds)`` every ``every`` seconds."""

    def __init__(self, extend: Callable[[BatchMeta, float], Any], meta: BatchMeta, every: float, seconds: float):
        super().__init__(meta, every, seconds)
        self._extend = extend
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LeaseHeartbeat:
        self._extend(self.meta, self.seconds)
        self.beats += 1
        self._thread = threading.Thread(target=self._run, name="tq-keep-leased", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self._extend(self.meta, self.seconds)
            except TransferQueueError as exc:
                self._failed(exc)
                return
            self.beats += 1

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class AsyncLeaseHeartbeat(_Beats):
    """The async client's heartbeat: a task awaiting ``extend(meta, seconds)`` every ``every`` seconds."""

    def __init__(self, extend: Callable[[BatchMeta, float], Any], meta: BatchMeta, every: float, seconds: float):
        super().__init__(meta, every, seconds)
        self._extend = extend
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncLeaseHeartbeat:
        await self._extend(self.meta, self.seconds)
        self.beats += 1
        self._task = asyncio.ensure_future(self._run())
        return self

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            try:
                await self._extend(self.meta, self.seconds)
            except TransferQueueError as exc:
                self._failed(exc)
                return
            self.beats += 1

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
