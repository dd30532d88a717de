"""QueueConfig: the one source of truth for how a queue is shaped."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from transfer_queue.errors import InvalidRequest

SHARED_MEMORY_ENV = "TRANSFER_QUEUE_SHARED_MEMORY"


def shared_memory_default() -> bool:
    """``QueueConfig.shared_memory``'s default: ``TRANSFER_QUEUE_SHARED_MEMORY=1`` in the environment turns it on
    (``0`` or unset: off), so a test tier can run every queue it starts with it."""
    value = os.environ.get(SHARED_MEMORY_ENV, "0").strip().lower()
    if value not in ("0", "1", "true", "false", ""):
        raise InvalidRequest(f"{SHARED_MEMORY_ENV} must be 0 or 1, got {value!r}")
    return value in ("1", "true")


@dataclass(frozen=True)
class QueueConfig:
    """How a queue is shaped; validated on construction.

    Args:
        global_batch_size: prompts per global step (a step partition holds ``global_batch_size * num_n_samples``
            rows).
        num_global_batch: steps live at once (the step ring); a put that would open one more waits for a clear.
        num_n_samples: rows per GRPO group (responses per prompt).
        num_storage_units: storage actors holding the payload.
        storage_unit_bytes: payload bytes one storage unit may hold; puts beyond it wait for a clear.
        default_timeout: seconds an operation waits when the caller passes ``timeout=None`` (finite, never forever).
        put_grace: extra seconds a put's reservation outlives its timeout before it is aborted (client died).
        max_reservation_s: the longest a put's reservation lives, whatever timeout the put asked for (plus
            ``put_grace``): a producer that died with a huge timeout holds rows, bytes and groups no longer.
        disconnect_grace: seconds after a client's last connection closed before its open puts are aborted (rows,
            bytes and groups freed) and its leases go back to ready; a client that reconnects within it keeps both.
        max_waiting_requests: requests (get_meta, put) parked in the controller at once; one more is refused with
            ``QueueBusy`` instead of being parked.
        seqlen_fields: dense 2-D fields whose row sums count towards a row's length (jagged fields always count).
        lease_s: seconds rows handed out by ``get_meta`` stay leased without an acknowledgement before they go back
            to ready (a task's ``set_task_options(lease_s=...)`` or a call's ``lease_s`` overrides it).
        max_lease_s: the most seconds one ``extend_lease`` may set a lease's deadline ahead of now (a consumer that
            needs longer extends again, e.g. with ``keep_leased``): a dead client's rows come back within it.
        max_deliveries: times a row is handed out to a task before, coming back once more, it is dead-lettered.
        max_fields: fields one partition may hold (1..64; each row keeps its produced fields as bits of a uint64).
        promote_jagged: a dense field whose first per-row dimension changes between puts becomes jagged (as
            upstream TransferQueue does) instead of raising SchemaMismatch.
        http_host: address the read-only HTTP endpoints (``/metrics`` of every actor, the controller's ``/status``)
            bind; 127.0.0.1 unless you open them to a Prometheus on another host (e.g. ``0.0.0.0``).
        http_port: the controller's HTTP port (0: a free one; storage units always take free ones); -1: no HTTP.
        storage_unit_max_restarts: times Ray restarts a storage unit the controller started that died (its process or
            node); a restarted unit comes back empty and the rows it held are reported lost (``client.lost_rows``).
            0: a dead unit stays down.
        checkpoint_timeout: seconds ``save_checkpoint`` waits for every storage unit to write its files; a unit that
            takes longer (stalled, overloaded disk) fails the save with ``CheckpointError`` naming it, and the
            previous checkpoint stays current. The queue serves every other client meanwhile.
        task_names: the tasks that consume this queue's rows. Given, ``get_meta``, ``set_task_options`` and
            ``register_sampler`` refuse any other name with ``UnknownTask`` (a typo fails at once instead of starting
            a new consumer that is served every row again). Empty (the default): any name is served, and a name
            never seen before that starts a new consumer of a partition known tasks already consume is warned about
            once (``UnknownTaskWarning`` in the caller, a warning in the controller's log).
        replicas: copies of every row's payload, each on another storage unit (on another Ray node where the units
            run on several): 1 (the default) or 2. With 2, a put commits once both units hold its blocks, a read falls
            back to the other copy at once when a unit is down or came back empty, and a row is lost only when both
            copies are gone; the byte budget is halved (every byte is held twice). At most ``num_storage_units``.
        status_partitions: live partitions the status summary (``client.status()``, ``/status.json``, the status
            page and command) details one by one: the most recent ones; the rest are counted in aggregate
            (``partitions_omitted``), so a status read stays bounded however many partitions are live.
        journal_dir: a directory where the controller journals its bookkeeping (commits, consumption, clears, kv
            keys; transfer_queue.state.journal): a controller started again over it (Ray restarting it, or a new one
            in the same process) replays it and finds its storage units' rows. None (the default): no journal.
        journal_fsync: when the journal is made durable: ``"always"`` (each serving pass's records are fsynced before
            its replies go out: an acknowledged commit survives a host crash), ``"interval"`` (at most once per
            second: a host crash may lose the last second, a process crash nothing) or ``"never"`` (the OS decides).
        journal_snapshot_bytes: the journal's log is folded into a fresh snapshot once it is longer than this and
            than the last snapshot (which bounds both replay time and disk use).
        restart_retry_s: seconds every client of the queue keeps asking the controller again, with backoff, a call
            that failed with ``ServerGone`` (the controller died; with ``journal_dir`` Ray restarts it and it comes
            back where it was) before it raises the ``ServerGone``. A put's commit is never asked again (whether its
            rows became visible is unknown: it raises), nor an abort; a put's reserve is (nothing was committed).
            0 (the default): no retry.
        shared_memory: same-host payloads through shared memory (transfer_queue.wire.shm): a sync client on a storage
            unit's host copies a put straight into memory the unit granted and a get straight out of the unit's
            blocks (memfd segments passed once over the Unix socket, which then carries only control frames); the
            unit's and the client's buffers are pooled, so the steady state takes no page faults. Clients on other
            hosts, the async client, replica copies, checkpoints and refills keep using the sockets. Off by default
            (``TRANSFER_QUEUE_SHARED_MEMORY=1`` turns the default on).
        shared_memory_pool_bytes: with ``shared_memory``, the free segments a storage unit (and each client) keeps
            for reuse, in bytes; beyond it freed segments go back to the OS. Also the most a unit grants its
            connections to stage puts in, all together (each holds about its last put's size); a put beyond that,
            or larger than this, travels over the socket.
    """

    global_batch_size: int
    num_global_batch: int = 1
    num_n_samples: int = 1
    num_storage_units: int = 2
    storage_unit_bytes: int = 8 << 30
    default_timeout: float = 60.0
    put_grace: float = 30.0
    max_reservation_s: float = 600.0
    disconnect_grace: float = 5.0
    max_waiting_requests: int = 65536
    seqlen_fields: tuple[str, ...] = field(default=("attention_mask",))
    lease_s: float = 600.0
    max_lease_s: float = 3600.0
    max_deliveries: int = 5
    max_fields: int = 64
    promote_jagged: bool = False
    http_host: str = "127.0.0.1"
    http_port: int = 0
    storage_unit_max_restarts: int = 5
    checkpoint_timeout: float = 30.0
    status_partitions: int = 100
    replicas: int = 1
    task_names: tuple[str, ...] = ()
    journal_dir: str | None = None
    journal_fsync: str = "always"
    journal_snapshot_bytes: int = 64 << 20
    restart_retry_s: float = 0.0
    shared_memory: bool = field(default_factory=shared_memory_default)
    shared_memory_pool_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        for name in (
            "global_batch_size",
            "num_global_batch",
            "num_n_samples",
            "num_storage_units",
            "max_waiting_requests",
            "status_partitions",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequest(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.storage_unit_bytes, int) or self.storage_unit_bytes < 1:
            raise InvalidRequest(f"storage_unit_bytes must be an int >= 1, got {self.storage_unit_bytes!r}")
        if not isinstance(self.max_deliveries, int) or isinstance(self.max_deliveries, bool) or self.max_deliveries < 1:
            raise InvalidRequest(f"max_deliveries must be an int >= 1, got {self.max_deliveries!r}")
        for name in (
            "default_timeout",
            "put_grace",
            "max_reservation_s",
            "lease_s",
            "max_lease_s",
            "disconnect_grace",
            "checkpoint_timeout",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise InvalidRequest(f"{name} must be a finite number of seconds > 0, got {value!r}")
        restarts = self.storage_unit_max_restarts
        if not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < 0:
            raise InvalidRequest(f"storage_unit_max_restarts must be an int >= 0, got {restarts!r}")
        if not isinstance(self.max_fields, int) or isinstance(self.max_fields, bool) or not 1 <= self.max_fields <= 64:
            raise InvalidRequest(
                f"max_fields must be an int in [1, 64] (a row's produced fields are bits of a uint64), got "
                f"{self.max_fields!r}"
            )
        if not isinstance(self.promote_jagged, bool):
            raise InvalidRequest(f"promote_jagged must be a bool, got {self.promote_jagged!r}")
        if not isinstance(self.http_port, int) or isinstance(self.http_port, bool) or not -1 <= self.http_port < 65536:
            raise InvalidRequest(f"http_port must be an int in [-1, 65535] (0: free, -1: none), got {self.http_port!r}")
        replicas = self.replicas
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas not in (1, 2):
            raise InvalidRequest(
                f"replicas must be 1 or 2 (copies of each row on distinct storage units), got {replicas!r}"
            )
        if replicas > self.num_storage_units:
            raise InvalidRequest(
                f"replicas={replicas} needs as many storage units, each copy on another one; num_storage_units="
                f"{self.num_storage_units}"
            )
        object.__setattr__(self, "seqlen_fields", tuple(self.seqlen_fields))
        if not isinstance(self.task_names, (list, tuple)):
            raise InvalidRequest(f"task_names must be a list or tuple of task names, got {self.task_names!r}")
        names = tuple(self.task_names)
        if not all(isinstance(n, str) and n for n in names):
            raise InvalidRequest(f"task_names must be non-empty strs, got {names!r}")
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise InvalidRequest(f"task_names names {twice!r} twice")
        object.__setattr__(self, "task_names", names)
        if self.journal_dir is not None and (not isinstance(self.journal_dir, str) or not self.journal_dir):
            raise InvalidRequest(f"journal_dir must be a directory path (str) or None, got {self.journal_dir!r}")
        if self.journal_fsync not in ("always", "interval", "never"):
            raise InvalidRequest(f"journal_fsync must be 'always', 'interval' or 'never', got {self.journal_fsync!r}")
        snap = self.journal_snapshot_bytes
        if not isinstance(snap, int) or isinstance(snap, bool) or snap < 1:
            raise InvalidRequest(f"journal_snapshot_bytes must be an int >= 1, got {snap!r}")
        if not isinstance(self.shared_memory, bool):
            raise InvalidRequest(f"shared_memory must be a bool, got {self.shared_memory!r}")
        pool = self.shared_memory_pool_bytes
        if not isinstance(pool, int) or isinstance(pool, bool) or pool < 0:
            raise InvalidRequest(f"shared_memory_pool_bytes must be an int >= 0, got {pool!r}")
        retry = self.restart_retry_s
        if isinstance(retry, bool) or not isinstance(retry, (int, float)) or not 0 <= retry < float("inf"):
            raise InvalidRequest(f"restart_retry_s must be a finite number of seconds >= 0, got {retry!r}")

    def check_extension(self, seconds: Any) -> None:
        """``extend_lease``'s seconds: a finite number in (0, max_lease_s]; InvalidRequest otherwise."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= self.max_lease_s:
            raise InvalidRequest(
                f"extend_lease: seconds must be a number in (0, {float(self.max_lease_s)}] (max_lease_s), got "
                f"{seconds!r}"
            )

    @property
    def byte_budget(self) -> int:
        """Payload bytes the queue holds at most: what its units hold together, over the copies of each byte."""
        return self.storage_unit_bytes * self.num_storage_units // self.replicas

    @property
    def shared_memory_bytes(self) -> int:
        """What storage units and clients pool for shared memory: ``shared_memory_pool_bytes``, or 0 without
        ``shared_memory`` (the sockets only)."""
        return self.shared_memory_pool_bytes if self.shared_memory else 0

    @property
    def rows_per_step(self) -> int:
        return self.global_batch_size * self.num_n_samples

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["seqlen_fields"] = list(self.seqlen_fields)
        d["task_names"] = list(self.task_names)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QueueConfig:
        return cls(
            **{
                **d,
                "seqlen_fields": tuple(d.get("seqlen_fields", ("attention_mask",))),
                "task_names": tuple(d.get("task_names", ())),
            }
        )
