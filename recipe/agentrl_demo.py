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
as AgentRL's guide writes ``--loss_calculater GRPO``, is ``key=value``; the guide's own flags, ``--learning_rate``,
``--per_device_train_batch_size`` x ``--gradient_accumulation_steps``, ``--save_steps``, ``--db_connection_string``,
``--inf_tp_size`` / ``--inf_ep_size`` / ``--inf_mem_ratio``, map onto these keys, and the run prints the mapping before
it starts: docs/sampling.md, "The guide's command line"). Run again into
the same output_dir, it resumes from its checkpoint: a larger ``steps`` extends the run (a resume that changes a
setting which shapes the training is refused: CHANGEABLE_ON_RESUME lists those it may change), tasks claimed by a killed
run are re-dispatched when their leases run out, and no record is trained twice. ``--new`` starts over (the previous
run is moved aside to OUTPUT_DIR.prev-N, once the config is valid).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

import msgspec
import torch
import yaml
from torch.utils.data import Dataset

from orchestration.config import ConfigError, Range, Text, check_ranges, config_from_cli, config_to_dict, flatten_dict
from orchestration.ledger_grpo import LedgerGRPOTrainer, LedgerRows, LedgerTrainingConfig
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
    DBRecordData,
    InferenceClient,
    InferenceService,
    Ledger,
    MalformedConnectionString,
    Record,
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
from workers.ledger.schema import redact
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
    # a local Hugging Face model directory (config, weights, tokenizer; nothing is downloaded): the policy of engine
    # and trainer in place of the built-in tiny addition Llama; None: the built-in one
    model_name_or_path: str | None = None
    max_new_tokens: int = 4  # the longest answer sampled (SamplingConfig.max_new_tokens)
    # false: no engine, no scheduler, no samplers: train from the finished, untrained records the ledger holds and
    # stop when too few are left for a step
    enable_sampling: bool = True

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
        "max_new_tokens": Range(int, 1),
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
        if self.model_name_or_path is not None:
            check_model_dir(self.model_name_or_path)


def check_model_dir(path: str) -> None:
    """Refuse ``path`` unless it is a local Hugging Face model directory (its ``config.json`` at least): the demo
    downloads nothing, so a hub name such as ``Qwen/Qwen2.5-7B`` is refused too."""
    if not Path(path).is_dir():
        raise ConfigError(
            f"model_name_or_path: expected a local Hugging Face model directory (config.json, weights, tokenizer; "
            f"nothing is downloaded), got {path!r}, which is not a directory"
        )
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"model_name_or_path: expected a Hugging Face model directory holding config.json, weights and a "
            f"tokenizer (save_pretrained writes one), got {path!r} without config.json"
        )


# Settings a resumed run may change (everything else shapes the training: a resume that changes it is refused): how
# long to go on, bookkeeping, the leases' length, and the SFT warm-up's target (a resumed run does not warm up again).
CHANGEABLE_ON_RESUME = (
    "steps",
    "output_dir",
    "resume",
    "checkpoint_every",
    "lease_s",
    "sft_target",
    "enable_sampling",
)


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

    def response_ids(self, text: str) -> list[int]:
        """An answer's tokens as sampled, rebuilt from a record's text: the answer, then ``<eos>``."""
        return [*self.tokenizer.encode(text), self.tokenizer.eos_token_id]


class PretrainedChat:
    """The endpoint's ChatFormat over a model directory's tokenizer: the question rendered with its chat template
    (as the assistant's turn to answer) if it has one, else as plain text; answers decoded without special tokens
    (the eos the engine stops at)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))

    def prompt_ids(self, messages):
        if self.templated:
            text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return list(self.tokenizer.encode(messages[-1]["content"]))

    def append_ids(self, messages):
        raise ValueError("the addition task is single-turn")

    def decode(self, ids):
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def response_ids(self, text: str) -> list[int]:
        """An answer's tokens rebuilt from a record's text: the text's tokens, then the eos token."""
        return [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]


# --- the run ------------------------------------------------------------------------------------------------------
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


def prompt_source_producer(source, engine, engine_lock, sink, chat, config: AgentRLDemoConfig, done, paused) -> None:
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


