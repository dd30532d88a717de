"""Accuracy of SmolLM2-135M-Instruct on arithmetic tasks: the prepared model, or a GRPO run's checkpoint.

For each task setting: greedy accuracy and sampled mean reward (temperature 1, ``--samples`` per prompt) on the
eval prompts (the ones a run's ``eval_every`` scores, for the same ``--prompts``), and a few example responses.
Before training it picks a difficulty GRPO can move (well below 1, not near 0); after, it shows what was learnt.

``python recipe/smollm2/evaluate.py [--only "add 0-9"] [--checkpoint outputs/smollm2/checkpoints/step_00000040]
[--prompts 32] [--samples 4] [--max-new-tokens 8] [--threads 2]`` (one process, no Ray)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable from a checkout without installing

from workers.engines.base import SamplingParams
from workers.engines.hf import HFEngine
from workers.tasks.arithmetic import ArithmeticTask

SETTINGS: dict[str, dict[str, Any]] = {
    "add 0-9": {"operators": "+", "max_operand": 9},
    "add 10-99": {"operators": "+", "min_operand": 10, "max_operand": 99},
    "sub 0-9": {"operators": "-", "max_operand": 9},
    "mul 0-9": {"operators": "*", "max_operand": 9},
    "mul 2-12": {"operators": "*", "min_operand": 2, "max_operand": 12},
}


def load_model_weights(model: torch.nn.Module, checkpoint: str) -> None:
    """Load the model weights of a ``trainers/checkpoint.py`` checkpoint (saved by any number of ranks)."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "no process group: assuming a single process", which is the intent here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=Path(checkpoint) / "dcp")  # in place
    model.load_state_dict(state["model"])


def score(task: ArithmeticTask, engine: HFEngine, prompts: list[dict], n: int, params: SamplingParams) -> tuple:
    generations = engine.generate([p["prompt_ids"] for p in prompts], n, params)
    texts = [[task.decode(g.token_ids) for g in group] for group in generations]
    rewards = [task.reward(t, answer=p["answer"]) for group, p in zip(texts, prompts, strict=True) for t in group]
    return sum(rewards) / len(rewards), texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help=f"a subset of {list(SETTINGS)}")
    parser.add_argument("--checkpoint", default=None, help="a run's checkpoint directory (default: the prepared model)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    engine = None
    for name, kwargs in SETTINGS.items():
        if args.only and name not in args.only:
            continue
        task = ArithmeticTask(**kwargs)
        if engine is None:
            tok = task.tokenizer
            model = task.build_policy()
            if args.checkpoint:
                load_model_weights(model, args.checkpoint)
            engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        prompts = task.prompts("eval", args.prompts, seed=1)
        t0 = time.perf_counter()
        greedy, greedy_texts = score(task, engine, prompts, 1, SamplingParams(args.max_new_tokens, temperature=0.0))
        sampled, texts = score(task, engine, prompts, args.samples, SamplingParams(args.max_new_tokens, seed=0))
        print(f"{name:10s} greedy {greedy:.3f}  sampled {sampled:.3f}  ({time.perf_counter() - t0:.1f} s)")
        for p, g, group in list(zip(prompts, greedy_texts, texts, strict=True))[:3]:
            print(f"    {p['question'][8:-30]:>8} = {p['answer']:>4}: greedy {g[0]!r}; sampled {group}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
