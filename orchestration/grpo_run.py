"""GRPORun: the actors of one run on the queue, and the loop over global steps.

    queue   = transfer_queue.init(...)            # controller + storage units
    rollout = RolloutWorker x k (each with an engine actor)
    reward  = RewardWorker x m
    trainer = GRPOTrainerRank x world_size (FSDP2)
    resume from the latest checkpoint | init_from | SFT warm-up -> checkpoint 0   (run_resume.py, sft_warm_up.py)
    for step:
        put the step's prompts, n-times expanded     (async: up to max_staleness steps ahead)
        rollout workers stream responses into those rows; reward workers stream rewards into them
        trainer ranks stream complete groups (DP rounds) and step
        publish weights to the engines (every sync_every steps), clear the step, log, checkpoint (run_resume.py)
        (keeping rows for a trainer-group restart: a step is cleared by the checkpoint that covers it)

With ``weight_sync: shm`` the trainer writes each version into a WeightChannel on this host and engines pull it
themselves, so the driver launches step s+1's rollout while step s trains: the rollout waits inside the engine for
the version it needs (sync: the one step s produces) and starts the moment it is written, with no driver round trip.

Where the run starts and what its checkpoints hold (the queue's snapshot included) is orchestration/run_resume.py's;
the SFT warm-up is orchestration/sft_warm_up.py's. GRPORun holds the run's state and the loop, and calls them.

Everything a person needs to follow a run is written under ``output_dir``: ``metrics.jsonl`` (one row per step),
``metrics.png``, ``config.yaml`` and ``checkpoints/``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import ray
import torch
from ray.exceptions import RayActorError, RayError

import transfer_queue
from orchestration.config import ConfigError, RLConfig
from orchestration.inference import (
    RolloutRequests,
    inference_manager,
    model_directory,
    reserve_server_gpus,
    starts_servers,
    worker_urls,
)
from orchestration.metric_sinks import run_sinks
from orchestration.metrics import MetricsLog, PlotRefresher, StepReporter, fifth_means
from orchestration.queue_resume import QueueResume, resume_steps
from orchestration.regenerate import LostPrompts
from orchestration.run_plan import save_config
from orchestration.run_resume import (
    Start,
    checkpoints_dir,
    init_reference,
    load_checkpoint,
    queue_record,
    restorable_queue,
    restored_outputs,
    resumed_state,
    save_checkpoint,
    start_from_weights,
    start_point,
)
from orchestration.run_trace import StageTrace
from orchestration.sft_warm_up import sft_warm_up
from orchestration.stopping import RunStopped, SigtermStops, stopped_line
from orchestration.supervisor import Supervisor, when_up
from orchestration.trainer_restarts import (
    RANK_DEATH_WAIT_S,
    TrainerRankDied,
    any_failed,
    covered_steps,
    finish_writes,
    joined_rows,
    keeps_rows,
    queue_running,
    queue_steps,
    raise_if_rank_died,
    rank_died,
    run_with_trainer_restarts,
    take_kept_queue,
    write_kept_queue,
)
from rl_contracts.actors import actor_class
from rl_contracts.colocate import ColocatedServers
from rl_contracts.images import IMAGE_REFS
from rl_contracts.inflight import inflight_partition
from rl_contracts.lost_rows import put_retrying
from rl_contracts.prompts import PromptSource
from rl_contracts.rows import jagged
from rl_contracts.stages import REDO_GROUP, REWARD_TASK, ROLLOUT_TASK, TRAIN_TASK
from rl_contracts.task import Task, load_task
from rl_contracts.weight_channel import WeightChannel
from trainers.checkpoint import latest_checkpoint
from trainers.config import TrainerConfig
from trainers.grpo import GRPOTrainerRank
from transfer_queue.runtime import init_ray
from workers.api_key import key_from_env
from workers.engines.base import SamplingParams
from workers.engines.host import EngineSpec
from workers.reward import RewardWorker
from workers.rollout import RolloutWorker, start_engine

if TYPE_CHECKING:
    from workers.engines.manager import InferenceManager

logger = logging.getLogger(__name__)

#: queue_journal: seconds the run's queue clients ask the controller again while Ray restarts it (QueueConfig
#: restart_retry_s); a restart takes a few seconds (a new process, the journal's replay)
QUEUE_RESTART_RETRY_S = 60.0
#: starts a trainer-group restart repeats exactly (the same weights, a fresh optimizer): a death before the run's first
#: checkpoint keeps the queue for them as for a checkpoint (an SFT warm-up saves checkpoint 0 itself)
REPEATABLE_STARTS = (Start.FRESH, Start.INIT_FROM)

#: the task of a run whose config names none (``task.name: null``): the demo's addition task
DEFAULT_TASK = "workers.tasks.addition:AdditionTask"
#: the task of a run on your own files (``model.path``, ``data.*``, ``reward.fn``; docs/quickstart.md)
FILE_TASK = "workers.tasks.files:FileTask"


def run_task_name(config: RLConfig) -> str:
    """The ``"module:Class"`` of the run's task: ``task.name``, or :data:`DEFAULT_TASK` when the config names none.
    Task names are resolved here, above workers and trainers: the trainer ranks are handed the task object."""
    if config.trains_on_files:
        return FILE_TASK
    return config.task.name or DEFAULT_TASK


def run_task_kwargs(config: RLConfig) -> dict[str, Any]:
    """The constructor arguments of the run's task: ``task.kwargs``, or for a run on your own files those of
    :data:`FILE_TASK`, from the ``model``, ``data`` and ``reward`` sections (they travel to every actor)."""
    if not config.trains_on_files:
        return config.task.kwargs
    reward_file, _, reward_name = (config.reward.fn or "").rpartition(":")
    return {
        # absolute paths: actors may run in another working directory than the driver's
        "model_path": _absolute(config.model.path),
        "train_files": _absolute(config.data.train_files),
        "val_files": _absolute(config.data.val_files),
        "prompt_key": config.data.prompt_key,
        "reward_fn": f"{_absolute(reward_file)}:{reward_name}" if reward_file.endswith(".py") else config.reward.fn,
        "reward_batch": config.reward.batch,
    }


def _absolute(paths: Any) -> Any:
    """A path, or each of a list of paths, made absolute against this process's working directory (None stays)."""
    if isinstance(paths, list):
        return [_absolute(p) for p in paths]
    return str(Path(paths).expanduser().absolute()) if paths else paths


def load_run_task(config: RLConfig) -> Task:
    """The run's task object: :func:`run_task_name` built with :func:`run_task_kwargs`."""
    return load_task(run_task_name(config), run_task_kwargs(config))


