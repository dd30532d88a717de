"""``Ledger``: the narrow store interface over SQLite (WAL, the default) or PostgreSQL. All SQL lives here.

Every public method is one explicit transaction. A claim takes a task whose lease expired (the longest expired
first), else the oldest pending task, each the first row of an index range (O(log n) in the tasks of the ledger,
see ``schema``): on PostgreSQL with ``SELECT ... FOR UPDATE SKIP LOCKED`` (concurrent claimers never wait on each
other's rows), on SQLite inside ``BEGIN IMMEDIATE`` (one writer at a time, the file is the lock); reads on SQLite
take no lock (a deferred ``BEGIN``: WAL lets them run beside the writer). Times are wall-clock seconds of the caller
(hosts that share a PostgreSQL ledger need synchronised clocks, as leases anywhere do).

>>> ledger = Ledger("sqlite:////tmp/doctest-ledger.db"); ledger.reset()
>>> ledger.write_epoch("train", 0, [Task(id="a")], owner="doc")
True
>>> claim, task = ledger.claim("train", owner="w1", lease_s=30)
>>> ledger.complete(claim.id); ledger.task_counts("train")
{'done': 1}
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

from sqlalchemy import (
    Connection,
    Float,
    Select,
    String,
    bindparam,
    column,
    create_engine,
    event,
    func,
    insert,
    inspect,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import DBAPIError, DisconnectionError, OperationalError

from workers.ledger import schema as s
from workers.ledger.errors import ClaimLost, LedgerNotFound, LedgerUnavailable, SchemaVersionMismatch
from workers.ledger.models import (
    DBRecordData,
    DispatchedSamplingTask,
    InferenceService,
    Record,
    Task,
    check_registered,
    task_from_row,
    task_type_name,
)
from workers.ledger.schema import redact


class EpochProgress(NamedTuple):
    """What the scheduler polls of one epoch, each count capped at the poll's ``limit``."""

    unfinished: int  # pending or running
    claimable: int  # pending, or running on an expired lease


