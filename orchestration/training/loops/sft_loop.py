"""run_sft_training: supervised fine-tuning over a list of samples with any ``TrainingBackend``.

Step ``k`` (1-based) trains on samples ``(k - 1) * batch_size`` to ``k * batch_size - 1``, taken modulo the number
of samples (a deterministic cycle, no shuffling: shuffle the list first if you want). The next step's batch is built
while the backend runs the current ``forward_backward``.

>>> rows = await run_sft_training(backend, samples, SFTTrainingConfig(num_steps=100, batch_size=4))  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from orchestration.training.backends.base import TrainingBackend
from orchestration.training.batches import samples_to_batch
from orchestration.training.types import LibraryError, Sample, SFTTrainingConfig


class MetricsLogger(Protocol):
    """Anything with ``log(metrics, step)`` (e.g. ``JSONLLogger``)."""

    def log(self, metrics: dict[str, Any], step: int) -> None: ...


async def run_sft_training(
    backend: TrainingBackend,
    samples: Sequence[Sample],
    config: SFTTrainingConfig,
    metrics_logger: MetricsLogger | None = None,
    *,
    pad_token_id: int = 0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Take ``config.num_steps`` optimizer steps of ``config.batch_size`` samples each.

    Every ``log_every`` steps (and at the last) the step's row goes to ``metrics_logger.log(row, step)``; a
    checkpoint is saved every ``checkpoint_every`` steps (0: never) and after the last step.

    Args:
        backend: the training backend (``forward_backward``, ``optim_step``, ``save_checkpoint``).
        samples: the training samples (at least one).
        config: steps, batch size, logging and checkpoint periods.
        metrics_logger: receives the logged rows (optional).
        pad_token_id: padding id of the batches.
        progress: show a tqdm progress bar (on stderr) with the latest loss.

    Returns:
        One row per step: ``step``, ``loss``, ``num_tokens``, ``grad_norm``, ``lr``, ``seconds`` (and what the
        backend's loss reports); the checkpoint rows carry ``checkpoint`` (its path).

    Raises:
        LibraryError: on no samples, or a backend missing a method of the protocol.
    """
    if not samples:
        raise LibraryError("run_sft_training needs at least one sample, got none")
    missing = [name for name in ("forward_backward", "optim_step", "save_checkpoint") if not hasattr(backend, name)]
    if missing:
        raise LibraryError(f"backend {type(backend).__name__} lacks {missing} of the TrainingBackend protocol")

    def batch_of(step: int) -> dict[str, Any]:
        start = (step - 1) * config.batch_size
        chosen = [samples[(start + i) % len(samples)] for i in range(config.batch_size)]
        return samples_to_batch(chosen, pad_token_id=pad_token_id)

    bar = _progress_bar(config.num_steps, progress)
    rows: list[dict[str, Any]] = []
    batch = batch_of(1)
    try:
        for step in range(1, config.num_steps + 1):
            t0 = time.perf_counter()
            pending = backend.forward_backward(batch)
            if step < config.num_steps:
                batch = batch_of(step + 1)  # built while the backward pass runs
            fwd = await pending.result()
            opt = await backend.optim_step().result()
            row: dict[str, Any] = {**fwd, **opt, "step": step, "seconds": time.perf_counter() - t0}
            last = step == config.num_steps
            if last or (config.checkpoint_every > 0 and step % config.checkpoint_every == 0):
                row["checkpoint"] = str(await backend.save_checkpoint(step, fwd))
            if metrics_logger is not None and (last or step % config.log_every == 0):
                metrics_logger.log(row, step=step)
            rows.append(row)
            if bar is not None:
                bar.set_postfix(loss=f"{row['loss']:.4f}", refresh=False)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return rows


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="sft", unit="step", leave=False)
