"""The main job: GRPO teaches a tiny Llama two-digit addition, on a local Ray cluster, on CPU.

    1. start the queue, 1 rollout worker (+ engine), 1 reward worker, 2 FSDP2 trainer ranks (gloo)
    2. SFT warm-up until one sampled answer per held-out problem is right sft.target_accuracy of the time (0.7)
    3. GRPO: 32 prompts x 8 samples per step; reward 1 for the exact sum
    4. metrics.jsonl + metrics.png under outputs/demo; the mean reward rises over the run

Run it with ``make demo`` (or ``python recipe/demo.py [--config FILE] [--new] [--print-config] [key=value ...]``;
``--help`` lists every key). Run again into the same output_dir, it resumes: a larger ``steps`` extends the run, a
changed training setting is refused (``--new`` starts over). Or submit it to a running
cluster: ``RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- python
recipe/demo.py`` (see docs/rl.md).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

from orchestration.config import ConfigError, config_from_cli
from orchestration.run_plan import plan_run

if TYPE_CHECKING:
    from orchestration import GRPORun

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "demo.yaml"


def grpo(run: GRPORun) -> list[dict[str, Any]]:
    """The loop (``GRPORun.run`` is the same): every stage streams through the queue, so in async mode
    (``max_staleness`` > 0) the next steps generate while this one trains."""
    run.begin()  # resume from the latest checkpoint | init_from | SFT warm-up, then checkpoint 0
    for step in run.steps():  # a progress line; after the last step a checkpoint and the plot
        run.generate(step)  # prompts x n_samples into the queue: rollout workers generate, reward workers score
        train = run.train(step)  # the FSDP2 ranks read the step's scored groups and take one optimizer step
        sync_s = run.sync_weights(step, train)  # every sync_every versions, the engines get the new weights
        row = run.end_step(step, train, sync_s)  # the step's rows cleared from the queue; its metrics
        if run.eval_due(step):
            row["eval_accuracy"] = run.evaluate()  # greedy accuracy on the held-out problems
        run.log(row)  # metrics.jsonl, the plot, checkpoints every checkpoint_every steps
    return run.rows


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_cli(__doc__ or "", DEFAULT_CONFIG, argv)
        plan = plan_run(config)
    except ConfigError as exc:
        print(f"demo.py: error: {exc}", file=sys.stderr)
        return 2
    print(plan.message, flush=True)
    from orchestration import train_from_command_line  # here: a refused run never loads Ray and the workers

    return train_from_command_line(config, loop=grpo)  # Ray, the run's actors; Ctrl-C/SIGTERM: one line, 130/143


if __name__ == "__main__":
    raise SystemExit(main())
