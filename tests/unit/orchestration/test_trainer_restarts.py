"""run_with_trainer_restarts (orchestration/trainer_restarts.py): a dead trainer rank starts the run again, up to
``train.max_restarts`` times, then ends it with TrainerRestartsSpent naming the key; other failures end it at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestration import trainer_restarts
from orchestration.config import ConfigError, RLConfig, load_config, parse_overrides
from orchestration.trainer_restarts import (
    KEPT_QUEUE,
    TrainerRankDied,
    TrainerRestartsSpent,
    covered_steps,
    joined_rows,
    keeps_rows,
    queue_steps,
    run_with_trainer_restarts,
    take_kept_queue,
    write_kept_queue,
)

CONFIG = Path(__file__).resolve().parents[3] / "recipe" / "configs" / "demo.yaml"


def config(out: Path, *overrides: str) -> RLConfig:
    return load_config(CONFIG, parse_overrides([f"output_dir={out}", *overrides]))


def dying(deaths: int) -> tuple[list[int], object]:
    """An attempt whose trainer rank 1 dies at step 4 the first ``deaths`` times; records each attempt's restarts."""
    seen: list[int] = []

    def attempt(cfg: RLConfig, restarts: int) -> str:
        seen.append(restarts)
        if len(seen) <= deaths:
            raise TrainerRankDied(1, 4)
        return "done"

    return seen, attempt


def test_a_dead_rank_restarts_the_run_until_it_finishes_and_says_so(tmp_path: Path, capsys) -> None:
    seen, attempt = dying(2)
    assert run_with_trainer_restarts(config(tmp_path, "train.max_restarts=3"), attempt) == "done"
    assert seen == [0, 1, 1]  # each start told the restarts no step row has counted yet (its own death's)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "trainer rank 1 died at step 4; restarting the trainer group from the start of GRPO (no checkpoint yet) "
        f"(restart {n} of 3)"
        for n in (1, 2)
    ]


def test_restarts_spent_end_the_run_with_a_typed_error_naming_the_budget_key(tmp_path: Path) -> None:
    seen, attempt = dying(10)
    with pytest.raises(TrainerRestartsSpent, match=r"expected at most train\.max_restarts=2 .* restart 3") as info:
        run_with_trainer_restarts(config(tmp_path, "train.max_restarts=2"), attempt)
    assert len(seen) == 3 and isinstance(info.value.__cause__, TrainerRankDied)
    assert str(info.value).startswith("trainer rank 1 died at step 4")


def test_max_restarts_0_ends_the_run_at_the_first_death(tmp_path: Path) -> None:
    seen, attempt = dying(1)
    with pytest.raises(TrainerRestartsSpent, match=r"train\.max_restarts=0"):
        run_with_trainer_restarts(config(tmp_path, "train.max_restarts=0"), attempt)
    assert seen == [0]


def test_another_failure_is_not_restarted(tmp_path: Path) -> None:
    attempts: list[int] = []

    def attempt(cfg: RLConfig, restarts: int) -> None:
        attempts.append(restarts)
        raise ValueError("a reward function raised")

    with pytest.raises(ValueError, match="a reward function raised"):
        run_with_trainer_restarts(config(tmp_path), attempt)
    assert attempts == [0]


def test_restarts_a_run_did_not_report_are_carried_to_the_next_start(tmp_path: Path) -> None:
    seen: list[int] = []

    def attempt(cfg: RLConfig, restarts: int) -> str:
        seen.append(restarts)
        if len(seen) < 3:
            died = TrainerRankDied(0, 2)
            died.unreported = restarts  # it died before a step row counted them
            raise died
        return "done"

    run_with_trainer_restarts(config(tmp_path), attempt)
    assert seen == [0, 1, 2]


def test_a_run_that_saved_a_checkpoint_restarts_with_resume_on(tmp_path: Path) -> None:
    configs: list[RLConfig] = []

    def attempt(cfg: RLConfig, restarts: int) -> str:
        configs.append(cfg)
        if len(configs) == 1:
            died = TrainerRankDied(0, 2)
            died.saved = True
            raise died
        return "done"

    run_with_trainer_restarts(config(tmp_path, "resume=false"), attempt)
    assert [c.resume for c in configs] == [False, True]


# ---- rows kept for a restart (train.restart_keeps_rows) -----------------------------------------------------------
def test_a_run_keeps_each_steps_rows_until_a_checkpoint_covers_it_only_when_it_may_restart_from_one(
    tmp_path: Path,
) -> None:
    kept = config(tmp_path, "checkpoint_every=2", "train.max_restarts=2")
    assert keeps_rows(kept)
    # the step in training, the 2 launched ahead, and the one trained since the last checkpoint
    assert queue_steps(kept, lookahead=2) == 4
    for off in ("train.max_restarts=0", "checkpoint_every=0", "train.restart_keeps_rows=false"):
        cfg = config(tmp_path, "checkpoint_every=2", "train.max_restarts=2", off)
        assert not keeps_rows(cfg), off
        assert queue_steps(cfg, lookahead=2) == 3, off


def test_a_checkpoint_covers_the_steps_before_it_not_other_partitions() -> None:
    assert covered_steps([7, 4, "inflight-4", 5, 6], 6) == [4, 5]
    assert covered_steps([6, 7], 6) == []


def test_a_kept_queue_note_serves_the_next_start_once_and_only_while_a_queue_runs(tmp_path: Path) -> None:
    record = {"dir": "queue", "steps": [4, 5, 6], "prompt_source": {"position": 56}, "prompt_states": []}
    write_kept_queue(tmp_path, tmp_path / "checkpoints" / "step_00000004", record)
    assert take_kept_queue(tmp_path, running=True) == {
        "checkpoint": str(tmp_path / "checkpoints" / "step_00000004"),
        "record": record,
    }
    assert take_kept_queue(tmp_path, running=True) is None  # taken
    write_kept_queue(tmp_path, tmp_path / "checkpoints" / "step_00000004", record)
    assert take_kept_queue(tmp_path, running=False) is None  # a new process: the queue it names is gone
    assert not (tmp_path / KEPT_QUEUE).exists()


