"""One client's channel to a queue: calls to the controller and the storage units, what it learned of their
health, and the checks every call shares. :class:`~transfer_queue.client.AsyncTransferQueueClient` is built on it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from transfer_queue.config import QueueConfig
from transfer_queue.errors import (
    ClientClosed,
    InvalidRequest,
    ProtocolMismatch,
    QueueClosed,
    RequestTimeout,
    RowsLost,
    ServerGone,
    StorageUnavailable,
    StorageUnitDown,
    UnsupportedValue,
    error_from_wire,
)
from transfer_queue.metadata import BatchMeta, PartitionKey, current_holders, describe_partition
from transfer_queue.wire import protocol as p
from transfer_queue.wire.columns import (
    Column,
)
from transfer_queue.wire.transport import AsyncioTransport, BlockingTransport, Transport

logger = logging.getLogger(__name__)
REPLY_SLACK = 5.0  # seconds a client waits beyond a server-side timeout before calling the server dead
RETRY_FIRST_S, RETRY_MAX_S = 0.1, 2.0  # restart_retry_s: the first pause before asking again, and the longest
# Requests asked again after ServerGone only if the caller knows the outcome: a commit may have been applied (its put
# raises instead: whether its rows are visible is unknown); an abort is best effort (the controller aborts anyway).
NOT_RETRIED = (p.Commit, p.Abort)
KV_READ_ATTEMPTS = 8  # kv_batch_get looks keys up again when a concurrent kv_put replaced them mid-read


# Sessions of queues this process shut down (``transfer_queue.shutdown``): their clients fail at once.
_closed_sessions: set[str] = set()


#: per thread, the (partition, task, dp_rank) whose next automatic DP round a client remembers (the most recent)
AUTO_ROUNDS_KEPT = 256


def mark_queue_closed(session_id: str) -> None:
    """Tell every client of this process that the queue of ``session_id`` is shut down: they raise QueueClosed."""
    _closed_sessions.add(session_id)


def _partition(global_step: int | None, partition_id: str | None, metadata: BatchMeta | None = None) -> PartitionKey:
    if metadata is not None and global_step is None and partition_id is None:
        return metadata.partition_id
    if (global_step is None) == (partition_id is None):
        raise InvalidRequest(
            f"give exactly one of global_step and partition_id, got global_step={global_step!r}, "
            f"partition_id={partition_id!r}"
        )
    if global_step is not None:
        if isinstance(global_step, bool) or not isinstance(global_step, (int, np.integer)) or global_step < 0:
            raise InvalidRequest(f"global_step must be an int >= 0, got {global_step!r}")
        key: PartitionKey = int(global_step)
    else:
        if not isinstance(partition_id, str) or not partition_id:
            raise InvalidRequest(f"partition_id must be a non-empty str, got {partition_id!r}")
        key = partition_id
    if metadata is not None and metadata.partition_id != key:
        raise InvalidRequest(f"the metadata is of partition {metadata.partition_id!r}, not {key!r}")
    return key


def _told(restart: p.UnitRestart) -> tuple[int, int, int]:
    """How far what a controller says of a unit's restart has gone: a later restart, more refilled, or (replicas=2)
    more blocks lost with it (``lost_with`` grows when a unit holding their other copies is retired before the refill
    got them back)."""
    return restart.restarts, restart.refilled_below, len(restart.lost_with)


def _kv_partition(partition_id: str) -> str:
    if not isinstance(partition_id, str) or not partition_id:
        raise InvalidRequest(f"a kv partition_id must be a non-empty str, got {partition_id!r}")
    return partition_id


class QueueChannel:
    """The plumbing of :class:`~transfer_queue.client.AsyncTransferQueueClient`: its sockets, its calls to the
    controller and the storage units, and the storage units it knows to be down."""

    def __init__(self, client_id: str, controller_info: p.ControllerInfo, *, transport: Transport | None = None):
        if not isinstance(controller_info, p.ControllerInfo):
            raise InvalidRequest(f"controller_info must be a ControllerInfo, got {type(controller_info).__name__}")
        if controller_info.protocol_version != p.PROTOCOL_VERSION:
            raise ProtocolMismatch(
                f"controller_info speaks protocol {controller_info.protocol_version}, this client "
                f"{p.PROTOCOL_VERSION}; install the same transfer_queue version on both sides"
            )
        self.client_id = client_id
        self.controller_info = controller_info
        self.config = QueueConfig.from_dict(controller_info.config)
        self._transport = transport or AsyncioTransport(secret=controller_info.secret)
        self._closed = False
        # who holds this client's leases: unique per client instance (client_id is a name and may repeat)
        self.owner = f"{client_id}#{uuid.uuid4().hex[:12]}"
        self._calls = itertools.count(1)
        # Storage units known to be down, and why: the controller's view (every reply of it carries it) plus the units
        # this client failed to reach since. Reads of rows on them fail at once (StorageUnitDown).
        self._down_units: dict[int, str] = {}
        # Where each storage unit listens now (a unit Ray restarted listens on new ports), and below which block id
        # the blocks of a restarted unit are lost: both from the controller's replies.
        self._unit_endpoints: list[p.Endpoint] = list(controller_info.storage_units)
        self._restarted: dict[int, p.UnitRestart] = {}
        # replicas=2: the retired units whose copies the controller moved onto others (where, how far): its replies
        self._moved: list[p.UnitMove] = []
        # The task options this client set (set_task_options), by task: set again after a ServerGone before the call
        # is asked again (restart_retry_s), since a controller restarted from its journal has forgotten them.
        self._task_options: dict[str, Any] = {}
        # Automatic DP rounds: per thread (a thread has its own connections), the round each (partition, task,
        # dp_rank) of it expects next; sent with its get_meta, so a controller that restarted (or a new connection
        # after one closed) numbers the thread's rounds where they stopped (transfer_queue/state/dp_rounds.py).
        self._auto_rounds = threading.local()
        # replicas=2: the unit holding the second copy of each unit's blocks (puts write both, reads fall back to it)
        self._replica_of: list[int] | None = controller_info.replica_units
        if self.config.replicas > 1 and (
            self._replica_of is None or len(self._replica_of) != len(controller_info.storage_units)
        ):
            raise InvalidRequest(
                f"the queue keeps replicas={self.config.replicas} copies of each row, but controller_info names the "
                f"replica of {0 if self._replica_of is None else len(self._replica_of)} of its "
                f"{len(controller_info.storage_units)} storage units"
            )

    # ---- plumbing ------------------------------------------------------------------------------------------
    def _next_auto_round(self, key: tuple[Any, ...]) -> int | None:
        """The automatic DP round this thread expects next for ``key`` (partition, task, dp_rank), None before its
        first."""
        return self._thread_auto_rounds().get(key)

    def _note_auto_round(self, key: tuple[Any, ...], meta: BatchMeta) -> None:
        """Remember the round after ``meta``'s when it is an automatic one (``auto-k``)."""
        group = meta.extra.get("dp_group_id")
        if isinstance(group, str) and group.startswith("auto-") and group[5:].isdigit():
            rounds = self._thread_auto_rounds()
            rounds.pop(key, None)  # the newest last: the oldest go first past AUTO_ROUNDS_KEPT
            rounds[key] = int(group[5:]) + 1
            while len(rounds) > AUTO_ROUNDS_KEPT:
                del rounds[next(iter(rounds))]

    def _thread_auto_rounds(self) -> dict[tuple[Any, ...], int]:
        rounds = getattr(self._auto_rounds, "rounds", None)
        if rounds is None:
            rounds = self._auto_rounds.rounds = {}
        return rounds

    def _timeout(self, timeout: float | None) -> float:
        if timeout is None:
            return self.config.default_timeout
        if not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise InvalidRequest(f"timeout must be a finite number of seconds > 0 (or None), got {timeout!r}")
        return float(timeout)

    def _frames(self, body: Any, buffers: Sequence[Any] = ()) -> tuple[list[Any], int]:
        request_id = self._transport.next_request_id()
        envelope = p.Envelope(p.PROTOCOL_VERSION, self.controller_info.session_id, request_id)
        try:
            encoded = p.encode(body)
        except (TypeError, OverflowError) as exc:  # e.g. an object in sampler_params: refused before sending
            raise UnsupportedValue(f"a {type(body).__name__} request cannot be encoded: {exc}") from None
        return [p.encode(envelope), encoded, *buffers], request_id

    async def _call(
        self,
        calls: Sequence[tuple[p.Endpoint, Any, Sequence[Any]]],
        timeout: float,
        who: str,
        into: Sequence[dict[int, Any]] | None = None,
    ) -> list[tuple[Any, list[Any]]]:
        if self._closed:
            raise ClientClosed(f"client {self.client_id!r} is closed")
        if self.controller_info.session_id in _closed_sessions:
            raise QueueClosed(
                f"client {self.client_id!r}: its queue was shut down (transfer_queue.shutdown); "
                "call transfer_queue.init to start a new one"
            )
        wire = []
        for endpoint, body, buffers in calls:
            frames, request_id = self._frames(body, buffers)
            wire.append((endpoint, frames, request_id))
        try:
            replies = await (
                self._transport.call_many(wire, timeout)
                if into is None
                else self._transport.call_many(wire, timeout, into)
            )
        except (RequestTimeout, ServerGone) as exc:
            error = type(exc)(f"{who}: {exc}")
            error.addresses = getattr(exc, "addresses", [])  # type: ignore[union-attr]
            raise error from None
        out = []
        for frames in replies:
            header = p.decode_reply_header(frames[0])
            if header.down_units is not None:  # a controller's reply: its view of the storage units replaces ours
                self._down_units = dict(header.down_units)
            if header.restarted_units:
                self._learn_restarts(header.restarted_units)
            if header.moved_units is not None:
                self._moved = header.moved_units
            if header.error_type is not None:
                raise error_from_wire(header.error_type, header.error_message or "")
            out.append((frames[1], frames[2:]))
        return out

    def _learn_restarts(self, restarted: dict[int, p.UnitRestart]) -> None:
        """Storage units Ray restarted: talk to them where they are now; their older blocks are lost, but those below
        ``refilled_below`` (replicas=2: copied back since)."""
        for unit, restart in restarted.items():
            known = self._restarted.get(unit)
            newer = known is None or _told(restart) > _told(known)
            if 0 <= unit < len(self._unit_endpoints) and newer:
                self._restarted[unit] = restart
                self._unit_endpoints[unit] = restart.endpoint

    def _read_units(self, meta: BatchMeta, avoid: Sequence[int] = ()) -> np.ndarray:
        """The storage unit to read each cell of ``meta`` from: the unit its block was placed on, or (replicas=2)
        the unit holding its second copy when the first is down, in ``avoid`` (it just failed) or restarted empty
        since the block was written, and the second is not (a retired unit's copy: where the controller moved it)."""
        units = meta.blocks % len(self._unit_endpoints)
        if self._replica_of is None:
            return units
        units, replica = current_holders(meta.blocks, len(self._unit_endpoints), self._replica_of, self._moved)
        fallback = ~self._usable(meta.blocks, units, avoid) & self._usable(meta.blocks, replica, avoid)
        return np.where(fallback, replica, units)

    def _usable(self, blocks: np.ndarray, units: np.ndarray, avoid: Sequence[int]) -> np.ndarray:
        """Per cell, whether ``units`` (its copy's unit) is neither down nor avoided and still holds ``blocks``."""
        return ~np.isin(units, [*self._down_units, *avoid]) & ~self._missing(blocks, units)

    def _missing(self, blocks: np.ndarray, units: np.ndarray) -> np.ndarray:
        """Per cell, whether ``units`` (a unit holding a copy of ``blocks``) lost it: it restarted empty since the
        block was written and has not got it back (replicas=2: below its ``refilled_below``)."""
        missing = np.zeros(np.shape(blocks), dtype=bool)
        for unit, restart in self._restarted.items():
            missing |= (units == unit) & (blocks < restart.lost_below) & (blocks >= restart.refilled_below)
        return missing

    def _rows_lost(self, meta: BatchMeta, units: np.ndarray) -> RowsLost | None:
        """The error for a read of ``meta`` if some of its cells were on a storage unit that restarted empty (with
        replicas=2: if both copies of them were gone, now or when the second of the units holding them then
        restarted; a retired unit's copies held where they were moved). ``units``: the unit each cell is read from;
        a lost cell is put on that unit's restart, else on the restart that lost its last copy."""
        num_units = len(self._unit_endpoints)
        if self._replica_of is None:
            gone = self._missing(meta.blocks, meta.blocks % num_units)
        else:
            first, second = current_holders(meta.blocks, num_units, self._replica_of, self._moved)
            gone = self._missing(meta.blocks, first) & self._missing(meta.blocks, second)
        took = {unit: np.zeros(np.shape(gone), dtype=bool) for unit in self._restarted}
        if self._replica_of is not None:
            for unit, restart in self._restarted.items():  # lost then, whatever was copied back or moved since
                for i, (partner, lo, hi) in enumerate(restart.lost_with):
                    moves = self._moved_then(restart, i, unit, partner)
                    one, other = current_holders(meta.blocks, num_units, self._replica_of, moves)  # as held then
                    pair = ((one == unit) & (other == partner)) | ((one == partner) & (other == unit))
                    took[unit] |= pair & (meta.blocks >= lo) & (meta.blocks < hi)
                    gone |= took[unit]
        read_from_restarted = np.isin(units, list(self._restarted))
        for unit, restart in sorted(self._restarted.items()):
            lost = ((units == unit) | (took[unit] & ~read_from_restarted)) & (meta.blocks >= 0) & gone
            if lost.any():
                rows = np.unique(meta.global_indexes[lost.any(axis=1)])
                fields = [name for j, name in enumerate(meta.field_names) if lost[:, j].any()]
                return RowsLost(
                    f"rows {rows[:20].tolist()}{' ...' if len(rows) > 20 else ''} ({len(rows)} of {len(meta)}) of "
                    f"{describe_partition(meta.partition_id)} were lost: storage unit {unit} died and was restarted "
                    f"empty (restart {restart.restarts}), taking fields {fields} of them; put them again as new rows "
                    "(client.lost_rows lists them)"
                )
        return None

    def _moved_then(self, restart: p.UnitRestart, entry: int, unit: int, partner: int) -> list[p.UnitMove]:
        """The moves as they stood when ``restart`` of ``unit`` lost its ``lost_with[entry]`` pair with ``partner``
        (each only as far as it had gone; those started since left out), those of a unit brought back after its
        move included (the blocks moved off it were not on it then). A controller that does not say how they stood:
        those of other units as they stand now (a move of either unit of the pair may have gone on since)."""
        if entry >= len(restart.lost_with_moved):
            return [move for move in self._moved if move.unit not in (unit, partner)]
        belows = restart.lost_with_moved[entry]
        return [
            msgspec.structs.replace(move, below=min(move.below, below))
            for move, below in zip(self._moved, belows, strict=False)
        ]

    async def _control(self, body: Any, reply_type: Any, timeout: float) -> Any:
        """One request to the controller. With ``restart_retry_s`` (QueueConfig), one that failed with ServerGone is
        asked again after a pause (doubling from RETRY_FIRST_S to RETRY_MAX_S) until that many seconds passed since
        the first failure; then the last ServerGone is raised. Commits and aborts are never asked again. Before it is
        asked again, the task options this client set are set again (the journal keeps them; this covers options set
        in a pass whose record the controller died before writing)."""
        give_up: float | None = None
        pause = RETRY_FIRST_S
        while True:
            try:
                if give_up is not None:  # asked again: the controller may be a new one
                    for options in list(self._task_options.values()):
                        await self._call([(self.controller_info.controller, options, ())], timeout, "set_task_options")
                ((reply, _),) = await self._call(
                    [(self.controller_info.controller, body, ())],
                    timeout,
                    f"the controller at {self.controller_info.controller.tcp} did not answer (is it alive?)",
                )
                return p.decode_as(reply, reply_type)
            except ServerGone as exc:
                now = time.monotonic()
                give_up = now + self.config.restart_retry_s if give_up is None else give_up
                if isinstance(body, NOT_RETRIED) or now >= give_up:
                    raise
                logger.warning(
                    "%s: %s; asking again in %.1f s (restart_retry_s: %.0f s left)",
                    type(body).__name__, exc, pause, give_up - now,
                )  # fmt: skip
                await self._pause(min(pause, give_up - now))
                pause = min(2 * pause, RETRY_MAX_S)
                if isinstance(body, p.Ack):  # the first may have been applied: acknowledged by us is no error then
                    body = msgspec.structs.replace(body, again=True)

    async def _pause(self, seconds: float) -> None:
        """Wait: without suspending over a blocking transport (its coroutines never suspend), else asyncio.sleep."""
        if isinstance(self._transport, BlockingTransport):
            time.sleep(seconds)
        else:
            await asyncio.sleep(seconds)

    async def _storage(
        self,
        calls: Sequence[tuple[int, Any, Sequence[Any]]],
        timeout: float,
        into: Sequence[dict[int, Any]] | None = None,
    ) -> list[tuple[Any, list]]:
        units = self._unit_endpoints
        try:
            return await self._call(
                [(units[u], body, bufs) for u, body, bufs in calls],
                timeout,
                f"storage units {[u for u, _, _ in calls]} did not answer",
                into,
            )
        except (RequestTimeout, ServerGone) as exc:
            # After the first failure the unit counts as down for this client (until the controller says otherwise).
            addresses = set(getattr(exc, "addresses", ()))
            called = sorted({u for u, _, _ in calls})
            failed = [u for u in called if {units[u].tcp, units[u].unix} & addresses] or called
            what = "is gone" if isinstance(exc, ServerGone) else f"did not answer within {timeout:.1f} s"
            for u in failed:
                self._down_units[u] = f"{units[u].tcp} {what}"
            error = StorageUnavailable(f"{exc}; a storage unit may have died")
            error.units = failed  # type: ignore[attr-defined]
            raise error from None

    def _unit_down(self, meta: BatchMeta, units: np.ndarray, down: dict[int, str], cause: str = "") -> StorageUnitDown:
        """The error for reads of ``meta``'s rows held by the ``down`` units: names each unit and its rows."""
        parts = []
        for u, why in sorted(down.items()):
            rows = np.unique(meta.global_indexes[np.any(units == u, axis=1)]).tolist()
            parts.append(f"storage unit {u} is down ({why}): it held rows {rows}")
        return StorageUnitDown(
            f"{cause}{'; '.join(parts)} of partition {meta.partition_id!r}, which cannot be read; new puts go to the "
            "live units"
        )

    def _field_lengths(self, columns: dict[str, Column], num_rows: int) -> tuple[bytes | None, list[str] | None]:
        """Per-row lengths of each length-bearing field (jagged, or in ``seqlen_fields``): ``Reserve.lengths`` and
        ``Reserve.length_fields``. Per field, so overwriting a field replaces its share of the row's length."""
        names, per_field = [], []
        for name, column in columns.items():
            if column.schema.kind == "jagged" or name in self.config.seqlen_fields:
                row = column.row_lengths()
                if row is not None:
                    names.append(name)
                    per_field.append(np.asarray(row, dtype=np.int64))
        if not names:
            return None, None
        return p.pack_indexes(np.stack(per_field, axis=1).reshape(-1)), names

    def close(self) -> None:
        """Close the sockets; the client cannot be used afterwards."""
        self._closed = True
        self._transport.close()