class Ledger:
    """The task ledger behind ``db_connection_string`` (``sqlite:///PATH`` or ``postgresql://...``).

    Args:
        connection_string: which database; the SQLite file's directory is created if missing.
        max_attempts: claims a task gets before it is marked failed with its last error.
        create: create the tables if missing (and check the schema version either way).
    """

    def __init__(self, connection_string: str, max_attempts: int = 3, create: bool = True):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.target = s.parse_connection_string(connection_string)
        self.connection_string = connection_string
        self.max_attempts = max_attempts
        self.backend = self.target.backend
        if self.backend == "sqlite":
            if not create and not os.path.exists(self.target.path or ""):
                raise LedgerNotFound(
                    f"no ledger at {redact(connection_string)}: the file {self.target.path} does not exist"
                )
            os.makedirs(os.path.dirname(os.path.abspath(self.target.path or ".")), exist_ok=True)
            self._engine = create_engine(self.target.url, connect_args={"timeout": 60})
            event.listen(self._engine, "connect", _sqlite_on_connect)
            event.listen(self._engine, "begin", _sqlite_begin)
            # SQLite's and PostgreSQL's INSERT both have on_conflict_do_nothing(); one callable serves either
            self._insert: Callable[[Any], Any] = sqlite_insert
        else:
            self._engine = create_engine(self.target.url, pool_size=2, connect_args={"connect_timeout": 5})
            # a connection idle a while is pinged before use (a restarted server dropped it); one just used is not:
            # the ping would be a claim's second round trip
            event.listen(self._engine, "checkout", partial(_ping_if_idle, self._engine.dialect))
            event.listen(self._engine, "checkin", _mark_checkin)
            self._insert = pg_insert
        self._open(create)

    # -- schema ----------------------------------------------------------------------------------------------------
    def _open(self, create: bool) -> None:
        with self._tx() as conn:
            if self.backend == "postgresql":  # several processes may create the schema at once
                conn.execute(text("SELECT pg_advisory_xact_lock(720110)"))
            if create:
                s.metadata.create_all(conn)
            elif not inspect(conn).has_table(s.meta.name):
                raise LedgerNotFound(f"no ledger tables in {self._redacted()}: nothing was ever written there")
            version = s.meta.c.key == "schema_version"
            found = conn.execute(select(s.meta.c.value).where(version)).scalar()
            if found is None:
                conn.execute(insert(s.meta).values(key="schema_version", value=str(s.SCHEMA_VERSION)))
                return
            at = int(found)
            while at < s.SCHEMA_VERSION and at in s.MIGRATIONS:  # an older ledger: add what this version adds
                for index in s.MIGRATIONS[at]:
                    index.create(conn, checkfirst=True)
                at += 1
                conn.execute(update(s.meta).where(version).values(value=str(at)))
            if at != s.SCHEMA_VERSION:
                raise SchemaVersionMismatch(
                    f"ledger {self._redacted()} has schema version {found}; this code expects {s.SCHEMA_VERSION}"
                )

    def reset(self) -> None:
        """Drop and recreate every ledger table (tests, fresh runs)."""
        with self._tx() as conn:
            s.metadata.drop_all(conn)
        self._open(create=True)

    def close(self) -> None:
        """Close the connections; on SQLite first fold the write-ahead log into the database file and truncate it
        (``wal_checkpoint(TRUNCATE)``), so the ``.db`` file alone holds everything, and the ``-wal`` and ``-shm``
        files disappear with the last connection (another process still reading keeps them, empty, until it closes).
        A checkpoint a busy reader blocks is skipped: the next open folds the log in."""
        if self.backend == "sqlite":
            try:
                raw = self._engine.raw_connection()  # outside a transaction (a checkpoint cannot run inside one)
                try:
                    cursor = raw.cursor()
                    cursor.execute(f"PRAGMA busy_timeout={CLOSE_CHECKPOINT_WAIT_MS}")  # not 60 s behind a reader
                    cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                finally:
                    raw.close()
            except (OperationalError, sqlite3.Error):  # the file is gone or busy past busy_timeout: still close
                pass
        self._engine.dispose()

    def _redacted(self) -> str:
        return self._engine.url.render_as_string(hide_password=True)

    @contextmanager
    def _tx(self, read_only: bool = False, autocommit: bool = False) -> Iterator[Connection]:
        """One transaction; a lost or refused connection becomes :class:`LedgerUnavailable`. ``read_only``: on SQLite
        a deferred ``BEGIN`` (no write lock: it reads beside a writer) instead of ``BEGIN IMMEDIATE``. ``autocommit``
        (PostgreSQL, for a block of one statement, atomic by itself): no ``BEGIN`` and ``COMMIT`` round trips."""
        try:
            with self._engine.connect() as conn:
                if read_only:
                    conn.execution_options(ledger_read_only=True)
                if autocommit and self.backend == "postgresql":
                    conn.execution_options(isolation_level="AUTOCOMMIT")
                with conn.begin():
                    yield conn
        except (OperationalError, DBAPIError) as exc:
            if isinstance(exc, OperationalError) or exc.connection_invalidated:
                first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
                password = self._engine.url.password
                if password:  # a driver may echo the connection parameters back
                    first = first.replace(str(password), "***")
                raise LedgerUnavailable(f"ledger {self._redacted()} unavailable: {first}") from exc
            raise

    # -- tasks -----------------------------------------------------------------------------------------------------
    def write_epoch(self, split: str, epoch: int, tasks: Sequence[Task], owner: str) -> bool:
        """Write one epoch of ``split``'s tasks, all or nothing; ``False`` (nothing written) if it already was."""
        now = time.time()
        rows = []
        for task in tasks:
            check_registered(task)
            if task.id is None:
                raise ValueError(f"every task needs an id before it is written; got {task!r}")
            rows.append(
                dict(
                    task_id=task.id,
                    split=split,
                    epoch=epoch,
                    type=task_type_name(task),
                    payload=task.payload(),
                    status="pending",
                    attempts=0,
                    created_at=now,
                    updated_at=now,
                )
            )
        with self._tx() as conn:
            marker = self._insert(s.epochs).values(
                split=split, epoch=epoch, num_tasks=len(rows), written_by=owner, written_at=now
            )
            if conn.execute(marker.on_conflict_do_nothing().returning(s.epochs.c.epoch)).first() is None:
                return False
            if rows:
                conn.execute(insert(s.tasks), rows)
        return True

    def written_epochs(self, split: str) -> list[int]:
        with self._tx(read_only=True) as conn:
            query = select(s.epochs.c.epoch).where(s.epochs.c.split == split).order_by(s.epochs.c.epoch)
            return list(conn.execute(query).scalars())

    def tasks(self, split: str | None = None, epoch: int | None = None) -> list[Task]:
        query = select(s.tasks).order_by(s.tasks.c.key)
        if split is not None:
            query = query.where(s.tasks.c.split == split)
        if epoch is not None:
            query = query.where(s.tasks.c.epoch == epoch)
        with self._tx(read_only=True) as conn:
            return [_task(row) for row in conn.execute(query)]

    def task_counts(self, split: str | None = None, epoch: int | None = None) -> dict[str, int]:
        query = select(s.tasks.c.status, func.count()).group_by(s.tasks.c.status)
        if split is not None:
            query = query.where(s.tasks.c.split == split)
        if epoch is not None:
            query = query.where(s.tasks.c.epoch == epoch)
        with self._tx(read_only=True) as conn:
            return {status: n for status, n in conn.execute(query)}

    def claimable_count(self, split: str, epoch: int | None = None, limit: int | None = None) -> int:
        """Tasks of ``split`` a claim would get now: pending, or running on an expired lease; with ``limit``, counted
        up to ``limit`` (O(log n + limit): two index ranges, never the table)."""
        params = dict(split=split, epoch=epoch, now=time.time())
        by_epoch = epoch is not None
        with self._tx(read_only=True) as conn:
            pending = _count(conn, _claimable(False, by_epoch), params, limit)
            expired = _count(conn, _claimable(True, by_epoch), params, limit)
        return pending + expired if limit is None else min(pending + expired, limit)

    def epoch_progress(self, split: str, epoch: int, limit: int) -> EpochProgress:
        """The scheduler's poll of ``split``'s ``epoch`` in one read: unfinished (pending or running) and claimable
        tasks, each counted up to ``limit``, O(log n + limit) (index ranges, never the table)."""
        t = s.tasks.c
        params = dict(split=split, epoch=epoch, now=time.time())
        running_query = select(t.key).where(t.split == split, t.status == "running", t.epoch == epoch)
        with self._tx(read_only=True) as conn:
            pending = _count(conn, _claimable(False, True), params, limit)
            expired = _count(conn, _claimable(True, True), params, limit)
            running = _count(conn, running_query.order_by(t.epoch, t.key), {}, limit)
        return EpochProgress(unfinished=min(pending + running, limit), claimable=min(pending + expired, limit))

    # -- claims ----------------------------------------------------------------------------------------------------
    def claim(
        self, split: str, owner: str, lease_s: float = 60.0, epoch: int | None = None
    ) -> tuple[DispatchedSamplingTask, Task] | None:
        """Claim a task of ``split`` (of ``epoch``, if given) for ``owner``: one whose lease expired (its worker died
        or stalled; the longest expired first), else the oldest pending one (lowest epoch, then the order written);
        ``None`` when there is none. A task whose expired claims used up ``max_attempts`` is marked failed.

        Each candidate is the first row of an index range (``schema``): O(log n) in the ledger's tasks. On PostgreSQL
        the claim is one statement (one round trip, no ``BEGIN``/``COMMIT``), see :meth:`claim_many`."""
        got = self.claim_many(split, owner, 1, lease_s=lease_s, epoch=epoch)
        return got[0] if got else None

    def claim_many(
        self, split: str, owner: str, n: int, lease_s: float = 60.0, epoch: int | None = None
    ) -> list[tuple[DispatchedSamplingTask, Task]]:
        """Claim up to ``n`` tasks of ``split`` (of ``epoch``, if given) for ``owner`` at once, in the order
        :meth:`claim` takes them (expired leases first, the longest expired first, then the oldest pending tasks);
        fewer (or none) when fewer are claimable. Each task gets a claim of its own (heartbeat, complete... each).

        PostgreSQL: one statement (``_PG_CLAIM``) locks the candidates with ``FOR UPDATE SKIP LOCKED`` (concurrent
        claimers never wait on each other's rows, nor take the same one), ends their expired claims, inserts the new
        claims and updates the tasks, run outside an explicit transaction: one round trip for all ``n``. SQLite: one
        ``BEGIN IMMEDIATE`` transaction (the file is the lock) for all ``n``."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if self.backend == "postgresql":
            return self._claim_pg(split, owner, n, lease_s, epoch)
        return self._claim_sqlite(split, owner, n, lease_s, epoch)

    def _claim_pg(
        self, split: str, owner: str, n: int, lease_s: float, epoch: int | None
    ) -> list[tuple[DispatchedSamplingTask, Task]]:
        out: list[tuple[DispatchedSamplingTask, Task]] = []
        while len(out) < n:
            now = time.time()
            deadline = now + lease_s
            params = dict(
                split=split,
                epoch=epoch,
                now=now,
                deadline=deadline,
                owner=owner,
                n=n - len(out),
                max_attempts=self.max_attempts,
            )
            with self._tx(autocommit=True) as conn:
                rows = conn.execute(_PG_CLAIM[epoch is not None], params).all()
            claimed = [row for row in rows if row.claim_id is not None]
            # the order a claim takes them: expired leases (the longest expired first), then pending tasks
            claimed.sort(key=lambda r: (0, r.was_deadline, 0, 0) if r.was == "running" else (1, 0.0, r.epoch, r.key))
            for row in claimed:
                out.append((_new_claim(row, row.claim_id, owner, row.attempts, deadline, now), _task(row)))
            if len(claimed) == len(rows):  # none failed on its last attempt: there is no more to take now
                break
        return out

    def _claim_sqlite(
        self, split: str, owner: str, n: int, lease_s: float, epoch: int | None
    ) -> list[tuple[DispatchedSamplingTask, Task]]:
        t = s.tasks.c
        out: list[tuple[DispatchedSamplingTask, Task]] = []
        now = time.time()
        params = dict(split=split, epoch=epoch, now=now)
        deadline = now + lease_s
        with self._tx() as conn:
            while len(out) < n:
                row = None
                for expired in (True, False):
                    row = conn.execute(_CANDIDATE[expired, epoch is not None], params).first()
                    if row is not None:
                        break
                if row is None:
                    break
                if row.status == "running":  # its worker died or stalled: expire that claim
                    error = f"claim {row.claim_id} expired: lease ended {now - row.lease_deadline:.1f} s ago"
                    self._end_claim(conn, row.claim_id, "expired", error, now)
                    if row.attempts >= self.max_attempts:
                        values = dict(status="failed", claim_id=None, last_error=error, updated_at=now)
                        conn.execute(update(s.tasks).where(t.key == row.key).values(**values))
                        continue
                attempt = row.attempts + 1
                inserted = conn.execute(
                    _NEW_CLAIM,
                    dict(
                        task_key=row.key,
                        owner=owner,
                        attempt=attempt,
                        status="running",
                        lease_deadline=deadline,
                        created_at=now,
                        updated_at=now,
                    ),
                ).inserted_primary_key
                assert inserted is not None  # a one-row INSERT has its primary key
                claim_id = inserted[0]
                taken = dict(task_key=row.key, attempt=attempt, new_claim_id=claim_id, deadline=deadline, now=now)
                conn.execute(_TAKE_TASK, taken)
                claim = _new_claim(row, claim_id, owner, attempt, deadline, now)
                out.append((claim, _task(row).model_copy(update={"status": "running", "attempts": attempt})))
        return out

    def heartbeat(self, claim_id: int, lease_s: float = 60.0) -> float:
        """Renew a live claim's lease; its new deadline. :class:`ClaimLost` if it is no longer the live claim."""
        now = time.time()
        deadline = now + lease_s
        with self._tx() as conn:
            row = self._live(conn, claim_id)
            renew = dict(lease_deadline=deadline, updated_at=now)
            conn.execute(update(s.claims).where(s.claims.c.id == claim_id).values(**renew))
            conn.execute(update(s.tasks).where(s.tasks.c.key == row.key).values(lease_deadline=deadline))
        return deadline

    def complete(self, claim_id: int) -> None:
        """The claim finished its task: claim and task are done."""
        now = time.time()
        with self._tx() as conn:
            row = self._live(conn, claim_id)
            self._end_claim(conn, claim_id, "done", None, now)
            conn.execute(
                update(s.tasks).where(s.tasks.c.key == row.key).values(status="done", claim_id=None, updated_at=now)
            )

    def fail(self, claim_id: int, error: str) -> str:
        """The claim's worker raised ``error``: the task is claimable again, or failed after ``max_attempts``.
        Returns the task's new status."""
        now = time.time()
        with self._tx() as conn:
            row = self._live(conn, claim_id)
            self._end_claim(conn, claim_id, "failed", error, now)
            status = "failed" if row.attempts >= self.max_attempts else "pending"
            conn.execute(
                update(s.tasks)
                .where(s.tasks.c.key == row.key)
                .values(status=status, claim_id=None, last_error=error, updated_at=now)
            )
        return status

    def release(self, claim_id: int, reason: str = "returned by its owner") -> None:
        """Give a claimed task back unfinished (cancellation); the attempt does not count."""
        now = time.time()
        with self._tx() as conn:
            row = self._live(conn, claim_id)
            self._end_claim(conn, claim_id, "expired", reason, now)
            conn.execute(
                update(s.tasks)
                .where(s.tasks.c.key == row.key)
                .values(status="pending", claim_id=None, attempts=row.attempts - 1, updated_at=now)
            )

    def claims(self, split: str | None = None, status: str | None = None) -> list[DispatchedSamplingTask]:
        c, t = s.claims.c, s.tasks.c
        query = select(s.claims, t.task_id, t.split, t.epoch).join(s.tasks, c.task_key == t.key).order_by(c.id)
        if split is not None:
            query = query.where(t.split == split)
        if status is not None:
            query = query.where(c.status == status)
        with self._tx(read_only=True) as conn:
            return [DispatchedSamplingTask.model_validate(dict(row._mapping)) for row in conn.execute(query)]

    def _live(self, conn: Connection, claim_id: int) -> Any:
        """The task row whose live claim ``claim_id`` is, locked; :class:`ClaimLost` if none. Found through the claim's
        primary key and then the task's (``tasks.claim_id`` has no index: a claim changes it twice)."""
        row = conn.execute(_LIVE, dict(live_claim_id=claim_id)).first()
        if row is None or row.status != "running":
            raise ClaimLost(self._lost(conn, claim_id))
        return row

    @staticmethod
    def _lost(conn: Connection, claim_id: int) -> str:
        """Why ``claim_id`` is not live, naming its task and claimer."""
        c, t = s.claims.c, s.tasks.c
        query = select(c.owner, c.status, t.task_id, t.split, t.epoch).join(s.tasks, c.task_key == t.key)
        found = conn.execute(query.where(c.id == claim_id)).first()
        if found is None:
            return f"claim {claim_id} does not exist: it is not the live claim of any task"
        return (
            f"claim {claim_id} of task {found.task_id} (owner {found.owner}) is no longer the task's live claim "
            f"(split {found.split}, epoch {found.epoch}, claim {found.status}: its lease expired and the task was "
            f"claimed again, or it already ended); its claimer may not write records or queue samples"
        )

    @staticmethod
    def _end_claim(conn: Connection, claim_id: int, status: str, error: str | None, now: float) -> None:
        values: dict[str, Any] = dict(status=status, updated_at=now)
        if error is not None:
            values["last_error"] = error
        conn.execute(update(s.claims).where(s.claims.c.id == claim_id, s.claims.c.status == "running").values(**values))

    # -- records ---------------------------------------------------------------------------------------------------
    def write_record(self, record: Record) -> tuple[Record, bool]:
        """Write ``record`` unless its (task, epoch, sample) already has one; the stored record and whether this
        call wrote it. Safe to retry after a lost connection: a second write is a no-op."""
        return self.write_records([record])[0]

    def write_records(self, records: Sequence[Record], replace_unqueued: bool = False) -> list[tuple[Record, bool]]:
        """:meth:`write_record` for several records (a GRPO group) in one transaction: all visible at once.

        ``replace_unqueued``: a sample recorded by an earlier claim whose tensors never reached the queue (its worker
        died in between) is replaced by this one, so that the record and the queued tensors are the same sample.

        A record that names its ``claim_id`` is written only while that claim is its task's live claim, checked in
        the same transaction: a claimer whose lease another took gets :class:`ClaimLost` and nothing is written."""
        now = time.time()
        r = s.records.c
        out = []
        with self._tx() as conn:
            for claim_id in sorted({rec.claim_id for rec in records if rec.claim_id is not None}):
                self._live(conn, claim_id)
            for record in records:
                values = record.model_dump(exclude={"id", "task_id", "split", "epoch", "created_at"})
                stmt = self._insert(s.records).values(**values, created_at=now).on_conflict_do_nothing()
                written = conn.execute(stmt.returning(r.id)).first() is not None
                if not written and replace_unqueued:
                    where = [r.task_key == record.task_key, r.sample_index == record.sample_index]
                    replace = update(s.records).where(*where, r.partition_id.is_(None)).values(**values)
                    written = conn.execute(replace.returning(r.id)).first() is not None
                query = self._records_query().where(
                    r.task_key == record.task_key, r.sample_index == record.sample_index
                )
                out.append((Record.model_validate(dict(conn.execute(query).one()._mapping)), written))
        return out

    def set_record_locations(
        self,
        record_ids: Sequence[int],
        partition_id: str,
        global_indexes: Sequence[int],
        claim_id: int | None = None,
    ) -> None:
        """Where the records' tensors went in the queue (one queue row each, in order). With ``claim_id``, only while
        that claim is live (:class:`ClaimLost` otherwise, nothing set)."""
        if len(record_ids) != len(global_indexes):
            raise ValueError(f"{len(record_ids)} record ids but {len(global_indexes)} global indexes")
        with self._tx() as conn:
            if claim_id is not None:
                self._live(conn, claim_id)
            for record_id, index in zip(record_ids, global_indexes, strict=True):
                stmt = update(s.records).where(s.records.c.id == record_id)
                conn.execute(stmt.values(partition_id=partition_id, global_indexes=[int(index)]))

    def records(self, split: str | None = None, epoch: int | None = None) -> list[Record]:
        query = self._records_query().order_by(s.records.c.id)
        if split is not None:
            query = query.where(s.tasks.c.split == split)
        if epoch is not None:
            query = query.where(s.tasks.c.epoch == epoch)
        with self._tx(read_only=True) as conn:
            return [Record.model_validate(dict(row._mapping)) for row in conn.execute(query)]

    def trainable(
        self, split: str, step: int, max_trained_count: int = 1, retrained_interval: int = 0, limit: int | None = None
    ) -> list[DBRecordData]:
        """Records a trainer may use at ``step``: trained fewer than ``max_trained_count`` times and, if trained
        before, at least ``retrained_interval`` steps ago."""
        r = s.records.c
        query = (
            self._records_query()
            .where(s.tasks.c.split == split, r.trained_count < max_trained_count)
            .where(or_(r.last_trained_step.is_(None), r.last_trained_step <= step - retrained_interval))
            .order_by(r.id)
            .limit(limit)
        )
        with self._tx(read_only=True) as conn:
            rows = [dict(row._mapping) for row in conn.execute(query)]
        return [DBRecordData.model_validate({**row, "record_id": row["id"]}) for row in rows]

    def mark_trained(
        self,
        record_ids: Sequence[int],
        step: int,
        max_trained_count: int | None = None,
        retrained_interval: int = 0,
    ) -> list[int]:
        """The trainer uses these records at ``step``: one more training each. With ``max_trained_count``, only
        records still trainable at ``step`` are marked (atomically, so two consumers never both train one
        record past its limit); returns the ids marked, the ones to train on."""
        if not record_ids:
            return []
        r = s.records.c
        stmt = update(s.records).where(r.id.in_([int(i) for i in record_ids]))
        if max_trained_count is not None:
            stmt = stmt.where(r.trained_count < max_trained_count).where(
                or_(r.last_trained_step.is_(None), r.last_trained_step <= step - retrained_interval)
            )
        stmt = stmt.values(trained_count=r.trained_count + 1, last_trained_step=step).returning(r.id)
        with self._tx() as conn:
            return sorted(conn.execute(stmt).scalars())

    @staticmethod
    def _records_query() -> Any:
        t = s.tasks.c
        return select(s.records, t.task_id, t.split, t.epoch).join(s.tasks, s.records.c.task_key == t.key)

    # -- inference services ----------------------------------------------------------------------------------------
    def register_service(self, service: InferenceService) -> None:
        """Insert or replace ``service`` (its ``status`` included: ``up`` by default, ``down`` for one that is known but
        cannot serve now, e.g. restarting); the registration is a heartbeat."""
        values = service.model_dump() | {"last_heartbeat": time.time()}
        with self._tx() as conn:
            stmt = self._insert(s.services).values(**values)
            conn.execute(stmt.on_conflict_do_update(index_elements=["name"], set_=values))

    def service_heartbeat(self, name: str, load: float | None = None, policy_version: int | None = None) -> None:
        values: dict[str, Any] = dict(last_heartbeat=time.time(), status="up")
        if load is not None:
            values["load"] = load
        if policy_version is not None:
            values["policy_version"] = policy_version
        with self._tx() as conn:
            if conn.execute(update(s.services).where(s.services.c.name == name).values(**values)).rowcount != 1:
                raise KeyError(f"no inference service named {name!r} is registered")

    def set_service_status(self, name: str, status: str) -> None:
        with self._tx() as conn:
            conn.execute(update(s.services).where(s.services.c.name == name).values(status=status, load=0.0))

    def mark_stale_services(self, stale_after_s: float) -> int:
        """Mark services whose last heartbeat is older than ``stale_after_s`` down; how many were marked."""
        cutoff = time.time() - stale_after_s
        c = s.services.c
        with self._tx() as conn:
            stmt = update(s.services).where(c.status == "up", c.last_heartbeat < cutoff).values(status="down")
            return conn.execute(stmt).rowcount

    def services(self, model: str | None = None, healthy_only: bool = False) -> list[InferenceService]:
        c = s.services.c
        query = select(s.services).order_by(c.load, c.name)
        if model is not None:
            query = query.where(c.model == model)
        if healthy_only:
            query = query.where(c.status == "up")
        with self._tx(read_only=True) as conn:
            return [InferenceService.model_validate(dict(row._mapping)) for row in conn.execute(query)]

    # -- locks -----------------------------------------------------------------------------------------------------
    def acquire_lock(self, name: str, owner: str, ttl_s: float) -> bool:
        """Take (or renew) the named lease for ``owner``; ``False`` while another owner holds it unexpired.

        One upsert: taken if absent, else renewed or taken over if ``owner`` holds it or it expired. (Before, an
        ``INSERT`` that found the lock held was followed by a read of it, which found nothing on PostgreSQL when its
        holder released it in between: ``NoResultFound``.)"""
        now = time.time()
        c = s.locks.c
        held = dict(owner=owner, expires_at=now + ttl_s)
        stmt = self._insert(s.locks).values(name=name, **held)
        stmt = stmt.on_conflict_do_update(
            index_elements=[c.name], set_=held, where=or_(c.owner == owner, c.expires_at < now)
        )
        with self._tx(autocommit=True) as conn:
            return conn.execute(stmt.returning(c.name)).first() is not None

    def release_lock(self, name: str, owner: str) -> None:
        with self._tx() as conn:
            conn.execute(s.locks.delete().where(s.locks.c.name == name, s.locks.c.owner == owner))

    # -- overview --------------------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Counts for the status view: tasks by (split, epoch, status), claims and records by status, services."""
        t, c = s.tasks.c, s.claims.c
        with self._tx(read_only=True) as conn:
            tasks = conn.execute(select(t.split, t.epoch, t.status, func.count()).group_by(t.split, t.epoch, t.status))
            claims = conn.execute(select(c.status, func.count()).group_by(c.status))
            out: dict[str, Any] = {
                "tasks": sorted((split, epoch, status, n) for split, epoch, status, n in tasks),
                "claims": dict(sorted(claims.all())),
                "records": conn.execute(select(func.count()).select_from(s.records)).scalar(),
                "records_trained": conn.execute(
                    select(func.count()).select_from(s.records).where(s.records.c.trained_count > 0)
                ).scalar(),
            }
        out["services"] = self.services()
        return out


