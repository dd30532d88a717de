"""RLConfig: one source of truth for a GRPO run, loaded from YAML and checked before any actor starts.

The run's config lives here, with the orchestration that reads all of it; its ``train`` section is the trainer's own
(``trainers.config.TrainConfig``), and ``trainers.config.TrainerConfig.from_run`` takes the trainer's part of a run.

The loading (:func:`load_config`), the command line (:func:`config_from_cli`) and the key ranges
(:func:`check_ranges`) take any config dataclass of this shape (``cls``): nested dataclass sections, a
``KEY_RANGES`` class variable with the range of each constrained dotted key, a ``resume`` field for ``--new``;
recipe/agentrl_demo.py's AgentRLDemoConfig is another.
"""

from __future__ import annotations

import difflib
import inspect
import re
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, overload

import msgspec
import yaml

from trainers.config import TrainConfig
from trainers.losses import LOSS_AGG_MODES, LOSSES, loss_named


class ConfigError(ValueError):
    """A configuration is inconsistent; the message says which values clash and what would fit."""


C = TypeVar("C")

#: the rollout engines that are clients of an inference server (``rollout.engine_url``, or the run's own servers)
SERVER_ENGINES = ("vllm-server", "sglang")
#: the ``InferenceManager`` engine that starts each one's servers
SERVER_KIND = {"vllm-server": "vllm", "sglang": "sglang"}


@dataclass
class TaskConfig:
    """Which task (prompts, reward, tokenizer, starting policy) to train on."""

    # "module:Class" of a rl_contracts.task.Task; None: the run's default task (orchestration.grpo_run.DEFAULT_TASK,
    # the addition task). The run resolves it and hands the trainer ranks the task object.
    name: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the task's constructor
    reward_fn: str | None = None  # "module:function" replacing the task's own reward, fn(response_text, **fields)
    num_train_prompts: int = 4096  # prompts of the training split
    num_eval_prompts: int = 256  # held-out prompts for the accuracy evaluations
    seed: int = 0  # which prompts the task draws


@dataclass
class ModelConfig:
    """The model of a run trained on your own files (docs/quickstart.md): a local Hugging Face directory."""

    path: str | None = None  # a local Hugging Face model directory: weights, tokenizer and its chat template


@dataclass
class DataConfig:
    """Your own prompts (docs/quickstart.md): JSONL or Parquet files read with ``datasets``, one prompt a row."""

    train_files: str | list[str] | None = None  # JSONL (.jsonl, .json) or Parquet (.parquet) files of training prompts
    val_files: str | list[str] | None = None  # held-out prompts for the evaluations; None: the training files
    prompt_key: str = "prompt"  # the column of the prompt: a string (the user turn) or a list of chat messages


@dataclass
class RewardConfig:
    """The reward of a run trained on your own files: a plain function, no Task class (docs/quickstart.md)."""

    # "module:function" or "path/to/file.py:function": reward(prompt, response, **fields) -> float, sync or async;
    # fields are the row's other columns
    fn: str | None = None
    batch: bool = False  # fn scores a batch: reward(prompts, responses, **fields) -> list[float], each field a list


@dataclass
class RolloutConfig:
    """Generation: engines, sampling, and how rows are taken from the queue."""

    num_workers: int = 1  # rollout worker actors, each with one engine
    engine: Literal["hf", "vllm", "vllm-server", "sglang"] = "hf"  # vllm: in-process vllm.LLM; *-server: a server
    # vllm-server / sglang: the servers started elsewhere (their key: TQ_API_KEY env), one URL for every rollout worker
    # or a list of one per worker; None: the run starts its own, one per rollout worker (orchestration/inference.py)
    engine_url: str | list[str] | None = None
    # the servers the run starts itself (engine_url None, one per rollout worker; workers/engines/manager.py):
    inf_tp_size: int = 1  # tensor-parallel size (devices) of each server the run starts
    inf_ep_size: int = 1  # expert-parallel size of each (vLLM: 1 or inf_tp_size; SGLang: a divisor of inf_tp_size)
    inf_mem_ratio: float | None = None  # fraction of each device's memory a server takes (None: the engine's default)
    # the devices of those servers: server i gets gpus[i * inf_tp_size : (i + 1) * inf_tp_size] as CUDA_VISIBLE_DEVICES;
    # None: Ray reserves num_workers x inf_tp_size GPUs of this node for them when it has GPUs (none: no placement)
    gpus: list[int] | None = None
    # those servers share their devices with training (the ledger flow's inference_colocate): before each training
    # step the rollout workers' generations are held and waited for, the servers' memory freed; after it they are
    # resumed and loaded with the new weights before generation goes on (orchestration/grpo_run.py)
    inference_colocate: bool = False
    engine_device: str = "cpu"  # where each engine runs: cpu, cuda, cuda:1
    max_new_tokens: int = 8  # longest response, in tokens
    temperature: float = 1.0  # sampling temperature; 0 is greedy (log-probs then at temperature 1)
    top_p: float = 1.0  # nucleus sampling; log-probs stay those of the untruncated distribution
    partial_rollout: bool = False  # a weight update stops generations mid-way; they resume on the new weights
    chunk_tokens: int = 16  # partial rollouts: tokens an engine without abort (or checkpointing) generates per call
    # partial rollouts: each chunk's partial responses go into the queue as they are generated, so a rollout worker
    # killed mid-step resumes them when its call is made again, instead of generating them again (rl_contracts/
    # inflight.py)
    checkpoint_inflight: bool = False
    groups_per_request: int = 16  # GRPO groups a rollout worker takes from the queue at a time
    num_reward_workers: int = 1  # reward worker actors
    reward_groups_per_request: int = 16  # GRPO groups a reward worker scores at a time
    # times Ray restarts each rollout / reward worker actor that dies (its process killed); the run goes on with the
    # restarted one, the rows it held handed back (orchestration/supervisor.py); -1: no limit, 0: a death ends the run
    max_worker_restarts: int = 10
    # Custom rollouts (workers/agents/rollout_fns.py) and task servers the run starts itself on 127.0.0.1.
    generate_fn: str | None = None  # "module:fn", an async generate(prompts, engine, **kwargs) -> list[Sample]
    generate_fn_kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments given to generate_fn
    filter_fn: str | None = None  # "module:fn", a group filter fn(samples) -> bool (False drops the group)
    reward_fn: str | None = None  # "module:fn", a per-sample reward fn(sample) -> float
    task_server_env: str | None = None  # environment the run serves (python -m workers.agents.task_server ENV)
    num_task_servers: int = 1  # task servers started; their URLs go to generate_fn as task_server_url
    task_server_max_episodes: int | None = None  # --max-episodes of each task server (None: the server's default)
    # --idle-timeout of each task server: seconds without a call before an episode expires (its environment closed);
    # keep it above the slowest turn of the run (a batched generation under load), or live episodes are lost
    task_server_idle_timeout: float = 1800.0


