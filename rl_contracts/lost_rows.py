"""What the RL loop's queue users do when a storage unit dies (see docs/architecture.md "Lost rows").

A unit that dies is down for a few seconds (reads of its rows raise ``StorageUnitDown``, puts placed on it fail with
``StorageUnavailable`` and leave nothing visible), then Ray restarts it empty and its rows are LOST (reads and puts
into them raise ``RowsLost``; ``get_meta`` never serves them again). The driver puts the lost prompts again as new
rows (``orchestration.regenerate``). A worker therefore hands back what it cannot read or write and goes on: the rows
that were lost are served to nobody, the others are served again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from transfer_queue.errors import RowsLost, StaleBatchMeta, StorageUnavailable, StorageUnitDown

logger = logging.getLogger(__name__)
PUT_ATTEMPTS = 5  # a put placed on a unit that died mid-put is tried again (the controller places it elsewhere)
DOWN_PAUSE_S = 0.5  # after a read found a unit down: wait a little (it is being restarted) before asking again
DOWN_WAIT_S = 120.0  # the longest a reader waits for a down unit to come back (or be restarted empty)


def release_quietly(client: Any, meta: Any) -> None:
    """Hand ``meta``'s rows back (lost rows stay lost; the others are served again); a cleared step is no matter."""
    try:
        client.release(meta)
    except StaleBatchMeta:
        pass


def read_or_none(client: Any, meta: Any, release: bool = True, **kwargs: Any) -> Any:
    """``client.get_data(meta)``, or None when some of its rows are lost; with ``release`` the rows are handed back
    then (a DP rank releases only once its peers agree). While a unit holding some of them is down (dead, not restarted
    yet) it keeps the lease and asks again, for up to ``DOWN_WAIT_S``: handing the rows back over and over would wear
    out their deliveries and dead-letter them."""
    deadline = time.monotonic() + DOWN_WAIT_S
    while True:
        try:
            return client.get_data(meta, **kwargs)
        except StorageUnitDown as exc:  # RowsLost too
            if not isinstance(exc, RowsLost) and time.monotonic() < deadline:
                time.sleep(DOWN_PAUSE_S)
                client.ping()  # the controller's reply says whether the unit is back, or restarted empty
                continue
            logger.warning("%d rows could not be read (%s); handing them back", len(meta), exc)
            if release:
                release_quietly(client, meta)
            return None


def write_or_release(client: Any, fields: Any, meta: Any) -> bool:
    """``client.put(fields, metadata=meta)``; False (and the rows handed back) when some of the rows were lost. A put
    that failed on a unit that died mid-put is tried again."""
    for attempt in range(PUT_ATTEMPTS):
        try:
            client.put(fields, metadata=meta)
            return True
        except RowsLost as exc:
            logger.warning("%d rows were lost before their fields were written (%s); handing them back", len(meta), exc)
            release_quietly(client, meta)
            return False
        except StorageUnavailable:
            if attempt == PUT_ATTEMPTS - 1:
                raise
            time.sleep(DOWN_PAUSE_S)
    raise AssertionError("unreachable")


def put_retrying(client: Any, fields: Any, **kwargs: Any) -> Any:
    """``client.put(fields, **kwargs)`` (new rows), tried again when the unit it was placed on died mid-put (nothing
    of a failed put is visible, so a retry never doubles rows)."""
    for attempt in range(PUT_ATTEMPTS):
        try:
            return client.put(fields, **kwargs)
        except StorageUnavailable:
            if attempt == PUT_ATTEMPTS - 1:
                raise
            time.sleep(DOWN_PAUSE_S)
    raise AssertionError("unreachable")


def served_batches(
    client: Any,
    clock: Any,
    fields: Sequence[str],
    rows: int,
    *,
    step: int,
    task_name: str,
    timeout: float,
    read: Sequence[str] | None = None,
) -> Iterator[tuple[Any, Any]]:
    """The batches of ``step`` a worker is served as ``task_name``, each as ``(meta, data)``, until the step has none
    left for it (``get_meta`` of whole groups, ``rows`` at most; ``data`` holds the fields ``read``, all ``fields`` by
    default). A batch with lost rows is handed back and skipped: its lost rows come back as new rows, the others are
    served again. Every call goes through ``clock`` (a ``QueueClock``)."""
    while True:
        meta = clock.call(
            client.get_meta, list(fields), rows, global_step=step, task_name=task_name, get_n_samples=True,
            timeout=timeout,
        )  # fmt: skip
        if len(meta) == 0:
            return
        data = clock.call(read_or_none, client, meta.select_fields(list(read)) if read is not None else meta)
        if data is not None:
            yield meta, data