def _claimable(expired: bool, by_epoch: bool) -> Select[Any]:
    """The claimable tasks of split ``:split`` (of epoch ``:epoch`` if ``by_epoch``) in the order a claim takes them,
    as one index range: running on a lease that ended before ``:now`` (``ix_tasks_leases``, the longest expired
    first), or pending (``ix_tasks_claimable``, the oldest first). Selects the key."""
    t = s.tasks.c
    if expired:
        query = select(t.key).where(t.split == bindparam("split"), t.status == "running")
        query = query.where(t.lease_deadline < bindparam("now")).order_by(t.lease_deadline)
    else:
        query = select(t.key).where(t.split == bindparam("split"), t.status == "pending").order_by(t.epoch, t.key)
    return query.where(t.epoch == bindparam("epoch")) if by_epoch else query


# a claim's statements, built once: building SQLAlchemy constructs costs more CPU than SQLite takes to run them
_CANDIDATE = {
    (expired, by_epoch): _claimable(expired, by_epoch)
    .with_only_columns(*s.tasks.c)
    .limit(1)
    .with_for_update(skip_locked=True)
    for expired in (True, False)
    for by_epoch in (False, True)
}
_NEW_CLAIM = insert(s.claims)
_TAKE_TASK = (
    update(s.tasks)
    .where(s.tasks.c.key == bindparam("task_key"))
    .values(
        status="running",
        attempts=bindparam("attempt"),
        claim_id=bindparam("new_claim_id"),
        lease_deadline=bindparam("deadline"),
        updated_at=bindparam("now"),
    )
)