@dataclass
class SFTConfig:
    """The supervised warm-up before RL (the SFT -> RL pipeline)."""

    enabled: bool = True  # warm up with SFT before RL (unless resuming or init_from)
    lr: float = 1e-3  # SFT learning rate
    batch_size: int = 64  # SFT rows per step
    max_steps: int = 2000  # SFT steps at most
    target_accuracy: float = 0.2  # stop once accuracy on the eval prompts reaches this
    target_metric: Literal["sampled", "greedy"] = "sampled"  # sampled at the rollout temperature, or greedy
    eval_every: int = 25  # SFT steps between accuracy evaluations
    # samples per eval prompt behind the sampled accuracy (their mean): one sample on each of 256 prompts measures an
    # accuracy of 0.7 with a standard error of ~0.03, 8 with ~0.01 (~25 ms an evaluation in the demo)
    eval_samples: int = 8


#: checkpoint_every=None: about this many checkpoints per run ...
DEFAULT_CHECKPOINTS_PER_RUN = 10
#: ... and never more than this many steps apart
DEFAULT_CHECKPOINTS_EVERY_AT_MOST = 100


@dataclass
class RLConfig:
    """A whole GRPO run.

    The queue holds ``num_global_batch = max_staleness + 1`` steps of ``prompts_per_step * n_samples`` rows.
    """

    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    steps: int = 200  # GRPO steps of the run (a resumed run with more steps extends it)
    prompts_per_step: int = 32  # prompts (GRPO groups) per step
    n_samples: int = 8  # responses per prompt (the group size)
    mode: Literal["sync", "async"] = "sync"  # sync: on-policy; async: rollout runs up to max_staleness steps ahead
    max_staleness: int = 0  # async: steps rollout may run ahead of training; older samples are not trained on
    # memory: via the object store; disk: a Hugging Face directory per version (engines off the cluster); shm: a
    # WeightChannel in shared memory that engines on this host pull from (no driver round trip; lets the driver
    # launch generation of step s+1 while step s trains, the engine waiting for the weights it needs)
    weight_sync: Literal["memory", "disk", "shm"] = "memory"
    # shm: each publish marks the 1 MiB chunks that changed since the previous one and writes only the chunks it
    # must; an engine one publish behind copies only the changed chunks (see rl_contracts/weight_channel.py)
    weight_delta: bool = False
    sync_every: int = 1  # publish weights every k optimizer steps
    output_dir: str = "outputs/grpo"  # metrics, plot, config and checkpoints of the run
    # steps between checkpoints (0: only at the end); None: sized to the run, about 10 checkpoints and at least one
    # every 100 steps (checkpoint_interval), so a stopped or crashed run loses little
    checkpoint_every: int | None = None
    checkpoint_keep: int = 2  # newest step checkpoints kept in output_dir/checkpoints
    # a checkpoint also holds the queue's rows of the steps launched ahead (async mode, the shm weight channel): a
    # resumed run trains the samples produced before the crash and generates only those that were in flight
    checkpoint_queue: bool = True
    resume: bool = True  # go on from the latest checkpoint in output_dir/checkpoints, if any
    init_from: str | None = None  # start RL from this checkpoint's weights (e.g. an SFT run's), fresh optimizer
    seed: int = 0  # seeds the weights, the prompt order and sampling
    num_storage_units: int = 2  # the queue's storage actors
    queue_timeout: float = 300.0  # seconds a queue read waits for its rows
    # copies of each row in the queue: 1, or 2 (on two storage units: a unit killed mid-run loses no row; needs
    # num_storage_units >= 3)
    queue_replicas: int = 1
    # the queue's controller journals its bookkeeping in output_dir/queue_journal: Ray restarts it when it dies and
    # the run's clients ask again (up to QUEUE_RESTART_RETRY_S) what failed meanwhile. Needs checkpoint_queue=false
    queue_journal: bool = False
    eval_every: int = 0  # greedy accuracy on the eval prompts every k steps (0: never)
    log_every: int = 10  # without a terminal: one plain line of metrics every k steps (a bar on a terminal)
    tensorboard: bool = False  # also write each step's metrics as TensorBoard scalars in output_dir/tensorboard
    # write output_dir/trace.json at the end: the queue's requests and each step's stages (generate, reward, train,
    # publish) as a Chrome/Perfetto trace (python -m transfer_queue trace records a running queue's alone)
    trace: bool = False
    wandb_project: str | None = None  # also log each step's metrics to this Weights & Biases project (needs wandb)
    wandb_mode: Literal["offline", "online"] = "offline"  # offline: W&B files in output_dir/wandb, no network
    mlflow_experiment: str | None = None  # also log each step's metrics to this MLflow experiment (needs mlflow)
    mlflow_tracking_uri: str | None = None  # an MLflow server or store; None: sqlite:///output_dir/mlflow.db

    #: the type and range of each constrained dotted key (:data:`KEY_RANGES`, assigned below its definition)
    KEY_RANGES: ClassVar[Mapping[str, Range | Text]]

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError on a value outside its KEY_RANGES entry or sizes that cannot work together, before any
        actor starts."""
        check_ranges(flatten_dict(config_to_dict(self)))
        if self.mode == "sync" and self.max_staleness != 0:
            raise ConfigError(f"mode='sync' trains on-policy: max_staleness must be 0, got {self.max_staleness}")
        if self.mode == "async" and self.max_staleness < 1:
            raise ConfigError(f"mode='async' needs max_staleness >= 1 (rollout runs ahead), got {self.max_staleness}")
        if self.sync_every - 1 > self.max_staleness:
            raise ConfigError(
                f"sync_every={self.sync_every} leaves engines up to {self.sync_every - 1} versions behind, more than "
                f"max_staleness={self.max_staleness}; use mode='async' with max_staleness >= {self.sync_every - 1}"
            )
        self._check_queue()
        self._check_parallelism()
        self._check_inference()
        tp, world = self.train.tp_size, self.train.world_size
        rounds = world // tp * self.train.minibatches_per_step  # each TP group reads one DP share
        ranks = f"train.world_size={world} ranks"
        if tp > 1:
            ranks = f"train.world_size={world} / train.tp_size={tp} = {world // tp} DP ranks"
        if self.prompts_per_step % rounds:
            raise ConfigError(
                f"prompts_per_step={self.prompts_per_step} groups must split evenly over {ranks} x "
                f"train.minibatches_per_step={self.train.minibatches_per_step}; use a multiple of {rounds}"
            )
        groups = self.train.max_train_groups
        if groups is not None and (not isinstance(groups, int) or groups < rounds or groups % rounds):
            per = "train.world_size" if tp == 1 else "train.world_size / train.tp_size"
            raise ConfigError(
                f"train.max_train_groups must be a multiple of {per} x train.minibatches_per_step = "
                f"{rounds} (each rank's share of a round), got {groups!r}"
            )
        if groups is not None and groups > self.prompts_per_step:
            raise ConfigError(
                f"train.max_train_groups={groups} is more than the prompts_per_step={self.prompts_per_step} groups "
                "rolled out per step; over-sampling rolls out more prompts than it trains on"
            )
        self._check_own_files()
        try:
            self.train.loss = loss_named(self.train.loss)  # in any case, as AgentRL's guide writes it: GRPO is grpo
        except ValueError:
            raise ConfigError(f"train.loss={self.train.loss!r} is not one of {sorted(LOSSES)}") from None
        if self.rollout.generate_fn and self.weight_sync == "shm":
            raise ConfigError(
                f"rollout.generate_fn={self.rollout.generate_fn!r} runs in rollout workers that take weights by "
                "update: use weight_sync='memory' or 'disk', not 'shm'"
            )
        if self.rollout.checkpoint_inflight and (not self.rollout.partial_rollout or self.rollout.generate_fn):
            raise ConfigError(
                "rollout.checkpoint_inflight=true checkpoints a partial rollout's chunks: it needs "
                f"rollout.partial_rollout=true and no rollout.generate_fn, got partial_rollout="
                f"{str(self.rollout.partial_rollout).lower()}, generate_fn={self.rollout.generate_fn!r}"
            )
        if self.weight_delta and self.weight_sync != "shm":
            raise ConfigError(
                f"weight_delta=true needs weight_sync='shm' (the shared-memory weight channel), got "
                f"weight_sync={self.weight_sync!r}"
            )
        low = self.train.rollout_is_low
        if low is not None and not low < self.train.rollout_is_high:
            raise ConfigError(
                f"train.rollout_is_low must be in [0, train.rollout_is_high={self.train.rollout_is_high}), got {low}"
            )

    def _check_parallelism(self) -> None:
        """``train.tp_size`` divides ``train.world_size``; the parallelisms the trainer has not are refused."""
        supported = (
            "supported: train.world_size (FSDP2 data parallel) and train.tp_size (tensor parallel within a node)"
        )
        for key, what in (
            ("pp_size", "pipeline parallelism"),
            ("ep_size", "expert parallelism"),
            ("cp_size", "context (sequence) parallelism"),
        ):
            value = getattr(self.train, key)
            if value > 1:
                raise ConfigError(f"train.{key}={value}: {what} is not supported; {supported}")
        tp, world = self.train.tp_size, self.train.world_size
        if world % tp:
            raise ConfigError(
                f"train.tp_size={tp} must divide train.world_size={world}: the ranks form world_size / tp_size "
                "tensor-parallel groups of tp_size ranks, one data-parallel rank each"
            )

    def _check_inference(self) -> None:
        """A list of ``rollout.engine_url`` has one URL per rollout worker; ``rollout.inf_*`` size the servers the
        run starts itself, so they need a server engine and no ``engine_url``."""
        rollout = self.rollout
        urls = rollout.engine_url
        if isinstance(urls, list) and len(urls) != rollout.num_workers:
            raise ConfigError(
                f"rollout.engine_url lists {len(urls)} URLs for rollout.num_workers={rollout.num_workers} rollout "
                "workers: give one URL per worker, or one URL (a string) for all of them"
            )
        self._check_server_gpus()
        self._check_colocate()
        sizing = {"inf_tp_size": rollout.inf_tp_size, "inf_ep_size": rollout.inf_ep_size}
        given: dict[str, float] = {key: value for key, value in sizing.items() if value != 1}
        if rollout.inf_mem_ratio is not None:
            given["inf_mem_ratio"] = rollout.inf_mem_ratio
        if not given:
            return
        key, value = next(iter(given.items()))
        if rollout.engine not in SERVER_ENGINES:
            raise ConfigError(
                f"rollout.{key}={value} sizes the inference servers the run starts, which only the engines "
                f"{', '.join(repr(e) for e in SERVER_ENGINES)} honour; rollout.engine={rollout.engine!r} runs in the "
                "rollout worker"
            )
        if urls is not None:
            raise ConfigError(
                f"rollout.{key}={value} sizes the inference servers the run starts, but rollout.engine_url names "
                "servers started elsewhere: drop engine_url (the run starts one server per rollout worker) or the "
                f"rollout.inf_* keys"
            )
        from workers.engines.errors import InvalidInferenceSizing
        from workers.engines.manager import sizing_args

        try:
            sizing_args(
                SERVER_KIND[rollout.engine],
                tp_size=rollout.inf_tp_size,
                ep_size=rollout.inf_ep_size,
                mem_ratio=rollout.inf_mem_ratio,
            )
        except InvalidInferenceSizing as exc:
            raise ConfigError(f"rollout.inf_*: {exc}") from None

    def _check_colocate(self) -> None:
        """``rollout.inference_colocate`` frees the memory of the servers the run starts (a server engine, no
        ``engine_url``) around training, holding the generations of the built-in rollout workers meanwhile."""
        rollout = self.rollout
        if not rollout.inference_colocate:
            return
        why = None
        if rollout.engine not in SERVER_ENGINES:
            why = f"rollout.engine={rollout.engine!r} runs in the rollout worker"
        elif rollout.engine_url is not None:
            why = "rollout.engine_url names servers started elsewhere (the run cannot release them)"
        elif rollout.generate_fn:
            why = f"rollout.generate_fn={rollout.generate_fn!r} runs agent rollout workers: their requests are not held"
        if why is not None:
            raise ConfigError(
                f"rollout.inference_colocate=true releases the memory of the inference servers the run starts "
                f"(rollout.engine {' or '.join(repr(e) for e in SERVER_ENGINES)} without rollout.engine_url or "
                f"rollout.generate_fn); {why}"
            )

    def _check_server_gpus(self) -> None:
        """``rollout.gpus`` places the servers the run starts (a server engine, no ``engine_url``): distinct device
        ids >= 0, ``inf_tp_size`` for each of the ``num_workers`` servers (``gpu_plan``)."""
        rollout = self.rollout
        gpus = rollout.gpus
        if gpus is None:
            return
        if rollout.engine not in SERVER_ENGINES or rollout.engine_url is not None:
            why = (
                f"rollout.engine={rollout.engine!r} runs in the rollout worker"
                if rollout.engine not in SERVER_ENGINES
                else "rollout.engine_url names servers started elsewhere: drop one of them"
            )
            raise ConfigError(
                f"rollout.gpus={gpus} places the inference servers the run starts (rollout.engine "
                f"{' or '.join(repr(e) for e in SERVER_ENGINES)} without rollout.engine_url); {why}"
            )
        negative = [g for g in gpus if g < 0]
        if negative:
            raise ConfigError(f"rollout.gpus: expected device ids >= 0, got {negative} in {gpus}")
        from workers.engines.errors import InvalidInferenceSizing
        from workers.engines.manager import gpu_plan

        try:
            gpu_plan(gpus, rollout.num_workers, rollout.inf_tp_size)
        except InvalidInferenceSizing as exc:
            raise ConfigError(
                f"rollout.gpus: {exc} (one server per rollout worker: rollout.num_workers={rollout.num_workers})"
            ) from None

    @property
    def trains_on_files(self) -> bool:
        """Whether the run trains on your own files (``model.path``, ``data.*``, ``reward.fn``) instead of a Task."""
        return any((self.model.path, self.data.train_files, self.data.val_files, self.reward.fn))

    def _check_own_files(self) -> None:
        """``model.path``, ``data.train_files`` and ``reward.fn`` come together, and exclude a Task of the config."""
        if not self.trains_on_files:
            return
        given = {"model.path": self.model.path, "data.train_files": self.data.train_files, "reward.fn": self.reward.fn}
        missing = [key for key, value in given.items() if not value]
        if missing:
            raise ConfigError(
                "training on your own files needs model.path, data.train_files and reward.fn together; missing "
                + ", ".join(missing)
            )
        clashes = {"task.name": self.task.name, "task.reward_fn": self.task.reward_fn, "task.kwargs": self.task.kwargs}
        for key, value in clashes.items():
            if value:
                raise ConfigError(
                    f"{key}={value!r} conflicts with model.path/data.train_files, which train on your own files with "
                    "reward.fn: drop the task.* keys, or drop model/data/reward to train a Task class"
                )
        if self.sft.enabled:
            raise ConfigError(
                "sft.enabled=True needs reference responses, which data.train_files has none of: set sft.enabled=false"
            )

    @property
    def recompute_old_logprobs(self) -> bool:
        """Whether the trainer recomputes the old log-probs (``train.recompute_old_logprobs``, or its default)."""
        if self.train.recompute_old_logprobs is not None:
            return self.train.recompute_old_logprobs
        trainer_device = "cuda" if self.train.num_gpus_per_rank > 0 else "cpu"
        same_numerics = self.rollout.engine == "hf" and self.rollout.engine_device.split(":")[0] == trainer_device
        several_updates = self.train.minibatches_per_step > 1 or self.train.ppo_epochs > 1
        return not same_numerics or self.mode == "async" or several_updates

    def _check_queue(self) -> None:
        if self.queue_replicas == 2 and self.num_storage_units < 3:
            raise ConfigError(
                f"queue_replicas=2 needs num_storage_units >= 3, got {self.num_storage_units}: a put goes to a unit "
                "and its partner, both live, so with two units one dead unit stops every put until Ray restarted it"
            )
        if self.queue_journal and self.checkpoint_queue:
            raise ConfigError(
                "queue_journal=true cannot go with checkpoint_queue=true: a resumed run starts its queue from the "
                "checkpoint's queue snapshot, and a journaled queue cannot start from a snapshot; set "
                "checkpoint_queue=false (a resumed run generates the steps launched ahead again) or queue_journal=false"
            )

    @property
    def checkpoint_interval(self) -> int:
        """Steps between checkpoints: ``checkpoint_every``, or by default ``steps / 10`` rounded up, at most 100
        (1000 steps: every 100; 200: every 20; 25: every 3). 0: only at the end.

        >>> RLConfig(steps=1000).checkpoint_interval, RLConfig(steps=200, checkpoint_every=0).checkpoint_interval
        (100, 0)
        """
        if self.checkpoint_every is not None:
            return self.checkpoint_every
        return min(DEFAULT_CHECKPOINTS_EVERY_AT_MOST, -(-self.steps // DEFAULT_CHECKPOINTS_PER_RUN))

    @property
    def num_global_batch(self) -> int:
        """Steps the queue holds at once: the step in training plus the ones rollout may run ahead."""
        return self.max_staleness + 1

    @property
    def output_path(self) -> Path:
        return Path(self.output_dir)


@dataclass(frozen=True)
class Range:
    """The numbers a key takes: ``kind`` (int or float; an int is a float too, a bool is neither), between ``low``
    and ``high`` (each closed unless ``*_open``), and None too when ``optional``."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False

    def describe(self) -> str:
        name = "an int" if self.kind is int else "a float"
        if self.low is not None and self.high is not None:
            bounds = f" in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        elif self.low is not None:
            bounds = f" {'>' if self.low_open else '>='} {self.low:g}"
        else:
            bounds = ""
        return name + bounds + (" or None" if self.optional else "")

    def admits(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, int if self.kind is int else (int, float)):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below  # False for nan: every comparison with it is

    def judges(self, value: Any) -> bool:
        """Whether a raw value (YAML or an override, before conversion) is checked here: numbers are, the rest's
        type is msgspec's to refuse ("Expected `float`, got `str`")."""
        return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class Text:
    """The strings a key takes: one of ``choices``, or a match of ``pattern`` (described as ``described``)."""

    choices: tuple[str, ...] = ()
    pattern: str = ""
    described: str = ""
    optional: bool = False

    def describe(self) -> str:
        what = f"one of {sorted(self.choices)}" if self.choices else self.described
        return what + (" or None" if self.optional else "")

    def admits(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if not isinstance(value, str):
            return False
        return value in self.choices if self.choices else re.fullmatch(self.pattern, value) is not None

    def judges(self, value: Any) -> bool:
        return isinstance(value, str)


def _ints(low: int, optional: bool = False) -> Range:
    return Range(int, low, optional=optional)


def _floats(low: float, *, low_open: bool = False, optional: bool = False) -> Range:
    return Range(float, low, low_open=low_open, optional=optional)


_POSITIVE = Range(float, 0, low_open=True)
_FRACTION = Range(float, 0, 1)
_ADAM_BETA = Range(float, 0, 1, high_open=True)  # 1 would never forget a gradient (and Adam's bias correction / 0)
_IMPORT_PATH = Text(pattern=r"[\w.]+:[\w.]+", described="'module:name'", optional=True)

#: the type and range of every numeric or constrained key, checked when a config is parsed (:func:`check_ranges`);
#: tests/unit/orchestration/test_config.py fails on a key of the dataclasses that is in neither this nor UNRANGED_KEYS
KEY_RANGES: dict[str, Range | Text] = {
    "task.reward_fn": _IMPORT_PATH,
    "task.name": _IMPORT_PATH,
    "task.num_train_prompts": _ints(1),
    "task.num_eval_prompts": _ints(1),
    "task.seed": _ints(0),
    "data.prompt_key": Text(pattern=r"\S.*", described="a column name"),
    "reward.fn": Text(
        pattern=r"(?:[\w.]+|\S+\.py):\w+", described="'module:function' or 'path/to/file.py:function'", optional=True
    ),
    "rollout.num_workers": _ints(1),
    "rollout.engine_device": Text(pattern=r"cpu|cuda(:\d+)?", described="cpu, cuda or cuda:N"),
    "rollout.max_new_tokens": _ints(1),
    "rollout.temperature": _floats(0),
    "rollout.top_p": Range(float, 0, 1, low_open=True),
    "rollout.groups_per_request": _ints(1),
    "rollout.num_reward_workers": _ints(1),
    "rollout.reward_groups_per_request": _ints(1),
    "rollout.max_worker_restarts": _ints(-1),
    "rollout.chunk_tokens": _ints(1),
    "rollout.generate_fn": _IMPORT_PATH,
    "rollout.filter_fn": _IMPORT_PATH,
    "rollout.reward_fn": _IMPORT_PATH,
    "rollout.num_task_servers": _ints(1),
    "rollout.inf_tp_size": _ints(1),
    "rollout.inf_ep_size": _ints(1),
    "rollout.inf_mem_ratio": Range(float, 0, 1, low_open=True, optional=True),
    "rollout.task_server_max_episodes": _ints(1, optional=True),
    "rollout.task_server_idle_timeout": _POSITIVE,
    "train.world_size": _ints(1),
    "train.tp_size": _ints(1),
    "train.pp_size": _ints(1),
    "train.ep_size": _ints(1),
    "train.cp_size": _ints(1),
    "train.backend": Text(("gloo", "nccl", "mpi", "ucc"), optional=True),
    "train.num_gpus_per_rank": _floats(0),
    "train.max_restarts": _ints(0),
    "train.restart_drain_s": _floats(0),
    "train.lr": _POSITIVE,
    "train.lr_warmup_steps": _ints(0),
    "train.weight_decay": _floats(0),
    "train.beta1": _ADAM_BETA,
    "train.beta2": _ADAM_BETA,
    "train.grad_clip": _POSITIVE,
    "train.micro_batch_size": _ints(1),
    "train.max_tokens_per_micro_batch": _ints(1),
    "train.fsdp_min_layer_params": _ints(0),
    "train.loss_seq_chunk_size": _ints(1, optional=True),
    "train.minibatches_per_step": _ints(1),
    "train.ppo_epochs": _ints(1),
    "train.clip_low": Range(float, 0, 1, high_open=True, optional=True),
    "train.clip_high": _floats(0, optional=True),
    "train.loss_agg": Text(LOSS_AGG_MODES, optional=True),
    "train.kl_coef": _floats(0),
    "train.kl_kind": Text(("k1", "k2", "k3")),
    "train.filters.zero_advantage_eps": _floats(0),
    "train.filters.minimal_advantage": _floats(0, optional=True),
    "train.filters.max_trained_count": _ints(1, optional=True),
    "train.filters.zero_std_eps": _floats(0),
    "train.max_train_groups": _ints(1, optional=True),
    "train.rollout_is_high": _POSITIVE,
    "train.rollout_is_low": _floats(0, optional=True),
    "sft.lr": _POSITIVE,
    "sft.batch_size": _ints(1),
    "sft.max_steps": _ints(1),
    "sft.target_accuracy": _FRACTION,
    "sft.eval_every": _ints(1),
    "sft.eval_samples": _ints(1),
    "steps": _ints(1),
    "prompts_per_step": _ints(1),
    "n_samples": _ints(1),
    "max_staleness": _ints(0),
    "sync_every": _ints(1),
    "checkpoint_every": _ints(0, optional=True),
    "checkpoint_keep": _ints(1),
    "seed": _ints(0),
    "num_storage_units": _ints(1),
    "queue_timeout": _POSITIVE,
    "queue_replicas": Range(int, 1, 2),
    "eval_every": _ints(0),
    "log_every": _ints(1),
}
RLConfig.KEY_RANGES = KEY_RANGES

#: keys whose type (a bool, a Literal, a free string or mapping) is all there is to check: msgspec does
UNRANGED_KEYS = frozenset(
    {
        "task.kwargs",
        "train.loss",  # one of LOSSES, which a user may extend: checked against it in RLConfig.validate
        "init_from",
        "model.path",  # any local directory: the file task checks it holds a model and a tokenizer
        "data.train_files",  # one path or a list: the file task checks they exist and are JSONL or Parquet
        "data.val_files",
        "reward.batch",
        "rollout.engine",
        "rollout.engine_url",
        "rollout.gpus",  # a list of ints (msgspec): RLConfig.validate checks its ids against the servers it places
        "rollout.partial_rollout",
        "rollout.checkpoint_inflight",
        "rollout.inference_colocate",
        "rollout.generate_fn_kwargs",
        "rollout.task_server_env",
        "train.filters.drop_zero_advantage",
        "train.filters.skip_non_positive_advantage",
        "train.filters.nonzero_std_groups",
        "train.normalize_advantage_std",
        "train.gradient_checkpointing",
        "train.restart_keeps_rows",
        "train.dynamic_batching",
        "train.activation_offloading",
        "train.recompute_old_logprobs",
        "train.rollout_correction",
        "train.mask_offpolicy_in_partial_rollout",
        "sft.enabled",
        "sft.target_metric",
        "mode",
        "weight_sync",
        "weight_delta",
        "output_dir",
        "checkpoint_queue",
        "queue_journal",
        "resume",
        "tensorboard",
        "trace",
        "wandb_project",
        "wandb_mode",
        "mlflow_experiment",
        "mlflow_tracking_uri",
    }
)


def check_ranges(values: dict[str, Any], raw: bool = False, ranges: Mapping[str, Range | Text] = KEY_RANGES) -> None:
    """Raise ConfigError on the first of the dotted ``values`` outside its ``ranges`` entry (an RLConfig's
    :data:`KEY_RANGES` by default), naming the key, what it takes and the value given. ``raw``: values as parsed
    from YAML or an override, before msgspec converts them; only those of the right sort are judged (a string for
    a number is msgspec's type error).

    >>> check_ranges({"train.lr": -1})
    Traceback (most recent call last):
    ...
    orchestration.config.ConfigError: train.lr must be a float > 0, got -1
    """
    for key, value in values.items():
        allowed = ranges.get(key)
        if allowed is None or (raw and not allowed.judges(value)) or allowed.admits(value):
            continue
        raise ConfigError(f"{key} must be {allowed.describe()}, got {value!r}")


@overload
def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RLConfig: ...


@overload
def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None, *, cls: type[C]) -> C: ...


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None, *, cls: type[Any] = RLConfig
) -> Any:
    """An RLConfig (or another config dataclass ``cls``, see the module docstring) from a YAML file (nested
    sections as in the dataclasses), with dotted ``overrides`` on top.

    Unknown keys are refused, naming the closest valid ones; a bad value names where it came from (the override
    ``key=value`` or the file).

    >>> load_config(None, {"steps": 10, "train.lr": 1e-3}).train.lr
    0.001
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping at the top level, got {type(raw).__name__}")
        _check_keys(raw, cls, "", f" in {path}", cls)
    overrides = overrides or {}
    for dotted, value in overrides.items():
        _check_keys(_nest(dotted, value), cls, "", f" in the override {dotted}={value!r}", cls)
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    try:
        # before msgspec builds the sections (FilterConfig checks its own)
        check_ranges(flatten_dict(raw), raw=True, ranges=cls.KEY_RANGES)
        return msgspec.convert(raw, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config: {exc}{_source(str(exc), overrides, path)}") from None
    except ConfigError as exc:
        raise ConfigError(f"{exc}{_source(str(exc), overrides, path)}") from None


def config_keys(cls: type = RLConfig, prefix: str = "") -> dict[str, tuple[Any, str]]:
    """Every dotted key of a config dataclass: ``{key: (default, one-line help)}``, the help from the comment on
    the field's line (the dataclasses are the one source of truth).

    >>> config_keys()["train.lr"][0]
    0.0005
    """
    comments = _field_comments(cls)
    out: dict[str, tuple[Any, str]] = {}
    instance = cls() if prefix else None  # a section; the root config is not built (its defaults may not validate)
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        if is_dataclass(f.type if isinstance(f.type, type) else _field_type(cls, f.name)):
            out.update(config_keys(_field_type(cls, f.name), f"{key}."))
            continue
        default = getattr(instance, f.name) if instance is not None else _default_of(f)
        out[key] = (default, comments.get(f.name, ""))
    return out


def _default_of(f: Any) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _field_comments(cls: type) -> dict[str, str]:
    """``name: comment`` for the fields of ``cls`` with a trailing ``# comment`` (or one on the line above)."""
    out, pending = {}, ""
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending = f"{pending} {stripped.lstrip('# ')}".strip()
            continue
        match = re.match(r"\s+(\w+):[^#]*?(?:#\s*(.*))?$", line)
        if match and not stripped.startswith(('"""', "def ", "@")):
            out[match.group(1)] = match.group(2) or pending
        pending = ""
    return out


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    node: Any = value
    for part in reversed(dotted.split(".")):
        node = {part: node}
    return node


