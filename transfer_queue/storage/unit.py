"""StorageUnit: a Ray actor holding tensor payloads as column blocks.

A put's rows arrive as one block per storage unit: for each field a column over the received frames (no copy).
A read names, per field, the (block, offset) of each row; rows come back gathered per field, as a view when they
are one contiguous run of one block. Blocks die when their partition is cleared, their put is aborted, or (kv
upserts) nothing references them any more; freed memory is handed back to the OS.

:class:`BlockStore` is the logic (no Ray, no sockets); :class:`StorageUnit` serves it over ZeroMQ.
"""

from __future__ import annotations

import ctypes
import hmac
import logging
import os
import resource
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from transfer_queue.errors import (
    InvalidRequest,
    PartitionCleared,
    PutExpired,
    StaleBatchMeta,
    UnknownField,
)
from transfer_queue.ops.metrics import StorageMetrics, nbytes, render, storage_families
from transfer_queue.ops.web import PROMETHEUS_TEXT, HttpEndpoint
from transfer_queue.storage.checkpoint import CheckpointError, load_unit, restore_into, save_unit
from transfer_queue.wire import protocol as p
from transfer_queue.wire.auth import write_token
from transfer_queue.wire.columns import Column, as_buffer, concat_columns, jagged_take, nframes, take_rows
from transfer_queue.wire.server import DEFAULT_MAX_MESSAGE_BYTES, Responder, Server
from transfer_queue.wire.shm import SegmentPool, supported
from transfer_queue.wire.transport import Endpoint
from transfer_queue.wire.unix_socket import GatheredFrame

logger = logging.getLogger(__name__)
TRIM_EVERY_BYTES = 64 << 20
SHM_IDLE_S = 60.0  # free shared-memory segments unused this long go back to the OS


@dataclass
class Block:
    partition_uid: int
    num_rows: int
    columns: dict[str, Column]
    nbytes: int