def _pg_claim(by_epoch: bool) -> Any:
    """PostgreSQL's claim of up to ``:n`` tasks as one statement. ``picked``: the candidates, locked with ``FOR UPDATE
    SKIP LOCKED`` (rows another claimer holds are passed over, never waited on; a row another claimer took meanwhile
    fails the re-checked ``WHERE``), expired leases first (``ix_tasks_leases``), then pending tasks
    (``ix_tasks_claimable``; read only when the expired ones are fewer than ``:n``). ``ended``: their expired claims.
    ``claimed``: a new claim for each, unless its expired claims used up ``:max_attempts``. Then the tasks: running
    under their new claim, or failed. Returns the tasks' rows (``claim_id`` NULL for a failed one), with what each
    was before (``was``, ``was_deadline``: the order a claim takes them)."""
    in_epoch = " AND epoch = :epoch" if by_epoch else ""
    columns = "key, status, claim_id, attempts, lease_deadline"
    expired_error = (
        "'claim ' || p.claim_id || ' expired: lease ended ' || round((:now - p.lease_deadline)::numeric, 1) || ' s ago'"
    )
    sql = f"""
WITH expired AS (
    SELECT {columns} FROM ledger_tasks
    WHERE split = :split AND status = 'running' AND lease_deadline < :now{in_epoch}
    ORDER BY lease_deadline LIMIT :n FOR UPDATE SKIP LOCKED
), pending AS (
    SELECT {columns} FROM ledger_tasks
    WHERE split = :split AND status = 'pending'{in_epoch}
    ORDER BY epoch, key LIMIT :n FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT * FROM (SELECT * FROM expired UNION ALL SELECT * FROM pending) AS candidates LIMIT :n
), ended AS (
    UPDATE ledger_claims AS c SET status = 'expired', updated_at = :now, last_error = {expired_error}
    FROM picked AS p
    WHERE p.status = 'running' AND c.id = p.claim_id AND c.status = 'running'
), claimed AS (
    INSERT INTO ledger_claims (task_key, owner, attempt, status, lease_deadline, created_at, updated_at)
    SELECT key, :owner, attempts + 1, 'running', :deadline, :now, :now FROM picked
    WHERE status = 'pending' OR attempts < :max_attempts
    RETURNING id, task_key
)
UPDATE ledger_tasks AS t SET
    status = CASE WHEN c.id IS NULL THEN 'failed' ELSE 'running' END,
    attempts = CASE WHEN c.id IS NULL THEN p.attempts ELSE p.attempts + 1 END,
    claim_id = c.id,
    lease_deadline = CASE WHEN c.id IS NULL THEN p.lease_deadline ELSE :deadline END,
    last_error = CASE WHEN c.id IS NULL THEN {expired_error} ELSE t.last_error END,
    updated_at = :now
FROM picked AS p LEFT JOIN claimed AS c ON c.task_key = p.key
WHERE t.key = p.key
RETURNING t.key, t.task_id, t.split, t.epoch, t.type, t.payload, t.status, t.attempts, t.claim_id, t.last_error,
    p.status AS was, p.lease_deadline AS was_deadline
"""
    t = s.tasks.c
    return text(sql).columns(
        t.key,
        t.task_id,
        t.split,
        t.epoch,
        t.type,
        t.payload,
        t.status,
        t.attempts,
        t.claim_id,
        t.last_error,
        column("was", String),
        column("was_deadline", Float),
    )