def test_a_queue_kept_for_a_restart_that_will_not_come_is_stopped(tmp_path: Path, monkeypatch) -> None:
    stopped: list[bool] = []
    monkeypatch.setattr(trainer_restarts.transfer_queue, "shutdown", lambda: stopped.append(True))

    def attempt(cfg: RLConfig, restarts: int) -> str:
        write_kept_queue(tmp_path, tmp_path / "checkpoints" / "step_00000002", {"steps": [2]})
        died = TrainerRankDied(0, 3)
        died.saved = died.kept_queue = True
        raise died

    with pytest.raises(TrainerRestartsSpent):
        run_with_trainer_restarts(config(tmp_path, "train.max_restarts=0"), attempt)
    assert stopped == [True] and not (tmp_path / KEPT_QUEUE).exists()


def test_max_restarts_below_0_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.max_restarts must be an int >= 0, got -1"):
        config(tmp_path, "train.max_restarts=-1").validate()


def test_restart_drain_s_below_0_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.restart_drain_s must be a float >= 0, got -1"):
        config(tmp_path, "train.restart_drain_s=-1").validate()


class _Worker:
    """A rollout worker's ``finish_writes`` call: its answer (batches left), or ``dead`` / ``silent``."""

    def __init__(self, answer: object):
        self.answer = answer
        self.finish_writes = self.finish_generating = self  # a rollout worker's call, or an engine's
        self.timeouts: list[float] = []

    def remote(self, timeout_s: float) -> _Worker:
        self.timeouts.append(timeout_s)
        return self


def test_finish_writes_counts_the_batches_left_a_dead_or_silent_worker_as_one(monkeypatch, caplog) -> None:
    workers = [_Worker(0), _Worker(2), _Worker("dead"), _Worker("silent")]

    def wait(refs, num_returns, timeout):
        assert num_returns == len(refs) == 4 and timeout == 15.0  # the workers' own wait, and a margin
        done = [r for r in refs if r.answer != "silent"]
        return done, [r for r in refs if r not in done]

    def get(ref):
        if ref.answer == "dead":
            raise trainer_restarts.RayActorError()
        return ref.answer

    monkeypatch.setattr(trainer_restarts.ray, "wait", wait)
    monkeypatch.setattr(trainer_restarts.ray, "get", get)

    assert trainer_restarts.finish_writes(workers, 5.0) == 4  # 0 + 2 + 1 dead + 1 silent
    assert [w.timeouts for w in workers] == [[5.0]] * 4
    assert "4 rollout batches were still in flight after 5 s: they are generated again" in caplog.text


def test_finish_writes_also_waits_for_the_generation_a_dead_worker_left_running_in_the_runs_engine(monkeypatch):
    """The run's engines (``EngineActor.finish_generating``: True once no checkpointed generation runs) are waited
    for beside the workers; one still generating, dead or silent counts as a batch left."""
    workers = [_Worker(0)]
    engines = [_Worker(True), _Worker(False), _Worker("dead")]

    def get(ref):
        if ref.answer == "dead":
            raise trainer_restarts.RayActorError()
        return ref.answer

    monkeypatch.setattr(trainer_restarts.ray, "wait", lambda refs, num_returns, timeout: (refs, []))
    monkeypatch.setattr(trainer_restarts.ray, "get", get)
    assert trainer_restarts.finish_writes(workers, 5.0, engines) == 2
    assert [e.timeouts for e in engines] == [[5.0]] * 3


def test_joined_rows_keep_each_starts_rows_up_to_the_step_the_next_one_resumed_from() -> None:
    first = [{"step": s, "reward": 0.0} for s in range(5)]  # died after step 4; checkpoint at step 3
    second = [{"step": s, "reward": 0.5} for s in range(3, 7)]  # died after step 6; checkpoint at step 6
    third = [{"step": s, "reward": 1.0} for s in range(6, 10)]
    rows = joined_rows([(0, first), (3, second), (6, third)])
    assert [(r["step"], r["reward"]) for r in rows] == [(s, 0.0) for s in range(3)] + [
        (s, 0.5) for s in range(3, 6)
    ] + [(s, 1.0) for s in range(6, 10)]
    assert joined_rows([(2, first[2:])]) == first[2:]  # no restart: the start's rows as they are


def test_the_reward_line_after_a_trainer_restart_covers_the_whole_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from orchestration import grpo_run

    class FakeRun:
        """A run whose trainer rank dies after step 4 the first time; the second start resumes from checkpoint 2."""

        starts = 0

        def __init__(self, cfg: RLConfig):
            self.start, self.rows, self.timings, self.restarts_trainer = 0, [], {}, 0
            FakeRun.starts += 1

        def __enter__(self) -> FakeRun:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def run(self) -> list[dict[str, float]]:
            first = FakeRun.starts == 1
            self.start = 0 if first else 2
            for step in range(self.start, 5 if first else 10):
                self.rows.append({"step": step, "reward": 0.0 if step < 2 else 1.0})
            if first:
                raise TrainerRankDied(1, 4)
            return self.rows

    monkeypatch.setattr(grpo_run, "GRPORun", FakeRun)
    rows = grpo_run.train_and_report(config(tmp_path, "train.max_restarts=1"))
    assert [r["step"] for r in rows] == list(range(10))
    assert "GRPO mean reward: first fifth 0.000 -> last fifth 1.000 (+1.000)" in capsys.readouterr().out
