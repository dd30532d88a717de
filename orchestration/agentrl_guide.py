"""AgentRL's RL-guide flags mapped onto a run's config: the guide writes its arguments as ``--KEY VALUE``
(``--loss_calculater GRPO``) and has flags of its own (``--learning_rate``, ``--per_device_train_batch_size`` x
``--gradient_accumulation_steps``, ``--save_steps``, ``--db_connection_string``, ``--inf_tp_size`` / ``--inf_ep_size`` /
``--inf_mem_ratio``); these functions turn such a command line into ``KEY=VALUE`` overrides and map the guide's own
flags onto the keys of a config dataclass with the fields ``GuideConfig`` names (recipe/agentrl_demo.py's
``AgentRLDemoConfig``), saying each mapping as a line (docs/sampling.md, "The guide's command line").
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import msgspec
import yaml

from orchestration.config import ConfigError
from workers.ledger import MalformedConnectionString, parse_connection_string
from workers.ledger.schema import redact


class GuideConfig(Protocol):
    """The fields of a run's config dataclass the guide's flags map onto or are said with."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    lr_warmup_steps: int
    num_generations: int
    sft_target: float
    model_name_or_path: str | None
    output_dir: str
    max_new_tokens: int
    loss_calculater: str
    enable_sampling: bool
    eval_strategy: str | bool
    eval_steps: int | None
    convert_record_to_data_func: str | None
    inference_engine: str  # hf (in this process), vllm or sglang (an InferenceManager's servers)
    inference_dp_size: int


C = TypeVar("C", bound=GuideConfig)


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
    "eval_strategy",
    "eval_steps",
    "convert_record_to_data_func",
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
    "eval_strategy",
    "eval_steps",
    "convert_record_to_data_func",
)


#: what serves a policy with tensor or expert parallelism (the demo's in-process HFEngine does neither)
PARALLEL_ENGINES = (
    "inference_engine=vllm or sglang: the run's InferenceManager starts inference_dp_size servers (one per DP group) "
    "sized by the guide's inf_tp_size / inf_ep_size / inf_mem_ratio and registers them in the ledger "
    "(workers/engines/manager.py; docs/sampling.md)"
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
    config: C, guide: Mapping[str, str], given: Mapping[str, str], flagged: Collection[str] = ()
) -> tuple[C, list[str]]:
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
    changes.update(inference_mapping(config, guide, lines))
    if config.model_name_or_path is not None and "sft_target" not in given:
        changes["sft_target"] = 0.0  # a pretrained model: no warm-up unless asked for
    try:
        config = dataclasses.replace(config, **changes)
    except ConfigError as exc:
        flags = {
            "lr": "learning_rate",
            "checkpoint_every": "save_steps",
            "prompts_per_step": "per_device_train_batch_size",
            "inference_tp_size": "inf_tp_size",
            "inference_ep_size": "inf_ep_size",
            "inference_mem_ratio": "inf_mem_ratio",
        }
        named = [f"--{flag}" for key, flag in flags.items() if key in changes and str(exc).startswith(key)]
        raise ConfigError(f"{' '.join(named)}: {exc}" if named else str(exc)) from None
    lines.update(native_lines(config, [key for key in given if key in flagged]))
    raw = {**guide, **given}
    return config, [f"--{flag} {raw[flag]} -> {lines[flag]}" for flag in GUIDE_ORDER if flag in lines and flag in raw]


def batch_mapping(config: GuideConfig, guide: Mapping[str, str], lines: dict[str, str]) -> dict[str, Any]:
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


