"""run_rl_training: GRPO over any ``TrainingBackend``, with rollouts from an ``AsyncRolloutManager`` and weights synced
to the engines every ``sync_every`` steps.

One step: ``batch = await rollout_manager.generate_batch()`` (whole groups, rewards set, filtered), advantages
(GRPO's group-normalised ones for groups of more than one sample, else ``reward - baseline``:
``compute_advantages``), ``forward_backward`` then ``optim_step``. Every ``sync_every`` steps (and after the last) the
backend saves a checkpoint and ``sync_weights_to_engines`` loads it into every engine; an engine that fails or hangs
is reported in the step's row (``sync_failed``) while the others go on, and a sync that reaches no engine at all stops
the run (the rollouts would go on from weights that never move). Each checkpoint directory also holds
``rollout_state.json`` (the prompt buffer's position and the groups carried to the next batch), so
``run_rl_training(..., resume_from=path)`` goes on from it without skipping or repeating a prompt.

>>> rows = await run_rl_training(backend, buffer, manager, engines, RLTrainingConfig(num_steps=100))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestration.training.advantages import compute_advantages, compute_group_advantages
from orchestration.training.backends.base import TrainingBackend
from orchestration.training.batches import samples_to_batch
from orchestration.training.loops.sft_loop import MetricsLogger, _progress_bar
from orchestration.training.types import LibraryError, RLTrainingConfig, RolloutBatch
from orchestration.training.weight_sync import sync_weights_to_engines

__all__ = ["compute_advantages", "run_rl_training"]

logger = logging.getLogger(__name__)
ROLLOUT_STATE = "rollout_state.json"


async def run_rl_training(
    backend: TrainingBackend,
    buffer: Any,
    rollout_manager: Any,
    engines: Sequence[Any],
    config: RLTrainingConfig,
    metrics_logger: MetricsLogger | None = None,
    *,
    pad_token_id: int = 0,
    resume_from: str | Path | None = None,
    sync_timeout: float = 300.0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Train ``config.num_steps`` GRPO steps; returns one metric row per step run.

    Args:
        backend: the training backend.
        buffer: the prompt buffer the manager draws from (``save_state`` / ``load_state``).
        rollout_manager: ``generate_batch()`` returning a ``RolloutBatch`` of whole groups (``AsyncRolloutManager``);
            its ``state()`` / ``load_state()`` are saved with each checkpoint when it has them.
        engines: objects with ``update_weights_from_checkpoint(path)`` (may be empty: a ``generate_fn`` sampling
            from the backend's own model needs no sync).
        config: steps, sync and checkpoint periods, advantage baseline, logging period.
        metrics_logger: receives every ``log_every``-th row (and the last) as ``log(row, step)``.
        pad_token_id: padding id of the training batches.
        resume_from: a checkpoint directory this function wrote: the backend, the buffer and the manager go on
            from it (its step is the last one done).
        sync_timeout: seconds one engine may take to load a checkpoint.
        progress: a tqdm progress bar with the latest reward.

    Raises:
        LibraryError: a backend missing a method of the protocol, a manager without ``generate_batch``, a batch
            without rewards, a checkpoint without its rollout state, or a weight sync that reached no engine.
    """
    missing = [name for name in ("forward_backward", "optim_step", "save_checkpoint") if not hasattr(backend, name)]
    if missing:
        raise LibraryError(f"backend {type(backend).__name__} lacks {missing} of the TrainingBackend protocol")
    if not callable(getattr(rollout_manager, "generate_batch", None)):
        raise LibraryError(f"rollout_manager needs an async generate_batch(), got {type(rollout_manager).__name__}")
    first = 1
    if resume_from is not None:
        first = await _resume(backend, buffer, rollout_manager, Path(resume_from)) + 1
    rows: list[dict[str, Any]] = []
    bar = _progress_bar(config.num_steps - first + 1, progress)
    try:
        for step in range(first, config.num_steps + 1):
            row = await _step(backend, rollout_manager, config, step, pad_token_id)
            last = step == config.num_steps
            synced = None
            if engines and (last or step % config.sync_every == 0):
                synced = await backend.save_checkpoint(step, _scalars(row))
                row.update(await _sync(engines, synced, step, sync_timeout))
            if last or (config.checkpoint_every > 0 and step % config.checkpoint_every == 0):
                synced = synced or await backend.save_checkpoint(step, _scalars(row))
                row["checkpoint"] = str(synced)
            if synced is not None:
                _save_rollout_state(Path(synced), buffer, rollout_manager)
            if metrics_logger is not None and (last or step % config.log_every == 0):
                metrics_logger.log(row, step=step)
            rows.append(row)
            if bar is not None:
                bar.set_postfix(reward=f"{row['reward_mean']:.3f}", refresh=False)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return rows


