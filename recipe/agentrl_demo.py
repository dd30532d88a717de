"""AgentRL's flow end to end on CPU: a ``Dataset`` of custom ``Task``s, a custom ``AsyncSampler``, the
``SamplingScheduler`` over a SQLite ledger, and a GRPO trainer learning from the records through the queue.

    1. SFT warm-up of a tiny Llama on two-digit addition until a sampled answer is right 20 % of the time
    2. the policy's engine behind the OpenAI-compatible endpoint, registered as an InferenceService
    3. SamplingScheduler (a thread): writes AdditionProblem tasks epoch by epoch; AdditionSampler claims one, asks the
       endpoint for num_generations answers, scores them (evaluate_record), records them and queues the group
    4. the trainer (this thread): whole groups from the queue -> records marked trained (never twice) -> GRPO step
       -> new weights into the engine (the policy version samplers record)
    5. metrics.jsonl (the warm-up's ``sft`` rows, a ``grpo`` row per step) and metrics.png (redrawn every minute)
    6. ``python -m workers.ledger status --db sqlite:///OUTPUT/ledger.db`` at the end

``prompts_from=prompt-source`` is the switch back to the usual GRPO input: prompts drawn from a ``PromptSource``
and sampled from the engine by one producer thread, no ledger (the trainer and the queue are the same).

Run it with ``make agentrl-demo`` (or ``python recipe/agentrl_demo.py [--config FILE] [--new] [--print-config]
[key=value ...]``; ``--help`` lists every key, recipe/configs/agentrl_demo.yaml holds the defaults; ``--key value``,
as AgentRL's guide writes ``--loss_calculater GRPO``, is ``key=value``). Run again into
the same output_dir, it resumes from its checkpoint: a larger ``steps`` extends the run (a resume that changes a
setting which shapes the training is refused: CHANGEABLE_ON_RESUME lists those it may change), tasks claimed by a killed
run are re-dispatched when their leases run out, and no record is trained twice. ``--new`` starts over (the previous
run is moved aside to OUTPUT_DIR.prev-N, once the config is valid).
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

import torch
from torch.utils.data import Dataset

from orchestration.config import ConfigError, Range, Text, check_ranges, config_from_cli, config_to_dict, flatten_dict
from orchestration.ledger_grpo import LedgerGRPOTrainer, LedgerTrainingConfig
from orchestration.metrics import MetricsLog, PlotRefresher
from orchestration.run_plan import move_aside, refuse_changed_settings, save_config
from rl_contracts.prompts import PromptSource
from trainers.losses import loss_named
from transfer_queue.runtime import init_ray
from workers.agents.openai_api import create_app
from workers.agents.samplers import BatchingSampler, engine_generate
from workers.agents.task_server import serve_in_background
from workers.api_key import new_api_key
from workers.engines import HFEngine, SamplingParams
from workers.ledger import (
    AsyncSampler,
    InferenceClient,
    InferenceService,
    MalformedConnectionString,
    SamplingConfig,
    SamplingScheduler,
    ServiceRegistration,
    Task,
    parse_connection_string,
    register_new_model,
    shared_ledger,
)
from workers.ledger.__main__ import render_status
from workers.ledger.queue_sink import QueueSink
from workers.tasks.addition import AdditionTokenizer, addition_reward, build_model, make_prompts, sft_batch

PARTITION = "agentrl"
DEFAULT_CONFIG = Path(__file__).parent / "configs" / "agentrl_demo.yaml"


@dataclass
class AgentRLDemoConfig:
    """The demo's run: recipe/configs/agentrl_demo.yaml with dotted overrides on top (orchestration.config's loader)."""

    steps: int = 150  # GRPO steps of the run (a resumed run with more steps extends it)
    # scheduler: tasks from the ledger through a SamplingScheduler; prompt-source: a plain PromptSource, no ledger
    prompts_from: Literal["scheduler", "prompt-source"] = "scheduler"
    prompts_per_step: int = 16  # prompts (GRPO groups) per step
    num_generations: int = 8  # answers sampled per prompt (the group size)
    num_tasks: int = 512  # tasks per epoch (prompts the dataset holds)
    lr: float = 5e-4  # AdamW learning rate of GRPO
    beta1: float = 0.9  # AdamW's beta1 for GRPO (AgentRL's name): the decay of the gradient's running mean
    beta2: float = 0.999  # AdamW's beta2 for GRPO (AgentRL's name): the decay of the squared gradient's running mean
    # the policy loss (AgentRL's name, spelt as there): grpo, gspo, cispo, minirl or ppo (trainers.losses), any case
    loss_calculater: str = "grpo"
    # linear learning-rate warm-up over the first k GRPO steps: a fresh AdamW's first steps are full-size whatever
    # the gradient, and without it the first GRPO steps can undo the SFT warm-up
    lr_warmup_steps: int = 20
    sft_target: float = 0.2  # sampled accuracy the SFT warm-up stops at; 0 skips the warm-up
    max_trained_count: int = 1  # a record is trained at most this often
    retrained_interval: int = 0  # steps at least between two trainings of a record (max_trained_count > 1)
    max_steps_ahead: int = 2  # sampling pauses this many steps ahead of the trainer
    checkpoint_every: int = 10  # steps between checkpoints (output_dir/checkpoint.pt; one at the end too)
    # seconds a claimed task's lease lasts (heartbeats renew it every lease_s / 5, at least 0.2 s); a killed run's
    # claimed tasks are re-dispatched once their leases run out
    lease_s: float = 5.0
    seed: int = 0  # seeds the weights, the tasks and sampling
    output_dir: str = "outputs/agentrl_demo"  # metrics.jsonl, metrics.png, checkpoint.pt and the SQLite ledger
    db: str | None = None  # the ledger's db_connection_string; None: sqlite:///OUTPUT_DIR/ledger.db
    resume: bool = True  # go on from output_dir/checkpoint.pt, if any (--new: the old run is moved aside)

    #: the type and range of each numeric or constrained key, checked when the config is parsed
    KEY_RANGES: ClassVar[Mapping[str, Range | Text]] = {
        "steps": Range(int, 1),
        "prompts_from": Text(("scheduler", "prompt-source")),  # the Literal's values, named in the refusal
        "prompts_per_step": Range(int, 1),
        "num_generations": Range(int, 1),
        "num_tasks": Range(int, 1),
        "lr": Range(float, 0, low_open=True),
        "beta1": Range(float, 0, 1, high_open=True),
        "beta2": Range(float, 0, 1, high_open=True),
        "lr_warmup_steps": Range(int, 0),
        "sft_target": Range(float, 0, 1),
        "max_trained_count": Range(int, 1),
        "retrained_interval": Range(int, 0),
        "max_steps_ahead": Range(int, 1),  # 0 would pause sampling for good
        "checkpoint_every": Range(int, 1),
        "lease_s": Range(float, 0.25, low_open=True),  # the heartbeat (at least 0.2 s) must come within the lease
        "seed": Range(int, 0),
    }

    def __post_init__(self) -> None:
        check_ranges(flatten_dict(config_to_dict(self)), ranges=self.KEY_RANGES)
        try:
            self.loss_calculater = loss_named(self.loss_calculater)  # "GRPO", as AgentRL's guide writes it
        except ValueError as exc:
            raise ConfigError(f"loss_calculater: {exc}") from None
        if self.db is not None:
            try:
                parse_connection_string(self.db)
            except MalformedConnectionString as exc:
                raise ConfigError(str(exc).replace("db_connection_string", "db", 1)) from None


# Settings a resumed run may change (everything else shapes the training: a resume that changes it is refused): how
# long to go on, bookkeeping, the leases' length, and the SFT warm-up's target (a resumed run does not warm up again).
CHANGEABLE_ON_RESUME = ("steps", "output_dir", "resume", "checkpoint_every", "lease_s", "sft_target")


# --- the user's side, as in the seed: a task type, a dataset of tasks, a sampler -------------------------------------
@register_new_model
class AdditionProblem(Task):
    question: str  # "07+35="
    answer: str  # "042"


class AdditionDataset(Dataset):
    def __init__(self, num: int, seed: int):
        self.items = make_prompts(num, seed)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        return AdditionProblem(question=self.items[idx]["prompt"], answer=self.items[idx]["answer"])


class AdditionSampler(AsyncSampler):
    async def run(self):
        assert isinstance(self.task, AdditionProblem)  # the scheduler hands this sampler the dataset's tasks
        messages = [{"role": "user", "content": self.task.question}]
        completion = await self.create_chat_completions(messages, n=self.config.num_generations)
        await self.record_completion(messages, completion)

    async def evaluate_record(self, record):
        assert isinstance(self.task, AdditionProblem)
        return addition_reward(record.messages[-1]["content"], self.task.answer)


class AdditionChat:
    """The endpoint's ChatFormat for this single-turn task: the prompt is ``<bos>`` + the question."""

    def __init__(self, tokenizer: AdditionTokenizer):
        self.tokenizer = tokenizer

    def prompt_ids(self, messages):
        return [self.tokenizer.bos_token_id, *self.tokenizer.encode(messages[-1]["content"])]

    def append_ids(self, messages):
        raise ValueError("the addition task is single-turn")

    def decode(self, ids):
        return self.tokenizer.decode(list(ids))


