"""A run that keeps each step's rows for a trainer-group restart (``train.restart_keeps_rows``,
orchestration/trainer_restarts.py), driven as tests/unit/orchestration/test_prompt_resume.py drives GRPORun's own
bookkeeping (in process, no Ray actor) over a stand-in queue: a step is cleared by the checkpoint that covers it, not
once trained; a trainer rank's death leaves the queue with a note of the steps from the checkpoint on; the restart
resumes from that queue, serving the trainer those steps again, and draws only the prompts of the steps after them,
as an uninterrupted run draws them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestration import grpo_run
from orchestration.config import RLConfig, load_config, parse_overrides
from orchestration.grpo_run import GRPORun
from orchestration.metrics import MetricsLog
from orchestration.trainer_restarts import KEPT_QUEUE, take_kept_queue
from rl_contracts.prompts import PromptSource
from rl_contracts.stages import TRAIN_TASK
from tests.unit.orchestration.test_prompt_resume import InProcessRank, Recorder

CONFIG = Path(__file__).resolve().parents[3] / "recipe" / "configs" / "demo.yaml"
STEPS = 8
ROWS = 8 * 4


class StandInQueue:
    """The queue's calls the driver makes: its live steps, the clears, the consumption resets; every row produced."""

    def __init__(self) -> None:
        self.steps: set[int] = set()
        self.cleared: list[int] = []
        self.reset: list[tuple[str | None, int | None]] = []

    def list_partitions(self) -> list[Any]:
        return [*sorted(self.steps), "inflight-1"]

    def clear(self, global_step: int | None = None) -> None:
        assert global_step in self.steps, f"step {global_step} cleared twice, or never put"
        self.steps.discard(global_step)
        self.cleared.append(global_step)

    def reset_consumption(self, task_name: str | None = None, global_step: int | None = None) -> None:
        self.reset.append((task_name, global_step))

    def get_production_status(self, global_step: int) -> dict[str, Any]:
        return {"fields": {"response_ids": {"produced": ROWS}, "reward": {"produced": ROWS}}}

    def get_meta(self, fields: list[str], n: int, **_: Any) -> list[int]:
        return list(range(n))

    def ack(self, meta: Any) -> None:
        pass


def config(out: Path) -> RLConfig:
    overrides = [
        f"output_dir={out}", f"steps={STEPS}", "sft.enabled=false", "checkpoint_queue=false", "checkpoint_every=2",
        "train.max_restarts=2", "prompts_per_step=8", "n_samples=4",
    ]  # fmt: skip
    return load_config(CONFIG, parse_overrides(overrides))


def started(cfg: RLConfig, queue: StandInQueue) -> tuple[GRPORun, Recorder]:
    run = GRPORun.__new__(GRPORun)  # no queue, no actors: the driver's bookkeeping alone
    run.cfg, run.out = cfg, cfg.output_path
    run.task = type("NoRewardFields", (), {"reward_fields": ()})()
    run.lookahead = cfg.max_staleness + 1  # weight_sync=shm: rollout runs a step ahead
    run.prompts = PromptSource([{"prompt_ids": [i, i + 1]} for i in range(40)], cfg.seed)
    run.prompt_states, run.version, run._saved_step, run._queue_from = {}, 0, None, None
    run.trainer, run.reward, run.queue_resume = [InProcessRank()], ["reward worker"], None
    run.metrics = MetricsLog(run.out / "metrics.jsonl")
    run.keeps_rows = grpo_run.keeps_rows(cfg)
    run._kept = take_kept_queue(run.out, running=True)  # the stand-in queue runs on
    recorder = Recorder()
    run.client, run.lost_prompts = queue, recorder
    return run, recorder


