"""``transfer_queue.init`` / ``shutdown`` / ``get_controller``: one named queue per Ray cluster.

``init`` starts the controller (which starts its storage units) under a fixed name and namespace on the current
Ray cluster, or attaches to the one already running there if its configuration is the same. The actors are owned
by the process that created them, so they live as long as its job (right for ``ray job submit``).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import ray

from transfer_queue.config import QueueConfig
from transfer_queue.controller.actor import ControllerActor
from transfer_queue.errors import ConfigMismatch, InvalidRequest, QueueNotFound
from transfer_queue.ops.runs import RunFile, RunRecord, command_line, live_runs, publish, ray_attach_env, start_block
from transfer_queue.samplers import SamplerSpec, make_sampler
from transfer_queue.wire import protocol as p
from transfer_queue.wire.socket_dirs import sweep_stale

if TYPE_CHECKING:  # the client loads torch, which the controller's process (it runs this module's actor) never needs
    from transfer_queue.client import TransferQueueClient

NAMESPACE = "transfer_queue"
CONTROLLER_NAME = "TransferQueueController"
# A non-detached actor dies when its owner drops the last handle, even when it has a name: the process that
# started the queue keeps this one until shutdown(), so the queue lives exactly as long as its job.
_started: list[Any] = []
# A journaled controller's storage units, started by this process so they outlive the controller's restarts: kept
# here, or Ray would stop them once the dead controller's borrowed handles were their last ones.
_units: list[Any] = []
_run_files: list[RunFile] = []  # this process's discovery record, while the queue it started runs
logger = logging.getLogger(__name__)


RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_AUTH_DEFAULT_NOTICE = "Token authentication is enabled for this Ray cluster"


def _not_the_auth_default_notice(record: logging.LogRecord) -> bool:
    return RAY_AUTH_DEFAULT_NOTICE not in record.getMessage()


def init_ray(**kwargs: Any) -> Any:
    """``ray.init(**kwargs)`` without the notice Ray logs on every local start that it turned on token
    authentication, its default (the warning that it is *disabled* still shows). Authentication is left to Ray."""
    auth_log = logging.getLogger(RAY_AUTH_LOGGER)
    if _not_the_auth_default_notice not in auth_log.filters:
        auth_log.addFilter(_not_the_auth_default_notice)
    return ray.init(**kwargs)


def start_storage_units(
    num_units: int,
    options: dict[str, Any] | list[dict[str, Any]] | None = None,
    bind_host: str | None = None,
    bind_node_id: str | None = None,
    max_restarts: int = 0,
) -> list[Any]:
    """Start ``num_units`` StorageUnit actors (a controller that was given no handles calls this).

    Args:
        options: Ray ``.options(...)`` for all units, or one dict per unit.
        bind_host: the address their sockets bind (default: their node's).
        bind_node_id: apply ``bind_host`` only to units that land on this Ray node (the others bind their node's
            address): an address of one host cannot be bound on another.
        max_restarts: times Ray restarts a unit that died (``QueueConfig.storage_unit_max_restarts``), unless
            ``options`` set ``max_restarts`` themselves.
    """
    # here, not at the top: the controller's process runs this module's actor class and never loads the storage
    # unit's column code (torch); the units' own processes do
    from transfer_queue.storage.unit import StorageUnit

    options = options or {}
    per_unit = options if isinstance(options, list) else [options] * num_units
    if len(per_unit) != num_units:
        raise InvalidRequest(f"storage_unit_options has {len(per_unit)} entries for {num_units} storage units")
    return [
        StorageUnit.options(**{"max_restarts": max_restarts, **per_unit[i]}).remote(  # type: ignore[attr-defined]
            i, num_units, bind_host, bind_node_id=bind_node_id if bind_host is not None else None
        )
        for i in range(num_units)
    ]


@ray.remote
class TransferQueueController(ControllerActor):
    """The controller's Ray actor class (its body and arguments: :class:`ControllerActor`): given no
    ``storage_units``, it starts ``num_storage_units`` StorageUnit actors and owns them (stops them on shutdown,
    lets Ray restart them up to ``storage_unit_max_restarts`` times).

    >>> controller = TransferQueueController.remote(global_batch_size=8, num_n_samples=4)  # doctest: +SKIP
    >>> info = ray.get(controller.get_info.remote())  # doctest: +SKIP
    """

    def start_storage_units(
        self, num_units: int, options: dict[str, Any] | list[dict[str, Any]] | None, bind_host: str | None
    ) -> list[Any]:
        # bind_host is an address of this node: units that Ray places on other nodes bind their own
        return start_storage_units(
            num_units, options, bind_host, p.ray_node_id(), self._config.storage_unit_max_restarts
        )


def _config_of(handle: Any) -> dict[str, Any]:
    return ray.get(handle.get_config.remote())


def init(
    *,
    global_batch_size: int,
    num_global_batch: int = 1,
    num_n_samples: int = 1,
    sampler: SamplerSpec | None = None,
    num_storage_units: int = 2,
    client_id: str | None = None,
    spin_seconds: float = 0.0,
    storage_unit_options: dict[str, Any] | list[dict[str, Any]] | None = None,
    controller_options: dict[str, Any] | None = None,
    restore_from: str | None = None,
    run_metrics: str | None = None,
    **config: Any,
) -> TransferQueueClient:
    """Start the queue on the current Ray cluster (or attach to the running one) and return a ready client.

    Args:
        global_batch_size, num_global_batch, num_n_samples: the shape of the queue (see QueueConfig).
        sampler: the default sampler: an instance, a class, or a callable returning one.
        num_storage_units: storage actors to start.
        client_id: a name for the returned client's logs.
        spin_seconds: the client's reply spin (see TransferQueueClient).
        storage_unit_options, controller_options: Ray ``.options(...)`` for the actors (placement, resources).
        restore_from: a directory ``client.save_checkpoint`` wrote: the new queue starts from it (its partitions,
            consumption, DP rounds, kv keys, samplers' states and payload), on ``num_storage_units`` units however
            many saved it. Ignored when a queue already runs (attaching never restores).
        run_metrics: where the program writes its own metrics (e.g. its ``metrics.jsonl``), for the lines
            printed when the queue starts and for the status command.
        journal_dir: (a QueueConfig field) the controller journals its bookkeeping there and Ray restarts it when
            it dies: it replays the journal, binds the same port and finds its storage units' rows (docs/api.md).
        **config: other QueueConfig fields (``storage_unit_bytes``, ``default_timeout``, ``put_grace``, ...).

    Raises:
        ConfigMismatch: a queue runs on this cluster with another configuration (``shutdown()`` it first).

    >>> client = transfer_queue.init(global_batch_size=8, num_n_samples=4)  # doctest: +SKIP
    """
    if config.get("journal_dir") is not None:
        config["journal_dir"] = os.path.abspath(config["journal_dir"])
    wanted = QueueConfig(
        global_batch_size=global_batch_size,
        num_global_batch=num_global_batch,
        num_n_samples=num_n_samples,
        num_storage_units=num_storage_units,
        **config,
    ).to_dict()
    # resolved here, where the caller's environment is (TRANSFER_QUEUE_SHARED_MEMORY): the controller actor's process
    # may not have it (a cluster started before it was set), and would build another configuration
    config["shared_memory"] = wanted["shared_memory"]
    wanted_sampler = type(make_sampler(sampler)).__name__
    if not ray.is_initialized():
        init_ray()
    sweep_stale()  # socket directories of queues whose processes died without cleaning up (on this host)
    handle = _find()
    if handle is None:
        journaled = wanted["journal_dir"] is not None
        units, options = None, dict(controller_options or {})
        if journaled:
            # Ray restarts a journaled controller that died (ray.kill(..., no_restart=False), a crash); its storage
            # units are this process's, not the controller's (an actor's actors die with it), so they keep their
            # rows across the controller's restart
            options = {"max_restarts": -1, **options}
            units = start_storage_units(
                num_storage_units, storage_unit_options, max_restarts=wanted["storage_unit_max_restarts"]
            )
        try:
            handle = TransferQueueController.options(  # type: ignore[attr-defined]
                name=CONTROLLER_NAME, namespace=NAMESPACE, **options
            ).remote(
                global_batch_size,
                num_global_batch,
                num_n_samples,
                sampler,
                num_storage_units=num_storage_units,
                storage_units=units,
                storage_unit_options=None if journaled else storage_unit_options,
                restore_from=None if restore_from is None else os.path.abspath(restore_from),
                own_storage_units=journaled,
                **config,
            )
            ray.get(handle.get_info.remote())
            if not _started:  # a driver that exits without shutdown() still stops its queue (and its sockets)
                atexit.register(_shutdown_at_exit)
            _started.append(handle)
            _units.extend(units or ())
            _announce(handle, run_metrics)
        except ValueError:  # another process created it first: attach below
            for unit in units or ():
                ray.kill(unit)
            handle = _find()
            if handle is None:
                raise
    running = _config_of(handle)
    running_sampler = running.pop("sampler", wanted_sampler)
    if running != wanted or running_sampler != wanted_sampler:
        diff = {k: (running.get(k), wanted.get(k)) for k in wanted if running.get(k) != wanted.get(k)}
        if running_sampler != wanted_sampler:
            diff["sampler"] = (running_sampler, wanted_sampler)
        raise ConfigMismatch(
            f"a queue with another configuration runs on this cluster; (running, asked) = {diff}; "
            "call transfer_queue.shutdown() first or use the same configuration"
        )
    info = ray.get(handle.get_info.remote())
    from transfer_queue.client import TransferQueueClient, default_client_id

    return TransferQueueClient(client_id or default_client_id(), info, spin_seconds=spin_seconds)


def _announce(handle: Any, run_metrics: str | None) -> None:
    """Write this run's discovery record (what ``python -m transfer_queue status`` finds it by) and print the status
    command, the status page and where the metrics go."""
    url = ray.get(handle.http_endpoints.remote()).get("controller")
    record = RunRecord(
        pid=os.getpid(),
        started_at=time.time(),
        command=command_line(),
        ray_address=ray.get_runtime_context().gcs_address,
        ray_env=ray_attach_env(),
        namespace=NAMESPACE,
        controller=CONTROLLER_NAME,
        status_page=f"{url}/status" if url else None,
        metrics=f"{url}/metrics" if url else None,
        run_metrics=run_metrics,
    )
    _forget_run()
    try:
        _run_files.append(publish(record))
        runs = live_runs()
    except OSError as exc:  # the queue runs all the same; only the status command's no-flag lookup misses it
        logger.warning("could not write the run's discovery record: %s; the status command needs --address", exc)
        runs = [record]
    print(start_block(record, runs), file=sys.stderr, flush=True)


def _forget_run() -> None:
    for run_file in _run_files:
        run_file.remove()
    _run_files.clear()


def _find() -> Any | None:
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def get_controller() -> Any:
    """The controller's actor handle, from any process of the cluster.

    Raises:
        QueueNotFound: no queue was started (``transfer_queue.init``) on this cluster.
    """
    handle = _find()
    if handle is None:
        raise QueueNotFound(f"no {CONTROLLER_NAME} runs in namespace {NAMESPACE!r}; call transfer_queue.init first")
    return handle


def get_client(client_id: str | None = None, spin_seconds: float = 0.0) -> TransferQueueClient:
    """A new client of the queue running on this cluster."""
    info = ray.get(get_controller().get_info.remote())
    from transfer_queue.client import TransferQueueClient, default_client_id

    return TransferQueueClient(client_id or default_client_id(), info, spin_seconds=spin_seconds)


def _shutdown_at_exit() -> None:
    """Stop the queue this process started, if it still runs (registered by ``init``; runs before Ray's own exit)."""
    if _started:
        try:
            shutdown(timeout=10.0)
        except Exception:  # exiting anyway: Ray kills the actors, the next init sweeps their socket directories
            pass


def shutdown(timeout: float = 30.0) -> None:
    """Stop the queue ``init`` started; returns once its name is free, so ``init`` may follow at once."""
    _forget_run()  # the status command stops finding this process's run from now on
    if not ray.is_initialized():
        return
    handle = _find()
    if handle is None:
        return
    try:  # this process's clients of the queue fail at once from now on (QueueClosed), not at their timeout
        from transfer_queue.client import mark_queue_closed

        mark_queue_closed(ray.get(handle.get_info.remote(), timeout=min(timeout, 10.0)).session_id)
    except Exception:  # a dead or stuck controller: its clients learn it from the transport (ServerGone)
        pass
    try:
        ray.get(handle.shutdown.remote(), timeout=timeout)
    except Exception:  # a dead or stuck controller is killed below anyway
        pass
    ray.kill(handle)
    for unit in _units:  # the journaled controller's shutdown stopped them; killed in case it was dead
        ray.kill(unit)
    _units.clear()
    _started.clear()
    atexit.unregister(_shutdown_at_exit)
    deadline = time.monotonic() + timeout
    while _find() is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{CONTROLLER_NAME} still holds its name {timeout} s after being killed")
        time.sleep(0.05)
