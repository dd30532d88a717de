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