async def _step(
    backend: TrainingBackend, manager: Any, config: RLTrainingConfig, step: int, pad_token_id: int
) -> dict[str, Any]:
    t0 = time.perf_counter()
    batch: RolloutBatch = await manager.generate_batch()
    if not isinstance(batch, RolloutBatch) or len(batch) == 0:
        raise LibraryError(f"generate_batch() must return a non-empty RolloutBatch, got {batch!r:.80}")
    rollout_s = time.perf_counter() - t0
    group = int(batch.metadata.get("group_size", 1))
    if config.group_normalize and group > 1:
        advantages = compute_group_advantages(batch.rewards, group)
    else:
        advantages = compute_advantages(batch.rewards, config.baseline)
    train_batch = samples_to_batch(batch.to_samples(), pad_token_id=pad_token_id, advantages=advantages)
    t1 = time.perf_counter()
    fwd = await backend.forward_backward(train_batch).result()
    opt = await backend.optim_step().result()
    rollout = {k: v for k, v in batch.metadata.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {
        **{f"rollout/{k}": v for k, v in rollout.items()},
        **fwd,
        **opt,
        "step": step,
        "reward_mean": sum(batch.rewards) / len(batch),
        "response_length_mean": sum(batch.response_lengths) / len(batch),
        "rollout_s": rollout_s,
        "train_s": time.perf_counter() - t1,
    }


async def _sync(engines: Sequence[Any], checkpoint: Path, step: int, timeout: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    replies = await sync_weights_to_engines(engines, str(checkpoint), version=step, timeout=timeout)
    failed = [reply for reply in replies if not reply.get("success")]
    if len(failed) == len(replies):
        raise LibraryError(
            f"the weight sync after step {step} reached none of the {len(replies)} engines: "
            f"{[reply.get('error') for reply in failed]}"
        )
    for reply in failed:
        logger.warning(
            "step %d: engine %s did not load the new weights: %s", step, reply.get("engine"), reply.get("error")
        )
    return {"sync_s": time.perf_counter() - t0, "sync_failed": len(failed)}


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}


def _save_rollout_state(checkpoint: Path, buffer: Any, manager: Any) -> None:
    state = {
        "manager": manager.state() if callable(getattr(manager, "state", None)) else None,
        "buffer": buffer.save_state() if callable(getattr(buffer, "save_state", None)) else None,
    }
    tmp = checkpoint / f".{ROLLOUT_STATE}.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(checkpoint / ROLLOUT_STATE)


async def _resume(backend: Any, buffer: Any, manager: Any, path: Path) -> int:
    """Load ``path`` into the backend, the buffer and the manager; returns the step it holds."""
    state_file = path / ROLLOUT_STATE
    if not state_file.is_file():
        raise LibraryError(f"{path} holds no {ROLLOUT_STATE}: resume_from takes a checkpoint run_rl_training wrote")
    metadata = await backend.load_checkpoint(path)
    state = json.loads(state_file.read_text())
    if state["manager"] is not None and callable(getattr(manager, "load_state", None)):
        manager.load_state(state["manager"])  # holds the buffer's state too
    elif state["buffer"] is not None:
        buffer.load_state(state["buffer"])
    return int(metadata["step"])
