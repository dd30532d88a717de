"""The SFT warm-up of an RL run: supervised steps on the trainer ranks until the engines' accuracy on the eval prompts
reaches ``sft.target_accuracy`` (or ``sft.max_steps``), before GRPO (``sft.enabled``, orchestration/run_resume.py's
``Start.SFT``) or alone (recipe/sft.py: :func:`run_sft`, a starting point for RL with ``init_from``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from tqdm import tqdm

from orchestration.config import SFTConfig
from orchestration.metrics import MetricsLog, plot_metrics

if TYPE_CHECKING:
    from orchestration.grpo_run import GRPORun

logger = logging.getLogger(__name__)


def sft_warm_up(
    cfg: SFTConfig,
    trainer: list[Any],
    publish: Callable[[int], float],
    evaluate: Callable[[bool, int], float],
    metrics: MetricsLog,
) -> float:
    """Supervised warm-up until accuracy reaches the target (or ``max_steps``); returns the accuracy.

    Every ``eval_every`` steps the trainer's weights go to the engines (``publish(0)``: the warm-up's version is 0)
    and ``evaluate(sampled, samples)`` measures them; each evaluation is a ``sft`` row of ``metrics``. The trainer
    ranks' optimizer is reset at the end: RL starts with its own.

    Stopping on *sampled* accuracy (the default) matters: at temperature 1 a model with 20% greedy accuracy
    samples the right answer only ~8% of the time, and GRPO then needs several times more steps to take off.
    """
    accuracy, done, t0 = 0.0, 0, time.perf_counter()
    with tqdm(total=cfg.max_steps, desc="SFT warm-up", unit="step", dynamic_ncols=True) as bar:
        while done < cfg.max_steps:
            k = min(cfg.eval_every, cfg.max_steps - done)
            stats = ray.get([r.sft_steps.remote(done, k, cfg.lr, cfg.batch_size) for r in trainer])[0]
            done += k
            publish(0)
            accuracy = evaluate(cfg.target_metric == "sampled", cfg.eval_samples)
            metrics.write(
                {"kind": "sft", "step": done, "accuracy": accuracy, **stats, "elapsed_s": time.perf_counter() - t0}
            )
            bar.update(k)
            bar.set_postfix(loss=f"{stats['sft_loss']:.3f}", **{f"{cfg.target_metric}_acc": f"{accuracy:.2f}"})
            if accuracy >= cfg.target_accuracy:
                break
    ray.get([r.reset_optimizer.remote() for r in trainer])
    return accuracy


def run_sft(run: GRPORun) -> Path:
    """Only the supervised warm-up of ``run`` (a fresh ``metrics.jsonl`` and its plot); returns its checkpoint
    (step 0), a starting point for RL (``init_from``)."""
    run.metrics = MetricsLog(run.out / "metrics.jsonl", truncate=True)
    accuracy = run.warm_up()
    logger.info("SFT reached %s accuracy %.3f", run.cfg.sft.target_metric, accuracy)
    plot_metrics(run.out / "metrics.jsonl", run.out / "metrics.png", title=f"SFT warm-up on {run.task_label}")
    return run.save(0)
