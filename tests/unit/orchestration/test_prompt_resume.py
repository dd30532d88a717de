"""A run stopped at a checkpoint and resumed draws, step for step, the prompts an uninterrupted run of the same seed
draws: GRPORun's own ``put_prompts``, ``save`` and ``_resume_or_warm_up`` over real checkpoints on disk, with the
trainer rank's checkpoint calls done in process (a tiny model, no Ray actor) and the queue's put recorded.

The step loop is :meth:`GRPORun.run`'s bookkeeping: launch the step and the steps ahead (the weight channel's
``lookahead``: rollout draws a step ahead even in sync mode), checkpoint every ``checkpoint_every`` steps and at the
end, forget the trained step's prompt position. The e2e tier checks the same through whole demo runs
(tests/e2e/test_demo.py, ``prompts_crc``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestration import grpo_run
from orchestration.config import load_config, parse_overrides
from orchestration.grpo_run import GRPORun
from orchestration.metrics import MetricsLog
from rl_contracts.prompts import PromptSource
from trainers import checkpoint

CONFIG = Path(__file__).resolve().parents[3] / "recipe" / "configs" / "demo.yaml"
STEPS = 6


class _Remote:
    def __init__(self, fn: Any):
        self.remote = fn


class InProcessRank:
    """A trainer rank's checkpoint calls, in process (``.remote`` returns the value; ``ray.get`` is the identity):
    the manifest with ``extra_state`` as JSON, as trainers/checkpoint.py writes it, and no weights."""

    def __init__(self) -> None:
        self.save_checkpoint = _Remote(self._save)
        self.load_checkpoint = _Remote(self._load)

    @staticmethod
    def _save(path: str, extra: dict[str, Any], overwrite: bool = False, queue_dir: str | None = None) -> None:
        assert queue_dir is None, "checkpoint_queue=false: no queue is saved here"
        (Path(path) / "dcp").mkdir(parents=True, exist_ok=overwrite)
        (Path(path) / "dcp" / ".metadata").write_bytes(b"")
        (Path(path) / "checkpoint.json").write_text(json.dumps({"extra_state": extra}))

    @staticmethod
    def _load(path: str) -> dict[str, Any]:
        assert checkpoint.is_complete_checkpoint(path), path
        return dict(json.loads((Path(path) / "checkpoint.json").read_text())["extra_state"])


class Recorder:
    """Stands in for the queue and the lost-prompt ledger: remembers each step's prompts as put."""

    def __init__(self) -> None:
        self.prompts: dict[int, list[Any]] = {}
        self.restored: dict[int, tuple[list[Any], list[int]]] = {}  # steps resumed from a queue: prompts, put again
        self.put_again: dict[int, set[int]] = {}

    def remember(self, step: int, prompts: list[Any]) -> None:
        assert step not in self.prompts, f"step {step} drew its prompts twice"
        self.prompts[step] = [p["prompt_ids"] for p in prompts]

    def restore(self, step: int, prompts: list[Any], put_again: list[int]) -> None:
        assert step not in self.prompts and step not in self.restored, f"step {step} drew its prompts twice"
        self.restored[step] = ([p["prompt_ids"] for p in prompts], list(put_again))

    def forget(self, step: int, cleared: bool = True) -> None:
        if cleared:
            self.put_again.pop(step, None)


