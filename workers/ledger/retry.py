"""Retrying ledger calls while the database is away (:class:`LedgerUnavailable`), with capped exponential backoff.

Every write of the ledger is idempotent or guarded (a record has a unique (task, epoch, sample); a claim's end is
checked against the live claim), so a call whose reply was lost can be retried without recording anything twice.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from workers.ledger.errors import LedgerUnavailable

T = TypeVar("T")
log = logging.getLogger(__name__)


def backoff_delays(base_s: float = 0.1, max_s: float = 2.0) -> Iterator[float]:
    """0.1, 0.2, 0.4, ... capped at ``max_s``, each with up to 25 % jitter (so workers do not retry in step)."""
    delay = base_s
    while True:
        yield delay * (1 + random.random() / 4)
        delay = min(delay * 2, max_s)


def with_retry(
    call: Callable[[], T], deadline_s: float = 120.0, on_retry: Callable[[LedgerUnavailable], None] | None = None
) -> T:
    """``call()``, retried on :class:`LedgerUnavailable` until ``deadline_s`` has passed (then the error is raised)."""
    end = time.monotonic() + deadline_s
    for delay in backoff_delays():
        try:
            return call()
        except LedgerUnavailable as exc:
            if time.monotonic() + delay > end:
                raise
            if on_retry is not None:
                on_retry(exc)
            log.warning("%s; retrying in %.2f s", exc, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


async def with_retry_async(
    call: Callable[[], Awaitable[T]],
    deadline_s: float = 120.0,
    on_retry: Callable[[LedgerUnavailable], None] | None = None,
) -> T:
    """The async form of :func:`with_retry`: ``await call()``, retried with backoff on :class:`LedgerUnavailable`."""
    end = time.monotonic() + deadline_s
    for delay in backoff_delays():
        try:
            return await call()
        except LedgerUnavailable as exc:
            if time.monotonic() + delay > end:
                raise
            if on_retry is not None:
                on_retry(exc)
            log.warning("%s; retrying in %.2f s", exc, delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


async def with_retry_to_end(call: Callable[[], T], deadline_s: float = 120.0) -> T:
    """:func:`with_retry` of ``call`` in a worker thread, awaited to its end even when the awaiting task is cancelled
    meanwhile: the cancellation is raised once the call has returned (or raised). For the calls that end a claim
    (complete, fail, release), which must reach the ledger whatever cancels their task: a plain ``await
    asyncio.to_thread(...)`` cancelled before a pool thread picked the call up cancels the call, which then never runs
    (and the claim stays running until its lease runs out)."""
    call_in_thread = asyncio.ensure_future(asyncio.to_thread(with_retry, call, deadline_s))
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(call_in_thread)
        except asyncio.CancelledError as exc:
            if call_in_thread.cancelled():  # the call itself was cancelled (the loop is closing): nothing to wait for
                raise
            cancelled = exc  # the awaiting task was: wait on
            continue
        except BaseException as error:
            if cancelled is not None:  # the cancellation wins, raised from the call's error
                raise cancelled from error
            raise
        if cancelled is not None:
            raise cancelled
        return result
