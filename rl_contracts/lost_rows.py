"""What the RL loop's queue users do when a storage unit dies (see docs/architecture.md "Lost rows").

A unit that dies is down for a few seconds (reads of its rows raise ``StorageUnitDown``, puts placed on it fail with
``StorageUnavailable`` and leave nothing visible), then Ray restarts it empty and its rows are LOST (reads and puts
into them raise ``RowsLost``; ``get_meta`` never serves them again). The driver puts the lost prompts again as new
rows (``orchestration.regenerate``). A worker therefore hands back what it cannot read or write and goes on: the rows
that were lost are served to nobody, the others are served again.

A worker that dies (its process killed) is a lease that ends: the rollout and reward tasks acknowledge explicitly
(:data:`WORKER_TASK_OPTIONS`), after the worker's put, so the rows a dead worker held come back to ready
``disconnect_grace`` (5 s) after its connections closed, and the restarted worker (or another) takes them. A worker
that died between its put and its ``ack`` had written them: the second put is refused (``FieldAlreadyProduced``),
:func:`write_or_release` then writes the rows that nobody wrote and acknowledges the rest, so no row is produced twice
and none is left unproduced.

A worker stopped on purpose while its queue goes on (a trainer-group restart that keeps the queue,
orchestration/trainer_restarts.py) first writes the batches it is generating: each batch passes a
:class:`BatchesInFlight` from its generation to its write, and ``finish`` holds new ones back and waits for those.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from rl_contracts.colocate import RequestGate
from rl_contracts.rows import jagged
from transfer_queue.errors import (
    FieldAlreadyProduced,
    NotLeased,
    RequestTimeout,
    RowsLost,
    ServerGone,
    StaleBatchMeta,
    StorageUnavailable,
    StorageUnitDown,
)

logger = logging.getLogger(__name__)


class BatchesInFlight:
    """The batches a worker is generating, from their generation to their write (``with in_flight.batch(meta):``):
    :meth:`finish` starts no new one and waits for these (a worker about to be stopped keeps its work), :meth:`rows`
    counts the rows whose generation started (what the worker's death would make generate again)."""

    def __init__(self) -> None:
        self._gate = RequestGate()
        self._rows: dict[int, int] = {}
        self._generating: set[int] = set()

    @contextlib.contextmanager
    def batch(self, meta: Any, generating: bool = True) -> Iterator[None]:
        """One batch's generation and write; waits (held) once :meth:`finish` was called. ``generating`` False: its
        generation starts later (:meth:`generating`; e.g. its weights load first), until then :meth:`rows` leaves it
        out (nothing of it would be generated again)."""
        with self._gate.passing():
            self._rows[id(meta)] = len(meta)
            if generating:
                self._generating.add(id(meta))
            try:
                yield
            finally:
                del self._rows[id(meta)]
                self._generating.discard(id(meta))

    def generating(self, meta: Any) -> None:
        """The generation of ``meta``'s batch (in :meth:`batch`) starts now."""
        if id(meta) in self._rows:
            self._generating.add(id(meta))

    def finish(self, timeout_s: float) -> int:
        """Hold new batches back and wait up to ``timeout_s`` for those in flight; returns how many are left."""
        self._gate.drain(timeout_s)
        return self._gate.active

    def rows(self) -> int:
        """Rows of the batches whose generation started."""
        return sum(self._rows[key] for key in list(self._generating) if key in self._rows)


PUT_ATTEMPTS = 5  # a put placed on a unit that died mid-put is tried again (the controller places it elsewhere)
DOWN_PAUSE_S = 0.5  # after a read found a unit down: wait a little (it is being restarted) before asking again
DOWN_WAIT_S = 120.0  # the longest a reader waits for a down unit to come back (or be restarted empty)
#: the rollout and reward tasks' ``set_task_options`` (the driver sets them): rows are done when the worker's put is
#: (``ack`` after it), not when it read them, so a worker that dies mid-batch hands them back (its connections close:
#: after ``disconnect_grace``). The lease is long: it ends early only for a worker that hangs, and a batch that
#: outlasted it would be generated twice (the second put refused).
WORKER_TASK_OPTIONS: dict[str, Any] = {"ack": "explicit", "lease_s": 3600.0}


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


def write_or_release(client: Any, fields: Any, meta: Any, group_size: int = 1) -> int:
    """``client.put(fields, metadata=meta)`` then ``client.ack(meta)``; returns the rows this call wrote: 0, with the
    rows handed back, when some of them were lost. A put that failed on a unit that died mid-put is tried again.

    A put refused because some rows already hold their fields (``FieldAlreadyProduced``: they were served again after
    a worker that wrote them died before its ack) is made again group by group (``group_size`` rows: a GRPO group's
    rows are always written together): the groups nobody wrote are written, the others are left as they are, and the
    whole meta is acknowledged, so nobody is served those rows again."""
    try:
        written = _put(client, fields, meta)
    except FieldAlreadyProduced as exc:
        logger.warning("%d rows were served again after they were written (%s); writing the others", len(meta), exc)
        written = 0
        for start in range(0, len(meta), group_size):
            positions = list(range(start, min(start + group_size, len(meta))))
            try:
                wrote = _put(client, rows_at(fields, positions), meta.select_samples(positions))
            except FieldAlreadyProduced:
                continue
            if wrote is None:  # lost meanwhile: hand all of them back (the written ones come back refused, then acked)
                release_quietly(client, meta)
                return 0
            written += wrote
    if written is None:
        return 0
    try:
        client.ack(meta)
    except (NotLeased, StaleBatchMeta) as exc:  # the step was cleared, or the rows were handed back as lost meanwhile
        logger.warning("%d rows written could not be acknowledged (%s)", len(meta), exc)
    return written


def _put(client: Any, fields: Any, meta: Any) -> int | None:
    """``put`` (tried again while the unit it went to is down, and when the controller died under its commit: the
    outcome of that commit is unknown, so the put is made again, and a commit that had landed is then refused with
    ``FieldAlreadyProduced``); the rows written, None when some were lost (then they are handed back)."""
    for attempt in range(PUT_ATTEMPTS):
        try:
            client.put(fields, metadata=meta)
            return len(meta)
        except RowsLost as exc:
            logger.warning("%d rows were lost before their fields were written (%s); handing them back", len(meta), exc)
            release_quietly(client, meta)
            return None
        except (StorageUnavailable, ServerGone, RequestTimeout):
            if attempt == PUT_ATTEMPTS - 1:
                raise
            time.sleep(DOWN_PAUSE_S)
    raise AssertionError("unreachable")


def rows_at(fields: dict[str, Any], positions: list[int]) -> dict[str, Any]:
    """The rows at ``positions`` of each field of a put (jagged nested and dense tensors, numpy arrays, lists)."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            offsets = value.offsets().tolist()  # type: ignore[attr-defined]  # a jagged tensor's; not in the stubs
            values = value.values()
            out[name] = jagged([values[offsets[i] : offsets[i + 1]].tolist() for i in positions], value.dtype)
        elif isinstance(value, (torch.Tensor, np.ndarray)):
            out[name] = value[positions]
        else:
            out[name] = [value[i] for i in positions]
    return out


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