def check_run_task(task: Task, config: RLConfig) -> None:
    """Refuse a task a run cannot train: one that yields images (its ``image_source()`` is not None) where the run's
    rollout cannot sample with them. A vision task's prompt rows carry their images' blob keys (``image_refs``); the
    rollout workers hand them to the in-process ``hf`` engine, which resolves them through the task's image source
    (the trainer does the same). Refused: any other ``rollout.engine`` (their engines take token ids only), partial
    rollouts, a ``rollout.generate_fn`` (its rows are trajectories, without images) and the SFT warm-up (its batches
    carry no images).

    Raises:
        ConfigError: naming the task, the setting that clashes, and what is supported.
    """
    if task.image_source() is None:
        return
    clashes = []
    if config.rollout.engine != "hf":
        clashes.append(f"rollout.engine={config.rollout.engine!r} (its engine takes no images)")
    if config.rollout.partial_rollout:
        clashes.append("rollout.partial_rollout=true")
    if config.rollout.generate_fn:
        clashes.append(f"rollout.generate_fn={config.rollout.generate_fn!r}")
    if config.sft.enabled:
        clashes.append("sft.enabled=true (the SFT warm-up feeds no images)")
    if clashes:
        raise ConfigError(
            f"task {run_task_name(config)!r} yields images (its image_source() is not None), which a run trains with "
            f"rollout.engine='hf', without partial rollouts, a generate_fn or the SFT warm-up; got "
            f"{', '.join(clashes)} (docs/sampling.md, 'Vision-language models')"
        )


def check_task_prompts(task: Task, task_name: str, prompts: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """``prompts`` (``task.prompts(split, ...)``), checked before any is put into the queue: each is a dict with
    ``prompt_ids``, the task's ``reward_fields`` and, for a task that yields images (its ``image_source()`` is not
    None), ``image_refs`` (its images' blob keys).

    Raises:
        ConfigError: naming the task, the split, the prompt's index in ``prompts``, the missing keys and the keys it
            has.
    """
    required = ["prompt_ids", *task.reward_fields]
    why = ""
    if task.image_source() is not None:
        required.append(IMAGE_REFS)
        why = f" ({IMAGE_REFS!r}: the task yields images, its image_source() is not None)"
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, dict):
            raise ConfigError(
                f"task {task_name!r}: {split} prompt {index}: expected a dict with keys {required}{why}, got a "
                f"{type(prompt).__name__}"
            )
        missing = [key for key in required if key not in prompt]
        if missing:
            raise ConfigError(
                f"task {task_name!r}: {split} prompt {index} lacks {missing}: expected keys {required}{why}, got "
                f"keys {sorted(prompt)}"
            )
    return prompts