def inference_mapping(config: GuideConfig, guide: Mapping[str, str], lines: dict[str, str]) -> dict[str, Any]:
    """The guide's sizing of its inference services (``--inf_tp_size`` / ``--inf_ep_size`` / ``--inf_mem_ratio``),
    said in ``lines``; the config's changes. With ``inference_engine=hf`` (HFEngine, in this process, on one device)
    sizes of 1 and a memory ratio in (0, 1] are accepted and said, anything else is refused naming what honours it;
    with ``vllm`` / ``sglang`` they become ``inference_tp_size`` / ``inference_ep_size`` / ``inference_mem_ratio``, the
    sizing of each of the ``inference_dp_size`` servers the run's ``InferenceManager`` starts (the config refuses what
    the engine cannot honour)."""
    engine = config.inference_engine
    servers = (
        f"each of the inference_dp_size={config.inference_dp_size} {engine} servers the run's InferenceManager starts"
    )
    changes: dict[str, Any] = {}
    for flag, what in (("inf_tp_size", "tensor"), ("inf_ep_size", "expert")):
        if flag in guide:
            size = guide_value(flag, guide[flag], int)
            if engine != "hf":
                changes[f"inference_{flag[4:]}"] = size
                lines[flag] = f"inference_{flag[4:]}={size} ({what} parallel size of {servers})"
                continue
            if size != 1:
                raise ConfigError(
                    f"--{flag}: expected 1 (the demo's engine, HFEngine, serves the policy in this process on one "
                    f"device: no {what} parallelism), got {size}; {what}-parallel serving is {PARALLEL_ENGINES}"
                )
            lines[flag] = (
                f"accepted: the hf engine serves the policy on one device ({what} parallel size 1; larger sizes need "
                "engine vllm or sglang through an InferenceManager)"
            )
    if "inf_mem_ratio" in guide:
        ratio = guide_value("inf_mem_ratio", guide["inf_mem_ratio"], float)
        if not 0 < ratio <= 1:
            raise ConfigError(f"--inf_mem_ratio: expected a float in (0, 1] (a fraction of device memory), got {ratio}")
        if engine != "hf":
            flag = "--gpu-memory-utilization" if engine == "vllm" else "--mem-fraction-static"
            changes["inference_mem_ratio"] = ratio
            lines["inf_mem_ratio"] = f"inference_mem_ratio={ratio} ({servers}: {flag} {ratio})"
        else:
            lines["inf_mem_ratio"] = (
                "accepted, not used: the hf engine does not pre-allocate a KV-cache pool, so there is no memory to "
                "size (an InferenceManager passes it to vLLM as --gpu-memory-utilization, to SGLang as "
                "--mem-fraction-static)"
            )
    return changes


def native_lines(config: GuideConfig, given: Collection[str]) -> dict[str, str]:
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
    evaluation = {
        "no": "no evaluation sampling",
        "steps": f"every eval_steps={config.eval_steps} GRPO steps",
        "epoch": "at each epoch end of the training tasks (num_tasks prompts trained)",
    }.get(str(config.eval_strategy), "")
    meaning = {
        "eval_strategy": f"eval_strategy={config.eval_strategy} ({evaluation}; held-out tasks sampled through the "
        "ledger's split eval, never trained; eval rows in metrics.jsonl)",
        "eval_steps": f"eval_steps={config.eval_steps} (GRPO steps between evaluations)",
        "model_name_or_path": f"model_name_or_path={config.model_name_or_path} ({model})",
        "output_dir": f"output_dir={config.output_dir}",
        "num_generations": f"num_generations={config.num_generations} (answers sampled per prompt: the GRPO group)",
        "max_new_tokens": f"max_new_tokens={config.max_new_tokens} (SamplingConfig.max_new_tokens: the longest answer)",
        "loss_calculater": f"loss_calculater={config.loss_calculater} (LedgerTrainingConfig.loss)",
        "enable_sampling": f"enable_sampling={config.enable_sampling} ({sampling})",
        "convert_record_to_data_func": f"convert_record_to_data_func={config.convert_record_to_data_func} (each "
        "ledger Record -> {prompt_ids, response_ids} the trainer learns from, None skips it and its group)",
    }
    return {key: meaning[key] for key in given if key in meaning}