def drive(run: GRPORun, queue: StandInQueue, until: int) -> None:
    """GRPORun.run's bookkeeping from where it starts: launch the steps due, train one, log it (``end_step`` and
    ``log``'s clear, checkpoint and forgetting); a trainer rank dies while step ``until`` trains."""
    for step in range(run._resume_or_warm_up(), run.cfg.steps):
        for ahead in range(step, min(step + run.lookahead + 1, run.cfg.steps)):
            if ahead not in queue.steps:
                run.put_prompts(ahead)
                queue.steps.add(ahead)
        if step == until:
            return
        if not run.keeps_rows:
            queue.clear(step)
        if (step + 1) % run.cfg.checkpoint_interval == 0:
            run.save(step + 1)
        if not run.keeps_rows:
            run.prompt_states.pop(step, None)
    if run._saved_step != run.cfg.steps:
        run.save(run.cfg.steps)


@pytest.fixture(autouse=True)
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpo_run.ray, "get", lambda refs, **_: refs)
    monkeypatch.setattr(grpo_run, "put_retrying", lambda *args, **kwargs: None)


def test_a_restart_resumes_the_steps_since_its_checkpoint_from_the_kept_queue_and_draws_no_prompt_twice(
    tmp_path: Path,
) -> None:
    uninterrupted_queue = StandInQueue()
    whole, whole_prompts = started(config(tmp_path / "whole"), uninterrupted_queue)
    drive(whole, uninterrupted_queue, until=STEPS)
    # each step cleared once, by the checkpoint after it (2, 4, 6 and the last)
    assert uninterrupted_queue.cleared == list(range(STEPS)) and uninterrupted_queue.steps == set()

    queue = StandInQueue()
    dying, first = started(config(tmp_path / "split"), queue)
    drive(dying, queue, until=5)  # steps 4 trained after checkpoint 4; rank 1 dies while step 5 trains
    assert queue.cleared == [0, 1, 2, 3] and queue.steps == {4, 5, 6}
    # a storage unit had lost group 3 of steps 4 (trained since the checkpoint) and 5: their prompts were put again
    first.put_again = {4: {12, 13, 14, 15}, 5: {12, 13, 14, 15}}
    assert dying._keep_queue()
    note = (tmp_path / "split" / KEPT_QUEUE).read_text()
    assert '"steps": [4, 5, 6]' in note and "step_00000004" in note

    again, second = started(config(tmp_path / "split"), queue)
    drive(again, queue, until=STEPS)
    # the trainer, back at checkpoint 4, is served steps 4-6 again; nothing drawn or generated again for them
    assert queue.reset == [(TRAIN_TASK, 4), ("rollout", 4), ("reward", 4)] + [
        (task, s) for s in (5, 6) for task in (TRAIN_TASK, "rollout", "reward")
    ]
    assert sorted(second.prompts) == [7]
    # the restored steps' prompts, drawn again where they drew (a lost group of them is put again with its prompt),
    # and the lost rows the dying run had put again (not put a second time), a step trained since the checkpoint too
    assert second.restored == {
        4: (first.prompts[4], [12, 13, 14, 15]),
        5: (first.prompts[5], [12, 13, 14, 15]),
        6: (first.prompts[6], []),
    }
    resumed = {**first.prompts, **second.prompts}
    assert resumed == whole_prompts.prompts
    assert queue.cleared == list(range(STEPS)) and queue.steps == set()
    [row] = MetricsLog(tmp_path / "split" / "metrics.jsonl").rows("resume")
    assert (row["step"], row["restored_steps"], row["restored_rows"], row["relaunched_rows"]) == (4, [4, 5, 6], 96, 0)