def _libc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def _mmap_large_allocations(threshold: int = 1 << 20) -> None:
    """Serve allocations above ``threshold`` with mmap, so freeing a payload returns it to the OS at once
    (glibc otherwise raises the threshold dynamically and keeps freed payloads in its heap)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except OSError:
        pass


class BlockStore:
    """Blocks of one storage unit, by block id, with tombstones so late writes of dead puts are refused.

    Tombstones stay bounded over a long run: the controller's drop messages say which partitions are live (every
    other uid up to ``max_uid`` is dead) and below which block id every put has finished (a write there is late),
    so the store keeps only what those two facts do not already say.
    """

    def __init__(self, unit: int, num_units: int, secret: bytes = b""):
        self.unit = unit
        self.num_units = num_units
        self.secret = secret  # checks each write's reservation token (b"": no check, unit tests of the store)
        self.holds: frozenset[int] = frozenset()  # replicas=2: the units whose blocks this one holds a copy of
        self.blocks: dict[int, Block] = {}
        self.by_partition: dict[int, set[int]] = {}
        self.dead_partitions: set[int] = set()  # cleared uids the controller's live list does not cover yet
        self.dead_blocks: dict[int, set[int]] = {}  # aborted or dropped blocks at or above block_floor
        self.live_uids: frozenset[int] = frozenset()
        self.max_uid = 0  # uids up to this that are not in live_uids are dead
        self.block_floor = 0  # every block below this belongs to a finished put
        self.nbytes = 0
        self._freed_since_trim = 0

    def write(self, req: p.Write, buffers: Sequence[Any]) -> None:

        if self._dead(req.partition_uid):
            raise PartitionCleared(f"partition uid {req.partition_uid} was cleared; the write was dropped")
        late = req.block_id < self.block_floor and not req.refill  # a refill copies a block of a finished put
        if late or req.block_id in self.dead_blocks.get(req.partition_uid, ()):
            raise PutExpired(
                f"block {req.block_id} belongs to a put that was aborted or already finished; the write was dropped"
            )
        mine = req.block_id % self.num_units == self.unit or req.block_id % self.num_units in self.holds
        if not mine and not req.refill:  # the controller's copies (signed) go anywhere: a retired unit's are moved
            raise InvalidRequest(
                f"block {req.block_id} belongs to storage unit {req.block_id % self.num_units}, not {self.unit}"
            )
        if req.block_id in self.blocks:
            if req.refill:  # a refill tried again after its answer was late: the block is here already
                return
            raise InvalidRequest(f"block {req.block_id} was already written")
        for spec in req.columns:
            if spec.nframes != nframes(spec.schema):
                raise InvalidRequest(
                    f"column {spec.name!r} declares {spec.nframes} frames; a {spec.schema.kind} column has "
                    f"{nframes(spec.schema)}"
                )
        expected = sum(nframes(c.schema) for c in req.columns)
        if expected != len(buffers):
            raise InvalidRequest(f"the write describes {expected} buffers and carries {len(buffers)}")
        columns: dict[str, Column] = {}
        i = 0
        for spec in req.columns:
            if spec.num_rows != req.num_rows or spec.name in columns:
                raise InvalidRequest(f"column {spec.name!r}: {spec.num_rows} rows in a block of {req.num_rows}")
            k = nframes(spec.schema)
            columns[spec.name] = Column.from_buffers(spec.schema, spec.num_rows, buffers[i : i + k])
            i += k
        nbytes = sum(memoryview(b).nbytes for b in buffers)
        self._check_reserved(req, nbytes)
        self.blocks[req.block_id] = Block(req.partition_uid, req.num_rows, columns, nbytes)
        self.by_partition.setdefault(req.partition_uid, set()).add(req.block_id)
        self.nbytes += nbytes

    def _check_reserved(self, req: p.Write, nbytes: int) -> None:
        """The write must carry the controller's token for what its put reserved, and no more bytes than that."""
        if not self.secret:
            return
        expected = write_token(self.secret, req.partition_uid, req.block_id, req.num_rows, req.max_bytes)
        if not hmac.compare_digest(req.token, expected):
            raise InvalidRequest(
                f"block {req.block_id}: the write does not carry the controller's reservation for it (a put must "
                "reserve before it writes)"
            )
        if nbytes > req.max_bytes:
            raise InvalidRequest(
                f"block {req.block_id} carries {nbytes} bytes; its put reserved {req.max_bytes} (declared sizes must "
                "match the data)"
            )

    def read(self, req: p.Read, gathered: bool = False) -> tuple[p.ReadReply, list[Any]]:
        """The rows ``req`` names, field by field: a reply and its buffers. ``gathered`` (the server's sends): a
        field whose rows lie in several blocks, each a run, in order, comes back as a :class:`GatheredFrame` of
        those runs, not copied into one new buffer (the common large read: a step's puts read back in order)."""
        if self._dead(req.partition_uid):
            raise StaleBatchMeta(f"the rows of this BatchMeta were cleared (partition uid {req.partition_uid})")
        specs, buffers = [], []
        for spec in req.fields:
            parts, positions = self._parts(req.partition_uid, spec)
            runs = _in_order(parts, positions) if gathered and len(parts) > 1 else None
            if runs is not None:
                column_spec, frames = _gathered(runs)
                specs.append(p.ColumnSpec(spec.name, *column_spec))
                buffers.extend(frames)
                continue
            column = concat_columns(parts, positions, sum(len(pos) for pos in positions))
            specs.append(p.ColumnSpec(spec.name, column.schema, column.num_rows, nframes(column.schema)))
            buffers.extend(column.buffers())
        return p.ReadReply(specs), buffers

    def _parts(self, uid: int, spec: p.ReadField) -> tuple[list[Column], list[np.ndarray]]:
        """Each block's rows of ``spec``'s field, and where they go in the reply."""
        blocks = p.unpack_indexes(spec.blocks)
        offsets = p.unpack_indexes(spec.offsets)
        if len(blocks) != len(offsets):
            raise InvalidRequest(f"field {spec.name!r}: {len(blocks)} block ids but {len(offsets)} offsets")
        parts, positions = [], []
        for block_id in np.unique(blocks).tolist():
            block = self.blocks.get(block_id)
            if block is None or block.partition_uid != uid:
                raise StaleBatchMeta(
                    f"block {block_id} of field {spec.name!r} is gone (its partition was cleared or the value was "
                    "overwritten); get a fresh BatchMeta"
                )
            column = block.columns.get(spec.name)
            if column is None:
                raise UnknownField(f"field {spec.name!r} is not in block {block_id}; it has {list(block.columns)}")
            pos = np.flatnonzero(blocks == block_id)
            rows = offsets[pos]
            if len(rows) and (rows.min() < 0 or rows.max() >= block.num_rows):
                raise InvalidRequest(f"offsets of field {spec.name!r} lie outside block {block_id}")
            parts.append(_take(column, rows))
            positions.append(pos)
        if not parts:
            raise InvalidRequest(f"field {spec.name!r}: a read needs at least one row")
        if len({part.schema for part in parts}) > 1:  # a field promoted to jagged: its older blocks are dense
            parts = [part.as_jagged() for part in parts]
        return parts, positions

    def _dead(self, uid: int) -> bool:
        return uid in self.dead_partitions or (uid <= self.max_uid and uid not in self.live_uids)

    def drop_blocks(self, uid: int, block_ids: Sequence[int], block_floor: int | None = None) -> None:
        self.dead_blocks.setdefault(uid, set()).update(
            b for b in block_ids if b >= max(self.block_floor, block_floor or 0)
        )
        for block_id in block_ids:
            self._free(block_id)
        self._raise_floor(block_floor)
        self._maybe_trim()

    def drop_partition(
        self,
        uid: int,
        live_uids: Sequence[int] | None = None,
        max_uid: int | None = None,
        block_floor: int | None = None,
    ) -> None:
        self.dead_partitions.add(uid)
        self.dead_blocks.pop(uid, None)
        for block_id in self.by_partition.pop(uid, set()):
            self._free(block_id)
        if live_uids is not None and max_uid is not None and max_uid >= self.max_uid:
            # the controller's view replaces the tombstones it covers: every uid up to max_uid not live is dead
            self.live_uids, self.max_uid = frozenset(live_uids), max_uid
            self.dead_partitions = {u for u in self.dead_partitions if u > max_uid}
            for dead in [u for u in self.by_partition if self._dead(u)]:  # a late write that slipped in before
                for block_id in self.by_partition.pop(dead):
                    self._free(block_id)
        self._raise_floor(block_floor)
        self._maybe_trim(force=True)

    def _raise_floor(self, block_floor: int | None) -> None:
        if block_floor is None or block_floor <= self.block_floor:
            return
        self.block_floor = block_floor
        for uid in list(self.dead_blocks):
            kept = {b for b in self.dead_blocks[uid] if b >= block_floor}
            if kept:
                self.dead_blocks[uid] = kept
            else:
                del self.dead_blocks[uid]

    def _free(self, block_id: int) -> None:
        block = self.blocks.pop(block_id, None)
        if block is not None:
            self.nbytes -= block.nbytes
            self._freed_since_trim += block.nbytes
            blocks = self.by_partition.get(block.partition_uid)
            if blocks is not None:
                blocks.discard(block_id)

    def _maybe_trim(self, force: bool = False) -> None:
        if self._freed_since_trim >= TRIM_EVERY_BYTES or (force and self._freed_since_trim):
            _libc_trim()
            self._freed_since_trim = 0

    def stats(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "pid": os.getpid(),
            "cpu_s": time.process_time(),  # this process (the unit serves from a thread of it)
            "blocks": len(self.blocks),
            "bytes": self.nbytes,
            "rss_bytes": _rss_bytes(),
            "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,  # minor faults of this process
        }


