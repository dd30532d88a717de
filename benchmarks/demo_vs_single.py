"""The main job against one plain process, on the same GRPO steps, in one run (``make bench-demo``).

    single: recipe/experiments/addition_single_process.py --seeds S --grpo-steps N   (no Ray, no queue)
    demo:   recipe/demo.py steps=N seed=S [overrides]                                   (the distributed job)

Both warm up with SFT first (not timed; with ``--same-sft`` the single process starts from the demo's SFT weights
instead, so the two GRPO loops start from the same policy and differ only in mechanism and sampling luck); the ratio
is the wall time of the GRPO phase alone (distributed / single).
Prints the per-step profile of the demo (medians over steps of where each step's time went, by actor), a table,
and on its last lines ``ratio: X`` and ``last fifth: D (single S)``. Writes everything, with the machine's load
average before and after, to ``benchmarks/results/demo-vs-single-<timestamp>.json``.

    .venv/bin/python benchmarks/demo_vs_single.py --steps 1000 --seed 0 [weight_sync=memory ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# where a demo step's time goes, by actor (metrics.jsonl keys; seconds per step)
PROFILE = {
    "step_s": "driver: one step, end to end (steady state: steps overlap)",
    "weights_wait_s": "rollout: waiting for the trainer's weights (weight channel)",
    "generate_s": "rollout: engine generation",
    "rollout_queue_s": "rollout: queue calls (get_meta, get_data, put)",
    "reward_s": "reward: scoring",
    "reward_queue_s": "reward: queue calls",
    "train_queue_s": "trainer: queue calls",
    "train_s": "trainer: batch building, FSDP forward/backward, collectives, optimizer",
    "sync_s": "trainer: weight publish (gather + write / object store + engine load)",
    "wait_s": "all: parked in get_meta until upstream produced the rows",
}


def fifths(rewards: list[float]) -> tuple[float, float]:
    k = max(1, len(rewards) // 5)
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def curve(rewards: list[float], window: int = 50) -> list[float]:
    """Mean reward of each ``window`` consecutive steps (the learning curve, coarse enough to compare)."""
    chunks = [rewards[i : i + window] for i in range(0, len(rewards), window)]
    return [round(sum(chunk) / len(chunk), 3) for chunk in chunks]


def run(cmd: list[str], log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    with log.open("w") as out:
        code = subprocess.call(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        sys.exit(f"{' '.join(cmd)} failed ({code}); its output: {log}")


def single_process(steps: int, seed: int, work: Path, init_from: Path | None = None) -> dict:
    out = work / "single.json"
    script = ROOT / "recipe" / "experiments" / "addition_single_process.py"
    started = time.perf_counter()
    cmd = [sys.executable, str(script), "--seeds", str(seed), "--grpo-steps", str(steps), "--out", str(out)]
    run(cmd + (["--init-from", str(init_from)] if init_from else []), work / "single.log")
    result = json.loads(out.read_text())["results"][0]
    first, last = fifths(result["rewards"])
    return {
        "grpo_wall_s": result["grpo_seconds_per_step"] * steps,
        "ms_per_step": 1000 * result["grpo_seconds_per_step"],
        "generate_ms": 1000 * result["generate_seconds_per_step"],
        "train_ms": 1000 * result["train_seconds_per_step"],
        "first_fifth": first,
        "last_fifth": last,
        "curve": curve(result["rewards"]),
        "sft_steps": result["sft_steps"],
        "total_s": time.perf_counter() - started,
    }


def demo(steps: int, seed: int, overrides: list[str], work: Path) -> dict:
    out = work / "demo"
    started = time.perf_counter()
    run(
        [
            sys.executable,
            str(ROOT / "recipe" / "demo.py"),
            f"steps={steps}",
            f"seed={seed}",
            f"output_dir={out}",
            *overrides,
        ],
        work / "demo.log",
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in rows if r["kind"] == "grpo"]
    summary = next(r for r in rows if r["kind"] == "summary")
    first, last = fifths([r["reward"] for r in grpo])
    steady = grpo[len(grpo) // 10 :] or grpo  # the first steps warm caches and start actors' threads
    profile = {k: 1000 * statistics.median(r.get(k, 0.0) for r in steady) for k in PROFILE}
    return {
        "grpo_wall_s": summary["grpo_wall_s"],
        "ms_per_step": 1000 * summary["grpo_wall_s"] / len(grpo),
        "first_fifth": first,
        "last_fifth": last,
        "curve": curve([r["reward"] for r in grpo]),
        "sft_steps": max((r["step"] for r in rows if r["kind"] == "sft"), default=0),
        "profile_ms": profile,
        "total_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument(
        "--same-sft",
        action="store_true",
        help="run the demo first and start the single process's GRPO from the demo's SFT weights: compares the two "
        "GRPO loops alone, without the luck of two separate warm-ups",
    )
    parser.add_argument(
        "--keep",
        metavar="DIR",
        help="copy both runs' logs and outputs (the demo's metrics.jsonl and metrics.png, no checkpoints) to DIR",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides for recipe/demo.py")
    args = parser.parse_args()
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as tmp:
        work = Path(tmp)
        if args.same_sft:  # the demo warms up; the single process starts GRPO from the demo's SFT weights
            distributed = demo(args.steps, args.seed, args.overrides, work)
            load.append(os.getloadavg())
            sft = work / "demo" / "checkpoints" / "step_00000000"
            single = single_process(args.steps, args.seed, work, init_from=sft)
            load.append(os.getloadavg())
        else:
            single = single_process(args.steps, args.seed, work)
            load.append(os.getloadavg())
            distributed = demo(args.steps, args.seed, args.overrides, work)
            load.append(os.getloadavg())
        if args.keep:
            skip = shutil.ignore_patterns("checkpoints", "reference")
            shutil.copytree(work, args.keep, ignore=skip, dirs_exist_ok=True)
    ratio = distributed["grpo_wall_s"] / single["grpo_wall_s"]
    start = "both from the demo's SFT weights" if args.same_sft else "each after its own SFT warm-up"
    print(f"GRPO phase, {args.steps} steps, seed {args.seed}, {start} (load average 1/5/15 min: {load})")
    print("| run | GRPO wall s | ms/step | reward first fifth | last fifth |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in (("single process", single), ("distributed (make demo)", distributed)):
        print(
            f"| {name} | {r['grpo_wall_s']:.1f} | {r['ms_per_step']:.0f} | {r['first_fifth']:.3f} | "
            f"{r['last_fifth']:.3f} |"
        )
    for name, r in (("single process", single), ("distributed", distributed)):
        print(f"{name}: SFT steps {r['sft_steps']}; 50-step mean reward {' '.join(f'{x:.3f}' for x in r['curve'])}")
    print(f"\nsingle process per step: generate {single['generate_ms']:.0f} ms, train+sync {single['train_ms']:.0f} ms")
    print("distributed per step (median over steps after the first tenth; actors overlap, so parts need not add up):")
    for key, what in PROFILE.items():
        print(f"  {key:16s} {distributed['profile_ms'][key]:7.1f} ms  {what}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"demo-vs-single-{time.strftime('%Y%m%d-%H%M%S')}.json"
    record = {"args": vars(args), "loadavg": load, "single": single, "distributed": distributed, "ratio": ratio}
    path.write_text(json.dumps(record, indent=1))
    print(f"results: {path}")
    print(f"ratio: {ratio:.2f}")
    print(f"last fifth: {distributed['last_fifth']:.3f} (single {single['last_fifth']:.3f})")


if __name__ == "__main__":
    main()
