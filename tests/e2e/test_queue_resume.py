"""An async demo run killed (SIGKILL of its process group) after a checkpoint, while rows of the steps launched ahead
are in the queue, and resumed: the checkpoint's queue snapshot comes back, the rows produced before the crash are
trained (not generated again), the rows that were in flight are generated again, and every prompt batch of the run
is trained exactly once, in order, as an uninterrupted run draws them (checked by each step's ``prompts_crc``).

The second test catches a rollout in flight on purpose: its generate_fn (tests/e2e/gated_rollout.py) holds the
second request of one step until the run is killed, so that step's checkpoint has half its rows generated, the other
half taken by the rollout worker (acknowledged) but never written, and the next step not started."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestration.config import load_config, parse_overrides
from orchestration.grpo_run import load_run_task
from rl_contracts.prompts import PromptSource, prompts_checksum
from tests.e2e.test_demo import ROOT, SHORT, run_demo
from trainers.checkpoint import latest_checkpoint

pytestmark = pytest.mark.timeout(900)
STEPS = 10
KNOBS = ("mode=async", "max_staleness=2", "checkpoint_every=1", "weight_sync=memory")


def start_demo(out: Path, *overrides: str) -> subprocess.Popen:
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, str(ROOT / "recipe" / "demo.py"), f"output_dir={out}", *SHORT, *overrides]
    log = (out.parent / "first.log").open("w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def metric_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def prompt_batches(config: Path, steps: int, overrides: tuple[str, ...] = ()) -> list[list[dict]]:
    """The prompt batch of each step of an uninterrupted run of ``config`` (as PromptSource serves them)."""
    cfg = load_config(config, parse_overrides(list(overrides)))
    task = load_run_task(cfg)
    source = PromptSource(task.prompts("train", cfg.task.num_train_prompts, cfg.task.seed), cfg.seed)
    return [source.next_batch(cfg.prompts_per_step) for _ in range(steps)]


def expected_crcs(out: Path, steps: int) -> list[float]:
    """The prompts_crc of each step of an uninterrupted run: its prompt batches, each row n_samples times."""
    n = load_config(out / "config.yaml").n_samples
    return [
        float(n * prompts_checksum(p["prompt_ids"] for p in batch))
        for batch in prompt_batches(out / "config.yaml", steps)
    ]


def kill_after_checkpoint(run: subprocess.Popen, out: Path, step: int) -> list[dict]:
    """SIGKILL the run's process group once a checkpoint of ``step`` or later with steps in flight is written;
    returns the metrics rows written by then."""
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline and run.poll() is None:
            saves = [r for r in metric_rows(out) if r["kind"] == "checkpoint" and r["queue_steps"]]
            if saves and saves[-1]["step"] >= step:
                break
            time.sleep(0.05)
        log = (out.parent / "first.log").read_text()
        assert run.poll() is None, f"the demo ended before it could be killed:\n{log[-3000:]}"
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(30)
    return metric_rows(out)


def lineage(rows: list[dict], killed: list[dict], resumed_at: int) -> tuple[list[dict], list[dict]]:
    """The run's GRPO rows as its model saw them: the killed run's steps before the checkpoint, then the resumed
    run's; and the resumed run's alone."""
    resume = next(i for i, r in enumerate(rows) if r["kind"] == "resume")
    assert rows[:resume] == killed
    after = [r for r in rows[resume:] if r["kind"] == "grpo"]
    return [r for r in killed if r["kind"] == "grpo" and r["step"] < resumed_at] + after, after


RESUMED = re.compile(
    r"resumed from step (\d+): (\d+) rows of steps \[([\d, ]+)\] restored from the queue checkpoint, (\d+) re-launched"
)


@pytest.mark.slow  # two demo runs, each starting Ray: two to four minutes on a loaded 2-core machine
def test_an_async_run_killed_after_a_checkpoint_trains_the_rows_its_queue_held(tmp_path):
    out = tmp_path / "async"
    # a checkpoint with steps in flight, past the first one (whose steps ahead may still be empty)
    killed = kill_after_checkpoint(start_demo(out, f"steps={STEPS}", *KNOBS), out, 2)
    latest = latest_checkpoint(out / "checkpoints")
    saved = json.loads((latest / "checkpoint.json").read_text())["extra_state"]
    resumed_at, queued = saved["step"], saved["queue"]["steps"]
    assert queued and queued[0] == resumed_at and (latest / "queue" / "CURRENT").is_file()

    second = run_demo(out, f"steps={STEPS}", *KNOBS)
    said = RESUMED.search(second.stdout)
    assert said, second.stdout[-3000:]
    restored, relaunched = int(said[2]), int(said[4])
    assert int(said[1]) == resumed_at and [int(s) for s in said[3].split(",")] == queued
    assert restored + relaunched == len(queued) * 32  # 8 prompts x 4 samples per step
    assert restored > 0, "no row of the queue checkpoint was restored"

    rows = metric_rows(out)
    resume = {"restored_steps": queued, "restored_rows": restored, "relaunched_rows": relaunched}
    assert [r for r in rows if r["kind"] == "resume"] == [{"kind": "resume", "step": resumed_at, **resume}]
    trained, after = lineage(rows, killed, resumed_at)
    # every prompt batch trained exactly once, in the order an uninterrupted run draws them: none skipped, none twice
    assert [r["step"] for r in trained] == list(range(STEPS))
    assert [r["prompts_crc"] for r in trained] == expected_crcs(out, STEPS)
    assert all(r["rows"] == 32 for r in trained)
    # the restored rows were trained: the resumed run generated only the others of the restored steps
    assert sum(r["rows"] - r["generated_rows"] for r in after if r["step"] in queued) == restored
    assert all(r["generated_rows"] == r["rows"] for r in after if r["step"] not in queued)


GATED = 5  # the step whose second rollout request is held until the run is killed


@pytest.mark.slow  # two demo runs, each starting Ray: two to four minutes on a loaded 2-core machine
def test_rows_a_killed_run_had_in_flight_are_generated_again_and_the_rest_are_not(tmp_path):
    out = tmp_path / "gated"
    gate = tmp_path / "gate.json"
    knobs = (
        *KNOBS,
        "rollout.generate_fn=tests.e2e.gated_rollout:gated_generate",
        f"rollout.generate_fn_kwargs={{gate: {gate}}}",
    )
    batches = prompt_batches(ROOT / "recipe" / "configs" / "demo.yaml", GATED + 1, (*SHORT, *knobs))
    held = [p["prompt_ids"] for p in batches[GATED][4:]]  # the step's second request: groups 4-7
    assert not {tuple(ids) for ids in held} & {tuple(p["prompt_ids"]) for b in batches for p in b[:4]}
    gate.write_text(json.dumps({"prompt_ids": held}))
    killed = kill_after_checkpoint(start_demo(out, "steps=8", *knobs), out, GATED)
    # the trainer waits for the held rows: the checkpoint of GATED is the last one
    assert latest_checkpoint(out / "checkpoints").name == f"step_{GATED:08d}"
    gate.unlink()

    second = run_demo(out, "steps=8", *knobs)
    # GATED: its first request generated (16 rows), its second taken but never written; GATED + 1 not started
    message = f"resumed from step {GATED}: 16 rows of steps [{GATED}, {GATED + 1}] restored from the queue checkpoint"
    assert f"{message}, 48 re-launched" in second.stdout, second.stdout[-3000:]
    trained, after = lineage(metric_rows(out), killed, GATED)
    assert [r["step"] for r in trained] == list(range(8))
    assert all(r["rows"] == 32 and r["trained_rows"] == 32 for r in trained)
    assert [r["generated_rows"] for r in after] == [16, 32, 32]  # GATED: only the rows that were in flight
