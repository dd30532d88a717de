"""The inference servers of a run's rollout workers: started elsewhere (``rollout.engine_url``) or by the run.

A ``vllm-server`` or ``sglang`` rollout engine is a client of a server. With ``rollout.engine_url`` the servers were
started elsewhere: one URL serves every rollout worker, or a list gives each worker its own. Without it the run starts
its own through an :class:`~workers.engines.manager.InferenceManager`: one server per rollout worker (its DP group),
sized by ``rollout.inf_tp_size`` / ``inf_ep_size`` / ``inf_mem_ratio``, loading the run's model directory
(:func:`model_directory`), with a fresh API key. Rollout worker ``i`` talks to server ``i`` (:func:`worker_urls`); its
engine client loads each published version into that server (``EngineActor.update_weights`` / ``pull_weights``), so
the manager itself syncs nothing. :meth:`GRPORun.shutdown <orchestration.grpo_run.GRPORun.shutdown>` stops the
servers however the run ends. With ``rollout.inference_colocate`` each training step frees their memory: the rollout
workers' generations are held (:class:`RolloutRequests`) and the servers released before it, resumed and loaded with
the new weights after it (``rl_contracts.colocate.ColocatedServers``, the ledger flow's cycle too).

Placement: server ``i`` gets its own ``inf_tp_size`` devices as ``CUDA_VISIBLE_DEVICES`` (the manager's ``gpus``
split, :func:`~workers.engines.manager.gpu_plan`): ``rollout.gpus`` when given, else the GPUs Ray reserves for the
servers on this node (:func:`reserve_server_gpus`, held by a :class:`GPUHolder` actor until the servers stop, so the
trainer's ranks and the rollout workers are placed on other devices). On a node without GPUs nothing is placed: the
servers' environment is the run's.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError

from orchestration.config import SERVER_ENGINES, SERVER_KIND, RolloutConfig
from rl_contracts.actors import actor_class
from workers.engines.errors import InvalidInferenceSizing

if TYPE_CHECKING:
    from rl_contracts.task import Task
    from workers.engines.manager import InferenceManager

logger = logging.getLogger(__name__)


def starts_servers(rollout: RolloutConfig) -> bool:
    """Whether the run starts its own inference servers: a server engine and no ``rollout.engine_url``."""
    return rollout.engine in SERVER_ENGINES and rollout.engine_url is None


def worker_urls(rollout: RolloutConfig, started: list[str] | None = None) -> list[str | None]:
    """The server URL of each rollout worker, by worker index: server ``i`` of those the run ``started`` (an
    ``InferenceManager``'s ``urls``, one per worker), else ``rollout.engine_url`` (a list: its ``i``-th URL; one
    URL: that one for all); None for an engine in the rollout worker.

    >>> worker_urls(RolloutConfig(num_workers=2, engine="sglang", engine_url="http://h:30000"))
    ['http://h:30000', 'http://h:30000']
    >>> worker_urls(RolloutConfig(num_workers=2, engine="sglang"), ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    ['http://127.0.0.1:1', 'http://127.0.0.1:2']

    Raises:
        ValueError: ``started`` when the run starts none, none when it does, or not one URL per rollout worker.
    """
    workers = rollout.num_workers
    if rollout.engine not in SERVER_ENGINES:
        if started is not None:
            raise ValueError(f"rollout.engine={rollout.engine!r} runs in the rollout worker: no servers to use")
        return [None] * workers
    if starts_servers(rollout):
        if started is None or len(started) != workers:
            got = "none" if started is None else f"{len(started)}"
            raise ValueError(f"the run starts one server per rollout worker: expected {workers} URLs, got {got}")
        return list(started)
    if started is not None:
        raise ValueError(f"rollout.engine_url={rollout.engine_url!r} names the servers: the run starts none")
    urls = rollout.engine_url
    if isinstance(urls, list):
        if len(urls) != workers:  # RLConfig.validate refuses it first
            raise ValueError(f"rollout.engine_url lists {len(urls)} URLs for {workers} rollout workers")
        return list(urls)
    return [urls] * workers


def model_directory(model_path: str | None, task: Task, out: Path) -> str:
    """The model directory the run's servers load first: ``model.path`` when the run trains on your files, else
    the task's starting policy and its tokenizer (:func:`stand_in_tokenizer` when it cannot be saved) written once
    to ``out/inference_model``. The weights a server serves are the run's published ones (every rollout starts
    after the first publish), so these give the servers the architecture and config."""
    if model_path:
        return str(Path(model_path).expanduser().absolute())
    directory = out / "inference_model"
    directory.mkdir(parents=True, exist_ok=True)
    policy = task.build_policy()
    policy.save_pretrained(str(directory))
    save = getattr(task.tokenizer, "save_pretrained", None)
    if callable(save):
        save(str(directory))
    else:
        stand_in_tokenizer(int(policy.config.vocab_size), task.tokenizer).save_pretrained(str(directory))
    return str(directory.absolute())


def stand_in_tokenizer(vocab_size: int, tokenizer: Any) -> Any:
    """A Hugging Face tokenizer of ``vocab_size`` words ``t0 t1 ...`` with ``tokenizer``'s eos / pad / bos ids, for a
    task whose own tokenizer cannot be saved (the addition task's): vLLM's OpenAI server loads one at start, and the
    engines send and receive token ids only, so its words are never used."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab_size)}
    special = {
        f"{name}_token": f"t{token_id}"
        for name in ("eos", "pad", "bos")
        if isinstance(token_id := getattr(tokenizer, f"{name}_token_id", None), int) and 0 <= token_id < vocab_size
    }
    backend = Tokenizer(WordLevel(words, unk_token=special.get("pad_token", "t0")))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


def inference_manager(rollout: RolloutConfig, model_dir: str, out: Path, **kwargs: Any) -> InferenceManager:
    """The run's servers, one per rollout worker (an ``InferenceManager`` of ``dp_size = rollout.num_workers``), not
    started yet (``start()``: the owner holds it first, so a failed or interrupted start is stopped with the run),
    logs in ``out/inference_logs``, placed on ``rollout.gpus`` unless ``kwargs`` give ``gpus`` (the ids Ray reserved,
    :func:`reserve_server_gpus`); ``kwargs`` go to the manager (tests: ``server_command``, ``health_interval``).

    Raises:
        InvalidInferenceSizing: ``rollout.inf_*`` the engine cannot honour (``RLConfig.validate`` refuses them first).
    """
    from workers.engines.manager import InferenceManager

    kwargs.setdefault("log_dir", str(out / "inference_logs"))
    if kwargs.get("gpus") is None:
        kwargs["gpus"] = rollout.gpus
    return InferenceManager(
        SERVER_KIND[rollout.engine],
        model_dir,
        dp_size=rollout.num_workers,
        inf_tp_size=rollout.inf_tp_size,
        inf_ep_size=rollout.inf_ep_size,
        inf_mem_ratio=rollout.inf_mem_ratio,
        **kwargs,
    )


class RolloutRequests:
    """The generations of a run's rollout workers (each worker's ``RequestGate``), held and let go together: the
    ``requests`` of a colocated run's ``rl_contracts.colocate.ColocatedServers``."""

    def __init__(self, workers: list[Any]):
        self.workers = workers
        self.active = 0  # generations still in flight after the last drain
        self.held = False  # between drain() and resume(): the servers may be released

    def drain(self, timeout_s: float) -> bool:
        """Hold every worker's next generations and wait up to ``timeout_s`` for those in flight; whether none is
        left. A dead worker (being restarted) is skipped: the supervisor's restart holds its new gate
        (:meth:`restarted`)."""
        self.held = True
        self.active = sum(_alive([worker.drain_requests.remote(timeout_s) for worker in self.workers], 0))
        return self.active == 0

    def resume(self) -> None:
        """Let the held generations go on (a dead worker skipped: its restarted gate starts open)."""
        self.held = False
        _alive([worker.resume_requests.remote() for worker in self.workers], None)
        self.active = 0

    def restarted(self, index: int) -> None:
        """Worker ``index`` was restarted (its gate starts open): while the requests are held (the servers released)
        its gate is closed too, so that it generates nothing before :meth:`resume`."""
        if self.held:
            ray.get(self.workers[index].drain_requests.remote(0.0))


def _alive(refs: list[Any], dead: Any) -> list[Any]:
    """The results of the workers' calls ``refs``; ``dead`` for a call whose worker died (or is being restarted)."""
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except RayActorError:
            out.append(dead)
    return out


@ray.remote(num_cpus=0)
class GPUHolder:
    """An actor that holds GPUs of a node for the run's inference servers (processes Ray does not place): Ray gives
    no other task or actor those devices while it lives. It runs nothing on them."""

    def gpu_ids(self) -> list[str]:
        return [str(g) for g in ray.get_gpu_ids()]


def reserve_server_gpus(
    rollout: RolloutConfig, trainer_gpus: float = 0.0, timeout_s: float = 60.0
) -> tuple[Any, list[str]] | None:
    """GPUs of this node (the driver's, where the manager starts the servers) reserved through Ray for the servers of a
    run that starts them: ``rollout.num_workers x rollout.inf_tp_size`` devices held by a :class:`GPUHolder` actor
    (kill it once the servers stopped), and their ids (Ray's, which are the node's ``CUDA_VISIBLE_DEVICES`` ids), for
    the manager's ``gpus``. None when there is nothing to place: ``rollout.gpus`` given, no servers to start, Ray not
    running, a node without GPUs (CPU: the servers' environment stays as it is), or a node whose GPUs do not hold the
    servers and the trainer's ranks (``trainer_gpus``) apart: then they share the devices (colocated, the servers
    sized by ``inf_mem_ratio``), as before this reservation existed, instead of the trainer waiting for GPUs forever.

    Raises:
        InvalidInferenceSizing: this node has fewer GPUs than the servers need (naming both numbers), or Ray could not
            reserve them within ``timeout_s`` (other actors hold them).
    """
    if rollout.gpus is not None or not starts_servers(rollout) or not ray.is_initialized():
        return None
    node = ray.get_runtime_context().get_node_id()
    total = int(next((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == node and n["Alive"]), 0))
    if total == 0:
        return None
    need = rollout.num_workers * rollout.inf_tp_size
    if total < need:
        raise InvalidInferenceSizing(
            f"{rollout.num_workers} servers of inf_tp_size={rollout.inf_tp_size} devices need {need} gpus, this node "
            f"has {total}"
        )
    if need + math.ceil(trainer_gpus) > total:  # no room for both apart: servers and trainer share the devices
        logger.info(
            "the run's %d inference servers share this node's %d GPUs with its trainer ranks (%g GPUs)",
            rollout.num_workers,
            total,
            trainer_gpus,
        )
        return None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    holder = (
        actor_class(GPUHolder)
        .options(num_gpus=need, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        .remote()
    )
    try:
        ids = ray.get(holder.gpu_ids.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.kill(holder)
        raise InvalidInferenceSizing(
            f"{rollout.num_workers} servers of inf_tp_size={rollout.inf_tp_size} devices need {need} gpus of this "
            f"node's {total}: Ray could not reserve them within {timeout_s:g} s (other actors hold them); set "
            f"rollout.gpus to place the servers yourself"
        ) from None
    return holder, ids