def save_staged(staging: str, unit: int, num_units: int, blocks: dict[int, Block]) -> int:
    """Write ``blocks`` as unit ``unit``'s files of the checkpoint staged under ``staging``; returns their bytes. A
    staging directory that is gone belongs to a save the controller gave up (this unit was too slow): nothing is
    written, so a late unit leaves no files behind."""
    if not os.path.isdir(staging):
        raise CheckpointError(f"the checkpoint staged under {staging} was abandoned before this unit wrote it")
    save_unit(staging, unit, num_units, blocks)
    return sum(block.nbytes for block in blocks.values())


def _in_order(parts: list[Column], positions: list[np.ndarray]) -> list[Column] | None:
    """``parts`` in reply order when each is one run of the reply's rows and the runs follow each other from row 0
    (then the parts' bytes end to end are the reply's); None otherwise, or for object columns (one encoded list)."""
    if parts[0].schema.kind == "object":
        return None
    order = sorted(range(len(parts)), key=lambda i: int(positions[i][0]))
    at = 0
    for i in order:
        pos = positions[i]
        if int(pos[0]) != at or int(pos[-1]) != at + len(pos) - 1:  # np.unique per block: ascending, no repeats
            return None
        at += len(pos)
    return [parts[i] for i in order]


def _gathered(runs: list[Column]) -> tuple[tuple[Any, int, int], list[Any]]:
    """The (schema, rows, frames) spec and the frames of ``runs`` laid end to end, without copying their data: a
    dense column is one :class:`GatheredFrame`; a jagged one its values as one and its offsets (small) joined."""
    schema = runs[0].schema
    num_rows = sum(run.num_rows for run in runs)
    values = GatheredFrame([as_buffer(run.data) for run in runs if run.data is not None and run.data.numel()])
    if schema.kind == "dense":
        return (schema, num_rows, 1), [values]
    offsets, base = [np.zeros(1, dtype=np.int64)], 0
    for run in runs:
        assert run.offsets is not None
        run_offsets = run.offsets.numpy()
        offsets.append(run_offsets[1:] - run_offsets[0] + base)
        base += int(run_offsets[-1] - run_offsets[0])
    return (schema, num_rows, 2), [values, np.concatenate(offsets)]


