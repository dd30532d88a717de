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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

from orchestration.config import ConfigError, config_from_cli
from orchestration.run_plan import plan_run

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "demo.yaml"


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_cli(__doc__ or "", DEFAULT_CONFIG, argv)
        plan = plan_run(config)
    except ConfigError as exc:
        print(f"demo.py: error: {exc}", file=sys.stderr)
        return 2
    print(plan.message, flush=True)
    from orchestration import train_from_command_line  # here: a refused run never loads Ray and the workers

    return train_from_command_line(config)


if __name__ == "__main__":
    raise SystemExit(main())