def test_restored_steps_further_ahead_than_the_run_launches_are_started_when_due(tmp_path: Path) -> None:
    """A kept queue holds the steps trained since the checkpoint and those launched ahead of them: a step further
    ahead than the run launches from its start has its missing rows generated only once it is due (sampled within
    ``max_staleness`` of the version that trains it), and never has its prompts put again."""
    from orchestration.queue_resume import QueueResume

    run, _ = started(config(tmp_path), StandInQueue())
    run.cfg.steps, run.pending = STEPS, {}
    run.queue_resume = QueueResume(step=4, rows_per_step=ROWS, kept={s: {} for s in (4, 5, 6, 7)})
    started_steps: list[int] = []
    run._restart_step = lambda s, start, first_version: started_steps.append(s) or ([], [])  # type: ignore[method-assign]

    def launch(step: int, min_version: int | None = None) -> tuple[list[Any], list[Any]]:
        raise AssertionError(f"step {step}'s prompts are in the queue: not put again")

    run.launch = launch  # type: ignore[method-assign]
    run.start, run.first_version = 4, 4
    assert sorted(run._relaunch_restored(4, 4)) == [4, 5]  # lookahead 1: steps 4 and 5 are due
    assert started_steps == [4, 5]
    run.pending = {4: ([], []), 5: ([], [])}
    run.generate(5)
    assert started_steps == [4, 5, 6]
    run.generate(6)
    assert started_steps == [4, 5, 6, 7] and run._restored_later == frozenset()


def test_a_death_before_the_first_checkpoint_keeps_the_queue_and_the_restart_starts_again_from_it(
    tmp_path: Path,
) -> None:
    """No checkpoint yet (no SFT warm-up, checkpoint_every=2, a rank dies in step 1): the restart starts from the
    same weights as the run did, so the queue is kept as for a checkpoint: steps 0-2 are trained again from their
    kept rows, nothing drawn or generated again for them."""
    uninterrupted_queue = StandInQueue()
    whole, whole_prompts = started(config(tmp_path / "whole"), uninterrupted_queue)
    drive(whole, uninterrupted_queue, until=STEPS)

    queue = StandInQueue()
    dying, first = started(config(tmp_path / "split"), queue)
    drive(dying, queue, until=1)
    assert queue.cleared == [] and queue.steps == {0, 1, 2}
    assert dying._keep_queue()
    note = json.loads((tmp_path / "split" / KEPT_QUEUE).read_text())
    assert note["checkpoint"] is None and note["record"]["steps"] == [0, 1, 2]

    again, second = started(config(tmp_path / "split"), queue)
    drive(again, queue, until=STEPS)
    assert queue.reset == [(task, s) for s in (0, 1, 2) for task in (TRAIN_TASK, "rollout", "reward")]
    assert sorted(second.prompts) == [3, 4, 5, 6, 7]
    assert {s: prompts for s, (prompts, _) in second.restored.items()} == {s: first.prompts[s] for s in (0, 1, 2)}
    assert {**first.prompts, **second.prompts} == whole_prompts.prompts
    assert queue.cleared == list(range(STEPS)) and queue.steps == set()


def test_a_trained_step_kept_for_a_restart_keeps_the_record_of_its_groups_put_again(tmp_path: Path) -> None:
    """end_step forgets a trained step's prompts but, with its rows kept, not the lost rows whose groups were put
    again: the kept queue's record names them (the restart trains the step again without putting them twice)."""
    from orchestration.regenerate import LostPrompts

    queue = StandInQueue()
    run, _ = started(config(tmp_path), queue)
    run.lost_prompts = LostPrompts(queue, TRAIN_TASK, lambda *args: None, lambda *args: ([], []))
    run.lost_prompts.remember(4, [{"prompt_ids": [g]} for g in range(8)])
    run.lost_prompts.put_again[4] = {12, 13, 14, 15}
    run.pending, run.stage_trace, run._step_started, run.restarts_trainer = {4: ([], [])}, None, (0.0, 0.0), 0
    run.supervisor = type("Supervisor", (), {"gather": lambda self, s, refs: [], "take_restarts": lambda self: {}})()

    run.end_step(4, {"rows": float(ROWS)}, 0.0)

    assert 4 not in run.lost_prompts.prompts and run.lost_prompts.put_again == {4: {12, 13, 14, 15}}