_PG_CLAIM = {by_epoch: _pg_claim(by_epoch) for by_epoch in (False, True)}


_LIVE = (
    select(s.tasks)
    .where(
        s.tasks.c.key
        == select(s.claims.c.task_key).where(s.claims.c.id == bindparam("live_claim_id")).scalar_subquery(),
        s.tasks.c.claim_id == bindparam("live_claim_id"),
    )
    .with_for_update(of=s.tasks)
)


def _count(conn: Connection, query: Select[Any], params: dict[str, Any], limit: int | None) -> int:
    """How many rows ``query`` selects, up to ``limit`` (all of them with ``None``). The query keeps its index's
    order: under a ``LIMIT`` PostgreSQL would otherwise read the table from its start, on a guess that the rows are
    spread evenly (they are not: the claimed ones are at its start)."""
    rows = (query.limit(limit) if limit is not None else query.order_by(None)).subquery()
    return int(conn.execute(select(func.count()).select_from(rows), params).scalar() or 0)


def _new_claim(
    row: Any, claim_id: int, owner: str, attempt: int, deadline: float, now: float
) -> DispatchedSamplingTask:
    """The live claim just taken on the task ``row`` (a row of ``tasks``)."""
    return DispatchedSamplingTask(
        id=claim_id,
        task_key=row.key,
        task_id=row.task_id,
        split=row.split,
        epoch=row.epoch,
        owner=owner,
        attempt=attempt,
        status="running",
        lease_deadline=deadline,
        created_at=now,
        updated_at=now,
        last_error=row.last_error,
    )