def drive(out: Path, steps: int, *overrides: str, crash_at: int | None = None) -> dict[int, list[Any]]:
    """The prompts each step of this run (fresh or resumed from ``out``'s latest checkpoint) draws, to ``steps``;
    ``crash_at``: the run dies right after its checkpoint of that step (the steps drawn ahead die with it)."""
    cfg = load_config(
        CONFIG,
        parse_overrides(
            [f"output_dir={out}", f"steps={steps}", "sft.enabled=false", "checkpoint_queue=false", *overrides]
        ),
    )
    run = GRPORun.__new__(GRPORun)  # no queue, no actors: the driver's prompt and checkpoint bookkeeping alone
    run.cfg, run.out = cfg, out
    run.task = type("NoRewardFields", (), {"reward_fields": ()})()
    run.lookahead = cfg.max_staleness + 1  # weight_sync=shm: rollout runs a step ahead
    run.prompts = PromptSource([{"prompt_ids": [i, i + 1]} for i in range(20)], cfg.seed)
    run.prompt_states, run.version, run._saved_step, run._queue_from = {}, 0, None, None
    run.trainer = [InProcessRank()]
    run.metrics = MetricsLog(out / "metrics.jsonl")
    recorder = Recorder()
    run.client, run.lost_prompts = None, recorder
    start = run._resume_or_warm_up()
    for step in range(start, steps):
        for ahead in range(step, min(step + run.lookahead + 1, steps)):
            if ahead not in recorder.prompts:
                run.put_prompts(ahead)
        if cfg.checkpoint_interval and (step + 1) % cfg.checkpoint_interval == 0:
            run.save(step + 1)
            if step + 1 == crash_at:
                return recorder.prompts
        run.prompt_states.pop(step, None)
    if run._saved_step != steps:
        run.save(steps)
    return recorder.prompts


@pytest.fixture(autouse=True)
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpo_run.ray, "get", lambda refs, **_: refs)
    monkeypatch.setattr(grpo_run, "put_retrying", lambda *args, **kwargs: None)


@pytest.mark.parametrize(
    "knobs", [(), ("checkpoint_every=2",), ("mode=async", "max_staleness=1", "checkpoint_every=1")]
)
def test_a_resumed_run_draws_each_steps_prompts_as_an_uninterrupted_run(tmp_path: Path, knobs: tuple[str, ...]):
    uninterrupted = drive(tmp_path / "whole", STEPS, *knobs)
    assert sorted(uninterrupted) == list(range(STEPS))

    first = drive(tmp_path / "split", STEPS // 2, *knobs)
    second = drive(tmp_path / "split", STEPS, *knobs)
    assert sorted(second) == list(range(STEPS // 2, STEPS))  # the resumed run starts at the checkpoint
    resumed = {**first, **second}
    for step in range(STEPS):
        assert resumed[step] == uninterrupted[step], f"step {step}: resumed {resumed[step]} != {uninterrupted[step]}"


@pytest.mark.parametrize("knobs", [(), ("mode=async", "max_staleness=2")])
def test_a_run_that_dies_after_a_checkpoint_draws_again_the_prompts_drawn_ahead(tmp_path: Path, knobs: tuple[str, ...]):
    """A checkpoint taken while rollout has drawn the next steps' prompts stands before those draws: the resumed run
    draws them again (they died with the run) and then goes on as an uninterrupted run would."""
    uninterrupted = drive(tmp_path / "whole", STEPS, "checkpoint_every=1", *knobs)
    first = drive(tmp_path / "split", STEPS, "checkpoint_every=1", *knobs, crash_at=STEPS // 2)
    assert max(first) > STEPS // 2 - 1, "no step was drawn ahead of the checkpoint"
    second = drive(tmp_path / "split", STEPS, "checkpoint_every=1", *knobs)
    assert sorted(second) == list(range(STEPS // 2, STEPS))
    resumed = {**{s: p for s, p in first.items() if s < STEPS // 2}, **second}
    for step in range(STEPS):
        assert resumed[step] == uninterrupted[step], f"step {step}: resumed {resumed[step]} != {uninterrupted[step]}"


def test_a_resumed_run_cuts_metrics_back_to_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    drive(out, STEPS, "checkpoint_every=2", crash_at=2)
    log = MetricsLog(out / "metrics.jsonl")
    for step in range(4):  # the crashed run had logged steps 2 and 3 after its checkpoint at 2
        log.write({"kind": "grpo", "step": step})
    drive(out, STEPS, "checkpoint_every=2")
    assert [r["step"] for r in log.rows("grpo")] == [0, 1]