def grpo_optimizer(policy: torch.nn.Module, config: AgentRLDemoConfig) -> torch.optim.AdamW:
    """GRPO's AdamW: ``lr`` (the warm-up scales it per step), betas ``(beta1, beta2)``."""
    return torch.optim.AdamW(policy.parameters(), lr=config.lr, betas=(config.beta1, config.beta2))


def save_checkpoint(path: Path, policy, optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"policy": policy.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else argv
        flagged = {arg[2:].split("=", 1)[0] for arg in argv if arg.startswith("--")}  # the guide's --KEY form
        argv, guide = take_guide_flags(options_first(guide_flags(argv)))
        print_config = "--print-config" in argv
        argv = [arg for arg in argv if arg != "--print-config"]  # printed once the guide's flags are applied
        config = config_from_cli(__doc__ or "", DEFAULT_CONFIG, argv, cls=AgentRLDemoConfig)
        config, mapping = apply_guide(config, guide, given_keys(argv), flagged)
        if print_config:
            print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
            return 0
        message = plan_output(config)
    except ConfigError as exc:
        print(f"agentrl_demo.py: error: {exc}", file=sys.stderr)
        return 2
    if mapping:
        print("AgentRL's flags -> this demo's config:\n" + "\n".join(f"  {line}" for line in mapping), flush=True)
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


#: AgentRL's RL-guide flags that are not keys of this demo: ``apply_guide`` maps each onto the config (or checks it
#: and says why it changes nothing here)
GUIDE_ONLY = (
    "learning_rate",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "save_steps",
    "db_connection_string",
    "inf_tp_size",
    "inf_ep_size",
    "inf_mem_ratio",
)
#: the guide's flags that are keys of this demo as they are (the mapping prints them too)
GUIDE_NATIVE = (
    "model_name_or_path",
    "output_dir",
    "num_generations",
    "max_new_tokens",
    "loss_calculater",
    "enable_sampling",
)
#: the order of the guide's example command, the mapping's order
GUIDE_ORDER = (
    "model_name_or_path",
    "output_dir",
    "db_connection_string",
    "enable_sampling",
    "loss_calculater",
    "inf_tp_size",
    "inf_ep_size",
    "inf_mem_ratio",
    "num_generations",
    "max_new_tokens",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "save_steps",
)
#: what serves a policy with tensor or expert parallelism (the demo's in-process HFEngine does neither)
PARALLEL_ENGINES = (
    "VLLMEngine(..., tensor_parallel_size=N, enable_expert_parallel=True) (workers/engines/vllm_engine.py) or an "
    "SGLang server started with --tp-size N --ep-size M behind SGLangEngine, registered with ServiceRegistration "
    "(docs/sampling.md)"
)


def options_first(argv: list[str]) -> list[str]:
    """The command line's own options (``--new``, ``--config FILE``, ...) before the ``KEY=VALUE`` overrides, each
    kind in its order: the guide's flags may come in any order (``--output_dir X --new --num_generations 8``), and
    argparse takes the overrides only as one run after the options."""
    options: list[str] = []
    overrides: list[str] = []
    for i, arg in enumerate(argv):
        is_value = i > 0 and argv[i - 1] == "--config"
        (overrides if "=" in arg and not arg.startswith("-") and not is_value else options).append(arg)
    return options + overrides


def take_guide_flags(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """The guide's flags that are not the demo's keys (``GUIDE_ONLY``), taken out of the ``KEY=VALUE`` overrides:
    the overrides left, and those flags' raw values by name, in the order given."""
    rest, guide = [], {}
    for arg in overrides:
        key, _, value = arg.partition("=")
        if not arg.startswith("-") and key in GUIDE_ONLY:
            guide[key] = value
        else:
            rest.append(arg)
    return rest, guide


def given_keys(overrides: list[str]) -> dict[str, str]:
    """The config keys a command line's ``KEY=VALUE`` overrides set, with their raw values."""
    return dict(arg.split("=", 1) for arg in overrides if not arg.startswith("-") and "=" in arg)


def guide_value(flag: str, raw: str, kind: type) -> Any:
    """A guide flag's value as ``kind`` (YAML-parsed as overrides are), or a ConfigError naming the flag."""
    value = yaml.safe_load(raw)
    try:
        return msgspec.convert(value, kind, strict=False)
    except msgspec.ValidationError:
        raise ConfigError(
            f"--{flag}: expected {'an int' if kind is int else 'a ' + kind.__name__}, got {raw!r}"
        ) from None


def apply_guide(
    config: AgentRLDemoConfig, guide: Mapping[str, str], given: Mapping[str, str], flagged: Collection[str] = ()
) -> tuple[AgentRLDemoConfig, list[str]]:
    """``config`` with AgentRL's guide flags (``guide``: ``GUIDE_ONLY``'s raw values) mapped onto it, and the
    mapping as lines, one per guide flag given (``guide``'s, and those of ``GUIDE_NATIVE`` the command line wrote as
    ``--KEY``, ``flagged``; ``given``: every key the overrides set, with its raw value), in the order of the guide's
    example (``GUIDE_ORDER``): ``--learning_rate 1e-6 -> lr=1e-06 ...``.

    Raises:
        ConfigError: a value of the wrong type or out of range, a MongoDB connection string (naming the supported
            backends), ``inf_tp_size`` / ``inf_ep_size`` above 1 (naming engines that would serve so), or a batch
            of rows that does not split into whole groups of ``num_generations``.
    """
    changes: dict[str, Any] = {}
    lines: dict[str, str] = {}
    if "learning_rate" in guide:
        changes["lr"] = guide_value("learning_rate", guide["learning_rate"], float)
        lines["learning_rate"] = (
            f"lr={changes['lr']!r} (GRPO's AdamW, warmed up over lr_warmup_steps={config.lr_warmup_steps})"
        )
    changes.update(batch_mapping(config, guide, lines))
    if "save_steps" in guide:
        changes["checkpoint_every"] = guide_value("save_steps", guide["save_steps"], int)
        lines["save_steps"] = (
            f"checkpoint_every={changes['checkpoint_every']} (output_dir/checkpoint.pt; one at the end too)"
        )
    if "db_connection_string" in guide:
        db = guide_value("db_connection_string", guide["db_connection_string"], str)
        try:
            parse_connection_string(db)
        except MalformedConnectionString as exc:
            raise ConfigError(f"--{exc}") from None
        changes["db"] = db
        lines["db_connection_string"] = f"db={redact(db)} (the ledger: tasks, claims, records)"
    lines.update(inference_mapping(guide))
    if config.model_name_or_path is not None and "sft_target" not in given:
        changes["sft_target"] = 0.0  # a pretrained model: no warm-up unless asked for
    try:
        config = dataclasses.replace(config, **changes)
    except ConfigError as exc:
        flags = {
            "lr": "learning_rate",
            "checkpoint_every": "save_steps",
            "prompts_per_step": "per_device_train_batch_size",
        }
        named = [f"--{flag}" for key, flag in flags.items() if key in changes and str(exc).startswith(key)]
        raise ConfigError(f"{' '.join(named)}: {exc}" if named else str(exc)) from None
    lines.update(native_lines(config, [key for key in given if key in flagged]))
    raw = {**guide, **given}
    return config, [f"--{flag} {raw[flag]} -> {lines[flag]}" for flag in GUIDE_ORDER if flag in lines and flag in raw]


def batch_mapping(config: AgentRLDemoConfig, guide: Mapping[str, str], lines: dict[str, str]) -> dict[str, Any]:
    """``per_device_train_batch_size`` x ``gradient_accumulation_steps`` x trainer processes (1: the demo trains in
    this one) = rows per optimizer step = ``prompts_per_step`` x ``num_generations``."""
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps")
    if not any(key in guide for key in keys):
        return {}
    per_device, accumulation = (guide_value(key, guide.get(key, "1"), int) for key in keys)
    for key, value in zip(keys, (per_device, accumulation), strict=True):
        if value < 1:
            raise ConfigError(f"--{key}: expected an int >= 1, got {value}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise ConfigError(
            f"WORLD_SIZE: expected 1 (the demo trains in one process: run it with python, or torchrun "
            f"--nproc_per_node 1), got {world}"
        )
    rows, n = per_device * accumulation * world, config.num_generations
    if rows % n:
        raise ConfigError(
            f"--per_device_train_batch_size {per_device} x --gradient_accumulation_steps {accumulation} x {world} "
            f"trainer process = {rows} rows per optimizer step, which do not split into whole GRPO groups of "
            f"num_generations={n}: expected a multiple of {n} (e.g. --gradient_accumulation_steps "
            f"{n // math.gcd(n, per_device)})"
        )
    prompts = rows // n
    step = f"{per_device} x {accumulation} x {world} trainer process = {rows} rows per optimizer step"
    lines["per_device_train_batch_size"] = (
        f"prompts_per_step={prompts} ({step} = {prompts} group{'s' * (prompts != 1)} of num_generations={n})"
    )
    lines["gradient_accumulation_steps"] = (
        f"prompts_per_step={prompts} (with per_device_train_batch_size; one optimizer step per {rows} rows, "
        f"taken in one forward and backward)"
    )
    return {"prompts_per_step": prompts}


def inference_mapping(guide: Mapping[str, str]) -> dict[str, str]:
    """The guide's sizing of its inference services, checked against the demo's engine (HFEngine, in this process,
    on one device): sizes of 1 and a memory ratio in (0, 1] are accepted and said; anything else is refused."""
    lines = {}
    for flag, what in (("inf_tp_size", "tensor"), ("inf_ep_size", "expert")):
        if flag in guide:
            size = guide_value(flag, guide[flag], int)
            if size != 1:
                raise ConfigError(
                    f"--{flag}: expected 1 (the demo's engine, HFEngine, serves the policy in this process on one "
                    f"device: no {what} parallelism), got {size}; {what}-parallel serving is {PARALLEL_ENGINES}"
                )
            lines[flag] = f"accepted: the hf engine serves the policy on one device ({what} parallel size 1)"
    if "inf_mem_ratio" in guide:
        ratio = guide_value("inf_mem_ratio", guide["inf_mem_ratio"], float)
        if not 0 < ratio <= 1:
            raise ConfigError(f"--inf_mem_ratio: expected a float in (0, 1] (a fraction of device memory), got {ratio}")
        lines["inf_mem_ratio"] = (
            "accepted, not used: the hf engine does not pre-allocate a KV-cache pool, so there is no memory to size "
            "(vLLM's gpu_memory_utilization, SGLang's --mem-fraction-static)"
        )
    return lines


def native_lines(config: AgentRLDemoConfig, given: Collection[str]) -> dict[str, str]:
    """The mapping's lines of the guide's flags that are the demo's own keys (``GUIDE_NATIVE``) given."""
    warm_up = (
        f"SFT warm-up to sampled accuracy sft_target={config.sft_target}, asked for"
        if config.sft_target > 0
        else "a pretrained model: no SFT warm-up (sft_target=0; set sft_target to warm up)"
    )
    model = (
        "the built-in tiny addition Llama"
        if config.model_name_or_path is None
        else f"the policy of engine and trainer in place of the built-in tiny addition Llama; {warm_up}"
    )
    sampling = (
        "the engine's endpoint, the SamplingScheduler and AdditionSampler write records the trainer learns from"
        if config.enable_sampling
        else "no engine, scheduler or samplers (no SFT warm-up): train from the untrained records in the ledger, "
        "stop when too few are left for a step"
    )
    meaning = {
        "model_name_or_path": f"model_name_or_path={config.model_name_or_path} ({model})",
        "output_dir": f"output_dir={config.output_dir}",
        "num_generations": f"num_generations={config.num_generations} (answers sampled per prompt: the GRPO group)",
        "max_new_tokens": f"max_new_tokens={config.max_new_tokens} (SamplingConfig.max_new_tokens: the longest answer)",
        "loss_calculater": f"loss_calculater={config.loss_calculater} (LedgerTrainingConfig.loss)",
        "enable_sampling": f"enable_sampling={config.enable_sampling} ({sampling})",
    }
    return {key: meaning[key] for key in given if key in meaning}


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


def load_policy(config: AgentRLDemoConfig) -> PolicySetup:
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


def sampling_config(config: AgentRLDemoConfig, out: Path) -> SamplingConfig:
    return SamplingConfig(
        output_dir=str(out),
        db_connection_string=config.db,
        model="adder",
        num_generations=config.num_generations,
        max_new_tokens=config.max_new_tokens,
        max_prompt_tokens=16 if config.model_name_or_path is None else 256,  # a chat template's prompt is longer
        num_epochs=config.steps * config.prompts_per_step // config.num_tasks + 2,
        target_concurrency=config.prompts_per_step,
        max_concurrent_samples_per_process=config.prompts_per_step,
        lease_s=config.lease_s,
        heartbeat_s=max(config.lease_s / 5, 0.2),
    )


def train(config: AgentRLDemoConfig) -> int:
    """The run itself: warm-up (or resume), then GRPO from the ledger's records (or a PromptSource); with
    ``enable_sampling`` false, GRPO from the records the ledger already holds, nothing sampled."""
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(out, config)  # what a resume of this run is checked against
    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    setup = load_policy(config)
    policy = setup.policy
    optimizer = grpo_optimizer(policy, config)
    checkpoint = out / "checkpoint.pt"
    state = torch.load(checkpoint, weights_only=True) if checkpoint.exists() else None
    title = f"GRPO on two-digit addition (AgentRL demo, prompts from {config.prompts_from})"
    record = RunRecord(out, None if state is None else int(state["step"]), title)
    engine = None
    if config.enable_sampling:
        engine = HFEngine(copy.deepcopy(policy), pad_token_id=setup.pad_token_id, eos_token_id=setup.eos_token_id)
    if state is not None:
        policy.load_state_dict(state["policy"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        print(f"resumed from {checkpoint} at step {start}", flush=True)
    else:
        if engine is not None and config.sft_target > 0:
            t0 = time.perf_counter()
            tokens = SFTTokens(setup.chat, setup.pad_token_id, setup.eos_token_id)
            sft_steps, accuracy = warm_up(
                policy,
                engine,
                tokens,
                config.sft_target,
                config.seed,
                record=record.write,
                max_new_tokens=config.max_new_tokens,
            )
            print(f"SFT warm-up: {sft_steps} steps, sampled accuracy {accuracy:.2f}, {time.perf_counter() - t0:.0f} s")
            optimizer = grpo_optimizer(policy, config)
        start = 0
        save_checkpoint(checkpoint, policy, optimizer, start)
    cfg = sampling_config(config, out)
    ledger = shared_ledger(cfg)
    batch_rows = config.prompts_per_step * config.num_generations
    training = LedgerTrainingConfig(
        batch_rows, config.max_trained_count, config.retrained_interval, loss=config.loss_calculater
    )
    if engine is None:
        trainer = LedgerGRPOTrainer(policy, optimizer, None, ledger, PARTITION, training, setup.pad_token_id)
        return train_from_ledger(config, trainer, setup, ledger, record, checkpoint, start)
    engine.update_weights(start, state_dict=policy.state_dict())
    return train_with_sampling(config, setup, engine, optimizer, ledger, cfg, training, record, checkpoint, start)


def train_with_sampling(
    config: AgentRLDemoConfig,
    setup: PolicySetup,
    engine: HFEngine,
    optimizer: torch.optim.Optimizer,
    ledger: Ledger,
    cfg: SamplingConfig,
    training: LedgerTrainingConfig,
    record: RunRecord,
    checkpoint: Path,
    start: int,
) -> int:
    """GRPO on what the samplers (or the prompt-source producer) put into the queue, the engine updated each step."""
    import ray

    import transfer_queue

    policy, out = setup.policy, Path(config.output_dir)
    started_ray = not ray.is_initialized()  # a caller's Ray session (a test's) is used, and left running
    if started_ray:
        init_ray(num_cpus=4, include_dashboard=False, logging_level=logging.ERROR)
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

    api_key = new_api_key()  # the endpoint's, for this run: its samplers send it, the ledger never holds it
    app = create_app(
        BatchingSampler(locked_generate), setup.chat, model="adder", max_tokens=config.max_new_tokens, api_key=api_key
    )
    sink = QueueSink(client, PARTITION)
    trainer = LedgerGRPOTrainer(policy, optimizer, client, ledger, PARTITION, training, pad_token_id=setup.pad_token_id)
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
        problems = [
            {**p, "prompt_ids": setup.prompt_ids(p["prompt"])} for p in make_prompts(config.num_tasks, config.seed)
        ]
        source = PromptSource(problems, seed=config.seed)
        produce = lambda: prompt_source_producer(  # noqa: E731
            source, engine, engine_lock, sink, setup.chat, config, done, ahead
        )
    rewards: list[float] = []
    with serve_in_background(app) as url:
        service = InferenceService(name="adder-0", url=url + "/v1", model="adder")
        with ServiceRegistration(ledger, service, policy_version=lambda: engine.version):
            sampling = threading.Thread(target=produce, name=f"sampling-{config.prompts_from}", daemon=True)
            sampling.start()
            t0 = time.perf_counter()
            for step in range(start, config.steps):
                warm_up_lr(optimizer, config, step)
                row = trainer.step(step)
                with engine_lock:
                    engine.update_weights(step + 1, state_dict=policy.state_dict())
                end_of_step(config, row, rewards, record, checkpoint, policy, optimizer)
            save_checkpoint(checkpoint, policy, optimizer, config.steps)
            done.set()
            sampling.join(120)
    elapsed = time.perf_counter() - t0
    transfer_queue.shutdown()
    if started_ray:
        ray.shutdown()
    report(config, rewards, elapsed, record)
    print(f"scheduler: {dict(scheduler.stats)}\n")
    print(render_status(ledger))
    ledger.close()  # a normal end leaves ledger.db alone: its -wal and -shm files are checkpointed away
    return 0


def train_from_ledger(
    config: AgentRLDemoConfig,
    trainer: LedgerGRPOTrainer,
    setup: PolicySetup,
    ledger: Ledger,
    record: RunRecord,
    checkpoint: Path,
    start: int,
) -> int:
    """``enable_sampling`` false: GRPO steps on the whole groups of untrained records the ledger holds (their messages
    re-tokenised), until too few are left for a step; no engine, no scheduler, no samplers, no queue."""
    policy, optimizer = setup.policy, trainer.optimizer
    records = {r.id: r for r in ledger.records("train")}
    where = redact(ledger.connection_string)
    print(f"enable_sampling=false: training from the {len(records)} records in {where}", flush=True)
    rewards: list[float] = []
    t0 = time.perf_counter()
    step = start
    while step < config.steps:
        rows = ledger_rows(ledger, records, setup, config, step)
        if rows is None:
            left = len(ledger.trainable("train", step, config.max_trained_count, config.retrained_interval))
            print(
                f"enable_sampling=false: stopping at step {step}: {left} trainable records left, fewer than a step's "
                f"{config.prompts_per_step} whole groups of num_generations={config.num_generations}",
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


def ledger_rows(
    ledger: Ledger, records: Mapping[int | None, Record], setup: PolicySetup, config: AgentRLDemoConfig, step: int
) -> LedgerRows | None:
    """A step's rows out of the ledger: the first ``prompts_per_step`` whole groups (``num_generations`` records of
    one task and epoch) still trainable at ``step``, each record's prompt and answer re-tokenised from its messages
    (the ledger keeps no tokens); None when there are fewer such groups."""
    groups: dict[str, list[DBRecordData]] = {}
    for data in ledger.trainable("train", step, config.max_trained_count, config.retrained_interval):
        if data.record_id in records:  # written before this run started: a finished sample
            groups.setdefault(data.group_id or f"record/{data.record_id}", []).append(data)
    whole = [group for group in groups.values() if len(group) == config.num_generations]
    if len(whole) < config.prompts_per_step:
        return None
    chosen = [(g, data) for g, group in enumerate(whole[: config.prompts_per_step]) for data in group]
    messages = [records[data.record_id].messages for _, data in chosen]
    return LedgerRows(
        record_ids=[data.record_id for _, data in chosen],
        group_ids=[g for g, _ in chosen],
        rewards=torch.tensor([float(data.score or 0.0) for _, data in chosen]),
        policy_versions=torch.tensor([float(data.policy_version) for _, data in chosen]),
        prompts=[setup.chat.prompt_ids(m[:-1]) for m in messages],
        responses=[setup.chat.response_ids(m[-1]["content"]) for m in messages],
    )


def warm_up_lr(optimizer: torch.optim.Optimizer, config: AgentRLDemoConfig, step: int) -> None:
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


def report(config: AgentRLDemoConfig, rewards: list[float], elapsed: float, record: RunRecord) -> None:
    if rewards:
        k = max(1, len(rewards) // 5)
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        source = config.prompts_from if config.enable_sampling else "the ledger's records"
        print(
            f"\nGRPO ({source}): {len(rewards)} steps in {elapsed:.0f} s; "
            f"mean reward first fifth {first:.3f} -> last fifth {last:.3f} ({last - first:+.3f})"
        )
    print(f"plot: {record.finish()}")


if __name__ == "__main__":
    raise SystemExit(main())