def _take(column: Column, rows: np.ndarray) -> Column:
    """Rows of a block's column; a view when they are one contiguous ascending run."""

    n = len(rows)
    contiguous = n and int(rows[-1]) - int(rows[0]) == n - 1 and (n == 1 or bool(np.all(np.diff(rows) == 1)))
    if contiguous:
        return column.slice(int(rows[0]), int(rows[0]) + n)
    if column.schema.kind == "object":
        assert column.objects is not None
        return Column(column.schema, n, objects=[column.objects[i] for i in rows.tolist()])
    assert column.data is not None
    if column.schema.kind == "dense":
        return Column(column.schema, n, data=take_rows(column.data, rows))
    assert column.offsets is not None
    values, offsets = jagged_take(column.data, column.offsets.numpy(), rows)
    return Column(column.schema, n, data=values, offsets=offsets)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class StorageServer(Server):
    """Serves a BlockStore from a background thread, over ZeroMQ (any host) and a Unix socket (this host).

    ``shared_memory_bytes`` > 0: payloads of same-host clients that ask for it travel through shared memory
    (transfer_queue.wire.shm): blocks written over the Unix socket live in memfd segments of a pool that keeps up to
    that many free bytes, each for at most ``SHM_IDLE_S`` unused."""

    what = "storage unit"

    def __init__(
        self,
        store: BlockStore,
        host: str | None = None,
        session_id: str | None = None,
        secret: bytes = b"",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        advertise_host: str | None = None,
        shared_memory_bytes: int = 0,
    ):
        shm = shared_memory_bytes > 0 and supported()
        pool = SegmentPool(shared_memory_bytes, f"tq-shm-u{store.unit}") if shm else None
        super().__init__(
            f"tq-storage-{store.unit}",
            p.decode_storage_request,
            session_id,
            host,
            secret,
            max_message_bytes,
            advertise_host,
            shm_pool=pool,
        )
        self.store = store
        self.metrics = StorageMetrics()  # recorded on the serving thread; read by scrapes under ``lock``
        self._handlers: dict[type, Any] = {
            p.Write: lambda req, bufs: self.store.write(req, bufs),
            p.Read: lambda req, bufs: self.store.read(req, gathered=True),
            p.DropBlocks: lambda req, bufs: self.store.drop_blocks(req.partition_uid, req.block_ids, req.block_floor),
            p.DropPartition: lambda req, bufs: self.store.drop_partition(
                req.partition_uid, req.live_uids, req.max_uid, req.block_floor
            ),
            p.StorageStats: lambda req, bufs: self.stats(),
        }
        # checkpoint saves: the block table is taken on this thread, the files are written by one thread beside it
        self._saver = ThreadPoolExecutor(1, thread_name_prefix=f"tq-storage-{store.unit}-save")
        self._saves: list[tuple[Future[int], Responder]] = []
        self._next_shm_trim = 0.0
        self.start()

    def _save(self, req: p.SaveUnit, responder: Responder) -> None:
        """Take the block table now (its blocks' buffers never change once written, so a block dropped after this
        is still written from here) and write it in the background; answered by :meth:`periodic` once written."""
        store = self.store
        blocks = dict(store.blocks)
        if req.primaries is not None:  # replicas=2: each block is saved once, by the holder the controller chose
            primaries = set(req.primaries)
            blocks = {b: block for b, block in blocks.items() if b % store.num_units in primaries}
        self._saves.append(
            (self._saver.submit(save_staged, req.staging, store.unit, store.num_units, blocks), responder)
        )

    def periodic(self, events: dict[Any, int]) -> None:
        if self.shm_pool is not None:
            now = time.monotonic()
            if now >= self._next_shm_trim:
                self._next_shm_trim = now + 1.0
                self.shm_pool.trim(SHM_IDLE_S)
        if not self._saves:
            return
        pending = []
        for future, responder in self._saves:
            if not future.done():
                pending.append((future, responder))
            elif future.exception() is not None:
                exc = future.exception()
                responder.fail(CheckpointError(f"storage unit {self.store.unit}: {type(exc).__name__}: {exc}"))
            else:
                responder.ok(future.result())
        self._saves = pending

    def close_sockets(self) -> None:
        self._saver.shutdown(wait=False, cancel_futures=True)
        super().close_sockets()

    def handle(self, request: Any, buffers: list[Any], responder: Responder) -> None:
        if isinstance(request, p.SaveUnit):
            self._save(request, responder)
            return
        started, kind = time.perf_counter(), type(request).__struct_config__.tag
        try:
            result = self._handlers[type(request)](request, buffers)
        except Exception as exc:
            self.metrics.record(kind, time.perf_counter() - started, exc)
            raise
        if isinstance(result, tuple):
            responder.ok(*result)
            self.metrics.bytes_out += nbytes(result[1])
        else:
            responder.ok(result)
            if kind == "write":
                self.metrics.bytes_in += nbytes(buffers)
        self.metrics.record(kind, time.perf_counter() - started)

    def prometheus_text(self) -> bytes:
        """This unit's metrics in the Prometheus text format (see transfer_queue.ops.metrics)."""
        with self.lock:
            shm = {} if self.shm_pool is None else {"shm": self.shm_pool.stats()}
            families = list(storage_families({**self.store.stats(), **shm}, self.metrics))
        return render(lambda: families)

    def stats(self) -> dict[str, Any]:
        """The store's figures, the serving loop's counters (``server`` key) and, with shared memory, its pool's
        (``shm``: segments open, their bytes, free bytes kept, segments created and reused)."""
        with self.lock:
            shm = {} if self.shm_pool is None else {"shm": self.shm_pool.stats()}
            return {**self.store.stats(), "server": super().stats(), **shm}


