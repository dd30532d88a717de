"""InferenceManager: the run's own inference services, one engine server per data-parallel (DP) group.

AgentRL's RL guide: "Training starts inference services on TP leader processes for each DP group". Here the run
makes one ``InferenceManager``, which starts ``dp_size`` servers (vLLM or SGLang) through :class:`EngineServer`, each
sized by the guide's knobs on the engine's own command line:

    ============== ==================================================== ==============================================
    knob           vLLM (``vllm_server_command``)                        SGLang (``sglang_server_command``)
    ============== ==================================================== ==============================================
    inf_tp_size    ``--tensor-parallel-size N``                          ``--tp-size N``
    inf_ep_size    ``--enable-expert-parallel`` (EP = TP: only 1 or N)   ``--ep-size M`` (M divides N)
    inf_mem_ratio  ``--gpu-memory-utilization R``                        ``--mem-fraction-static R``
    ============== ==================================================== ==============================================

On vLLM's CPU build, ``--gpu-memory-utilization R`` is the fraction of the host's memory each server reserves (vLLM
reads it so there) and ``VLLM_CPU_KVCACHE_SPACE`` overrides it: with ``inf_mem_ratio`` the manager removes that
variable from the servers' environment (logged) and refuses ``dp_size * inf_mem_ratio > 1`` (the servers share the
host) or ``VLLM_CPU_KVCACHE_SPACE`` in ``env``; without it the servers keep ``vllm_server_env``'s 1 GiB KV cache.

A value an engine cannot honour is refused when the manager is made (:class:`InvalidInferenceSizing`, naming the
engine, the value and what it supports). Each running server is an ``InferenceService`` of the ledger when one is
given (``url`` = the server's ``/v1``, ``policy_version``, ``up`` while healthy and serving the newest weights,
``down`` otherwise); the monitor's health checks are its heartbeats. A server that crashes is restarted by its
``EngineServer`` on its port (the same URL), loaded with the newest weights and registered ``up`` again.
``sync_weights`` loads a checkpoint directory into every server; ``release_memory`` / ``resume_memory`` free and
take back the devices for a training phase; ``stop`` (or leaving the ``with`` block) stops them all. No server
outlives the run: ``EngineServer``'s exit and SIGTERM / SIGINT handlers stop them (installed from the thread that
starts the manager, which should be the main thread), and the kernel kills them if the run is SIGKILLed.

    with InferenceManager("sglang", "/models/policy", dp_size=2, inf_tp_size=4, ledger=ledger) as services:
        ...                                          # samplers find services.services in the ledger
        services.sync_weights("/ckpt/step-10", version=10)
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from workers.api_key import new_api_key
from workers.engines.errors import InvalidInferenceSizing
from workers.engines.server import EngineServer, ServerRecord, _install_exit_handlers

if TYPE_CHECKING:
    import torch

    from rl_contracts.scratch import ScratchDir
    from workers.ledger.config import SamplingConfig
    from workers.ledger.models import InferenceService
    from workers.ledger.store import Ledger

logger = logging.getLogger(__name__)

#: the engines an InferenceManager starts servers of
SERVER_ENGINES = ("vllm", "sglang")

#: vLLM's CPU KV cache size in GiB: it overrides ``--gpu-memory-utilization`` on vLLM's CPU backend
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def _vllm_on_cpu() -> bool:
    from workers.engines.vllm_server import vllm_on_cpu

    return vllm_on_cpu()


#: ``(model_path, port, host, *, extra) -> argv``: ``vllm_server_command``, ``sglang_server_command``, or a stand-in
ServerCommand = Callable[..., list[str]]


def sizing_args(engine: str, *, tp_size: int = 1, ep_size: int = 1, mem_ratio: float | None = None) -> list[str]:
    """The flags of ``engine``'s server command line for the guide's ``inf_tp_size`` / ``inf_ep_size`` /
    ``inf_mem_ratio`` (see the module docstring's table); ``mem_ratio=None`` leaves the engine's default.

    Raises:
        InvalidInferenceSizing: an engine that is not a server engine, a size below 1, a ratio outside (0, 1], or a
            value the engine cannot honour (vLLM's expert parallelism spans the whole tensor-parallel group; SGLang's
            ``--ep-size`` divides ``--tp-size``).
    """
    if engine not in SERVER_ENGINES:
        hint = " (HFEngine runs in the process that samples, so it has no server to start)" if engine == "hf" else ""
        raise InvalidInferenceSizing(
            f"engine {engine!r}: expected one of {', '.join(SERVER_ENGINES)}, the engines an InferenceManager starts "
            f"servers of{hint}"
        )
    for knob, size in (("inf_tp_size", tp_size), ("inf_ep_size", ep_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidInferenceSizing(f"{engine}: {knob} expected an int >= 1, got {size!r}")
    if mem_ratio is not None and (
        isinstance(mem_ratio, bool) or not isinstance(mem_ratio, int | float) or not 0 < mem_ratio <= 1
    ):
        raise InvalidInferenceSizing(
            f"{engine}: inf_mem_ratio expected a float in (0, 1] (the fraction of each device's memory the server "
            f"takes), got {mem_ratio!r}"
        )
    if engine == "vllm":
        if ep_size not in (1, tp_size):
            raise InvalidInferenceSizing(
                f"vllm: inf_ep_size={ep_size} with inf_tp_size={tp_size}: vLLM's --enable-expert-parallel spreads "
                f"the experts over the whole tensor-parallel group of a server (expert parallel size = "
                f"--tensor-parallel-size), so it supports inf_ep_size 1 (no expert parallelism) or {tp_size}"
            )
        argv = ["--tensor-parallel-size", str(tp_size)]
        if ep_size > 1:
            argv.append("--enable-expert-parallel")
        if mem_ratio is not None:
            argv += ["--gpu-memory-utilization", str(float(mem_ratio))]
        return argv
    if tp_size % ep_size:
        raise InvalidInferenceSizing(
            f"sglang: inf_ep_size={ep_size} with inf_tp_size={tp_size}: SGLang's --ep-size splits the "
            f"--tp-size ranks of a server into expert groups, so it supports an inf_ep_size that divides "
            f"inf_tp_size={tp_size}"
        )
    argv = ["--tp-size", str(tp_size), "--ep-size", str(ep_size)]
    if mem_ratio is not None:
        argv += ["--mem-fraction-static", str(float(mem_ratio))]
    return argv


def gpu_plan(gpus: Sequence[int | str], num_servers: int, tp_size: int) -> list[list[int | str]]:
    """Each server's devices (its ``CUDA_VISIBLE_DEVICES``): server ``r`` gets ``gpus[r * tp_size : (r + 1) *
    tp_size]``; devices beyond ``num_servers * tp_size`` are left unused.

    >>> gpu_plan([0, 1, 2, 3, 4], num_servers=2, tp_size=2)
    [[0, 1], [2, 3]]

    Raises:
        InvalidInferenceSizing: fewer than ``num_servers * tp_size`` devices (naming both numbers), a device listed
            twice (two servers would share it), or a count below 1.
    """
    for name, value in (("num_servers", num_servers), ("inf_tp_size", tp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidInferenceSizing(f"{name} expected an int >= 1, got {value!r}")
    need = num_servers * tp_size
    if len(gpus) < need:
        raise InvalidInferenceSizing(
            f"{num_servers} servers of inf_tp_size={tp_size} devices need {need} gpus, got {len(gpus)}: {list(gpus)}"
        )
    twice = sorted({str(g) for g in gpus[:need] if [str(h) for h in gpus[:need]].count(str(g)) > 1})
    if twice:
        raise InvalidInferenceSizing(
            f"gpus: expected {need} distinct devices, one server each, got {', '.join(twice)} more than once in "
            f"{list(gpus)}"
        )
    return [list(gpus[r * tp_size : (r + 1) * tp_size]) for r in range(num_servers)]


class _LedgerBridge:
    """``EngineServer``'s record sink that keeps the ledger's ``InferenceService`` rows: ``up`` (registered, which
    is also its heartbeat) while the server is healthy and has the newest weights, ``down`` otherwise."""

    def __init__(self, ledger: Ledger | None, model: str, kind: str = "openai") -> None:
        self.ledger, self.model, self.kind = ledger, model, kind
        self.reloading: set[str] = set()  # servers started anew that have not got the newest weights yet
        self.has_weights = False  # a sync happened: a server started anew must be reloaded before it serves
        self._lock = threading.Lock()

    def service(self, record: ServerRecord) -> InferenceService:
        from workers.ledger.models import InferenceService

        up = record.status == "healthy" and record.name not in self.reloading
        return InferenceService(
            name=record.name,
            kind=self.kind,  # an engine of SERVER_ENGINES: how the samplers ask it and read its replies
            url=f"{record.url}/v1" if record.url else None,
            model=self.model,
            policy_version=record.version,
            status="up" if up else "down",
        )

    def register(self, record: ServerRecord) -> None:
        with self._lock:
            if self.has_weights and record.status in ("crashed", "starting"):
                self.reloading.add(record.name)  # a new process: it starts from the weights on its command line
            if self.ledger is None:
                return
            service = self.service(record)
            try:
                self.ledger.register_service(service)
            except Exception as exc:  # a ledger outage must not stop the server's monitor; the next check retries
                logger.warning("could not register inference service %s in the ledger: %s", record.name, exc)


class InferenceManager:
    """One inference server per DP group, started, registered, synced, freed and stopped together (see the module
    docstring).

    Args:
        engine: ``"vllm"`` or ``"sglang"``.
        model_path: the model directory every server loads first.
        dp_size: how many servers (one per data-parallel group).
        inf_tp_size: tensor-parallel size of each server (devices per server).
        inf_ep_size: expert-parallel size of each server (see :func:`sizing_args`).
        inf_mem_ratio: fraction of each device's memory a server takes (None: the engine's default).
        ledger: where the servers are registered as ``InferenceService`` rows (None: nowhere).
        model: the model name they are registered under (``SamplingConfig.model``).
        name: servers are named ``{name}-{rank}``.
        host: the address they bind.
        gpus: device ids to share out (server ``r`` gets ``gpus[r * tp : (r + 1) * tp]`` as
            ``CUDA_VISIBLE_DEVICES``); None leaves the environment's devices to every server.
        extra_args: more flags for every server's command line (e.g. ``["--dtype", "bfloat16"]`` for vLLM).
        env: environment additions for every server (a ``None`` value removes the variable).
        server_command: ``(model_path, port, host, *, extra) -> argv``; default: the engine's
            (``vllm_server_command`` / ``sglang_server_command``); ``extra`` holds the sizing flags then
            ``extra_args``.
        engine_factory: ``url -> engine client``; default: ``VLLMServerEngine`` / ``SGLangEngine``.
        health_path: default: the engine client's (``/health``, SGLang's ``/health_generate``).
        sleep_mode: vLLM only: the servers run with ``--enable-sleep-mode`` (a GPU) and ``release_memory`` uses it;
            otherwise a release stops the vLLM servers and ``resume_memory`` starts them again.
        api_key: one key for all the servers (True: a fresh one; False: none); ``self.api_key`` is what the
            samplers' ``InferenceClient(api_key=...)`` sends.
        log_dir, startup_timeout, health_interval, max_restarts: each ``EngineServer``'s (the health checks are
            also the ledger heartbeats: keep ``health_interval`` below ``SamplingConfig.service_stale_s``).

    Raises:
        InvalidInferenceSizing: at construction, for a size the engine cannot honour, ``dp_size < 1``, fewer
            ``gpus`` than ``dp_size * inf_tp_size``, or (vLLM's CPU build) ``dp_size * inf_mem_ratio > 1`` or
            ``inf_mem_ratio`` with ``VLLM_CPU_KVCACHE_SPACE`` in ``env``.
    """

    def __init__(
        self,
        engine: str,
        model_path: str,
        *,
        dp_size: int = 1,
        inf_tp_size: int = 1,
        inf_ep_size: int = 1,
        inf_mem_ratio: float | None = None,
        ledger: Ledger | None = None,
        model: str = "policy",
        name: str = "inference",
        host: str = "127.0.0.1",
        gpus: Sequence[int | str] | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
        server_command: ServerCommand | None = None,
        engine_factory: Callable[[str], Any] | None = None,
        health_path: str | None = None,
        sleep_mode: bool = False,
        api_key: str | bool = True,
        log_dir: str | None = None,
        startup_timeout: float = 600.0,
        health_interval: float = 5.0,
        max_restarts: int = 3,
    ):
        self.engine_kind = engine
        self.sizing = sizing_args(engine, tp_size=inf_tp_size, ep_size=inf_ep_size, mem_ratio=inf_mem_ratio)
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise InvalidInferenceSizing(f"{engine}: dp_size expected an int >= 1 (one server each), got {dp_size!r}")
        plan = None
        if gpus is not None:
            try:
                plan = gpu_plan(gpus, dp_size, inf_tp_size)
            except InvalidInferenceSizing as exc:
                raise InvalidInferenceSizing(f"{engine}: {exc}") from None
        if sleep_mode and engine != "vllm":
            raise InvalidInferenceSizing(
                f"{engine}: sleep_mode is vLLM's (--enable-sleep-mode); {engine} releases memory without it"
            )
        # vLLM's CPU backend reads --gpu-memory-utilization as the fraction of the host's memory a server reserves,
        # unless VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, which vllm_server_env sets) overrides it
        self.cpu_memory_ratio = engine == "vllm" and inf_mem_ratio is not None and _vllm_on_cpu()
        if self.cpu_memory_ratio:
            assert inf_mem_ratio is not None
            if dp_size * inf_mem_ratio > 1:
                raise InvalidInferenceSizing(
                    f"vllm on CPU: inf_mem_ratio={inf_mem_ratio} is the fraction of this host's memory each server "
                    f"reserves (vLLM's CPU backend reads --gpu-memory-utilization so) and the {dp_size} servers share "
                    f"this host: dp_size x inf_mem_ratio = {dp_size * inf_mem_ratio:g}, expected at most 1"
                )
            if (env or {}).get(KV_CACHE_ENV):
                raise InvalidInferenceSizing(
                    f"vllm on CPU: inf_mem_ratio={inf_mem_ratio} with {KV_CACHE_ENV}={(env or {})[KV_CACHE_ENV]} in "
                    f"env: the KV cache size in GiB overrides the memory fraction on vLLM's CPU backend; expected one "
                    f"of them"
                )
            logger.info(
                "vllm on CPU: --gpu-memory-utilization %s is the fraction of this host's memory each server reserves "
                "(its weights and activations, its KV cache from what remains); %s, which would override it, is "
                "removed from the servers' environment",
                inf_mem_ratio,
                KV_CACHE_ENV,
            )
        self.model_path, self.model = model_path, model
        self.api_key: str | None = new_api_key() if api_key is True else (api_key or None)
        self._bridge = _LedgerBridge(ledger, model, engine)
        self._weights: tuple[str, int] | None = None  # the newest checkpoint directory and its version
        self._scratch: ScratchDir | None = None  # where sync_state_dict wrote it
        self._sync_lock = threading.Lock()
        self.errors: dict[str, BaseException] = {}  # a restarted server that could not be reloaded

        default_command, factory, health, base_env = self._engine_defaults(sleep_mode)
        command = server_command or default_command
        extra = [*self.sizing, *(["--enable-sleep-mode"] if sleep_mode else []), *extra_args]

        def argv(host: str, port: int) -> list[str]:
            return command(model_path, port, host, extra=list(extra))

        self.servers: list[EngineServer] = []
        for rank in range(dp_size):
            server_env: dict[str, str | None] = {**base_env, **(env or {})}
            if self.cpu_memory_ratio:
                server_env[KV_CACHE_ENV] = None  # removed (the run's own environment may set it too)
            if plan is not None:
                server_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in plan[rank])
            server = EngineServer(
                argv,
                name=f"{name}-{rank}",
                model=model,
                health_path=health_path or health,
                host=host,
                env=server_env,
                log_dir=log_dir,
                startup_timeout=startup_timeout,
                health_interval=health_interval,
                max_restarts=max_restarts,
                engine_factory=engine_factory or factory,
                registry=self._bridge,
                api_key=self.api_key or False,
            )
            server.on_restart = functools.partial(self._reload, server)
            self.servers.append(server)

    @classmethod
    def from_config(cls, config: SamplingConfig, engine: str, model_path: str, **kwargs: Any) -> InferenceManager:
        """The manager of a run's ``SamplingConfig``: its ``inf_tp_size``, ``inf_ep_size``, ``inf_mem_ratio`` and
        ``model``; ``kwargs`` as the constructor's (``dp_size``, ``ledger``, ...)."""
        sizing = {
            "inf_tp_size": config.inf_tp_size,
            "inf_ep_size": config.inf_ep_size,
            "inf_mem_ratio": config.inf_mem_ratio,
            "model": config.model,
        }
        return cls(engine, model_path, **{**sizing, **kwargs})

    def _engine_defaults(self, sleep_mode: bool) -> tuple[ServerCommand, Callable[[str], Any], str, dict[str, str]]:
        if self.engine_kind == "vllm":
            from workers.engines.vllm_server import VLLMServerEngine, vllm_server_command, vllm_server_env

            # the servers answer to the manager's model name: the one its ledger services carry, which the samplers'
            # InferenceClient asks for (vLLM refuses another name with 404)
            return (
                functools.partial(vllm_server_command, served_model=self.model),
                lambda url: VLLMServerEngine(
                    url, served_model=self.model, model_path=self.model_path, sleep_mode=sleep_mode
                ),
                VLLMServerEngine.health_path,
                vllm_server_env(),
            )
        from workers.engines.sglang import SGLangEngine, sglang_server_command

        return (
            functools.partial(sglang_server_command, served_model=self.model),  # the services' model, as for vLLM
            lambda url: SGLangEngine(url, model_path=self.model_path),
            SGLangEngine.health_path,
            {},
        )

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> list[str]:
        """Start every server at once and wait until all are healthy (and registered); returns their URLs.

        Raises:
            EngineServerError: the first server's error that did not start (``EngineNeverHealthy``, ``PortInUse``,
                ``EngineServerExited``); every server is stopped then.
        """
        _install_exit_handlers()  # here, not in the pool's threads: signal handlers are set from the main thread
        with ThreadPoolExecutor(len(self.servers), thread_name_prefix="inference-start") as pool:
            futures = [pool.submit(server.start) for server in self.servers]
            errors = [future.exception() for future in futures]
        failed = [error for error in errors if error is not None]
        if failed:
            self.stop()
            raise failed[0]
        return self.urls

    def stop(self, grace: float = 10.0) -> None:
        """Stop every server (its whole process group) and mark it down in the ledger."""
        for server in self.servers:
            server.stop(grace)
        if self._scratch is not None:
            self._scratch.remove()
            self._scratch = None

    def __enter__(self) -> InferenceManager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check(self) -> dict[str, str]:
        """Each server's status by name; raises the error of a server that failed for good (its restart budget
        spent: ``RestartBudgetExhausted``) or could not be reloaded after a restart."""
        for server in self.servers:
            server.check()
        for error in self.errors.values():
            raise error
        return {server.name: server.record.status for server in self.servers}

    # ---- what it serves --------------------------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        """The servers' base URLs (a restarted server keeps its URL)."""
        return [str(server.url) for server in self.servers]

    @property
    def engines(self) -> list[Any]:
        """The engine clients of the servers (``VLLMServerEngine`` / ``SGLangEngine``), by DP rank."""
        return [server.engine for server in self.servers]

    @property
    def services(self) -> list[InferenceService]:
        """The ``InferenceService`` rows the servers are (or would be) registered as."""
        return [self._bridge.service(server.record) for server in self.servers]

    # ---- weights ---------------------------------------------------------------------------------------------
    def sync_weights(
        self, checkpoint_path: str, version: int | None = None, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """Load the Hugging Face directory ``checkpoint_path`` into every server at once as ``version`` (default:
        the newest version of any server + 1); one reply per server (``sync_weights_to_engines``'s: failures are
        replies, never raised). A server restarted later is loaded with it before it is registered ``up``: keep
        the directory until the next sync. A server that could not be reloaded after a restart is ``up`` again once
        this loads it."""
        from workers.engines.weight_sync import sync_weights_to_engines

        with self._sync_lock:
            if version is None:
                version = max(server.record.version for server in self.servers) + 1
            self._weights = (str(checkpoint_path), version)
            self._bridge.has_weights = True
            replies = sync_weights_to_engines(self.servers, str(checkpoint_path), version, timeout)
            for server, reply in zip(self.servers, replies, strict=True):
                if (
                    reply["success"] and server.name in self._bridge.reloading
                ):  # a restart it could not reload: now it is
                    self._bridge.reloading.discard(server.name)
                    self.errors.pop(server.name, None)
                    server.set_version(version)  # registered up again
            return replies

    def sync_state_dict(
        self, state_dict: dict[str, torch.Tensor], version: int, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """Write ``state_dict`` (Hugging Face names) once as a directory (safetensors and the model's config files,
        in ``/dev/shm``) and ``sync_weights`` it; the directory is kept for servers restarted later, until the next
        sync or ``stop``."""
        scratch = self.servers[0].engine.save_state_dict(state_dict)
        try:
            replies = self.sync_weights(str(scratch.path), version, timeout)
        except BaseException:
            scratch.remove()
            raise
        previous, self._scratch = self._scratch, scratch
        if previous is not None:
            previous.remove()
        return replies

    def _reload(self, server: EngineServer, engine: Any = None) -> None:
        """A server started anew (crash restart, resume after a release by stop): the newest weights, then ``up``
        again (at the same URL)."""
        weights = self._weights
        try:
            if weights is not None and server.engine is not None:
                path, version = weights
                server.engine.update_weights_from_checkpoint(path, version=version)
                server.record.version = version
            self.errors.pop(server.name, None)
        except Exception as exc:  # stays down in the ledger; check() raises it
            logger.error("%s: could not load the newest weights after a restart: %s", server.name, exc)
            self.errors[server.name] = exc
            return
        self._bridge.reloading.discard(server.name)
        server.set_version(server.record.version)  # registers the record again: up, its version

    # ---- memory for training (colocated) ---------------------------------------------------------------------
    def release_memory(self) -> list[str]:
        """Free every server's device memory for a training phase (``EngineServer.release_memory``: the engine's own
        call, or stopping the server); how each was freed (``"engine"`` or ``"stop"``). They are ``down`` until
        ``resume_memory``."""
        return [server.release_memory() for server in self.servers]

    def resume_memory(self) -> list[str]:
        """Bring every server back; one stopped by ``release_memory`` starts again (same URL) and is loaded with the
        newest weights before it is ``up``. Returns the URLs."""
        urls = []
        for server in self.servers:
            urls.append(server.resume_memory(reload=functools.partial(self._reload, server)))
        return urls

    def __repr__(self) -> str:
        return f"InferenceManager(engine={self.engine_kind!r}, servers={self.servers!r})"
