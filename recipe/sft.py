"""Supervised fine-tuning only: the first half of the SFT -> RL pipeline.

    python recipe/sft.py output_dir=outputs/sft                     # SFT until greedy accuracy >= target
    python recipe/demo.py sft.enabled=false \\
        init_from=outputs/sft/checkpoints/step_00000000            # GRPO from those weights

Both halves use the same trainer ranks and the same checkpoint format (model + optimizer + RNG, sharded with DCP).
The config is recipe/demo.py's (recipe/configs/demo.yaml, its sft section) with output_dir=outputs/sft:
``python recipe/sft.py [--config FILE] [--new] [--print-config] [key=value ...]``, ``--help`` lists every key. Run
again into the same output_dir, SFT starts over there (its checkpoint is replaced); ``--new`` moves the previous run
aside to OUTPUT_DIR.prev-N first.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

from orchestration.config import ConfigError, config_from_cli
from orchestration.run_plan import plan_run
from recipe.demo import DEFAULT_CONFIG

#: the recipe's own overrides of recipe/configs/demo.yaml (under those of the command line)
PRESET = {"output_dir": "outputs/sft"}


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_cli(__doc__ or "", DEFAULT_CONFIG, argv, preset=PRESET)
    except ConfigError as exc:
        print(f"sft.py: error: {exc}", file=sys.stderr)
        return 2
    if not config.resume:  # --new: the previous run is moved aside (SFT otherwise starts over in place)
        print(plan_run(config).message, flush=True)
    from orchestration import GRPORun, connect_ray  # here: a refused run never loads Ray and the workers
    from orchestration.sft_warm_up import run_sft

    connect_ray()
    with GRPORun(config) as run:  # the queue and the actors, stopped however this ends
        path = run_sft(run)
    print(f"plot: {config.output_path / 'metrics.png'}")
    print(f"SFT checkpoint: {path}\nstart RL from it with: python recipe/demo.py sft.enabled=false init_from={path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
