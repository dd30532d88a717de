"""The run-level loops of a GRPO run that learns from a ledger's records (recipe/agentrl_demo.py's): the SFT
warm-up, the policy and its chat format, GRPO on what a ``SamplingScheduler``'s samplers (or a ``PromptSource``
producer) put into the queue with the engine updated each step, or GRPO on the records the ledger already holds, and
the run's checkpoint, metrics and report. ``LedgerGRPOTrainer`` (orchestration/ledger_grpo.py) takes each step; the
config is any dataclass with the fields ``LedgerRunConfig`` names (``AgentRLDemoConfig``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch.utils.data import Dataset

from orchestration.config import ConfigError
from orchestration.ledger_grpo import LedgerGRPOTrainer, LedgerRows, LedgerTrainingConfig
from orchestration.metrics import MetricsLog, PlotRefresher
from rl_contracts.colocate import ColocatedServers
from rl_contracts.prompts import PromptSource
from transfer_queue.runtime import init_ray
from workers.agents.openai_api import create_app
from workers.agents.samplers import BatchingSampler, engine_generate
from workers.agents.task_server import serve_in_background
from workers.api_key import new_api_key
from workers.engines import HFEngine, SamplingParams
from workers.ledger import (
    AsyncSampler,
    DBRecordData,
    InferenceClient,
    InferenceService,
    Ledger,
    Record,
    RecordData,
    SamplingConfig,
    SamplingScheduler,
    ServiceRegistration,
    convert_record,
    resolve_convert_record_to_data_func,
)
from workers.ledger.__main__ import render_status
from workers.ledger.queue_sink import QueueSink
from workers.ledger.schema import redact
from workers.tasks.addition import (
    AdditionChat,
    AdditionTokenizer,
    PretrainedChat,
    addition_reward,
    build_model,
    make_prompts,
    sft_batch,
)

if TYPE_CHECKING:
    from workers.engines.manager import InferenceManager

logger = logging.getLogger(__name__)


class LedgerRunConfig(Protocol):
    """The fields of a run's config dataclass these loops read (recipe/agentrl_demo.py's ``AgentRLDemoConfig``)."""

    steps: int
    prompts_from: Literal["scheduler", "prompt-source"]
    prompts_per_step: int
    num_generations: int
    num_tasks: int
    lr: float
    beta1: float
    beta2: float
    lr_warmup_steps: int
    max_trained_count: int
    retrained_interval: int
    max_steps_ahead: int
    checkpoint_every: int
    seed: int
    output_dir: str
    model_name_or_path: str | None
    max_new_tokens: int
    enable_sampling: bool
    eval_strategy: str | bool  # no, steps or epoch (the config lower-cases it; False is no)
    eval_steps: int | None
    # "module:function" of a Record, on both paths; None: the default (sampling: the sampled tokens as they are)
    convert_record_to_data_func: str | None
    inference_engine: str  # hf: the engine in this process; vllm / sglang: an InferenceManager's servers
    inference_dp_size: int  # how many servers (one per DP group)
    inference_colocate: bool  # the servers release their memory for each training step


def warm_up(
    policy,
    engine,
    tokens: SFTTokens,
    target: float,
    seed: int,
    max_steps: int = 3000,
    record: Callable | None = None,
    max_new_tokens: int = 4,
) -> tuple[int, float]:
    """Supervised steps until one sampled answer per probe problem is right ``target`` of the time; ``record``
    gets an ``sft`` row (step, loss, accuracy) at each probe. ``tokens``: the problems' prompts and answers as the
    run's chat format renders them (the built-in tokenizer's, or a model directory's)."""
    if target <= 0:
        return 0, 0.0
    probe = tokens.render(make_prompts(256, seed=1_000_000 + seed))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    accuracy, step = 0.0, 0
    while step < max_steps:
        problems = tokens.render(make_prompts(64, seed=2_000_000 + seed * 100_000 + step))
        loss = policy(**sft_batch(problems, tokens)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 25 == 0:
            engine.update_weights(0, state_dict=policy.state_dict())
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=0)
            generations = engine.generate([p["prompt_ids"] for p in probe], n=1, params=params)
            scores = [
                addition_reward(tokens.decode(g.token_ids), p["answer"])
                for p, [g] in zip(probe, generations, strict=True)
            ]
            accuracy = sum(scores) / len(scores)
            if record is not None:
                record({"kind": "sft", "step": step, "sft_loss": loss.item(), "accuracy": accuracy})
            if accuracy >= target:
                break
    return step, accuracy


