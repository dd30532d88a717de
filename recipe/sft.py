"""Supervised fine-tuning only: the first half of the SFT -> RL pipeline.

    python recipe/sft.py output_dir=outputs/sft                     # SFT until greedy accuracy >= target
    python recipe/demo.py sft.enabled=false \\
        init_from=outputs/sft/checkpoints/step_00000000            # GRPO from those weights

Both halves use the same trainer ranks and the same checkpoint format (model + optimizer + RNG, sharded with DCP).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

from orchestration import GRPORun, connect_ray
from recipe.demo import DEFAULT_CONFIG
from trainers.config import load_config, parse_overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (its sft section is used)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.target_accuracy=0.5")
    args = parser.parse_args(argv)
    config = load_config(args.config, {"output_dir": "outputs/sft", **parse_overrides(args.overrides)})
    connect_ray()
    run = GRPORun(config)
    try:
        path = run.run_sft()
    finally:
        run.shutdown()
    print(f"plot: {config.output_path / 'metrics.png'}")
    print(f"SFT checkpoint: {path}\nstart RL from it with: python recipe/demo.py sft.enabled=false init_from={path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