def _check_keys(raw: dict[str, Any], cls: type, prefix: str, where: str, root: type) -> None:
    """Refuse keys that are not fields of ``cls`` (recursively into nested config sections), suggesting the closest
    keys of the whole config ``root``."""
    hints = {f.name: _field_type(cls, f.name) for f in fields(cls)}  # fields only, not the class variables
    for name, value in raw.items():
        key = f"{prefix}{name}"
        if name not in hints:
            valid = list(config_keys(root))
            close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6) or difflib.get_close_matches(
                name, [k.rsplit(".", 1)[-1] for k in valid], n=3, cutoff=0.6
            )
            hint = f"; did you mean {', '.join(close)}?" if close else "; see --help for every key"
            raise ConfigError(f"unknown config key {key!r}{where}{hint}")
        if is_dataclass(hints[name]):
            if not isinstance(value, dict):
                raise ConfigError(f"{key} is a section: expected a mapping of its keys{where}, got {value!r}")
            _check_keys(value, hints[name], f"{key}.", where, root)


def _source(message: str, overrides: dict[str, Any], path: str | Path | None) -> str:
    """Where the offending value came from: the overrides whose key the message names, else the YAML file."""
    named = [
        f"{key}={value!r}"
        for key, value in overrides.items()
        if re.search(rf"(?<![\w.]){re.escape(key)}\b", message) or f"$.{key}" in message
    ]
    if named:
        return f" (from the override {', '.join(named)})"
    return f" (from {path})" if path else ""


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["steps=10", "train.lr=1e-3"]`` -> ``{"steps": 10, "train.lr": 0.001}`` (values parsed as YAML)."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"an override is KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        out[key.strip()] = yaml.safe_load(value)
    return out