class SFTTokens:
    """What the SFT warm-up needs of a tokenizer, over the run's chat format: problems' prompts rendered
    (``render``), an answer's tokens (``encode``, the eos aside), samples decoded, the pad and eos ids."""

    def __init__(self, chat: AdditionChat | PretrainedChat, pad_token_id: int, eos_token_id: int):
        self.chat, self.pad_token_id, self.eos_token_id = chat, pad_token_id, eos_token_id

    def render(self, problems: list[dict]) -> list[dict]:
        return [{**p, "prompt_ids": self.chat.prompt_ids([{"role": "user", "content": p["prompt"]}])} for p in problems]

    def encode(self, text: str) -> list[int]:
        return self.chat.response_ids(text)[:-1]

    def decode(self, ids) -> str:
        return self.chat.decode(ids)


def prompt_source_producer(source, engine, engine_lock, sink, chat, config: LedgerRunConfig, done, paused) -> None:
    """The ``prompt-source`` input: each round draws ``prompts_per_step`` problems (their ``prompt_ids`` rendered by
    ``chat``), samples ``num_generations`` answers each from the engine and puts every group into the queue
    (``record_id`` -1: no ledger record)."""
    params = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=1.0)
    group = 0
    while not done.is_set():
        if paused():
            time.sleep(0.01)
            continue
        problems = source.next_batch(config.prompts_per_step)
        with engine_lock:
            version = engine.version
            generations = engine.generate([p["prompt_ids"] for p in problems], n=config.num_generations, params=params)
        for problem, answers in zip(problems, generations, strict=True):
            rows = [
                {
                    "record_id": -1,
                    "prompt_ids": problem["prompt_ids"],
                    "response_ids": g.token_ids,
                    "response_logprobs": g.logprobs,
                    "policy_version": version,
                    "reward": addition_reward(chat.decode(g.token_ids), problem["answer"]),
                }
                for g in answers
            ]
            sink.put_group(rows, f"prompt-source/{group}", group)
            group += 1


class RunRecord:
    """The run's ``metrics.jsonl`` and ``metrics.png``, as GRPORun keeps them: a fresh run starts the file over, a
    resumed one cuts it back to its checkpoint's step (each step keeps one row); the plot is redrawn at most every
    ``min_interval_s`` while rows come, and at ``finish``."""

    def __init__(self, out: Path, start: int | None, title: str, min_interval_s: float = 60.0):
        self.log = MetricsLog(out / "metrics.jsonl", truncate=start is None)
        if start is not None:
            self.log.cut_back(start)
        self.plot = PlotRefresher(self.log.path, out / "metrics.png", title=title, min_interval_s=min_interval_s)

    def write(self, row: dict[str, Any]) -> None:
        self.log.write(row)
        self.plot.maybe_refresh()

    def finish(self) -> Path:
        return self.plot.refresh()


def grpo_optimizer(policy: torch.nn.Module, config: LedgerRunConfig) -> torch.optim.AdamW:
    """GRPO's AdamW: ``lr`` (the warm-up scales it per step), betas ``(beta1, beta2)``."""
    return torch.optim.AdamW(policy.parameters(), lr=config.lr, betas=(config.beta1, config.beta2))


