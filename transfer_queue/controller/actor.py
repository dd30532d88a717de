"""TransferQueueController: the Ray actor of the control plane.

A thin shell: a ROUTER socket served by the shared poll loop (transfer_queue.wire.server), handing requests to its
:class:`~transfer_queue.controller.requests.RequestTable`, which translates them into calls of
:class:`~transfer_queue.state.queue_state.QueueState` (all bookkeeping lives there, unit-testable without Ray or a wire
format). Ray's own
actor calls (creating it, ``register_sampler``, ``get_info``) are the trusted control channel; everything on the
socket is typed msgpack and nothing received is unpickled. The controller never touches tensor bytes.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import msgspec
import ray

from transfer_queue.config import QueueConfig
from transfer_queue.controller.server import ControllerServer
from transfer_queue.controller.unit_watch import UnitWatcher
from transfer_queue.errors import (
    ConfigMismatch,
    InvalidRequest,
)
from transfer_queue.samplers import SamplerSpec
from transfer_queue.state.journal import Journal, open_journal, read_identity, remove_journal, write_identity
from transfer_queue.state.placement import replica_units
from transfer_queue.state.queue_state import QueueState
from transfer_queue.state.snapshot import block_map, read_snapshot, restore_state, unit_restores
from transfer_queue.storage.checkpoint import (
    current_checkpoint,
    read_controller,
)
from transfer_queue.wire import protocol as p
from transfer_queue.wire.auth import new_secret

logger = logging.getLogger(__name__)


class ControllerActor:
    """The control plane: which fields of which rows are produced, which tasks consumed them, and the samplers.

    It serves clients over ZeroMQ on behalf of the storage units it is handed. This class is the actor's body;
    ``transfer_queue.TransferQueueController`` (:mod:`transfer_queue.runtime`) is the Ray actor class, which starts
    ``num_storage_units`` :class:`~transfer_queue.storage.unit.StorageUnit` actors when it is given no
    ``storage_units`` (handles you created and placed yourself).

    Args:
        global_batch_size: prompts per global step.
        num_global_batch: steps live at once (the step ring).
        num_n_samples: rows per GRPO group.
        sampler: the default sampler for every task: an instance, a class, or a callable returning one.
        num_storage_units: storage actors to start when ``storage_units`` is not given.
        storage_units: storage actor handles to use instead (placed by you, e.g. one per node).
        storage_unit_options: Ray ``.options(...)`` for the storage actors this controller starts: one dict for
            all, or one per unit (``scheduling_strategy``, ``resources``, ``num_cpus``, ...).
        bind_host: address the controller's socket binds to (default: the node's address as Ray sees it; a wildcard
            such as ``0.0.0.0`` advertises the node's address). Storage units it starts on this node bind it too;
            units on other nodes bind their own node's address. To set each unit's ``bind_host`` and
            ``advertise_host``, start the units yourself and pass ``storage_units``.
        restore_from: a directory ``save_checkpoint`` wrote: start with its partitions, consumption, kv keys,
            samplers' states and payload (onto this controller's storage units, however many).
        own_storage_units: the ``storage_units`` given are this controller's own (stopped on shutdown, restarted by
            Ray): ``transfer_queue.init`` starts them itself for a controller with a ``journal_dir``, so that they
            outlive the controller's process (actors die with the actor that created them).
        **config: the other :class:`~transfer_queue.config.QueueConfig` fields (``storage_unit_bytes``,
            ``default_timeout``, ``put_grace``, ``seqlen_fields``).

    """

    def __init__(
        self,
        global_batch_size: int,
        num_global_batch: int = 1,
        num_n_samples: int = 1,
        sampler: SamplerSpec | None = None,
        *,
        num_storage_units: int | None = None,
        storage_units: list[Any] | None = None,
        storage_unit_options: dict[str, Any] | list[dict[str, Any]] | None = None,
        bind_host: str | None = None,
        restore_from: str | None = None,
        own_storage_units: bool = False,
        **config: Any,
    ):
        if storage_units is not None and num_storage_units not in (None, len(storage_units)):
            raise InvalidRequest(
                f"num_storage_units={num_storage_units} but {len(storage_units)} storage_units were given"
            )
        units = len(storage_units) if storage_units is not None else (num_storage_units or 2)
        self._config = QueueConfig(
            global_batch_size=global_batch_size,
            num_global_batch=num_global_batch,
            num_n_samples=num_n_samples,
            num_storage_units=units,
            **config,
        )
        state = QueueState(self._config, sampler)
        # a checkpoint that is missing or of another queue fails here, before any storage unit is started
        restoring = self._read_checkpoint(restore_from) if restore_from is not None else None
        journal: Journal | None = None
        identity: dict[str, Any] | None = None
        replayed = False
        if self._config.journal_dir is not None:
            if restoring is not None:
                raise InvalidRequest(
                    f"restore_from={restore_from!r} and journal_dir={self._config.journal_dir!r} were both given: a "
                    "journaled controller starts from its journal; restore the checkpoint into a queue without one"
                )
            # a controller started again (by Ray, after it died) replays the journal, and presents the session,
            # secret and port its clients and storage units know
            state, journal, replayed = open_journal(self._config, sampler)
            identity = read_identity(self._config.journal_dir)
            if replayed:
                logger.warning(
                    "replayed the journal under %s: %d partitions", self._config.journal_dir, len(state.partitions)
                )
        self._session_id = identity["session_id"] if identity else uuid.uuid4().hex
        # handed out through Ray only (get_info, attach); proven on every connection
        self._secret = identity["secret"] if identity else new_secret()
        self._owns_units = storage_units is None or own_storage_units
        if storage_units is None:
            storage_units = self.start_storage_units(units, storage_unit_options, bind_host)
        self._units = storage_units
        # replaying a journal: a unit that does not serve this session any more came back empty (Ray restarted it
        # while the controller was down, or the units are new: the process that started them died); its rows are lost.
        # A unit whose actor is dead for good (Ray will not restart it: e.g. retired before the controller died) is
        # left out: it stays down for good, and its copies are where its move put them (or are moved now).
        fresh: list[int] = []
        dead: set[int] = set()
        if journal is not None and replayed:
            sessions = _ask_each(storage_units, "session")
            dead = {u for u, session in enumerate(sessions) if session is _DEAD}
            fresh = [u for u, session in enumerate(sessions) if u not in dead and session != self._session_id]
        self._message_limit = limit = self._config.storage_unit_bytes * units + (1 << 20)  # a write never holds more
        live = [u for u in range(units) if u not in dead]
        shm = self._config.shared_memory_bytes
        attaching = [storage_units[u].attach.remote(self._session_id, u, units, self._secret, limit, shm) for u in live]
        attached = dict(zip(live, ray.get(attaching), strict=True))
        endpoints = [attached[u] if u in attached else _last_endpoint(identity, u) for u in range(units)]
        incarnations: list[str | None] = [None] * units
        for u, incarnation in zip(live, ray.get([storage_units[u].incarnation.remote() for u in live]), strict=True):
            incarnations[u] = incarnation
        # replicas=2: each unit's partner, fixed at the queue's start (a journal keeps them: a unit Ray restarted on
        # another node keeps its partner); each unit accepts the copies it holds before anything is written, restored
        # blocks included
        kept = identity.get("replica_of") if identity else None
        self._replica_of = (
            list(kept) if kept is not None else replica_units([e.node_id for e in endpoints], self._config.replicas)
        )
        if self._replica_of is not None:
            ray.get([storage_units[u].hold_copies.remote(self._copies_of(u)) for u in live])
        if restoring is not None:
            state = self._restore(*restoring, sampler)
        port = identity["port"] if identity else 0
        self._server = ControllerServer(
            state, self._session_id, endpoints, bind_host, self._secret, journal=journal, port=port
        )
        for unit in fresh:
            lost = self._server.restart_unit(unit, endpoints[unit])
            logger.warning("storage unit %d does not hold this queue's blocks any more: %s", unit, lost)
        for unit in sorted(dead):
            logger.warning("storage unit %d is dead for good (found so when the controller started again)", unit)
            self._server.mark_unit(unit, "its Ray actor died (found dead when the controller started again)", True)
        endpoint = self._server.endpoint
        self._journal_dir = journal.directory if journal is not None else None
        if journal is not None:
            self._write_identity(_port(endpoint), endpoints)
            # clients reach a journaled controller over TCP only: its port is the same after a restart (ZeroMQ
            # reconnects by itself), its Unix socket's path would not be
            endpoint = msgspec.structs.replace(endpoint, unix=None)
        self._watcher = UnitWatcher(
            storage_units,
            [e.node_id for e in endpoints],
            self._server.mark_unit,
            incarnations,
            self._unit_restarted,
            restartable=self._owns_units and self._config.storage_unit_max_restarts > 0,
        )
        self._web = serve_status(self._server, storage_units, self._config.http_host, self._config.http_port)
        self._info = p.ControllerInfo(
            p.PROTOCOL_VERSION,
            self._session_id,
            endpoint,
            endpoints,
            self._config.to_dict(),
            self._secret,
            self._replica_of,
        )

    def _write_identity(self, port: int, endpoints: list[p.Endpoint]) -> None:
        """Save what a controller started again over this journal must present and know (journaled queues only)."""
        if self._journal_dir is not None:
            units = [list(msgspec.structs.astuple(e)) for e in endpoints]
            write_identity(self._journal_dir, self._session_id, self._secret, port, units, self._replica_of)

    def _copies_of(self, unit: int) -> list[int]:
        """replicas=2: the units whose blocks ``unit`` holds the second copy of."""
        return [u for u, partner in enumerate(self._replica_of or ()) if partner == unit]

    def start_storage_units(
        self, num_units: int, options: dict[str, Any] | list[dict[str, Any]] | None, bind_host: str | None
    ) -> list[Any]:
        """Start this controller's own storage units (it was given none); the runtime's actor class does."""
        raise InvalidRequest(
            f"this controller was given no storage_units and cannot start {num_units}: pass storage_units=[...] or "
            "use transfer_queue.TransferQueueController, which starts them"
        )

    def _unit_restarted(self, unit: int) -> bool:
        """Ray restarted storage unit ``unit`` (the watcher saw a new incarnation): attach it to this session again, on
        its new ports; the rows it held are marked lost. Runs on the watcher's thread."""
        handle = self._units[unit]
        units = len(self._units)
        endpoint = ray.get(
            handle.attach.remote(
                self._session_id, unit, units, self._secret, self._message_limit, self._config.shared_memory_bytes
            ),
            timeout=60,
        )
        if self._replica_of is not None:  # before the controller marks it up: puts write copies to it from then on
            ray.get(handle.hold_copies.remote(self._copies_of(unit)), timeout=60)
        lost = self._server.restart_unit(unit, endpoint)
        storage = list(self._info.storage_units)
        storage[unit] = endpoint
        self._info = msgspec.structs.replace(self._info, storage_units=storage)
        self._write_identity(_port(self._server.endpoint), storage)  # a journal knows where each unit listens now
        if self._web is not None:
            try:
                url = ray.get(handle.serve_metrics.remote(self._config.http_host), timeout=30)
                with self._server.lock:
                    urls = list(self._server.endpoints.get("storage_units", []))
                    if unit < len(urls):
                        urls[unit] = url
                        self._server.endpoints = {**self._server.endpoints, "storage_units": urls}
            except Exception:  # metrics only: the unit serves the queue all the same
                logger.exception("storage unit %d: its /metrics endpoint did not start after the restart", unit)
        logger.warning("storage unit %d restarted: %s", unit, lost)
        return True

    def _read_checkpoint(self, root: str) -> tuple[str, str, dict[str, Any]]:
        """The committed checkpoint under ``root`` and its controller snapshot, checked against this queue's
        configuration."""
        checkpoint = current_checkpoint(root)
        snapshot = read_snapshot(read_controller(checkpoint))
        saved = snapshot["config"]
        for name in ("global_batch_size", "num_n_samples"):
            if saved[name] != getattr(self._config, name):
                raise ConfigMismatch(
                    f"the checkpoint under {root} is of a queue with {name}={saved[name]}; this one has "
                    f"{name}={getattr(self._config, name)}"
                )
        return root, checkpoint, snapshot

    def _restore(self, root: str, checkpoint: str, snapshot: dict[str, Any], sampler: SamplerSpec | None) -> QueueState:
        units = len(self._units)
        mapping, blocks = block_map(snapshot, units)
        plan = unit_restores(snapshot, mapping, units, self._replica_of)  # with replicas=2, both copies of each
        ray.get(
            [
                unit.restore_checkpoint.remote(checkpoint, files, block_ids)
                for unit, (files, block_ids) in zip(self._units, plan, strict=True)
            ]
        )
        logger.info("restored %d partitions from %s onto %d storage units", len(snapshot["partitions"]), root, units)
        return restore_state(snapshot, self._config, sampler, mapping, blocks)

    def save_checkpoint(self, directory: str) -> str:
        """Save the queue under ``directory`` (what ``client.save_checkpoint`` asks); returns its directory."""
        return self._server.save(directory)

    def get_info(self) -> p.ControllerInfo:
        """What ``TransferQueueClient(client_id=..., controller_info=...)`` needs."""
        return self._info

    def get_config(self) -> dict[str, Any]:
        """The QueueConfig as a dict, plus the default sampler's class name under ``sampler``."""
        return {**self._config.to_dict(), "sampler": type(self._server.state.default_sampler).__name__}

    def register_sampler(self, task_name: str, sampler: SamplerSpec) -> None:
        """Give ``task_name`` its own sampler (instance, class or callable); other tasks keep the default."""
        self._server.register_sampler(task_name, sampler)

    def cpu_seconds(self) -> float:
        """CPU seconds this controller process and its storage units have used so far (the queue's own cost)."""
        return time.process_time() + sum(unit["cpu_s"] for unit in self.storage_stats())

    def server_stats(self) -> dict[str, Any]:
        """The controller's socket counters: ``dropped.unauthenticated`` counts connections refused because they did
        not prove the queue's secret (none of their frames was read); ``storage_units_down`` the units it lost its
        connection to, or that Ray reports dead (placement skips them), and why in ``storage_units_down_reasons``;
        the serving loop's ``requests``, ``disconnects`` and ``failures.<where>`` (transfer_queue.wire.server)."""
        with self._server.lock:
            down = sorted(self._server.state.down_units)
            reasons = dict(self._server.down_reasons)
            restarted = {u: r.restarts for u, r in self._server.restarted_units.items()}
        return {
            **self._server.stats(),
            "storage_units_down": down,
            "storage_units_down_reasons": reasons,
            "storage_units_restarted": restarted,
        }

    def status(self, run_history: bool = False) -> dict[str, Any]:
        """The whole-queue summary (the same as ``client.status()``), through Ray."""
        return self._server.summary(run_history)

    def trace_start(self, max_events: int = 200_000) -> bool:
        """Record every request the controller answers as a span, the newest ``max_events`` kept (``python -m
        transfer_queue trace``; transfer_queue/ops/trace.py); returns False if a trace was already on."""
        return self._server.trace_start(max_events)

    def trace_stop(self) -> list[dict[str, Any]]:
        """Stop the trace; returns its spans as Chrome trace events."""
        return self._server.trace_stop()

    def trace_events(self) -> list[dict[str, Any]]:
        """The spans recorded so far, as Chrome trace events (the trace goes on)."""
        return self._server.trace_events()

    def why_stuck(self) -> dict[str, Any]:
        """What every parked get_meta and put waits for, and why (``python -m transfer_queue status --why-stuck``)."""
        return self._server.why_stuck()

    def http_endpoints(self) -> dict[str, Any]:
        """Where the read-only HTTP endpoints listen: ``controller`` (``/metrics``, ``/status``, ``/status.json``) and
        ``storage_units`` (each ``/metrics``); empty when ``http_port=-1``."""
        return dict(self._server.endpoints)

    def record_run_metrics(self, row: dict[str, Any]) -> None:
        """An RL run's metrics of one step (its finite numbers are kept): Prometheus gauges ``transfer_queue_rl_*``
        and the curves of the status page."""
        self._server.record_run_row(row)

    def clients_gone(self, owners: list[str]) -> None:
        """Clients ``owners`` (``TransferQueueClient.owner``) died for good: the rows they hold leased are ready again
        within a serving pass, not after ``disconnect_grace`` (nor, for a lease restored from the journal, whose owner
        never connected to this controller, at the lease's deadline). A supervisor that saw a worker's death says
        so (orchestration/supervisor.py); an owner that speaks again keeps what it holds by then. The automatic DP
        round counters a replayed journal kept for their connections go too: a client not seen before begins at the
        smallest counter of the clients left (``DPRounds.owners_gone``)."""
        with self._server.lock:
            self._server.state.clients_gone(list(owners))

    def storage_stats(self) -> list[dict[str, Any]]:
        """Blocks, payload bytes and resident memory of each storage unit. A unit that cannot answer (dead, being
        restarted by Ray, not attached again yet) reports zeros and ``error``: why."""
        refs = [u.stats.remote() for u in self._units]
        out = []
        for unit, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=30))
            except Exception as exc:  # one unit's failure must not hide the others' figures
                zeros = dict.fromkeys(("pid", "cpu_s", "blocks", "bytes", "rss_bytes"), 0)
                out.append({"unit": unit, **zeros, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        return out

    def shutdown(self) -> None:
        """Stop serving and stop the storage units this controller started (again: a no-op). A journaled
        controller's journal is removed: the queue it describes is gone (its units with it)."""
        self._watcher.stop()
        self._server.stop()
        if self._server.journal is not None and self._owns_units:
            remove_journal(self._server.journal.directory)
        if self._web is not None:
            self._web.stop()
            self._web = None
        if self._owns_units:
            self._owns_units = False
            for ref in [u.shutdown.remote() for u in self._units]:
                try:
                    ray.get(ref, timeout=10)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    pass  # a dead unit (or one on a dead or unreachable node): killed below all the same
            for unit in self._units:
                ray.kill(unit)


_DEAD = object()  # what _ask_each gives for a unit whose actor is dead for good


def _ask_each(units: list[Any], method: str, *args: Any) -> list[Any]:
    """Each unit's answer to ``method(*args)``, ``_DEAD`` for a unit whose actor died for good (Ray will not restart
    it); any other failure is raised."""
    refs = [getattr(u, method).remote(*args) for u in units]
    out: list[Any] = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except ray.exceptions.ActorUnavailableError:
            raise  # restarting or unreachable for now: not dead (the controller's start fails, and is tried again)
        except ray.exceptions.RayActorError:
            out.append(_DEAD)
    return out


def _last_endpoint(identity: dict[str, Any] | None, unit: int) -> p.Endpoint:
    """Where dead storage unit ``unit`` listened last, as the journal's identity keeps it (a journal written before
    it kept them: an address nothing of this queue listens on; the unit is down for good either way)."""
    known = (identity or {}).get("units") or []
    if unit < len(known):
        return msgspec.convert(known[unit], p.Endpoint)
    logger.warning("the journal does not say where dead storage unit %d listened", unit)
    return p.Endpoint("tcp://127.0.0.1:9")


def _port(endpoint: p.Endpoint) -> int:
    return int(endpoint.tcp.rsplit(":", 1)[1])


def serve_status(server: ControllerServer, units: list[Any], host: str, port: int) -> Any:
    """Start the controller's HTTP endpoint and the storage units' ones; ``None`` when ``port`` is -1."""
    if port < 0:
        return None
    from transfer_queue.ops.status_page import controller_routes
    from transfer_queue.ops.web import HttpEndpoint

    web = HttpEndpoint(controller_routes(server), host, port)
    # a unit dead for good (a controller started again from its journal after the unit was lost) serves nothing
    unit_urls = [None if url is _DEAD else url for url in _ask_each(units, "serve_metrics", host)]
    with server.lock:
        server.endpoints = {"controller": web.url, "storage_units": unit_urls}
    return web