class GRPORun:
    """Starts the queue and the actors of a run (see the module docstring); call :meth:`run`."""

    # The queue's task_names: it refuses any other (a typo'd stage fails at once instead of reading every row again).
    # A subclass that reads the queue under other names too adds them.
    queue_task_names: tuple[str, ...] = (ROLLOUT_TASK, REWARD_TASK, TRAIN_TASK)
    stage_trace: StageTrace | None = None  # trace=true: the run's trace (orchestration/run_trace.py)
    _steps_iter: Generator[int, None, None] | None = None  # what steps() handed out: __exit__ closes it
    inference: InferenceManager | None = None  # the inference servers the run started (orchestration/inference.py)
    gpu_holder: Any = None  # the actor holding the GPUs Ray reserved for those servers (reserve_server_gpus)
    # rollout.inference_colocate: those servers' memory freed for each training step (train, sync_weights)
    colocation: ColocatedServers | None = None
    images: bool = False  # a vision task (its image_source() is not None): its rows carry image_refs
    # trainer-group restarts (a trainer rank died: orchestration/trainer_restarts.py) the next step row counts
    restarts_trainer: int = 0
    # each step's rows kept in the queue until a checkpoint covers the step (trainer_restarts.keeps_rows; set at start)
    keeps_rows: bool = False
    _kept: dict[str, Any] | None = None  # the queue a trainer-group restart kept running: what it holds (_start)
    _restored_later: frozenset[int] = frozenset()  # restored steps whose workers start once due (_relaunch_restored)

    def __init__(self, config: RLConfig):
        config.validate()
        self.cfg = config
        self.timings: dict[str, float] = {}  # run(): seconds of the SFT warm-up (or resume) and of the GRPO steps
        # what shutdown stops; a start-up that fails part way stops what it had started (the weight channel included)
        self.channel: WeightChannel | None = None
        self.client: Any = None
        self.rollout: list[Any] = []
        self.engines: list[Any] = []  # the rollout workers' EngineActors (start_workers), the driver's
        self.reward: list[Any] = []
        self.trainer: list[Any] = []
        self.sinks: Any = None
        try:
            self._start()
        except BaseException:  # an error, a Ctrl-C or a SIGTERM (orchestration/stopping.py) during start-up
            self.shutdown()
            raise

    def _start(self) -> None:
        """Start the run's queue and actors (see the class docstring)."""
        cfg = self.cfg
        self.task_name = run_task_name(cfg)
        self.out = cfg.output_path
        self.out.mkdir(parents=True, exist_ok=True)
        save_config(self.out, cfg)
        self.task = load_run_task(cfg)
        check_run_task(self.task, cfg)
        self.images = self.task.image_source() is not None  # a vision task: its rows carry image_refs
        api_key, model_dir, started = key_from_env(), None, None  # engine_url's servers: the key in TQ_API_KEY
        if starts_servers(cfg.rollout):  # one server per rollout worker, loading the run's model, with its own key
            model_dir = model_directory(cfg.model.path, self.task, self.out)
            # each server its own devices: rollout.gpus, else GPUs Ray holds for them (none on a CPU node)
            reserved = reserve_server_gpus(cfg.rollout, cfg.train.world_size * cfg.train.num_gpus_per_rank)
            gpus = None
            if reserved is not None:
                self.gpu_holder, gpus = reserved
            self.inference = inference_manager(cfg.rollout, model_dir, self.out, gpus=gpus)
            api_key, started = self.inference.api_key, self.inference.start()
        self.worker_urls = worker_urls(cfg.rollout, started)  # rollout worker i's server (worker_spec)
        self.channel = WeightChannel.create() if cfg.weight_sync == "shm" else None
        # with a weight channel, producers run one step further ahead: the queue holds that step too
        self.lookahead = cfg.max_staleness + (1 if self.channel is not None else 0)
        self._queue_from: Path | None = None  # the checkpoint whose queue snapshot this queue starts from
        self.queue_resume: QueueResume | None = None
        # each step's rows stay in the queue until a checkpoint covers the step (trainer_restarts.keeps_rows); the
        # queue a trainer-group restart kept running, what it holds (the start attaches to it)
        self.keeps_rows = keeps_rows(cfg)
        self._kept = take_kept_queue(self.out, queue_running()) if self.keeps_rows else None
        self.client = transfer_queue.init(
            global_batch_size=cfg.prompts_per_step,
            num_n_samples=cfg.n_samples,
            num_global_batch=queue_steps(cfg, self.lookahead),
            sampler=transfer_queue.GRPOSampler(cfg.n_samples),
            num_storage_units=cfg.num_storage_units,
            default_timeout=cfg.queue_timeout,
            restore_from=self._restorable_queue() if self._kept is None else None,
            task_names=self.queue_task_names,
            run_metrics=str(self.out / "metrics.jsonl"),
            replicas=cfg.queue_replicas,
            **self._queue_journal(),
        )
        info = self.client.controller_info
        spec = EngineSpec(
            kind=cfg.rollout.engine,
            task_name=self.task_name,
            task_kwargs=run_task_kwargs(cfg),
            device=cfg.rollout.engine_device,
            weights_channel=str(self.channel.path) if self.channel is not None else None,
            weights_timeout=cfg.queue_timeout,
            model_path=model_dir,
            url=self.worker_urls[0],
            api_key=api_key,  # the key of the servers, handed to the actors through Ray
            partial_rollout=cfg.rollout.partial_rollout,
            chunk_tokens=cfg.rollout.chunk_tokens,
            seed=cfg.seed,
        )
        self.sampling = SamplingParams(
            max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p
        )
        self.rollout, self.reward = self.start_workers(info, spec)
        if cfg.rollout.inference_colocate and self.inference is not None:
            self.colocation = ColocatedServers(self.inference, RolloutRequests(self.rollout))
        self._weights_update: tuple[int, Any, str | None] | None = None  # what publish() last sent the rollout workers
        # dead rollout / reward workers: Ray restarts them, the supervisor makes their calls again (supervisor.py)
        self.supervisor = Supervisor(
            {"rollout": self.rollout, "reward": self.reward},
            self._call_again,
            self._worker_restarted,
            self.client,
            cfg.rollout.max_worker_restarts,
        )
        # each worker's queue client (its owner), by kind and index: a dead one's rows go back at once
        self._worker_owners: dict[str, dict[int, str]] = {
            kind: dict(enumerate(ray.get([w.queue_owner.remote() for w in workers])))
            for kind, workers in (("rollout", self.rollout), ("reward", self.reward))
        }
        rank_options = {"num_gpus": cfg.train.num_gpus_per_rank} if cfg.train.num_gpus_per_rank else {}
        trainer_config = TrainerConfig.from_run(cfg)  # the trainer's part of the run's config
        self.trainer = [
            actor_class(GRPOTrainerRank)
            .options(**rank_options)
            .remote(r, cfg.train.world_size, info, trainer_config, self.task)
            for r in range(cfg.train.world_size)
        ]
        master = ray.get(self.trainer[0].address.remote())
        ray.get([rank.setup.remote(*master) for rank in self.trainer])
        train = self.task.prompts("train", cfg.task.num_train_prompts, cfg.task.seed)
        self.prompts = PromptSource(check_task_prompts(self.task, self.task_name, train, "train"), cfg.seed)
        evals = self.task.prompts("eval", cfg.task.num_eval_prompts, cfg.task.seed + 1)
        self.eval_prompts = check_task_prompts(self.task, self.task_name, evals, "eval")
        self.metrics = MetricsLog(self.out / "metrics.jsonl")
        # each GRPO row also goes to the controller (Prometheus gauges, the status page) and TensorBoard/W&B if asked
        self.sinks = run_sinks(cfg, transfer_queue.get_controller(), self.out)
        # trace=true: the queue's requests and each step's stages, written to trace.json when the run ends
        self.stage_trace = StageTrace(transfer_queue.get_controller(), self.out / "trace.json") if cfg.trace else None
        self.version = 0  # the version the engines were last sent
        self.prompt_states: dict[int, dict[str, Any]] = {}  # PromptSource state before each launched step's draw
        self._saved_step: int | None = None
        self.step = 0  # GRPO steps done (what a Ctrl-C reports)
        self._resumed = False
        self._start_kind: Start | None = None  # how this start began (_resume_or_warm_up)
        # prompts whose rows die with a storage unit are put again (orchestration/regenerate.py)
        self.lost_prompts = LostPrompts(self.client, TRAIN_TASK, self.put_group, self.relaunch)
        # the loop's state (begin(), steps()): where GRPO starts, the steps launched and not yet trained, the rows
        self.start = 0
        self.first_version = 0
        self.pending: dict[int, tuple[list[Any], list[Any]]] = {}
        self.rows: list[dict[str, Any]] = []
        self._publish_refs: list[Any] = []

    def start_workers(self, info: Any, spec: EngineSpec) -> tuple[list[Any], list[Any]]:
        """The rollout and reward worker actors (a subclass, e.g. the agent recipe's, starts others).

        With ``rollout.generate_fn`` (e.g. ``workers.agents.rollout_fns:single_turn_generate``, the built-in single-turn
        rollout as such a function) the rollout workers run that function and it scores the samples: no reward
        workers."""
        cfg = self.cfg
        if cfg.rollout.generate_fn:
            from workers.agents.rollout_worker import AgentRolloutWorker

            workers = [
                actor_class(AgentRolloutWorker).options(**self.worker_options()).remote(
                    i, info, self.worker_spec(spec, i), self.sampling, cfg.n_samples, cfg.rollout.groups_per_request,
                    cfg.rollout.generate_fn, cfg.rollout.generate_fn_kwargs, cfg.rollout.filter_fn,
                    cfg.rollout.reward_fn, cfg.queue_timeout, cfg.seed + i,
                )
                for i in range(cfg.rollout.num_workers)
            ]  # fmt: skip
            return workers, []
        engine_options = {"num_gpus": 1} if cfg.rollout.engine_device.startswith("cuda") else {}
        # the engines are the driver's, not the workers': a rollout worker killed mid-generation leaves its engine
        # going on with the call, and the call made again after the worker's restart resumes what it generated
        self.engines = [
            start_engine(self.worker_spec(spec, i), engine_options, cfg.seed + i)
            for i in range(cfg.rollout.num_workers)
        ]
        rollout = [
            actor_class(RolloutWorker)
            .options(**self.worker_options())
            .remote(
                i,
                info,
                self.worker_spec(spec, i),
                self.sampling,
                cfg.n_samples,
                cfg.rollout.groups_per_request,
                cfg.queue_timeout,
                engine_options,
                cfg.seed + i,
                cfg.rollout.checkpoint_inflight,
                cfg.max_staleness,
                self.engines[i],
            )
            for i in range(cfg.rollout.num_workers)
        ]
        reward = [
            actor_class(RewardWorker)
            .options(**self.worker_options())
            .remote(
                i,
                info,
                self.task_name,
                run_task_kwargs(cfg),
                cfg.task.reward_fn,
                cfg.n_samples,
                cfg.rollout.reward_groups_per_request,
                cfg.queue_timeout,
            )
            for i in range(cfg.rollout.num_reward_workers)
        ]
        return rollout, reward

    def worker_options(self) -> dict[str, Any]:
        """Ray options of the rollout and reward worker actors: Ray restarts one that dies, up to
        ``rollout.max_worker_restarts`` times (the supervisor makes its calls again: orchestration/supervisor.py)."""
        return {"max_restarts": self.cfg.rollout.max_worker_restarts}

    def _call_again(self, kind: str, index: int, step: int) -> Any:
        """Worker ``index`` of ``kind``'s call of ``step``, made again (its worker died) in the redo group: a call of
        a later step may be waiting in the step group for the weights this step's training publishes."""
        if kind == "rollout":
            min_version = self._min_version(step, self.start, self.first_version)
            worker = self.rollout[index].generate_step.options(concurrency_group=REDO_GROUP)
            return worker.remote(step, self.prompt_fields(), min_version, self._train_version(step))
        return self.reward[index].score_step.options(concurrency_group=REDO_GROUP).remote(step)

    def _worker_restarted(self, kind: str, index: int) -> None:
        """The dead worker's queue client is gone: the controller hands its rows back now (a lease a restarted
        controller replayed from its journal would otherwise hold them to its deadline). A restarted rollout worker
        gets the weights last published (with the shm channel its engine pulls them)."""
        workers = self.rollout if kind == "rollout" else self.reward
        owners = self._worker_owners.setdefault(kind, {})
        if index in owners:  # a controller being restarted is waited for: its replay holds the dead worker's leases
            controller = transfer_queue.get_controller()
            when_up(lambda: ray.get(controller.clients_gone.remote([owners[index]])))
        owners[index] = when_up(lambda: ray.get(workers[index].queue_owner.remote()))
        if kind == "rollout" and self.colocation is not None and isinstance(self.colocation.requests, RolloutRequests):
            self.colocation.requests.restarted(index)  # its new gate is held while the servers are released
        if kind == "rollout" and self._weights_update is not None:
            update = self._weights_update
            when_up(lambda: ray.get(self.rollout[index].update_weights.remote(*update)))

    def _tracked(self, step: int, refs: tuple[list[Any], list[Any]]) -> tuple[list[Any], list[Any]]:
        """``(rollout refs, reward refs)`` of ``step``, one per worker in order, remembered by the supervisor."""
        for kind, kind_refs in zip(("rollout", "reward"), refs, strict=True):
            for index, ref in enumerate(kind_refs):
                self.supervisor.track(kind, index, step, ref)
        return refs

    def worker_spec(self, spec: EngineSpec, i: int) -> EngineSpec:
        """Rollout worker ``i``'s engine: ``spec`` with its own server's URL (orchestration/inference.py)."""
        return dataclasses.replace(spec, url=self.worker_urls[i])

    # ---- the pieces of a step ------------------------------------------------------------------------------
    def put_prompts(self, step: int) -> None:
        """The step's prompts, each repeated ``n_samples`` times: its group of rows."""
        n = self.cfg.n_samples
        # where the prompt source stood before this step drew: what a run resumed at ``step`` must draw next
        self.prompt_states[step] = self.prompts.state_dict()
        prompts = self.prompts.next_batch(self.cfg.prompts_per_step)
        self.lost_prompts.remember(step, prompts)
        put_retrying(self.client, self.prompt_rows([p for p in prompts for _ in range(n)]), global_step=step)

    def prompt_rows(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The fields of prompt rows (one entry per row)."""
        fields: dict[str, Any] = {"prompt_ids": jagged([p["prompt_ids"] for p in rows], torch.int64)}
        for name in self.task.reward_fields:
            fields[name] = [str(p[name]) for p in rows]
        if self.images:  # a vision task: each row names its prompt's images (blob keys), the n samples alike
            fields[IMAGE_REFS] = [list(p[IMAGE_REFS]) for p in rows]
        return fields

    def put_group(self, step: int, group: int, prompt: dict[str, Any]) -> None:
        """Put one prompt's group of rows into ``step`` again, with its group id (its first rows were lost)."""
        n = self.cfg.n_samples
        put_retrying(self.client, self.prompt_rows([prompt] * n), global_step=step, group_ids=[group] * n)

    def relaunch(self, step: int, rollout: bool, reward: bool) -> tuple[list[Any], list[Any]]:
        """Start the rollout and/or reward of ``step`` again (rows of it were put again after they had finished), in
        the workers' redo group: the step launched ahead may be waiting for this one's weights in their step group."""
        refs = (
            [w.generate_step.options(concurrency_group=REDO_GROUP).remote(
                step, self.prompt_fields(), None, self._train_version(step)) for w in self.rollout] if rollout else [],
            [w.score_step.options(concurrency_group=REDO_GROUP).remote(step) for w in self.reward] if reward else [],
        )  # fmt: skip
        return self._tracked(step, refs)

    def prompt_fields(self) -> list[str] | None:
        """The fields of a step's rows a rollout worker reads (None: its own default); a vision task's rows
        with their ``image_refs``."""
        if self.cfg.rollout.generate_fn:
            return ["prompt_ids", *self.task.reward_fields]
        return ["prompt_ids", IMAGE_REFS] if self.images else None

    def launch(self, step: int, min_version: int | None = None) -> tuple[list[Any], list[Any]]:
        """Put the step's prompts and start its rollout and reward; ``min_version`` (weight channel only): the
        policy version the rollout waits for."""
        self.put_prompts(step)
        return self._tracked(
            step,
            (
                [
                    w.generate_step.remote(step, self.prompt_fields(), min_version, self._train_version(step))
                    for w in self.rollout
                ],
                [w.score_step.remote(step) for w in self.reward],
            ),
        )

    def publish(self, version: int) -> float:
        """Send the trainer's weights to every engine as ``version``; returns the seconds it took."""
        t0 = time.perf_counter()
        if self.channel is not None:  # engines pull it before their next generation
            delta = self.cfg.weight_delta
            ray.get([rank.publish_weights.remote(str(self.channel.path), delta) for rank in self.trainer])
        elif self.cfg.weight_sync == "memory":
            weights = ray.get([rank.weights.remote() for rank in self.trainer])[0]
            self._send_weights((version, weights, None))
        else:
            path = self.out / "weights" / f"v{version:06d}"
            shutil.rmtree(path, ignore_errors=True)
            ray.get([rank.save_hf.remote(str(path)) for rank in self.trainer])
            self._send_weights((version, None, str(path)))
        self.version = version
        return time.perf_counter() - t0

    def _send_weights(self, update: tuple[int, Any, str | None]) -> None:
        """``update_weights(*update)`` on every rollout worker; a worker that died meanwhile gets them once Ray has
        restarted it (the supervisor's restart sends it ``update``, kept for later restarts too)."""
        self._weights_update = update
        refs = [w.update_weights.remote(*update) for w in self.rollout]
        for index, ref in enumerate(refs):
            try:
                ray.get(ref)
            except RayActorError as exc:
                self.supervisor.restarted("rollout", index, exc)

    def evaluate(self, sampled: bool = False, samples: int = 1) -> float:
        """Accuracy of the engines' current weights on the eval prompts: greedy, or the mean over ``samples`` samples
        per prompt at the rollout temperature (what GRPO's reward starts from)."""
        temperature = self.cfg.rollout.temperature if sampled else 0.0
        params = SamplingParams(max_new_tokens=self.cfg.rollout.max_new_tokens, temperature=temperature, seed=0)
        prompts = [p["prompt_ids"] for p in self.eval_prompts]
        # a vision task's prompts' image keys (its run has RolloutWorkers; an agent rollout worker takes none)
        images = ([list(p[IMAGE_REFS]) for p in self.eval_prompts],) if self.images else ()
        groups = ray.get(self.rollout[0].generate.remote(prompts, params, samples if sampled else 1, *images))
        return self.task.accuracy(self.eval_prompts, [[g.token_ids for g in group] for group in groups])

    def save(self, step: int) -> Path:
        """Checkpoint the run at ``step`` (orchestration/run_resume.py), the newest ``checkpoint_keep`` kept.

        The prompt position is the one before step ``step`` drew its prompts: in async mode rollout has already
        drawn up to ``max_staleness`` steps ahead, and a resumed run must draw those again, not skip them.

        Unless ``checkpoint_queue`` is off, the steps launched ahead (their rows in the queue) are saved with it: the
        queue's snapshot goes into the same checkpoint directory before it is committed (see
        :func:`~orchestration.run_resume.queue_record`), and a resumed run trains those rows instead of drawing and
        generating them again.
        """
        prompt_state = self.prompt_states.get(step, self.prompts.state_dict())
        extra = {"step": step, "prompt_source": prompt_state, "version": self.version}
        queue = (
            queue_record(step, self.prompt_states, self.prompts.state_dict(), self.lost_prompts.put_again)
            if self.cfg.checkpoint_queue
            else None
        )
        path = save_checkpoint(self.trainer, self.out, extra, queue, self.cfg.checkpoint_keep, self.metrics)
        self._saved_step = step
        if self.keeps_rows:  # a restart goes on from this checkpoint: the rows of the steps before it are done with
            self._clear_steps(below=step)
        return path

    def _clear_steps(self, below: int | None) -> None:
        """Clear the queue's steps before ``below`` (None: every step) and forget where they drew."""
        partitions = self.client.list_partitions()
        for step in covered_steps(partitions, below if below is not None else sys.maxsize):
            self.client.clear(global_step=step)
            self.prompt_states.pop(step, None)
            self.lost_prompts.forget(step)

    # ---- the run: GRPORun.run() and the recipes call these, in this order (docs/rl.md) ----------------------
    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Stop the actors and the queue however the block ends; a Ctrl-C (or a SIGTERM under
        :class:`~orchestration.stopping.SigtermStops`) becomes :class:`RunStopped` with the GRPO steps done."""
        if self._steps_iter is not None:  # a loop left early: its progress line closed, its trace written, first
            self._steps_iter.close()
        # a trainer rank's death (a call on it failed with RayActorError, or a rank's collective with it): the
        # trainer group restarts (orchestration/trainer_restarts.py)
        rank = rank_died(self.trainer, exc) if isinstance(exc, RayError) else None
        kept = False
        try:  # the train step raises TrainerRankDied itself (trainer_restarts.raise_if_rank_died)
            kept = (rank is not None or isinstance(exc, TrainerRankDied)) and self._keep_queue()
        finally:
            if kept:
                self.shutdown(keep_queue=True)
            else:
                self.shutdown()
        died = TrainerRankDied(rank, self.step, exc) if rank is not None else exc
        if isinstance(died, TrainerRankDied):  # what the restart needs to know of this run
            died.unreported, died.saved = self.restarts_trainer, self._saved_step is not None
            died.kept_queue = kept
        if died is not exc:
            raise died from exc
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt) and not isinstance(exc, RunStopped):
            raise RunStopped(self.step) from None

    def warm_up(self) -> float:
        """The SFT warm-up (orchestration/sft_warm_up.py); returns the accuracy it reached."""
        return sft_warm_up(self.cfg.sft, self.trainer, self.publish, self.evaluate, self.metrics)

    def begin(self) -> int:
        """Where GRPO starts: this run's latest checkpoint, or ``init_from``, or an SFT warm-up (then checkpoint 0);
        the KL reference, the engines' first weights, and the steps a restored queue holds relaunched. Returns the
        first GRPO step."""
        warm_up_started = time.perf_counter()
        self.start = self.step = self._resume_or_warm_up()
        self.timings["warm_up_s"] = time.perf_counter() - warm_up_started
        if self.cfg.train.kl_coef > 0:
            init_reference(self.trainer, self.out, resumed=self._resumed)
        self.publish(self.version)
        # the trainer's own version (what the channel holds; a resumed run may have published an older one)
        newest = self.channel.newest_version() if self.channel is not None else None
        self.first_version = newest if newest is not None else self.version
        self.pending = self._relaunch_restored(self.start, self.first_version)
        return self.start

    def steps(self) -> Iterator[int]:
        """The GRPO steps from :meth:`begin`'s to ``steps``, with a progress line; :meth:`log` each one's row. After
        the last: the run's summary row, its final checkpoint and plot. A loop that ends early (an error, a Ctrl-C)
        in a ``with`` block has the progress line closed and the trace written by the block's exit, before the
        actors stop (not whenever the interpreter collects the generator)."""
        self._steps_iter = self._steps()
        return self._steps_iter

    def _steps(self) -> Generator[int, None, None]:
        cfg = self.cfg
        controller = transfer_queue.get_controller()
        idle_cpu_per_s = self._queue_idle_cpu(controller)
        run_started = time.perf_counter()
        queue_cpu_start = ray.get(controller.cpu_seconds.remote())
        self.progress = StepReporter(self.start, cfg.steps, every=cfg.log_every)
        self.plot = PlotRefresher(
            self.out / "metrics.jsonl", self.out / "metrics.png", title=f"GRPO on {self.task_label}"
        )
        try:
            for step in range(self.start, cfg.steps):
                self._step_started = (time.perf_counter(), time.time())
                yield step
        finally:
            self.progress.close()  # a Ctrl-C's line starts on a line of its own, not after the bar
            self.timings["grpo_s"] = time.perf_counter() - run_started
            if self.stage_trace is not None:  # however the run ends: what was recorded is worth a look
                print(f"trace: {self.stage_trace.write()} (open it in https://ui.perfetto.dev)", flush=True)
        steps_run = max(len(self.rows), 1)
        server_cpu = ray.get(controller.cpu_seconds.remote()) - queue_cpu_start
        idle_cpu = idle_cpu_per_s * (time.perf_counter() - run_started)
        self.metrics.write(
            {
                "kind": "summary",
                "steps": len(self.rows),
                "grpo_wall_s": time.perf_counter() - run_started,
                "queue_server_cpu_s_per_step": server_cpu / steps_run,
                "queue_idle_cpu_s_per_step": idle_cpu / steps_run,
            }
        )
        if self._saved_step != cfg.steps:  # the last periodic checkpoint may already be this one
            self.save(cfg.steps)
        self.plot.refresh()

    def generate(self, step: int) -> None:
        """Put the prompts of ``step``, and of the steps up to ``max_staleness`` ahead (async mode; with a weight
        channel one more), that are not in the queue yet: rollout workers generate into their rows and reward workers
        score them as they come (Ray calls: this returns at once)."""
        for s in range(step, min(step + self.lookahead + 1, self.cfg.steps)):
            if s in self._restored_later:  # its prompts (and the rows made before a trainer-group restart) are there
                self._restored_later -= {s}
                self.pending[s] = self._restart_step(s, self.start, self.first_version)
            elif s not in self.pending:
                self.pending[s] = self.launch(s, self._min_version(s, self.start, self.first_version))

    def train(self, step: int) -> dict[str, float]:
        """The trainer ranks read ``step``'s scored groups from the queue as they are produced and take their optimizer
        steps (prompts lost with a storage unit are put again meanwhile); returns the trainer's metrics. With a weight
        channel, the publish of the new version is queued right behind the step on the ranks: no round trip.

        With ``rollout.inference_colocate`` the step's generation ends first, the steps launched ahead have their
        next generations held and those in flight waited for, and the servers' memory is freed (``sync_weights``
        brings them back)."""
        if self.colocation is not None:
            # the step's rollout done; a rollout worker that died meanwhile is restarted and its call made again
            self.lost_prompts.wait(self.pending[step][0], self.pending, self.supervisor.check)
            self.colocation.release()
        train_refs = [rank.train_step.remote(step) for rank in self.trainer]
        self._train_launched = time.time()
        self._publish_refs = []
        if self.channel is not None and self._publishes(step, self._version_after(step)):
            self._publish_refs = [
                rank.publish_weights.remote(str(self.channel.path), self.cfg.weight_delta) for rank in self.trainer
            ]

        # puts again prompts lost with a storage unit; the supervisor makes the calls of dead workers again; a rank's
        # death raises TrainerRankDied at once (a surviving rank may wait in a collective for it)
        def watch(pending: dict[int, tuple[list[Any], list[Any]]]) -> None:
            raise_if_rank_died(train_refs, step)
            self.supervisor.check(pending)

        try:
            train = self.lost_prompts.wait(train_refs, self.pending, watch)[0]
        except Exception:
            # a rank that died fails the survivors' collectives too: the death is the cause, whichever ended first
            if any_failed(train_refs):
                raise_if_rank_died(train_refs, step, RANK_DEATH_WAIT_S)
            raise
        self._train_done = time.time()
        return train

    def sync_weights(self, step: int, train: dict[str, float]) -> float:
        """The engines get the trainer's new weights when a publish is due (every ``sync_every`` versions, and after
        the last step); returns the seconds it took (0 when none was due). With ``rollout.inference_colocate`` the
        servers released for the step's training are resumed first, and the held generations go on after it."""
        if self.colocation is not None:
            return self.colocation.resume(lambda: self._sync_weights(step, train))
        return self._sync_weights(step, train)

    def _sync_weights(self, step: int, train: dict[str, float]) -> float:
        if self.channel is None:
            version = int(train["policy_version"])
            return self.publish(version) if self._publishes(step, version) else 0.0
        version = self._version_after(step)
        if int(train["policy_version"]) != version:  # the rollouts launched ahead wait for `version`
            raise RuntimeError(f"the trainer is at version {train['policy_version']}, expected {version}")
        if not self._publish_refs:
            return 0.0
        self.version = version
        return float(ray.get(self._publish_refs)[0])

    def end_step(self, step: int, train: dict[str, float], sync_s: float) -> dict[str, Any]:
        """Gather the step's rollout and reward figures, clear its rows from the queue; returns its metrics row."""
        rollout_refs, reward_refs = self.pending.pop(step)
        rollout_stats = self.supervisor.gather(step, rollout_refs)  # a call that died with its worker left out
        reward_stats = self.supervisor.gather(step, reward_refs)
        if not self.keeps_rows:  # else the checkpoint that covers the step clears it (save)
            self.client.clear(global_step=step)
        if self.cfg.rollout.checkpoint_inflight:  # partials a dead call left, unresumed (rl_contracts/inflight.py)
            self.client.kv_clear(None, inflight_partition(step))
        self.lost_prompts.forget(step, cleared=not self.keeps_rows)
        t0, wall0 = self._step_started
        if self.stage_trace is not None:
            wall = (wall0, time.time())
            train_wall = (self._train_launched, self._train_done)
            self.stage_trace.step(step, wall, train_wall, rollout_stats, reward_stats, sync_s)
        return self._step_row(step, train, rollout_stats, reward_stats, sync_s, time.perf_counter() - t0)

    def eval_due(self, step: int) -> bool:
        """Whether an evaluation follows ``step`` (every ``eval_every`` steps; never when it is 0)."""
        return bool(self.cfg.eval_every) and (step + 1) % self.cfg.eval_every == 0

    def log(self, row: dict[str, Any]) -> None:
        """Write a step's row (metrics.jsonl, the controller's gauges and any sinks), move the progress line, redraw
        the plot now and then, and checkpoint every ``checkpoint_interval`` steps."""
        step = int(row["step"])
        self.metrics.write(row)
        self.sinks.write(row)
        self.rows.append(row)
        self.step = step + 1
        self.progress.update(step, row)
        self.plot.maybe_refresh()
        if self.cfg.checkpoint_interval and (step + 1) % self.cfg.checkpoint_interval == 0:
            self.save(step + 1)
        if not self.keeps_rows:  # else kept with the step's rows (a restart's record names where each step drew)
            self.prompt_states.pop(step, None)

    def run(self) -> list[dict[str, Any]]:
        """SFT (unless resuming), then GRPO to ``steps``; returns the GRPO metric rows of this run. The same loop
        is written out in recipe/demo.py."""
        self.begin()
        for step in self.steps():
            self.generate(step)
            train = self.train(step)
            sync_s = self.sync_weights(step, train)
            row = self.end_step(step, train, sync_s)
            if self.eval_due(step):
                row["eval_accuracy"] = self.evaluate()
            self.log(row)
        return self.rows

    def _train_version(self, step: int) -> int:
        """The trainer's policy version when it trains ``step`` (the staleness of a resumed partial is measured
        against it)."""
        return self._version_after(step) - 1

    def _version_after(self, step: int) -> int:
        """The trainer's policy version once it has trained ``step``."""
        return self.first_version + step - self.start + 1

    def _publishes(self, step: int, version: int) -> bool:
        """Whether the weights of ``version`` (after ``step``) go to the engines: every ``sync_every``, and the last."""
        return version % self.cfg.sync_every == 0 or step == self.cfg.steps - 1

    def _min_version(self, step: int, start: int, first_version: int) -> int | None:
        """The oldest policy version the rollout of ``step`` may use (weight channel only; else None): the newest
        one published by then that keeps its samples within ``max_staleness`` (sync: the weights after step - 1)."""
        if self.channel is None:
            return None
        target = first_version + (step - start) - self.cfg.max_staleness
        return max(first_version, target - target % self.cfg.sync_every)

    @staticmethod
    def _queue_idle_cpu(controller: Any, seconds: float = 2.0) -> float:
        """CPU seconds per second the controller and storage processes use while idle (Ray's own threads)."""
        start = ray.get(controller.cpu_seconds.remote())
        time.sleep(seconds)
        return (ray.get(controller.cpu_seconds.remote()) - start) / seconds

    # ---- where the run starts (orchestration/run_resume.py) ---------------------------------------------------
    def _resume_or_warm_up(self) -> int:
        """Go on from this run's latest checkpoint; or start from ``init_from``; or warm up with SFT. Returns the
        first GRPO step."""
        start = start_point(self.cfg, self.out)
        self._resumed = start.kind is Start.RESUME
        self._start_kind = start.kind
        if start.kind is Start.RESUME:
            assert start.checkpoint is not None
            step = self._resume(start.checkpoint)
            self._drop_kept_queue()
            return step
        # a queue kept by a death before the run's first checkpoint: the run starts again from the same weights
        kept = self._kept if self._kept is not None and self._kept["checkpoint"] is None else None
        if kept is None or start.kind not in REPEATABLE_STARTS:
            self._drop_kept_queue()
            kept = None
        self._kept = None
        self.metrics = MetricsLog(self.out / "metrics.jsonl", truncate=True)
        if start.kind is Start.INIT_FROM:
            start_from_weights(self.trainer, str(self.cfg.init_from))
        elif start.kind is Start.SFT:
            self.warm_up()
            self.save(0)
        if kept is not None:
            self._resume_queue(0, kept["record"], kept=True)
        return 0

    def _resume(self, checkpoint: Path) -> int:
        """The trainer, the prompt position, the policy version and the metrics as ``checkpoint`` left them (and
        the queue, if it started from this checkpoint's snapshot); returns its step."""
        resumed = load_checkpoint(self.trainer, checkpoint)
        self.prompts.load_state_dict(resumed.prompt_source)
        self.version = resumed.version
        print(f"resumed from {checkpoint} at step {resumed.step}", flush=True)
        self.metrics.cut_back(resumed.step)  # the crashed run's rows past the checkpoint are written again
        if self._kept is not None and self._kept["checkpoint"] == str(checkpoint):
            self._resume_queue(resumed.step, self._kept["record"], kept=True)
            self._kept = None
        elif self._queue_from == checkpoint and resumed.queue is not None:
            self._resume_queue(resumed.step, resumed.queue)
        return resumed.step

    def _queue_journal(self) -> dict[str, Any]:
        """queue_journal: the controller journals in output_dir/queue_journal and every client of the queue (this
        driver's, the workers', the trainer ranks': they read it from the controller's info) asks again for up to
        QUEUE_RESTART_RETRY_S what failed while Ray restarted it. The journal outlives a controller, not the run: a
        journal left by a run that died (its units gone with it) is emptied, a resumed run starts from its checkpoint.
        """
        if not self.cfg.queue_journal:
            return {}
        journal = self.out / "queue_journal"
        if self._kept is None:  # a kept queue's controller journals there still
            shutil.rmtree(journal, ignore_errors=True)
        return {"journal_dir": str(journal), "restart_retry_s": QUEUE_RESTART_RETRY_S}

    def _keep_queue(self) -> bool:
        """A trainer rank died: leave the queue running for the restart (``keeps_rows``, and a checkpoint of this
        run to restart from), noting the steps it holds from that checkpoint on (trainer_restarts.write_kept_queue).
        False: the queue stops with the run, the restart starts a new one."""
        if not self.keeps_rows or self.client is None:
            return False
        checkpoint: Path | None = None
        if self._saved_step is None and not self._resumed:  # no checkpoint yet: the restart starts where this did
            if self._start_kind not in REPEATABLE_STARTS:
                return False
            step = 0
        else:
            checkpoint = latest_checkpoint(checkpoints_dir(self.out))
            if checkpoint is None:
                return False
            step = resumed_state(json.loads((checkpoint / "checkpoint.json").read_text())["extra_state"]).step
        record = queue_record(step, self.prompt_states, self.prompts.state_dict(), self.lost_prompts.put_again)
        if record is None:
            return False
        write_kept_queue(self.out, checkpoint, record)
        return True

    def _drop_kept_queue(self) -> None:
        """A kept queue the run did not resume from (another checkpoint was found): its steps are cleared."""
        if self._kept is not None:
            checkpoint = self._kept["checkpoint"] or "the run's start (no checkpoint)"
            logger.warning("the queue kept for %s is not resumed from: its steps are cleared", checkpoint)
            self._clear_steps(below=None)
            self._kept = None

    def _restorable_queue(self) -> str | None:
        """The queue snapshot of the checkpoint this run will resume from, if it has one: the queue starts from it."""
        restorable = restorable_queue(self.cfg, self.out)
        if restorable is None:
            return None
        self._queue_from = restorable[0]
        return str(restorable[1])

    def _resume_queue(self, step: int, record: dict[str, Any], kept: bool = False) -> None:
        """Go on with the steps the restored queue holds: the prompt source after their draws, and each task's
        consumption agreeing with what was produced before the crash (what was in flight is handed out again).
        ``kept``: the queue a trainer-group restart kept: the trainer is served the steps it had trained since the
        checkpoint again (queue_resume.resume_steps)."""
        self._clear_steps(below=step)  # the steps the checkpoint covers (a death after it, before their clear)
        self.prompt_states.update({int(s): state for s, state in record["prompt_states"]})
        # each restored step's prompts, drawn again where it drew them: a lost group of it is put again with its
        # prompt (orchestration/regenerate.py), unless the run before had put it again already
        put_again = {int(s): indexes for s, indexes in record.get("lost_put_again", [])}
        for s, state in record["prompt_states"]:
            self.prompts.load_state_dict(state)
            prompts = self.prompts.next_batch(self.cfg.prompts_per_step)
            self.lost_prompts.restore(int(s), prompts, put_again.get(int(s), []))
        self.prompts.load_state_dict(record["prompt_source"])
        outputs = restored_outputs(self.cfg, with_reward_workers=bool(self.reward))
        rows = self.cfg.prompts_per_step * self.cfg.n_samples
        retrain = TRAIN_TASK if kept else None
        self.queue_resume = resume_steps(self.client, step, record, rows, outputs, self.cfg.queue_timeout, retrain)
        print(self.queue_resume.message(ROLLOUT_TASK), flush=True)
        self.metrics.write(self.queue_resume.row(ROLLOUT_TASK))

    def _relaunch_restored(self, start: int, first_version: int) -> dict[int, tuple[list[Any], list[Any]]]:
        """Rollout and reward of the steps restored from the queue checkpoint (their prompts are in the queue):
        the workers take only the rows nobody had produced. A restored step further ahead than the run launches
        (a kept queue holds the steps trained since the checkpoint and those launched ahead of them) is started
        when it is due (:meth:`generate`): its missing rows sampled within ``max_staleness`` of its trainer."""
        steps = self.queue_resume.steps if self.queue_resume is not None else []
        self._restored_later = frozenset(s for s in steps if s > start + self.lookahead)
        return {s: self._restart_step(s, start, first_version) for s in steps if s not in self._restored_later}

    def _restart_step(self, s: int, start: int, first_version: int) -> tuple[list[Any], list[Any]]:
        """The rollout and reward calls of restored step ``s`` (its prompts are in the queue)."""
        return self._tracked(s, (
            [w.generate_step.remote(s, self.prompt_fields(), self._min_version(s, start, first_version),
                                    first_version + s - start) for w in self.rollout],
            [w.score_step.remote(s) for w in self.reward],
        ))  # fmt: skip

    def _step_row(
        self, step: int, train: dict[str, float], rollout: list[dict], reward: list[dict], sync_s: float, step_s: float
    ) -> dict[str, Any]:
        def total(stats: list[dict], key: str) -> float:
            return float(sum(s.get(key, 0.0) for s in stats))

        row: dict[str, Any] = {"kind": "grpo", "step": step, **train}
        row.update(
            step_s=step_s,
            samples_per_s=train["rows"] / step_s if step_s > 0 else 0.0,
            generate_s=total(rollout, "generate_s"),
            reward_s=total(reward, "reward_s"),
            queue_s=total(rollout, "queue_s") + total(reward, "queue_s") + train.get("queue_s", 0.0),
            queue_cpu_s=total(rollout, "queue_cpu_s") + total(reward, "queue_cpu_s") + train.get("queue_cpu_s", 0.0),
            rollout_queue_s=total(rollout, "queue_s"),
            reward_queue_s=total(reward, "queue_s"),
            train_queue_s=train.get("queue_s", 0.0),
            wait_s=total(rollout, "wait_s") + total(reward, "wait_s") + train.get("wait_s", 0.0),
            generated_rows=total(rollout, "rows"),  # fewer than rows: the rest came from a queue checkpoint
            sync_s=sync_s,
            weights_wait_s=total(rollout, "weights_wait_s"),
            engine_restarts=total(rollout, "engine_restarts"),
            reward_failures=total(reward, "failed"),
            reward_non_finite=total(reward, "non_finite"),
            tokens=total(rollout, "tokens"),
            **self.supervisor.take_restarts(),  # restarts_rollout, restarts_reward: worker deaths survived
            restarts_trainer=self.restarts_trainer,  # trainer-group restarts since the last row (trainer_restarts.py)
        )
        self.restarts_trainer = 0
        if self.cfg.rollout.checkpoint_inflight:  # tokens resumed from in-flight checkpoints, partials too stale
            for key in ("resumed_tokens", "stale_partials", "stale_partial_tokens"):
                row[key] = total(rollout, key)
        return row

    @property
    def task_label(self) -> str:
        return self.task_name.rsplit(":", 1)[-1]

    def shutdown(self, keep_queue: bool = False) -> None:
        """Stop the actors and the queue, then remove the weight channel and stop the run's inference servers
        (whatever failed before them): the ranks that write the channel and the workers that use the servers are gone
        by then. Stops only what started, so it also ends a start-up that failed; a
        second call does nothing. ``keep_queue``: the queue goes on running (a trainer-group restart attaches to it:
        :meth:`_keep_queue`); only this driver's client of it is closed, and the rollout workers first write the
        generations they have in flight into it (``train.restart_drain_s``: trainer_restarts.finish_writes)."""
        rollout, engines, sinks, actors, client, channel, inference = (
            self.rollout,
            self.engines,
            self.sinks,
            [*self.rollout, *self.engines, *self.reward, *self.trainer],
            self.client,
            self.channel,
            self.inference,
        )
        self.sinks, self.rollout, self.reward, self.trainer, self.client, self.channel = None, [], [], [], None, None
        self.engines = []
        self.inference = None
        holder, self.gpu_holder = self.gpu_holder, None
        try:
            if sinks is not None:
                sinks.close()
            if keep_queue and rollout and self.cfg.train.restart_drain_s > 0:  # their generations in flight kept
                try:
                    finish_writes(rollout, self.cfg.train.restart_drain_s, engines)
                except Exception:  # the workers are stopped anyway: what they held is generated again
                    logger.warning("could not wait for the rollout workers' writes in flight", exc_info=True)
            for actor in actors:
                ray.kill(actor)
            if client is not None and keep_queue:
                client.close()
            elif client is not None:
                transfer_queue.shutdown()
        finally:
            try:
                if channel is not None:
                    channel.close()
            finally:
                try:
                    if inference is not None:  # the run's inference servers, after the workers that used them
                        inference.stop()
                finally:
                    if holder is not None:  # their GPUs, once they stopped
                        ray.kill(holder)