@overload
def config_from_cli(
    description: str, default_config: str | Path, argv: list[str] | None = None, *, preset: dict[str, Any] | None = None
) -> RLConfig: ...


@overload
def config_from_cli(
    description: str,
    default_config: str | Path,
    argv: list[str] | None = None,
    *,
    cls: type[C],
    preset: dict[str, Any] | None = None,
) -> C: ...


def config_from_cli(
    description: str,
    default_config: str | Path,
    argv: list[str] | None = None,
    *,
    cls: type[Any] = RLConfig,
    preset: dict[str, Any] | None = None,
) -> Any:
    """The config of a recipe run: ``[--config FILE] [--new] [--print-config] [key=value ...]`` on top of the
    recipe's default YAML. ``--help`` lists every key with its default and meaning; ``--print-config`` prints the
    resolved config as YAML and exits; ``--new`` starts over instead of resuming (``resume=False``; the recipe
    moves the old run aside once the config is valid). ``cls``: the recipe's config dataclass (see the module
    docstring); ``preset``: the recipe's own dotted overrides of the YAML, under those of the command line.

    A bad key or value raises ConfigError (the recipe says it and exits with 2) before anything starts."""
    import argparse

    preset = preset or {}
    try:
        defaults: Any = load_config(default_config, preset, cls=cls)
    except ConfigError:
        defaults = None  # the help lists the dataclasses' defaults; the error comes when the config is loaded
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=keys_help(defaults, cls=cls),
    )
    parser.add_argument("--config", default=str(default_config), help="YAML config (keys below)")
    parser.add_argument(
        "--new", action="store_true", help="start over in output_dir (the previous run there is moved aside)"
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of the dotted keys below, e.g. steps=20")
    args = parser.parse_args(argv)
    overrides = {**preset, **parse_overrides(args.overrides)}
    if args.new:
        overrides["resume"] = False
    config = load_config(args.config, overrides, cls=cls)
    if args.print_config:
        print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
        raise SystemExit(0)
    return config


def keys_help(defaults: Any = None, *, cls: type = RLConfig) -> str:
    """Every key of the config dataclass ``cls`` with its default (``defaults``' value, e.g. the recipe's YAML) and
    meaning."""
    lines = ["config keys (KEY=VALUE overrides, values parsed as YAML), with this recipe's defaults:"]
    values = flatten_dict(config_to_dict(defaults)) if defaults is not None else {}
    for key, (default, meaning) in config_keys(cls).items():
        lines.append(f"  {key} = {values.get(key, default)!r}" + (f"\n      {meaning}" if meaning else ""))
    return "\n".join(lines)


def config_to_dict(config: Any) -> dict[str, Any]:
    """The config (a config dataclass) as plain nested dicts (what ``config.yaml`` holds)."""
    return msgspec.to_builtins(config)


def flatten_dict(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``; free-form mappings (``task.kwargs``) stay whole."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "kwargs":
            out.update(flatten_dict(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
