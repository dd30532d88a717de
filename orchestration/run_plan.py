"""What a run does with its ``output_dir``, decided and said before any actor starts.

A directory with a finished or interrupted run in it is resumed, extended, refused or moved aside, never silently
re-used:

- no checkpoint there: a fresh run;
- ``resume`` (the default) and a checkpoint at step ``S``: the run goes on from ``S`` to ``steps`` when
  ``steps > S`` and every setting that shapes training is what the run was started with; otherwise the run is
  refused with a message naming the setting (or saying that ``steps`` must grow), and what to do instead;
- ``--new`` (``resume=False``): the old run is moved aside to ``OUTPUT_DIR.prev-N`` and a fresh run starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from orchestration.config import ConfigError, RLConfig, config_to_dict, flatten_dict
from trainers.checkpoint import latest_checkpoint

# Settings a resumed run may change: sizes of the machinery, bookkeeping and how long to go on. Everything else
# shapes the training itself (model, data, optimisation, loss, sampling) and would silently mix two runs.
CHANGEABLE_ON_RESUME = (
    "steps",
    "output_dir",
    "resume",
    "checkpoint_every",
    "checkpoint_keep",
    "checkpoint_queue",
    "eval_every",
    "log_every",
    "queue_timeout",
    "num_storage_units",
    "queue_replicas",
    "queue_journal",
    "rollout.num_workers",
    "rollout.num_reward_workers",
    "rollout.groups_per_request",
    "rollout.reward_groups_per_request",
    "rollout.engine_device",
    "train.num_gpus_per_rank",
    "train.micro_batch_size",
    "train.dynamic_batching",  # the same update, packed differently (trainers/fsdp.py: FSDPPolicy)
    "train.max_tokens_per_micro_batch",
    "train.loss_seq_chunk_size",  # the same log-probs and gradients, computed in chunks
    "train.activation_offloading",  # the same gradients, activations kept in host memory
    "sft.",  # a resumed run does not warm up again
    "init_from",
)


@dataclass(frozen=True)
class RunPlan:
    """``kind`` is "fresh", "resume" or "new" (an old run moved aside to ``moved_to``); ``message`` says it."""

    kind: str
    start_step: int
    message: str
    moved_to: Path | None = None


def plan_run(config: RLConfig) -> RunPlan:
    """Decide (and for ``--new`` carry out: move the old run aside) what this run does with its output_dir.

    Raises:
        ConfigError: a resume that would train nothing (``steps`` not above the checkpoint's step) or that changes
            a setting which cannot apply on resume; the message names it and the way out.
    """
    out = config.output_path
    latest = latest_checkpoint(out / "checkpoints")
    if latest is None:
        return RunPlan("fresh", 0, f"starting a new run in {out}")
    done = int(json.loads((latest / "checkpoint.json").read_text())["extra_state"].get("step", 0))
    if not config.resume:
        moved = move_aside(out)
        return RunPlan(
            "new", 0, f"--new: moved the previous run ({done} steps) to {moved}; starting over in {out}", moved
        )
    refuse_changed_settings(out, config, CHANGEABLE_ON_RESUME)
    if config.steps <= done:
        raise ConfigError(
            f"{out} holds a run that already finished {done} steps; steps={config.steps} would train nothing. "
            f"Pass steps={done + max(done, 1)} (any value > {done}) to extend it, --new to start over here, "
            f"or a new output_dir"
        )
    return RunPlan("resume", done, f"resuming {out} from its checkpoint at step {done}, on to step {config.steps}")


def save_config(out: Path, config: Any) -> Path:
    """Write ``config`` (a config dataclass) to ``out/config.yaml``: the settings a resume of this run is checked
    against (:func:`refuse_changed_settings`)."""
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    return path


def refuse_changed_settings(out: Path, config: Any, changeable: tuple[str, ...]) -> None:
    """Refuse a resume of the run in ``out`` with other training settings than it was started with (its
    ``config.yaml``; a run that has none is not checked). ``changeable``: dotted keys (or prefixes ending in ".")
    a resume may change.

    Raises:
        ConfigError: naming every changed setting (old -> new) and the way out.
    """
    saved_path = out / "config.yaml"
    if not saved_path.exists():
        return
    saved = yaml.safe_load(saved_path.read_text()) or {}
    changed = changed_settings(saved, config_to_dict(config), config_to_dict(type(config)()), changeable)
    if changed:
        listed = ", ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changed)
        raise ConfigError(
            f"{out} holds a run started with other settings ({listed}), which cannot apply on resume; "
            f"start over with --new, or pick a new output_dir"
        )


def changed_settings(
    saved: dict[str, Any],
    current: dict[str, Any],
    defaults: dict[str, Any] | None = None,
    changeable: tuple[str, ...] = CHANGEABLE_ON_RESUME,
) -> list[tuple[str, Any, Any]]:
    """``(dotted key, saved value, current value)`` for every setting that differs and may not change on resume
    (``changeable``). A key the saved config lacks (added since that run started, or left at its default) counts as
    its default (``defaults``: the config class's, as nested dicts; RLConfig's by default), which that run ran with."""
    flat_defaults = flatten_dict(defaults if defaults is not None else config_to_dict(RLConfig()))
    old, new = {**flat_defaults, **flatten_dict(saved)}, {**flat_defaults, **flatten_dict(current)}
    return [
        (key, old.get(key), new.get(key))
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key) and not key.startswith(changeable)
    ]


def move_aside(out: Path) -> Path:
    """Rename the directory ``out`` to the first free ``OUT.prev-N`` (N = 1, 2, ...) and return that path: what
    ``--new`` does with a previous run, in every recipe."""
    moved = _free_name(out)
    out.rename(moved)
    return moved


def _free_name(out: Path) -> Path:
    n = 1
    while out.with_name(f"{out.name}.prev-{n}").exists():
        n += 1
    return out.with_name(f"{out.name}.prev-{n}")