def connect_ray(env_vars: dict[str, str] | None = None, attempts: int = 3) -> None:
    """Attach to the cluster of a ``ray job submit``; otherwise start a local one with room for every actor.

    A local start is tried up to ``attempts`` times: Ray gives its raylet a fixed 30 s to register, which a heavily
    loaded machine can miss ("The current node timed out during startup")."""
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env={"env_vars": env_vars} if env_vars else None)
        return
    for attempt in range(1, attempts + 1):
        try:
            init_ray(
                num_cpus=max(16, os.cpu_count() or 1),
                include_dashboard=False,
                logging_level=logging.WARNING,
                runtime_env={"env_vars": env_vars} if env_vars else None,
            )
            return
        except Exception as exc:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(exc) or attempt == attempts:
                raise
            logger.warning("local Ray start %d/%d timed out (machine loaded?); starting again", attempt, attempts)
            ray.shutdown()


def time_line(steps: int, total_s: float, timings: dict[str, float]) -> str:
    """Where a run's time went, each figure named for what it measures: the GRPO steps alone, then the whole run
    with its SFT warm-up (or resume) and the rest: start-up (Ray, the queue, the actors, the reference policy, the
    first publish) and wind-down (the last checkpoint and plot, stopping the actors)."""
    grpo_s, warm_up_s = timings.get("grpo_s", 0.0), timings.get("warm_up_s", 0.0)
    per_step = f", {grpo_s / steps:.3f} s a step" if steps else ""
    start_up_s = max(total_s - grpo_s - warm_up_s, 0.0)
    return (
        f"GRPO: {steps} steps in {grpo_s:.1f} s{per_step}; the whole run {total_s:.1f} s "
        f"(start-up and wind-down {start_up_s:.1f} s, SFT warm-up or resume {warm_up_s:.1f} s, GRPO {grpo_s:.1f} s)"
    )