@ray.remote
class StorageUnit:
    """A Ray actor holding one share of the queue's payload. Create it through the controller (or pass handles
    to ``TransferQueueController(storage_units=[...])`` to place units yourself).

    Args:
        unit, num_units: this unit's number and how many the queue has.
        bind_host: the address its socket binds (default: its node's address as Ray sees it; ``0.0.0.0`` or ``::``
            for every interface).
        advertise_host: the address clients connect to (default: ``bind_host``, or the node's address when
            ``bind_host`` is a wildcard). Never a wildcard.
        bind_node_id: apply ``bind_host`` and ``advertise_host`` only if this unit runs on that Ray node, else use
            the node's address (a controller passes its own host's address down this way: a unit it starts on
            another node cannot bind there).
    """

    def __init__(
        self,
        unit: int,
        num_units: int,
        bind_host: str | None = None,
        advertise_host: str | None = None,
        bind_node_id: str | None = None,
    ):
        _mmap_large_allocations()
        if bind_node_id is not None and bind_node_id != p.ray_node_id():
            bind_host = advertise_host = None
        self._bind_host = bind_host
        self._advertise_host = advertise_host
        self._server: StorageServer | None = None  # serves from attach on: it needs the queue's secret first
        self._web: Any = None
        # A new id each time this actor starts: after Ray restarted it (empty), the controller sees a new one
        self._incarnation = uuid.uuid4().hex

    def attach(
        self,
        session_id: str,
        unit: int,
        num_units: int,
        secret: bytes = b"",
        max_message_bytes: int | None = None,
        shared_memory_bytes: int = 0,
    ) -> Endpoint:
        """Join a controller's session as unit ``unit`` of ``num_units``; returns where this unit listens.

        Joining the session it already serves, as the same unit, changes nothing (a controller restarted from its
        journal finds its blocks there).

        Args:
            secret: the queue's secret (through Ray, never a socket): every connection must prove it.
            max_message_bytes: the largest message a client may send (a write holds at most what the units hold).
            shared_memory_bytes: > 0: serve same-host clients through shared memory, keeping up to this many free
                bytes of segments pooled (``QueueConfig.shared_memory``); 0: over the socket only.
        """
        old = self._server
        if (
            old is not None
            and old.session_id == session_id
            and old.store.unit == unit
            and old.store.num_units == num_units
            and old.store.secret == secret
        ):
            # its controller was started again from its journal (journal_dir): the unit keeps its blocks and its
            # endpoint, which the journal's block ids still point to
            return old.endpoint
        if old is not None:
            with old.lock:
                if old.store.blocks:
                    raise InvalidRequest("a storage unit that holds data cannot join another session")
            old.stop()
        limit = DEFAULT_MAX_MESSAGE_BYTES if max_message_bytes is None else max_message_bytes
        store = BlockStore(unit, num_units, secret)
        self._server = StorageServer(
            store, self._bind_host, session_id, secret, limit, self._advertise_host, shared_memory_bytes
        )
        return self._server.endpoint

    def hold_copies(self, units: list[int]) -> None:
        """replicas=2: accept writes of the blocks of ``units`` too (this unit holds their second copy)."""
        server = self._joined()
        with server.lock:
            server.store.holds = frozenset(units)

    def session(self) -> str | None:
        """The session this unit serves (None: it joined none yet, e.g. Ray just restarted it empty): a controller
        started again from its journal tells the units that kept its blocks from fresh ones."""
        return None if self._server is None else self._server.session_id

    def incarnation(self) -> str:
        """This process's id, new each time Ray (re)starts the actor: the controller's watcher calls it every second
        and attaches a restarted unit (empty, on new ports) when it changes."""
        return self._incarnation

    def alive(self) -> bool:
        """A liveness call (the controller's watcher): Ray answers it with an actor error once this unit died."""
        return True

    def stats(self) -> dict[str, Any]:
        if self._server is None:
            raise InvalidRequest("this storage unit has not joined a queue yet (attach)")
        return self._server.stats()

    def restore_checkpoint(self, checkpoint: str, old_units: list[int], block_ids: dict[int, int]) -> int:
        """Load the blocks the controller's map names from the files of ``old_units`` (renumbered by ``block_ids``:
        restoring onto another number of units); blocks no partition references any more are left out."""

        server = self._joined()
        with server.lock:
            store = server.store
            secret, store.secret = store.secret, b""  # the controller vouches for these blocks: no put reserved them
            try:
                loaded = 0
                for unit in old_units:
                    saved = [block for block in load_unit(checkpoint, unit) if block.block_id in block_ids]
                    loaded += restore_into(store, saved, block_ids)
                return loaded
            finally:
                store.secret = secret

    def _joined(self) -> StorageServer:
        if self._server is None:
            raise InvalidRequest("this storage unit has not joined a queue yet (attach)")
        return self._server

    def serve_metrics(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve ``/metrics`` over HTTP on ``host:port`` (0: a free port); returns its URL (once started, the same)."""
        if self._web is None:

            def metrics() -> tuple[str, bytes]:
                if self._server is None:
                    raise InvalidRequest("this storage unit has not joined a queue yet (attach)")
                return PROMETHEUS_TEXT, self._server.prometheus_text()

            self._web = HttpEndpoint({"/metrics": metrics}, host, port)
        return self._web.url + "/metrics"

    def shutdown(self) -> None:
        if self._web is not None:
            self._web.stop()
            self._web = None
        if self._server is not None:
            self._server.stop()