def save_checkpoint(path: Path, policy, optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"policy": policy.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


@dataclass
class PolicySetup:
    """The run's policy and how its prompts and answers become tokens: the built-in addition Llama and its
    tokenizer, or a model directory's (``model_name_or_path``)."""

    policy: torch.nn.Module
    chat: AdditionChat | PretrainedChat
    pad_token_id: int
    eos_token_id: int

    def prompt_ids(self, question: str) -> list[int]:
        return self.chat.prompt_ids([{"role": "user", "content": question}])


def load_policy(config: LedgerRunConfig) -> PolicySetup:
    """The built-in tiny addition Llama, or the model and tokenizer of ``model_name_or_path`` (local files only)."""
    if config.model_name_or_path is None:
        tokenizer = AdditionTokenizer()
        policy = build_model(tokenizer.vocab_size, seed=config.seed)
        return PolicySetup(policy, AdditionChat(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = config.model_name_or_path
    hf_tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    eos = hf_tokenizer.eos_token_id if hf_tokenizer.eos_token_id is not None else model.config.eos_token_id
    if eos is None:
        raise ConfigError(f"model_name_or_path: {path}'s tokenizer and config name no eos token: answers could not end")
    pad = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else eos
    return PolicySetup(model.float(), PretrainedChat(hf_tokenizer), int(pad), int(eos))


def train_with_sampling(
    config: LedgerRunConfig,
    setup: PolicySetup,
    engine: HFEngine,
    optimizer: torch.optim.Optimizer,
    ledger: Ledger,
    cfg: SamplingConfig,
    training: LedgerTrainingConfig,
    record: RunRecord,
    checkpoint: Path,
    start: int,
    *,
    sampler_class: type[AsyncSampler],
    dataset: Dataset,
    partition: str,
    eval_dataset: Dataset | None = None,
    convert_record_to_data_func: Callable[[Record], Any] | str | None = None,
    inference_kwargs: Mapping[str, Any] | None = None,
) -> int:
    """GRPO on what the samplers (or the prompt-source producer) put into the queue, the engine updated each step:
    ``sampler_class`` samples the tasks of ``dataset`` (the run's), the queue's rows go to ``partition``. With
    ``eval_strategy`` other than ``no``, ``eval_dataset``'s tasks are sampled after the steps ``eval_due`` names
    (``evaluate``: split ``eval``, nothing queued, nothing trained) and an ``eval`` row is logged.

    What the samplers ask is ``config.inference_engine``'s: ``hf``, ``engine`` (in this process) behind the
    OpenAI-compatible endpoint, registered as one ``InferenceService``; ``vllm`` / ``sglang``, the
    ``inference_dp_size`` servers of an ``InferenceManager`` (:func:`start_inference_servers`; ``inference_kwargs``
    are more of its arguments), each loaded with the policy's weights after every step (``sync_state_dict``, the
    version ``step + 1``), released for each step's training and resumed before the load when
    ``inference_colocate``, and stopped however the run ends (normal end, an error, SIGINT / SIGTERM: the manager's
    handlers).

    ``convert_record_to_data_func`` (this argument, else the config's; None: the sampled tokens as they are): each
    finished group's records pass through it on their way into the queue (``workers.ledger.convert.sampled_row``):
    its very tokens keep the sampler's log-probs, other tokens are trained with the policy's own log-probs as the old
    ones, and a record it skips keeps its group out of the queue (each ``grpo`` row counts ``records_skipped`` and
    ``groups_skipped`` so far).

    The sampling side's failures reach the trainer: a sampler's non-retryable error (the scheduler's
    ``fatal_error``) or any error that ends the sampling thread is raised by the step waiting on the queue (it checks
    every ``training.check_every_s``), and the run ends with it (Ray and the queue shut down) rather than after the
    queue's timeout.

    Raises:
        InvalidRecordConverter: a ``convert_record_to_data_func`` name that does not import a function.
        ConfigError: a ``convert_record_to_data_func`` with ``prompts_from=prompt-source`` (no ledger records).
        InvalidRecordData: the hook returned something other than ``RecordData`` or None for a sampled record (the
            first such record ends the run).
    """
    import ray

    convert = run_hook(config, convert_record_to_data_func)
    if convert is not None and config.prompts_from != "scheduler":
        raise hook_without_records(config.prompts_from)

    out = Path(config.output_dir)
    started_ray = not ray.is_initialized()  # a caller's Ray session (a test's) is used, and left running
    if started_ray:
        init_ray(num_cpus=4, include_dashboard=False, logging_level=logging.ERROR)
    servers = None
    if config.inference_engine != "hf":
        servers = start_inference_servers(config, setup, ledger, cfg, out, start, **dict(inference_kwargs or {}))
    try:
        return _train_with_sampling(
            config, setup, engine, optimizer, ledger, cfg, training, record, checkpoint, start, servers, started_ray,
            sampler_class=sampler_class, dataset=dataset, partition=partition, eval_dataset=eval_dataset,
            convert=convert,
        )  # fmt: skip
    except BaseException:  # an error, or SIGINT's KeyboardInterrupt (SIGTERM: the manager's handler stops them)
        if servers is not None:
            servers.stop()
        raise


def _train_with_sampling(
    config: LedgerRunConfig,
    setup: PolicySetup,
    engine: HFEngine,
    optimizer: torch.optim.Optimizer,
    ledger: Ledger,
    cfg: SamplingConfig,
    training: LedgerTrainingConfig,
    record: RunRecord,
    checkpoint: Path,
    start: int,
    servers: InferenceManager | None,
    started_ray: bool,
    *,
    sampler_class: type[AsyncSampler],
    dataset: Dataset,
    partition: str,
    eval_dataset: Dataset | None,
    convert: Callable[[Record], Any] | None,
) -> int:
    import ray

    import transfer_queue

    policy, out = setup.policy, Path(config.output_dir)
    batch_rows = training.batch_rows
    client = transfer_queue.init(
        global_batch_size=config.prompts_per_step,
        num_n_samples=config.num_generations,
        sampler=transfer_queue.GRPOSampler(config.num_generations),
        num_storage_units=1,
        run_metrics=str(out / "metrics.jsonl"),
    )
    # generation (the endpoint's thread) and weight updates (this thread) take turns on the engine
    engine_lock = threading.Lock()
    generate = engine_generate(engine)

    def locked_generate(prompts, params):
        with engine_lock:
            return generate(prompts, params)

    # the endpoint's (or the servers'), for this run: its samplers send it, the ledger never holds it
    api_key = new_api_key() if servers is None else servers.api_key
    app = create_app(
        BatchingSampler(locked_generate), setup.chat, model="adder", max_tokens=config.max_new_tokens, api_key=api_key
    )
    sink = QueueSink(client, partition)
    failed: list[BaseException] = []  # what ended the sampling thread, if anything did

    def check_sampling() -> None:
        error = scheduler.fatal_error or (failed[0] if failed else None)
        if error is not None:
            raise error

    trainer = LedgerGRPOTrainer(
        policy,
        optimizer,
        client,
        ledger,
        partition,
        training,
        pad_token_id=setup.pad_token_id,
        check_producers=check_sampling,
    )
    done = threading.Event()
    ahead = lambda: sink.rows_put - trainer.rows_consumed >= config.max_steps_ahead * batch_rows  # noqa: E731
    sampling_client = InferenceClient(ledger, cfg, api_key=api_key)  # drained while colocated servers are released
    scheduler = SamplingScheduler(
        config=cfg,
        sampler_class=sampler_class,
        dataset=dataset,
        split="train",
        sink=sink,
        inference=sampling_client,
        stop_when=done.is_set,
        pause_when=ahead,
        convert_record_to_data_func=convert,
    )
    if config.prompts_from == "scheduler":
        produce: Callable[[], Any] = scheduler.run
    else:
        problems = [
            {**p, "prompt_ids": setup.prompt_ids(p["prompt"])} for p in make_prompts(config.num_tasks, config.seed)
        ]
        source = PromptSource(problems, seed=config.seed)
        produce = lambda: prompt_source_producer(  # noqa: E731
            source, engine, engine_lock, sink, setup.chat, config, done, ahead
        )

    def sample() -> None:
        try:
            produce()
        except BaseException as exc:  # the trainer's wait raises it (check_sampling)
            failed.append(exc)

    rewards: list[float] = []
    # colocated: the servers' memory freed for each step's training, the samplers' requests held meanwhile
    colocation = None
    if servers is not None and config.inference_colocate:
        colocation = ColocatedServers(servers, sampling_client)
    t0 = time.perf_counter()
    try:
        with contextlib.ExitStack() as serving:
            if servers is None:  # the in-process engine behind the endpoint, registered as one service
                url = serving.enter_context(serve_in_background(app))
                service = InferenceService(name="adder-0", url=url + "/v1", model="adder")
                serving.enter_context(ServiceRegistration(ledger, service, policy_version=lambda: engine.version))
            else:  # stopped (and marked down in the ledger) once the sampling is over, before the ledger closes
                serving.callback(servers.stop)
            sampling = threading.Thread(target=sample, name=f"sampling-{config.prompts_from}", daemon=True)
            sampling.start()

            def stop_sampling() -> None:  # also when a step raised; before the servers stop
                done.set()
                sampling_client.resume()  # requests held back by a drain end (a step that raised held them)
                sampling.join(120)

            serving.callback(stop_sampling)
            for step in range(start, config.steps):
                warm_up_lr(optimizer, config, step)
                row = trainer.step(step, before_train=colocation.release if colocation is not None else None)
                if convert is not None:  # counted so far (the samplers run ahead of the trainer)
                    row.update({key: scheduler.stats[key] for key in ("records_skipped", "groups_skipped")})
                if servers is None:
                    with engine_lock:
                        engine.update_weights(step + 1, state_dict=policy.state_dict())
                elif colocation is not None:  # back, the new weights, then the held requests go on
                    colocation.resume(functools.partial(sync_servers, servers, policy.state_dict(), step + 1))
                else:
                    sync_servers(servers, policy.state_dict(), step + 1)
                end_of_step(config, row, rewards, record, checkpoint, policy, optimizer)
                if eval_dataset is not None and eval_due(config, step):
                    inference = InferenceClient(ledger, cfg, api_key=api_key)
                    record.write(evaluate(ledger, cfg, sampler_class, eval_dataset, inference, step + 1))
            save_checkpoint(checkpoint, policy, optimizer, config.steps)
        check_sampling()  # a sampler that failed after the last step's rows were put
    finally:
        transfer_queue.shutdown()
        if started_ray:
            ray.shutdown()
    elapsed = time.perf_counter() - t0
    report(config, rewards, elapsed, record)
    print(f"scheduler: {dict(scheduler.stats)}\n")
    print(render_status(ledger))
    ledger.close()  # a normal end leaves ledger.db alone: its -wal and -shm files are checkpointed away
    return 0


def inference_model_directory(setup: PolicySetup, out: Path) -> str:
    """The model directory the run's servers load first: the policy as it is now (warmed up, or resumed) and its
    tokenizer (``model_name_or_path``'s), written to ``out/inference_model``.

    Raises:
        ConfigError: a chat format without a tokenizer to save (the built-in addition tokenizer's).
    """
    save = getattr(getattr(setup.chat, "tokenizer", None), "save_pretrained", None)
    if not callable(save):
        raise ConfigError(
            "inference_engine: the servers need a Hugging Face tokenizer with a chat template, and the built-in "
            "addition tokenizer is none: expected model_name_or_path (a local model directory)"
        )
    directory = out / "inference_model"
    directory.mkdir(parents=True, exist_ok=True)
    policy: Any = setup.policy  # a Hugging Face model (the built-in Llama or model_name_or_path's)
    policy.save_pretrained(str(directory))
    save(str(directory))
    return str(directory.absolute())


def start_inference_servers(
    config: LedgerRunConfig,
    setup: PolicySetup,
    ledger: Ledger,
    cfg: SamplingConfig,
    out: Path,
    version: int,
    **kwargs: Any,
) -> InferenceManager:
    """The run's ``config.inference_engine`` servers, started: an ``InferenceManager`` of ``inference_dp_size``
    servers sized by ``cfg``'s ``inf_tp_size`` / ``inf_ep_size`` / ``inf_mem_ratio``, loading
    :func:`inference_model_directory`, registered in ``ledger`` as ``InferenceService`` rows of ``cfg.model`` (named
    ``{model}-{rank}``, kind the engine's), where the samplers' ``InferenceClient`` finds them; a resumed run's weights
    (``version`` > 0) are loaded as that version. ``kwargs`` go to the manager (logs in ``out/inference_logs``).
    Every server is stopped when one does not start (or the start is interrupted).

    Raises:
        EngineServerError: a server that did not start (``EngineNeverHealthy``, ``PortInUse``, ...).
        InvalidInferenceSizing: a sizing the engine cannot honour (the config refuses it first).
    """
    from workers.engines.manager import InferenceManager

    kwargs.setdefault("log_dir", str(out / "inference_logs"))
    model_dir = inference_model_directory(setup, out)
    manager = InferenceManager.from_config(
        cfg, config.inference_engine, model_dir, dp_size=config.inference_dp_size, ledger=ledger, name=cfg.model,
        **kwargs,
    )  # fmt: skip
    try:
        manager.start()
        if version > 0:
            sync_servers(manager, setup.policy.state_dict(), version)
    except BaseException:
        manager.stop()
        raise
    print(
        f"inference: {len(manager.servers)} {config.inference_engine} server(s) at {', '.join(manager.urls)} "
        f"(logs in {kwargs['log_dir']})",
        flush=True,
    )
    return manager


def sync_servers(servers: InferenceManager, state_dict: dict[str, torch.Tensor], version: int) -> None:
    """Load ``state_dict`` into every server as ``version`` (``sync_state_dict``: written once, loaded by each); a
    server that could not load it keeps serving (and recording) its older version, logged; one that failed for good
    stops the run (``check``)."""
    replies = servers.sync_state_dict(state_dict, version)
    for server, reply in zip(servers.servers, replies, strict=True):
        if not reply.get("success"):
            logger.warning("%s did not load the weights of version %d: %s", server.name, version, reply)
    servers.check()


def train_from_ledger(
    config: LedgerRunConfig,
    trainer: LedgerGRPOTrainer,
    setup: PolicySetup,
    ledger: Ledger,
    record: RunRecord,
    checkpoint: Path,
    start: int,
    convert_record_to_data_func: Callable[[Record], Any] | str | None = None,
) -> int:
    """``enable_sampling`` false: GRPO steps on the whole groups of untrained records the ledger holds (each turned
    into tokens by ``convert_record_to_data_func``: this argument, else the config's, else
    ``default_convert_record_to_data``: the messages re-tokenised), until too few are left for a step; no engine, no
    scheduler, no samplers, no queue.

    Raises:
        InvalidRecordConverter: a ``convert_record_to_data_func`` name that does not import a function.
        InvalidRecordData: a hook that returned something other than ``RecordData`` or None.
    """
    convert = run_hook(config, convert_record_to_data_func)
    policy, optimizer = setup.policy, trainer.optimizer
    records = {r.id: r for r in ledger.records("train")}
    where = redact(ledger.connection_string)
    print(f"enable_sampling=false: training from the {len(records)} records in {where}", flush=True)
    rewards: list[float] = []
    t0 = time.perf_counter()
    step = start
    skipped: set[int] = set()
    while step < config.steps:
        rows = ledger_rows(ledger, records, setup, config, step, convert, skipped)
        if rows is None:
            left = len(ledger.trainable("train", step, config.max_trained_count, config.retrained_interval))
            skips = f" ({len(skipped)} of them skipped by convert_record_to_data_func)" if skipped else ""
            print(
                f"enable_sampling=false: stopping at step {step}: {left} trainable records left{skips}, fewer than a "
                f"step's {config.prompts_per_step} whole groups of num_generations={config.num_generations}",
                flush=True,
            )
            break
        warm_up_lr(optimizer, config, step)
        row = trainer.step_on(step, rows)
        end_of_step(config, row, rewards, record, checkpoint, policy, optimizer)
        step += 1
    save_checkpoint(checkpoint, policy, optimizer, step)
    report(config, rewards, time.perf_counter() - t0, record)
    print(render_status(ledger))
    ledger.close()
    return 0


def run_hook(config: LedgerRunConfig, argument: Callable[[Record], Any] | str | None) -> Callable[[Record], Any] | None:
    """The run's ``convert_record_to_data_func``: ``argument``, else the config's, resolved (None: none given).

    Raises:
        InvalidRecordConverter: a name that does not import a function.
    """
    spec = argument if argument is not None else getattr(config, "convert_record_to_data_func", None)
    return resolve_convert_record_to_data_func(spec)


def hook_without_records(prompts_from: str) -> ConfigError:
    """The refusal of a ``convert_record_to_data_func`` in a run whose prompts write no ledger records."""
    return ConfigError(
        f"convert_record_to_data_func: turns ledger records into training data, but prompts_from={prompts_from} "
        f"writes no records: expected prompts_from=scheduler with it"
    )


def default_convert_record_to_data(chat: AdditionChat | PretrainedChat) -> Callable[[Record], RecordData]:
    """The default ``convert_record_to_data_func`` of a run whose chat format is ``chat``: a record's
    ``messages[:-1]`` rendered as the prompt, its last message's content tokenised as the answer (eos included)."""

    def convert_record_to_data(record: Record) -> RecordData:
        messages = record.messages
        return RecordData(
            prompt_ids=chat.prompt_ids(messages[:-1]), response_ids=chat.response_ids(messages[-1]["content"])
        )

    return convert_record_to_data


def ledger_rows(
    ledger: Ledger,
    records: Mapping[int | None, Record],
    setup: PolicySetup,
    config: LedgerRunConfig,
    step: int,
    convert_record_to_data_func: Callable[[Record], Any] | None = None,
    skipped: set[int] | None = None,
) -> LedgerRows | None:
    """A step's rows out of the ledger: the first ``prompts_per_step`` whole groups (``num_generations`` records of
    one task and epoch) still trainable at ``step``, each record turned into its prompt's and answer's tokens by
    ``convert_record_to_data_func`` (None: ``default_convert_record_to_data(setup.chat)``, the messages re-tokenised:
    the ledger keeps no tokens); None when there are fewer such groups. A group with a record the hook skips (returns
    None or ``[]``) is passed over (its records' ids go into ``skipped``), as a group short of records is.

    Raises:
        InvalidRecordData: the hook returned something other than ``RecordData`` or None.
    """
    convert = convert_record_to_data_func or default_convert_record_to_data(setup.chat)
    groups: dict[str, list[DBRecordData]] = {}
    for data in ledger.trainable("train", step, config.max_trained_count, config.retrained_interval):
        if data.record_id in records:  # written before this run started: a finished sample
            groups.setdefault(data.group_id or f"record/{data.record_id}", []).append(data)
    chosen: list[tuple[int, DBRecordData, RecordData]] = []
    taken = 0
    for group in groups.values():
        if taken == config.prompts_per_step:
            break
        if len(group) != config.num_generations:
            continue
        if skipped is not None and any(data.record_id in skipped for data in group):
            continue  # the hook skipped one of its records at an earlier step: not converted again
        converted = [convert_record(convert, records[data.record_id]) for data in group]
        if any(c is None for c in converted):
            if skipped is not None:
                skipped.update(d.record_id for d, c in zip(group, converted, strict=True) if c is None)
            continue
        chosen.extend((taken, data, c) for data, c in zip(group, converted, strict=True) if c is not None)
        taken += 1
    if taken < config.prompts_per_step:
        return None
    return LedgerRows(
        record_ids=[data.record_id for _, data, _ in chosen],
        group_ids=[g for g, _, _ in chosen],
        rewards=torch.tensor([float(data.score or 0.0) for _, data, _ in chosen]),
        policy_versions=torch.tensor([float(data.policy_version) for _, data, _ in chosen]),
        prompts=[c["prompt_ids"] for _, _, c in chosen],
        responses=[c["response_ids"] for _, _, c in chosen],
    )


def eval_due(config: LedgerRunConfig, step: int) -> bool:
    """Whether the run evaluates once 0-based training step ``step`` is done (HF Trainer's ``eval_strategy``):
    ``steps``: every ``eval_steps`` steps; ``epoch``: when the steps' prompts (``prompts_per_step`` each) complete an
    epoch of the ``num_tasks`` training tasks; ``no``: never."""
    if config.eval_strategy == "steps":
        assert config.eval_steps is not None, "the config refuses eval_strategy=steps without eval_steps"
        return (step + 1) % config.eval_steps == 0
    if config.eval_strategy == "epoch":
        per_step, tasks = config.prompts_per_step, config.num_tasks
        return (step + 1) * per_step // tasks > step * per_step // tasks
    return False


def evaluate(
    ledger: Ledger,
    cfg: SamplingConfig,
    sampler_class: type[AsyncSampler],
    dataset: Dataset,
    inference: InferenceClient,
    steps_done: int,
) -> dict[str, Any]:
    """One evaluation after ``steps_done`` training steps: a ``SamplingScheduler`` writes ``dataset``'s tasks as epoch
    ``steps_done`` of split ``eval`` and its samplers sample and score them (claims and records as for training, but
    no sink: nothing goes into the queue, and the ledger's trainable records are split ``train``'s, so nothing of it
    is trained). A resumed run that evaluates after the same step again reads the records already there.

    Returns the run's ``eval`` row: ``eval_reward`` (the records' mean score), ``eval_accuracy`` (the share scoring
    1, the addition task's exact answer), ``eval_records`` and ``eval_s``."""
    t0 = time.perf_counter()
    scheduler = SamplingScheduler(
        config=cfg, sampler_class=sampler_class, dataset=dataset, split="eval", inference=inference
    )
    scheduler.run(epochs=[steps_done])
    scores = [float(r.score or 0.0) for r in ledger.records("eval", steps_done)]
    n = max(len(scores), 1)
    return {
        "kind": "eval",
        "step": steps_done,
        "eval_reward": sum(scores) / n,
        "eval_accuracy": sum(1 for x in scores if x >= 1.0) / n,
        "eval_records": len(scores),
        "eval_s": time.perf_counter() - t0,
    }


def warm_up_lr(optimizer: torch.optim.Optimizer, config: LedgerRunConfig, step: int) -> None:
    """The learning rate of ``step``: ``lr`` warmed up linearly over ``lr_warmup_steps`` (a function of the step, so
    a resumed run picks it up)."""
    for group in optimizer.param_groups:
        group["lr"] = config.lr * min(1.0, (step + 1) / max(1, config.lr_warmup_steps))


def end_of_step(config, row, rewards, record, checkpoint, policy, optimizer) -> None:
    """A step's metrics row, a progress line every 10 steps and a checkpoint every ``checkpoint_every``."""
    step = int(row["step"])
    rewards.append(row["reward"])
    record.write({"kind": "grpo", **row})
    if (step + 1) % 10 == 0:
        recent = rewards[-10:]
        print(
            f"step {step + 1}: reward {sum(recent) / len(recent):.3f} (last 10), "
            f"staleness {row['staleness']:.1f}, {row['rows_trained']}/{row['rows']} rows trained",
            flush=True,
        )
    if (step + 1) % config.checkpoint_every == 0:
        save_checkpoint(checkpoint, policy, optimizer, step + 1)


def report(config: LedgerRunConfig, rewards: list[float], elapsed: float, record: RunRecord) -> None:
    if rewards:
        k = max(1, len(rewards) // 5)
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        source = config.prompts_from if config.enable_sampling else "the ledger's records"
        print(
            f"\nGRPO ({source}): {len(rewards)} steps in {elapsed:.0f} s; "
            f"mean reward first fifth {first:.3f} -> last fifth {last:.3f} ({last - first:+.3f})"
        )
    print(f"plot: {record.finish()}")
