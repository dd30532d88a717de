"""AgentRL's flow end to end on CPU: a ``Dataset`` of custom ``Task``s, a custom ``AsyncSampler``, the
``SamplingScheduler`` over a SQLite ledger, and a GRPO trainer learning from the records through the queue.

    1. SFT warm-up of a tiny Llama on two-digit addition until a sampled answer is right 20 % of the time
    2. the policy's engine behind the OpenAI-compatible endpoint, registered as an InferenceService (or, with
       ``inference_engine=vllm`` / ``sglang``, ``inference_dp_size`` servers of an InferenceManager, each registered
       as one, loaded with the new weights after each step and stopped with the run)
    3. SamplingScheduler (a thread): writes AdditionProblem tasks epoch by epoch; AdditionSampler claims one, asks the
       endpoint for num_generations answers, scores them (evaluate_record), records them and queues the group
    4. the trainer (this thread): whole groups from the queue -> records marked trained (never twice) -> GRPO step
       -> new weights into the engine (the policy version samplers record)
    5. metrics.jsonl (the warm-up's ``sft`` rows, a ``grpo`` row per step, an ``eval`` row per evaluation with
       ``eval_strategy``: held-out tasks sampled through the ledger's split eval, never trained) and metrics.png
    6. ``python -m workers.ledger status --db sqlite:///OUTPUT/ledger.db`` at the end

``prompts_from=prompt-source`` is the switch back to the usual GRPO input: prompts drawn from a ``PromptSource``
and sampled from the engine by one producer thread, no ledger (the trainer and the queue are the same).

Run it with ``make agentrl-demo`` (or ``python recipe/agentrl_demo.py [--config FILE] [--new] [--print-config]
[key=value ...]``; ``--help`` lists every key, recipe/configs/agentrl_demo.yaml holds the defaults; ``--key value``,
as AgentRL's guide writes ``--loss_calculater GRPO``, is ``key=value``; the guide's own flags, ``--learning_rate``,
``--per_device_train_batch_size`` x ``--gradient_accumulation_steps``, ``--save_steps``, ``--db_connection_string``,
``--inf_tp_size`` / ``--inf_ep_size`` / ``--inf_mem_ratio``, ``--eval_strategy`` / ``--eval_steps``, map onto
these keys, and the run prints the mapping before it starts: docs/sampling.md, "The guide's command line"). Run again
into the same output_dir, it resumes from its checkpoint: a larger ``steps`` extends the run (a resume that changes a
setting which shapes the training is refused: CHANGEABLE_ON_RESUME lists those it may change), tasks claimed by a killed
run are re-dispatched when their leases run out, and no record is trained twice. ``--new`` starts over (the previous
run is moved aside to OUTPUT_DIR.prev-N, once the config is valid).
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

import torch
import yaml
from torch.utils.data import Dataset

from orchestration.agentrl_guide import (
    apply_guide,
    check_model_dir,
    given_keys,
    guide_flags,
    options_first,
    take_guide_flags,
)
from orchestration.config import ConfigError, Range, Text, check_ranges, config_from_cli, config_to_dict, flatten_dict
from orchestration.ledger_grpo import LedgerGRPOTrainer, LedgerTrainingConfig
from orchestration.ledger_run import (
    RunRecord,
    SFTTokens,
    grpo_optimizer,
    hook_without_records,
    load_policy,
    save_checkpoint,
    train_from_ledger,
    train_with_sampling,
    warm_up,
)
from orchestration.run_plan import move_aside, refuse_changed_settings, save_config
from trainers.losses import loss_named
from workers.engines import HFEngine
from workers.ledger import (
    AsyncSampler,
    InvalidRecordConverter,
    InvalidRecordData,
    MalformedConnectionString,
    Record,
    SamplingConfig,
    Task,
    parse_connection_string,
    register_new_model,
    resolve_convert_record_to_data_func,
    shared_ledger,
)
from workers.tasks.addition import addition_reward, make_prompts

PARTITION = "agentrl"
EVAL_STRATEGIES = ("no", "steps", "epoch")
INFERENCE_ENGINES = ("hf", "vllm", "sglang")  # inference_engine: the in-process HFEngine, or an InferenceManager's
EVAL_SEED = 7_000_000  # the held-out problems' seed offset: apart from the training tasks' (and the warm-up's)
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
    # HF Trainer's (AgentRL's guide: evaluation sampling): no, steps (every eval_steps GRPO steps) or epoch (each
    # num_tasks prompts trained), any case: the num_eval_tasks held-out problems sampled through the ledger (split
    # eval: never queued, never trained) and an eval row (eval_reward, eval_accuracy) in metrics.jsonl
    eval_strategy: str | bool = "no"  # false (YAML's reading of an unquoted no) is no
    eval_steps: int | None = None  # GRPO steps between evaluations (eval_strategy=steps only)
    num_eval_tasks: int = 32  # held-out problems each evaluation samples (seeded apart from the training tasks)
    # AgentRL's hook: "package.module:function" (or "package.module.function") called with each ledger Record,
    # returning {"prompt_ids": [...], "response_ids": [...]} or None to skip the record (and its group), on both paths:
    # enable_sampling=false trains the records the ledger holds through it; with sampling each finished group's records
    # pass through it into the queue (the sampled tokens returned keep their log-probs; other tokens are trained with
    # the policy's own log-probs as the old ones). None: false re-tokenises the messages with the policy's chat
    # format, true trains the sampled tokens as they are
    convert_record_to_data_func: str | None = None
    # what the samplers ask (enable_sampling, prompts_from=scheduler): hf, the policy's HFEngine in this process behind
    # the OpenAI-compatible endpoint; vllm or sglang: inference_dp_size servers (one per DP group) an InferenceManager
    # starts on the policy saved to OUTPUT_DIR/inference_model, registered in the ledger as InferenceServices, loaded
    # with the new weights after each step and stopped with the run (needs model_name_or_path: the servers apply its
    # tokenizer's chat template)
    inference_engine: str = "hf"
    inference_dp_size: int = 1  # vllm / sglang servers, one per DP group (hf: 1, the one in-process engine)
    inference_tp_size: int = 1  # tensor-parallel size of each server (the guide's --inf_tp_size)
    inference_ep_size: int = 1  # expert-parallel size of each server (the guide's --inf_ep_size)
    inference_mem_ratio: float | None = None  # each server's device memory fraction (--inf_mem_ratio); None: default
    # colocated servers (vllm / sglang) release their memory for each training step (once its rows are read) and
    # take it back before the new weights are loaded
    inference_colocate: bool = False

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
        "eval_strategy": Text(pattern=r"(?i)no|steps|epoch", described=f"one of {sorted(EVAL_STRATEGIES)} (any case)"),
        "eval_steps": Range(int, 1, optional=True),
        "num_eval_tasks": Range(int, 1),
        "inference_engine": Text(INFERENCE_ENGINES),
        "inference_dp_size": Range(int, 1),
        "inference_tp_size": Range(int, 1),
        "inference_ep_size": Range(int, 1),
        "inference_mem_ratio": Range(float, 0, 1, low_open=True, optional=True),
    }

    def __post_init__(self) -> None:
        if self.eval_strategy is False:  # eval_strategy=no, as YAML reads an unquoted no
            self.eval_strategy = "no"
        if isinstance(self.eval_strategy, str):
            self.eval_strategy = self.eval_strategy.lower()  # "STEPS", "Epoch": HF Trainer's IntervalStrategy
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
        if self.eval_strategy == "steps" and self.eval_steps is None:
            raise ConfigError("eval_steps: eval_strategy=steps needs eval_steps (an int >= 1), got none")
        if self.eval_strategy != "steps" and self.eval_steps is not None:
            raise ConfigError(
                f"eval_steps: only eval_strategy=steps reads it, got eval_steps={self.eval_steps} with "
                f"eval_strategy={self.eval_strategy}"
            )
        if self.convert_record_to_data_func is not None:
            if self.enable_sampling and self.prompts_from != "scheduler":
                raise hook_without_records(self.prompts_from)
            try:
                resolve_convert_record_to_data_func(self.convert_record_to_data_func)
            except InvalidRecordConverter as exc:
                raise ConfigError(str(exc)) from None
        self.check_inference()
        if self.eval_strategy != "no" and not self.enable_sampling:
            raise ConfigError(
                f"eval_strategy: {self.eval_strategy} samples the eval tasks, but enable_sampling=false starts no "
                f"engine to sample them: expected eval_strategy=no with enable_sampling=false"
            )

    def check_inference(self) -> None:
        """Refuse an ``inference_*`` setting the run cannot honour: server settings with the in-process hf engine,
        servers for a run that asks no server (``enable_sampling=false``, ``prompts_from=prompt-source``) or without
        a model directory (whose tokenizer's chat template the servers apply), or a sizing the engine cannot honour
        (``InferenceManager``'s own refusal)."""
        engine = self.inference_engine
        if engine == "hf":
            given = {
                "inference_dp_size": (self.inference_dp_size, 1),
                "inference_tp_size": (self.inference_tp_size, 1),
                "inference_ep_size": (self.inference_ep_size, 1),
                "inference_mem_ratio": (self.inference_mem_ratio, None),
                "inference_colocate": (self.inference_colocate, False),
            }
            for key, (value, expected) in given.items():
                if value != expected:
                    raise ConfigError(
                        f"{key}: sets the servers of inference_engine=vllm or sglang, but inference_engine=hf serves "
                        f"the policy in this process: expected {key}={expected} with it, got {value}"
                    )
            return
        if not self.enable_sampling:
            raise ConfigError(
                f"inference_engine: {engine} serves the samplers, but enable_sampling=false samples nothing: expected "
                f"inference_engine=hf (the default) with enable_sampling=false"
            )
        if self.prompts_from != "scheduler":
            raise ConfigError(
                f"inference_engine: {engine} servers answer the ledger's samplers, but prompts_from="
                f"{self.prompts_from} samples the in-process engine: expected prompts_from=scheduler with "
                f"inference_engine={engine}"
            )
        if self.model_name_or_path is None:
            raise ConfigError(
                f"inference_engine: {engine} servers apply the tokenizer's chat template to the samplers' messages, "
                f"and the built-in addition tokenizer has none: expected model_name_or_path (a local model directory) "
                f"with inference_engine={engine}"
            )
        from workers.engines.errors import InvalidInferenceSizing
        from workers.engines.manager import sizing_args

        try:
            sizing_args(
                engine,
                tp_size=self.inference_tp_size,
                ep_size=self.inference_ep_size,
                mem_ratio=self.inference_mem_ratio,
            )
        except InvalidInferenceSizing as exc:
            raise ConfigError(f"inference_engine={exc}") from None


# Settings a resumed run may change (everything else shapes the training: a resume that changes it is refused): how
# long to go on, bookkeeping, the leases' length, the SFT warm-up's target (a resumed run does not warm up again) and
# the evaluation (which trains nothing).
CHANGEABLE_ON_RESUME = (
    "steps",
    "output_dir",
    "resume",
    "checkpoint_every",
    "lease_s",
    "sft_target",
    "enable_sampling",
    "eval_strategy",
    "eval_steps",
    "num_eval_tasks",
    "convert_record_to_data_func",  # how records become tokens from now on, as enable_sampling may switch
    # what samples and where (the policy and its weights are the same)
    "inference_engine",
    "inference_dp_size",
    "inference_tp_size",
    "inference_ep_size",
    "inference_mem_ratio",
    "inference_colocate",
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


def held_out_dataset(config: AgentRLDemoConfig) -> AdditionDataset:
    """The evaluation's fixed problems: ``num_eval_tasks`` drawn with their own seed, none of them a training task's
    question (``AdditionDataset(num_tasks, seed)``)."""
    train = {item["prompt"] for item in make_prompts(config.num_tasks, config.seed)}
    dataset = AdditionDataset(config.num_eval_tasks + config.num_tasks, EVAL_SEED + config.seed)
    dataset.items = [item for item in dataset.items if item["prompt"] not in train][: config.num_eval_tasks]
    return dataset


class AdditionSampler(AsyncSampler):
    async def run(self):
        assert isinstance(self.task, AdditionProblem)  # the scheduler hands this sampler the dataset's tasks
        messages = [{"role": "user", "content": self.task.question}]
        completion = await self.create_chat_completions(messages, n=self.config.num_generations)
        await self.record_completion(messages, completion)

    async def evaluate_record(self, record):
        assert isinstance(self.task, AdditionProblem)
        return addition_reward(record.messages[-1]["content"], self.task.answer)


# --- the run -------------------------------------------------------------------------------------------------------
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
    try:
        return train(config)
    except InvalidRecordData as exc:  # the user's hook broke its contract: the run stopped at the first such record
        print(f"agentrl_demo.py: error: {exc}", file=sys.stderr)
        return 2


def train(
    config: AgentRLDemoConfig,
    convert_record_to_data_func: Callable[[Record], Any] | None = None,
    inference_kwargs: Mapping[str, Any] | None = None,
) -> int:
    """The run itself: warm-up (or resume), then GRPO from the ledger's records (or a PromptSource); with
    ``enable_sampling`` false, GRPO from the records the ledger already holds, nothing sampled. Each record is turned
    into tokens by ``convert_record_to_data_func`` (a callable; None: the config's, else the default), on both paths
    (with sampling, on its way into the queue). ``inference_kwargs``: more arguments of the ``InferenceManager`` of
    ``inference_engine`` vllm / sglang (tests: ``server_command``, ``engine_factory``, ``health_interval``).

    Raises:
        InvalidRecordData: the hook returned something other than a record's data or None (the run stops at the first
            such record, with sampling or without).
    """
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
        return train_from_ledger(config, trainer, setup, ledger, record, checkpoint, start, convert_record_to_data_func)
    engine.update_weights(start, state_dict=policy.state_dict())
    dataset = AdditionDataset(config.num_tasks, seed=config.seed)
    return train_with_sampling(
        config,
        setup,
        engine,
        optimizer,
        ledger,
        cfg,
        training,
        record,
        checkpoint,
        start,
        sampler_class=AdditionSampler,
        dataset=dataset,
        partition=PARTITION,
        eval_dataset=None if config.eval_strategy == "no" else held_out_dataset(config),
        convert_record_to_data_func=convert_record_to_data_func,
        inference_kwargs=inference_kwargs,
    )


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
        inf_tp_size=config.inference_tp_size,  # the InferenceManager's sizing (inference_engine vllm / sglang)
        inf_ep_size=config.inference_ep_size,
        inf_mem_ratio=config.inference_mem_ratio,
    )


if __name__ == "__main__":
    raise SystemExit(main())