# --- the run ------------------------------------------------------------------------------------------------------
def warm_up(
    policy, engine, tokenizer, target: float, seed: int, max_steps: int = 3000, record: Callable | None = None
) -> tuple[int, float]:
    """Supervised steps until one sampled answer per probe problem is right ``target`` of the time; ``record``
    gets an ``sft`` row (step, loss, accuracy) at each probe."""
    if target <= 0:
        return 0, 0.0
    probe = make_prompts(256, seed=1_000_000 + seed)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    accuracy, step = 0.0, 0
    while step < max_steps:
        loss = policy(**sft_batch(make_prompts(64, seed=2_000_000 + seed * 100_000 + step), tokenizer)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 25 == 0:
            engine.update_weights(0, state_dict=policy.state_dict())
            params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)
            generations = engine.generate([p["prompt_ids"] for p in probe], n=1, params=params)
            scores = [
                addition_reward(tokenizer.decode(g.token_ids), p["answer"])
                for p, [g] in zip(probe, generations, strict=True)
            ]
            accuracy = sum(scores) / len(scores)
            if record is not None:
                record({"kind": "sft", "step": step, "sft_loss": loss.item(), "accuracy": accuracy})
            if accuracy >= target:
                break
    return step, accuracy


def prompt_source_producer(source, engine, engine_lock, sink, tokenizer, n: int, per_step: int, done, paused) -> None:
    """The ``prompt-source`` input: each round draws ``per_step`` problems, samples ``n`` answers each from the engine
    and puts every group into the queue (``record_id`` -1: no ledger record)."""
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    group = 0
    while not done.is_set():
        if paused():
            time.sleep(0.01)
            continue
        problems = source.next_batch(per_step)
        with engine_lock:
            version = engine.version
            generations = engine.generate([p["prompt_ids"] for p in problems], n=n, params=params)
        for problem, answers in zip(problems, generations, strict=True):
            rows = [
                {
                    "record_id": -1,
                    "prompt_ids": problem["prompt_ids"],
                    "response_ids": g.token_ids,
                    "response_logprobs": g.logprobs,
                    "policy_version": version,
                    "reward": addition_reward(tokenizer.decode(g.token_ids), problem["answer"]),
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


def grpo_optimizer(policy: torch.nn.Module, config: AgentRLDemoConfig) -> torch.optim.AdamW:
    """GRPO's AdamW: ``lr`` (the warm-up scales it per step), betas ``(beta1, beta2)``."""
    return torch.optim.AdamW(policy.parameters(), lr=config.lr, betas=(config.beta1, config.beta2))


def save_checkpoint(path: Path, policy, optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"policy": policy.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    try:
        argv = guide_flags(sys.argv[1:] if argv is None else argv)
        config = config_from_cli(__doc__ or "", DEFAULT_CONFIG, argv, cls=AgentRLDemoConfig)
        message = plan_output(config)
    except ConfigError as exc:
        print(f"agentrl_demo.py: error: {exc}", file=sys.stderr)
        return 2
    if message:
        print(message, flush=True)
    return train(config)


# the command line's own flags; any other --KEY is a config key written as AgentRL's guide writes its arguments
CLI_FLAGS = ("--config", "--new", "--print-config", "--help")


def guide_flags(argv: list[str]) -> list[str]:
    """``--KEY VALUE`` and ``--KEY=VALUE`` (AgentRL's guide: ``--loss_calculater GRPO``) as ``KEY=VALUE`` overrides;
    the command line's own flags (``CLI_FLAGS``, ``-h``) and ``KEY=VALUE`` pass as they are. An unknown KEY is then
    refused as any override is, naming the closest keys."""
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        name = arg.split("=", 1)[0]
        if not arg.startswith("--") or name in CLI_FLAGS:
            out.append(arg)
        elif "=" in arg:
            out.append(arg[2:])
        else:
            value = next(args, None)
            if value is None or value.startswith("--"):
                raise ConfigError(f"{arg} needs a value: expected {arg} VALUE or {arg[2:]}=VALUE, got none")
            out.append(f"{arg[2:]}={value}")
    return out


def plan_output(config: AgentRLDemoConfig) -> str | None:
    """What the run does with its output_dir, said (and for ``--new`` done) before anything starts, as recipe/demo.py
    does: ``--new`` moves a previous run aside to ``OUTPUT_DIR.prev-N``; otherwise a checkpoint there is resumed
    (None: the run says it), provided ``steps`` goes past it.

    Raises:
        ConfigError: a resume that would train nothing (``steps`` not above the checkpoint's step), or with other
            training settings than the run was started with (its ``config.yaml``).
    """
    out = Path(config.output_dir)
    checkpoint = out / "checkpoint.pt"
    if not config.resume and out.is_dir() and any(out.iterdir()):
        return f"--new: moved the previous run to {move_aside(out)}; starting over in {out}"
    if not config.resume or not checkpoint.exists():
        return f"starting a new run in {out}"
    refuse_changed_settings(out, config, CHANGEABLE_ON_RESUME)
    done = int(torch.load(checkpoint, weights_only=True)["step"])
    if config.steps <= done:
        raise ConfigError(
            f"{out} holds a run that already finished {done} steps; steps={config.steps} would train nothing. "
            f"Pass steps={done + max(done, 1)} (any value > {done}) to extend it, --new to start over here, "
            f"or a new output_dir"
        )
    return None


def train(config: AgentRLDemoConfig) -> int:
    """The run itself: warm-up (or resume), then GRPO from the ledger's records (or a PromptSource)."""
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(out, config)  # what a resume of this run is checked against
    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    tokenizer = AdditionTokenizer()
    policy = build_model(tokenizer.vocab_size, seed=config.seed)
    engine = HFEngine(copy.deepcopy(policy), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    optimizer = grpo_optimizer(policy, config)
    checkpoint = out / "checkpoint.pt"
    state = torch.load(checkpoint, weights_only=True) if checkpoint.exists() else None
    title = f"GRPO on two-digit addition (AgentRL demo, prompts from {config.prompts_from})"
    record = RunRecord(out, None if state is None else int(state["step"]), title)
    if state is not None:
        policy.load_state_dict(state["policy"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        print(f"resumed from {checkpoint} at step {start}", flush=True)
    else:
        t0 = time.perf_counter()
        sft_steps, accuracy = warm_up(policy, engine, tokenizer, config.sft_target, config.seed, record=record.write)
        print(f"SFT warm-up: {sft_steps} steps, sampled accuracy {accuracy:.2f}, {time.perf_counter() - t0:.0f} s")
        optimizer = grpo_optimizer(policy, config)
        start = 0
        save_checkpoint(checkpoint, policy, optimizer, start)
    engine.update_weights(start, state_dict=policy.state_dict())

    import ray

    import transfer_queue

    init_ray(num_cpus=4, include_dashboard=False, logging_level=logging.ERROR)
    batch_rows = config.prompts_per_step * config.num_generations
    client = transfer_queue.init(
        global_batch_size=config.prompts_per_step,
        num_n_samples=config.num_generations,
        sampler=transfer_queue.GRPOSampler(config.num_generations),
        num_storage_units=1,
        run_metrics=str(out / "metrics.jsonl"),
    )
    cfg = SamplingConfig(
        output_dir=str(out),
        db_connection_string=config.db,
        model="adder",
        num_generations=config.num_generations,
        max_new_tokens=4,
        max_prompt_tokens=16,
        num_epochs=config.steps * config.prompts_per_step // config.num_tasks + 2,
        target_concurrency=config.prompts_per_step,
        max_concurrent_samples_per_process=config.prompts_per_step,
        lease_s=config.lease_s,
        heartbeat_s=max(config.lease_s / 5, 0.2),
    )
    ledger = shared_ledger(cfg)
    # generation (the endpoint's thread) and weight updates (this thread) take turns on the engine
    engine_lock = threading.Lock()
    generate = engine_generate(engine)

    def locked_generate(prompts, params):
        with engine_lock:
            return generate(prompts, params)

    api_key = new_api_key()  # the endpoint's, for this run: its samplers send it, the ledger never holds it
    app = create_app(
        BatchingSampler(locked_generate), AdditionChat(tokenizer), model="adder", max_tokens=4, api_key=api_key
    )
    sink = QueueSink(client, PARTITION)
    trainer = LedgerGRPOTrainer(
        policy,
        optimizer,
        client,
        ledger,
        PARTITION,
        LedgerTrainingConfig(
            batch_rows, config.max_trained_count, config.retrained_interval, loss=config.loss_calculater
        ),
        pad_token_id=tokenizer.pad_token_id,
    )
    done = threading.Event()
    ahead = lambda: sink.rows_put - trainer.rows_consumed >= config.max_steps_ahead * batch_rows  # noqa: E731
    scheduler = SamplingScheduler(
        config=cfg,
        sampler_class=AdditionSampler,
        dataset=AdditionDataset(config.num_tasks, seed=config.seed),
        split="train",
        sink=sink,
        inference=InferenceClient(ledger, cfg, api_key=api_key),
        stop_when=done.is_set,
        pause_when=ahead,
    )
    if config.prompts_from == "scheduler":
        produce: Callable[[], Any] = scheduler.run
    else:
        source = PromptSource(make_prompts(config.num_tasks, config.seed), seed=config.seed)
        produce = lambda: prompt_source_producer(  # noqa: E731
            source, engine, engine_lock, sink, tokenizer, config.num_generations, config.prompts_per_step, done, ahead
        )
    rewards = []
    with serve_in_background(app) as url:
        service = InferenceService(name="adder-0", url=url + "/v1", model="adder")
        with ServiceRegistration(ledger, service, policy_version=lambda: engine.version):
            sampling = threading.Thread(target=produce, name=f"sampling-{config.prompts_from}", daemon=True)
            sampling.start()
            t0 = time.perf_counter()
            for step in range(start, config.steps):
                for group in optimizer.param_groups:  # a function of the step: a resumed run picks it up
                    group["lr"] = config.lr * min(1.0, (step + 1) / max(1, config.lr_warmup_steps))
                row = trainer.step(step)
                with engine_lock:
                    engine.update_weights(step + 1, state_dict=policy.state_dict())
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
            save_checkpoint(checkpoint, policy, optimizer, config.steps)
            done.set()
            sampling.join(120)
    elapsed = time.perf_counter() - t0
    transfer_queue.shutdown()
    ray.shutdown()
    if rewards:
        k = max(1, len(rewards) // 5)
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        print(
            f"\nGRPO ({config.prompts_from}): {len(rewards)} steps in {elapsed:.0f} s; "
            f"mean reward first fifth {first:.3f} -> last fifth {last:.3f} ({last - first:+.3f})"
        )
    print(f"plot: {record.finish()}")
    print(f"scheduler: {dict(scheduler.stats)}\n")
    print(render_status(ledger))
    ledger.close()  # a normal end leaves ledger.db alone: its -wal and -shm files are checkpointed away
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
