"""Idle seconds per training step in async mode, with and without partial rollouts (HF engine, one process).

A rollout thread generates batches without pause (long-tailed response lengths: a random tiny Llama whose eos
ends a response with probability ~1/vocab per token, capped at ``--max-new-tokens``); a trainer thread "trains"
for ``--train-s`` seconds per step, then publishes its weights to the engine and waits until the engine has them
(as ``RLRun.publish`` does with ``weight_sync: memory``). That wait is the trainer's idle time. Without partial
rollouts the engine serves one call at a time (as ``EngineActor``), so the update waits for the generation in
flight; with them (``PartialRollout``) the generation stops at its next decoding step, loads the weights and
resumes its unfinished responses on them.

    python benchmarks/partial_rollout.py [--steps 12] [--train-s 0.3] [--max-new-tokens 256]

Prints one JSON line per mode: idle seconds per step (median, mean, max), rollout tokens/s, resumed responses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from workers.engines.base import SamplingParams
from workers.engines.hf import HFEngine
from workers.engines.partial import PartialRollout
from workers.models import build_tiny_causal_lm

VOCAB, EOS = 64, 2


class SerialEngine:
    """The engine as an actor without partial rollouts: one call at a time in arrival order (a Ray actor's queue),
    so an update waits for the generation in flight, not for later ones."""

    def __init__(self, engine: HFEngine):
        self.engine = engine
        self._turn = threading.Condition()
        self._next_ticket, self._serving = 0, 0

    def _call(self, fn, *args, **kwargs):
        with self._turn:
            ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
            self._turn.wait_for(lambda: self._serving == ticket)
        try:
            return fn(*args, **kwargs)
        finally:
            with self._turn:
                self._serving += 1
                self._turn.notify_all()

    def generate(self, prompts, n, params):
        return self._call(self.engine.generate, prompts, n, params)

    def update_weights(self, version, state_dict=None, path=None):
        self._call(self.engine.update_weights, version, state_dict=state_dict, path=path)


def run(mode: str, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    model = build_tiny_causal_lm(VOCAB, max_position_embeddings=args.max_new_tokens + 16, seed=0)
    hf = HFEngine(model, pad_token_id=0, eos_token_id=EOS)
    engine = PartialRollout(hf) if mode == "partial" else SerialEngine(hf)
    states = [build_tiny_causal_lm(VOCAB, max_position_embeddings=args.max_new_tokens + 16, seed=s).state_dict()
              for s in (1, 2)]  # fmt: skip
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    prompts = [[1, 5 + i % 50, 7] for i in range(args.prompts)]
    stop = threading.Event()
    tokens, batches, mixed = [0], [0], [0]

    def rollout() -> None:
        while not stop.is_set():
            groups = engine.generate(prompts, args.n, params)
            for group in groups:
                for g in group:
                    tokens[0] += len(g.token_ids)
                    if g.versions is not None and len(set(g.versions)) > 1:
                        mixed[0] += 1
            batches[0] += 1

    thread = threading.Thread(target=rollout, daemon=True)
    thread.start()
    time.sleep(args.train_s)  # the rollout gets going
    idle = []
    t_start = time.perf_counter()
    for step in range(args.steps):
        time.sleep(args.train_s)  # the training step (the trainer's CPU time is not simulated)
        t0 = time.perf_counter()
        engine.update_weights(step + 1, state_dict=states[step % 2])
        idle.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - t_start
    stop.set()
    thread.join()
    return {
        "mode": mode,
        "steps": args.steps,
        "train_s": args.train_s,
        "idle_s_per_step_median": round(statistics.median(idle), 4),
        "idle_s_per_step_mean": round(statistics.mean(idle), 4),
        "idle_s_per_step_max": round(max(idle), 4),
        "step_s_mean": round(elapsed / args.steps, 4),
        "rollout_tokens_per_s": round(tokens[0] / elapsed, 1),
        "responses_spanning_versions": mixed[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--train-s", type=float, default=0.3)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    args = parser.parse_args()
    for mode in ("plain", "partial"):
        print(json.dumps(run(mode, args)), flush=True)


if __name__ == "__main__":
    main()