#: a run's loop: called with the started run, returns its GRPO rows (``GRPORun.run``, or a recipe's own)
Loop = Callable[[GRPORun], list[dict[str, Any]]]


def train_and_report(config: RLConfig, loop: Loop | None = None) -> list[dict[str, Any]]:
    """Start ``config``'s run, go through ``loop`` (by default ``GRPORun.run``: SFT if configured, then GRPO), stop
    its actors, and print how the reward moved.

    Raises:
        RunStopped: on a Ctrl-C (KeyboardInterrupt), once the run's actors and queue are stopped; ``step`` is the
            GRPO steps done (orchestration/stopping.py).
        TrainerRestartsSpent: a trainer rank died after ``train.max_restarts`` restarts of the trainer group (each
            resumes the run from its last checkpoint: orchestration/trainer_restarts.py).
    """
    started = time.perf_counter()
    died: list[GRPORun] = []  # the starts a trainer rank's death ended (their rows up to it)

    def attempt(cfg: RLConfig, restarts: int) -> tuple[GRPORun, list[dict[str, Any]]]:
        with GRPORun(cfg) as run:
            run.restarts_trainer = restarts
            died.append(run)  # until it returns
            rows = loop(run) if loop is not None else run.run()
        died.pop()
        return run, rows

    # a dead trainer rank: the run stops and resumes from its last checkpoint, up to train.max_restarts times; the
    # reward line covers the whole run: each start's rows up to the step the next one resumed from
    run, last_rows = run_with_trainer_restarts(config, attempt)
    rows = joined_rows([(r.start, r.rows) for r in died] + [(run.start, last_rows)])
    first, last = fifth_means([r["reward"] for r in rows])
    print(f"\nGRPO mean reward: first fifth {first:.3f} -> last fifth {last:.3f} ({last - first:+.3f})")
    print(time_line(len(rows), time.perf_counter() - started, run.timings))
    print(f"metrics: {config.output_path / 'metrics.jsonl'}")
    print(f"plot: {config.output_path / 'metrics.png'}")
    return rows


def train_from_command_line(config: RLConfig, env_vars: dict[str, str] | None = None, loop: Loop | None = None) -> int:
    """A recipe's run: ``connect_ray`` then ``train_and_report`` with ``loop``; on Ctrl-C or SIGTERM one line (where
    it stopped, how to go on) and exit code 130 (143 for SIGTERM) instead of a traceback; Ray shut down however it
    ends.

    Returns:
        The process's exit code: 0, ``EXIT_INTERRUPTED`` or ``EXIT_TERMINATED``.
    """
    sigterm = SigtermStops()
    try:
        connect_ray(env_vars)
        with sigterm:  # after Ray's start: ray.init installs a SIGTERM handler of its own
            train_and_report(config, loop)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the run's actors, queue and weight channel are stopped
        print(stopped_line(config, exc), file=sys.stderr)
        return sigterm.exit_code()
    finally:
        ray.shutdown()
    return 0