def _task(row: Any) -> Task:
    return task_from_row(
        row.type,
        row.payload,
        id=row.task_id,
        split=row.split,
        epoch=row.epoch,
        status=row.status,
        attempts=row.attempts,
        last_error=row.last_error,
    )


# how long closing a SQLite ledger waits for readers to let its checkpoint through before it closes without one
CLOSE_CHECKPOINT_WAIT_MS = 1000

# how long a pooled PostgreSQL connection may sit unused and still be handed out without a ping
PING_AFTER_IDLE_S = 1.0


def _mark_checkin(dbapi_connection: Any, record: Any) -> None:
    if record is not None:
        record.info["ledger_checked_in"] = time.monotonic()


def _ping_if_idle(dialect: Any, dbapi_connection: Any, record: Any, proxy: Any) -> None:
    """``pool_pre_ping`` for connections idle longer than ``PING_AFTER_IDLE_S`` only: one back in use within that
    second is not pinged (a server restart inside it surfaces as :class:`LedgerUnavailable` on the next call, which
    callers retry, as they do for a restart during a call). A failed ping makes the pool open a fresh connection."""
    checked_in = record.info.get("ledger_checked_in")
    if checked_in is not None and time.monotonic() - checked_in <= PING_AFTER_IDLE_S:
        return
    try:
        dialect.do_ping(dbapi_connection)  # SELECT 1 in autocommit (no transaction left open)
    except Exception as exc:  # the connection is gone: the pool discards it and connects anew
        raise DisconnectionError(f"ledger connection lost while idle: {exc}") from exc


def _sqlite_begin(conn: Connection) -> None:
    # writers take the write lock up front (no deadlock between two deferred readers that both upgrade); reads do not
    read_only = conn.get_execution_options().get("ledger_read_only", False)
    conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


def _sqlite_on_connect(dbapi_connection: Any, _: Any) -> None:
    # let SQLAlchemy's "begin" event issue BEGIN IMMEDIATE instead of pysqlite's deferred BEGIN
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=60000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
