"""Where a run starts and what its checkpoints hold (orchestration/run_resume.py), without Ray: the choice between
resume, ``init_from``, an SFT warm-up and a fresh start given the run directory's state; the queue record, the
checkpoint's row and files; the KL reference. The trainer ranks are fakes whose ``.remote`` calls run in process
(``ray.get`` is the identity)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import ray

from orchestration import run_resume
from orchestration.config import RLConfig, load_config, parse_overrides
from orchestration.metrics import MetricsLog
from orchestration.queue_resume import QUEUE_DIR
from orchestration.run_resume import (
    Resumed,
    Start,
    StartPoint,
    checkpoint_row,
    init_reference,
    load_checkpoint,
    queue_record,
    restorable_queue,
    restored_outputs,
    resumed_state,
    save_checkpoint,
    start_from_weights,
    start_point,
)
from rl_contracts.stages import REWARD_TASK, ROLLOUT_TASK
from trainers.checkpoint import checkpoint_path, is_complete_checkpoint

CONFIG = Path(__file__).resolve().parents[3] / "recipe" / "configs" / "demo.yaml"


def config(out: Path, *overrides: str) -> RLConfig:
    return load_config(CONFIG, parse_overrides([f"output_dir={out}", *overrides]))


def write_checkpoint(path: Path, extra: dict[str, Any], queue_snapshot: bool = False) -> Path:
    """A complete checkpoint as trainers/checkpoint.py lays it out (manifest and DCP metadata), with no weights."""
    (path / "dcp").mkdir(parents=True)
    (path / "dcp" / ".metadata").write_bytes(b"")
    (path / "checkpoint.json").write_text(json.dumps({"extra_state": extra}))
    if queue_snapshot:
        (path / QUEUE_DIR).mkdir()
        (path / QUEUE_DIR / "CURRENT").write_text("ckpt-0")
    return path


class _Remote:
    def __init__(self, rank: FakeRank, name: str):
        self.rank, self.name = rank, name

    def remote(self, *args: Any) -> Any:
        self.rank.calls.append((self.name, args))
        method = getattr(self.rank, f"do_{self.name}", None)
        return method(*args) if method is not None else None


class FakeRank:
    """A trainer rank's handle: each ``rank.method.remote(*args)`` is recorded, and answered by ``do_method``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> _Remote:
        if name.startswith(("do_", "__")):
            raise AttributeError(name)
        return _Remote(self, name)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


class CheckpointingRank(FakeRank):
    """Writes and reads checkpoints as trainers/checkpoint.py lays them out; ``queue_s``: what its queue stage
    answers (None: the queue's save failed)."""

    def __init__(self, queue_s: float | None = 0.25) -> None:
        super().__init__()
        self.queue_s = queue_s

    def do_save_checkpoint(self, path: str, extra: dict[str, Any], overwrite: bool, queue_dir: str | None) -> Any:
        write_checkpoint(Path(path), extra, queue_snapshot=queue_dir is not None and self.queue_s is not None)
        return self.queue_s if queue_dir is not None else None

    @staticmethod
    def do_load_checkpoint(path: str) -> dict[str, Any]:
        return dict(json.loads((Path(path) / "checkpoint.json").read_text())["extra_state"])


@pytest.fixture(autouse=True)
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "get", lambda refs, **_: refs)


# ---- where a run starts --------------------------------------------------------------------------------------------
def test_a_new_run_warms_up_with_sft_or_starts_fresh(tmp_path: Path) -> None:
    assert start_point(config(tmp_path), tmp_path) == StartPoint(Start.SFT)
    assert start_point(config(tmp_path, "sft.enabled=false"), tmp_path) == StartPoint(Start.FRESH)


def test_a_new_run_with_init_from_starts_from_its_weights_without_sft(tmp_path: Path) -> None:
    cfg = config(tmp_path, f"init_from={tmp_path / 'sft' / 'step_00000000'}")
    assert cfg.sft.enabled
    assert start_point(cfg, tmp_path) == StartPoint(Start.INIT_FROM, tmp_path / "sft" / "step_00000000")


def test_a_run_with_checkpoints_resumes_from_its_latest_complete_one(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    write_checkpoint(checkpoint_path(root, 4), {"step": 4})
    write_checkpoint(checkpoint_path(root, 8), {"step": 8})
    (checkpoint_path(root, 12) / "dcp").mkdir(parents=True)  # a save that died: no manifest
    cfg = config(tmp_path, f"init_from={tmp_path / 'elsewhere'}")  # the run's own checkpoint wins over init_from
    assert start_point(cfg, tmp_path) == StartPoint(Start.RESUME, checkpoint_path(root, 8))


def test_a_run_without_resume_ignores_its_checkpoints(tmp_path: Path) -> None:
    write_checkpoint(checkpoint_path(tmp_path / "checkpoints", 4), {"step": 4})
    assert start_point(config(tmp_path, "resume=false"), tmp_path) == StartPoint(Start.SFT)
    assert restorable_queue(config(tmp_path, "resume=false"), tmp_path) is None


def test_a_run_with_only_incomplete_checkpoints_starts_over(tmp_path: Path) -> None:
    (checkpoint_path(tmp_path / "checkpoints", 4) / "dcp").mkdir(parents=True)
    assert start_point(config(tmp_path, "sft.enabled=false"), tmp_path) == StartPoint(Start.FRESH)


def test_the_queue_starts_from_the_snapshot_of_the_checkpoint_it_resumes_from(tmp_path: Path) -> None:
    record = {"dir": QUEUE_DIR, "steps": [4, 5], "prompt_source": {}, "prompt_states": []}
    path = write_checkpoint(checkpoint_path(tmp_path / "checkpoints", 4), {"step": 4, "queue": record}, True)
    assert restorable_queue(config(tmp_path), tmp_path) == (path, path / QUEUE_DIR)
    assert restorable_queue(config(tmp_path, "checkpoint_queue=false"), tmp_path) is None


def test_a_checkpoint_without_a_queue_snapshot_starts_an_empty_queue(tmp_path: Path) -> None:
    assert restorable_queue(config(tmp_path), tmp_path) is None  # no checkpoint at all
    write_checkpoint(checkpoint_path(tmp_path / "checkpoints", 4), {"step": 4})
    assert restorable_queue(config(tmp_path), tmp_path) is None


# ---- what a resume gives back --------------------------------------------------------------------------------------
def test_a_checkpoint_from_before_version_gives_back_its_policy_version() -> None:
    old = {"step": 3, "prompt_source": {"position": 9}, "policy_version": 2}
    assert resumed_state(old) == Resumed(3, {"position": 9}, 2, None)
    new = {"step": 3, "prompt_source": {}, "version": 5, "policy_version": 2, "queue": {"steps": [3]}}
    assert resumed_state(new) == Resumed(3, {}, 5, {"steps": [3]})


def test_every_rank_loads_the_checkpoint_and_the_driver_state_comes_back(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "step_00000006", {"step": 6, "prompt_source": {"position": 1}, "version": 6})
    ranks = [CheckpointingRank(), CheckpointingRank()]
    assert load_checkpoint(ranks, path) == Resumed(6, {"position": 1}, 6, None)
    assert [r.calls for r in ranks] == [[("load_checkpoint", (str(path),))]] * 2


def test_init_from_loads_the_weights_with_a_fresh_optimizer_at_version_0() -> None:
    ranks = [FakeRank(), FakeRank()]
    start_from_weights(ranks, "/runs/sft/step_00000000")
    for rank in ranks:
        assert rank.calls == [
            ("load_checkpoint", ("/runs/sft/step_00000000",)),
            ("reset_optimizer", ()),
            ("set_version", (0,)),
        ]


# ---- what a checkpoint holds ---------------------------------------------------------------------------------------
def test_the_queue_record_holds_the_steps_in_flight_and_where_each_drew() -> None:
    states = {3: {"position": 24}, 4: {"position": 32}, 5: {"position": 40}}
    assert queue_record(4, states, {"position": 48}) == {
        "dir": QUEUE_DIR,
        "steps": [4, 5],
        "prompt_source": {"position": 48},
        "prompt_states": [[4, {"position": 32}], [5, {"position": 40}]],
        "lost_put_again": [],
    }
    # the lost rows of the steps in flight whose groups were put again (a step done with is not recorded)
    put_again = {3: {9}, 5: {12, 7}}
    assert queue_record(4, states, {"position": 48}, put_again)["lost_put_again"] == [[5, [7, 12]]]


def test_nothing_in_flight_takes_no_queue_snapshot() -> None:
    assert queue_record(6, {3: {}, 5: {}}, {"position": 48}) is None
    assert queue_record(0, {}, {}) is None


def test_a_checkpoint_row_names_the_queue_steps_only_when_the_snapshot_was_saved() -> None:
    queue = {"steps": [4, 5]}
    assert checkpoint_row(4, 1.5, 0.25, queue) == {
        "kind": "checkpoint",
        "step": 4,
        "checkpoint_s": 1.5,
        "queue_s": 0.25,
        "queue_steps": [4, 5],
    }
    failed = checkpoint_row(4, 1.5, None, queue)  # the queue's save failed: the checkpoint went on without it
    assert (failed["queue_s"], failed["queue_steps"]) == (0.0, [])
    assert checkpoint_row(4, 1.5, None, None)["queue_steps"] == []


def test_a_saved_checkpoint_holds_the_driver_state_and_the_queue_record(tmp_path: Path) -> None:
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    rank = CheckpointingRank()
    extra = {"step": 4, "prompt_source": {"position": 32}, "version": 4}
    queue = queue_record(4, {4: {"position": 32}}, {"position": 40})
    path = save_checkpoint([rank], tmp_path, extra, queue, keep=2, metrics=metrics)
    assert path == checkpoint_path(tmp_path / "checkpoints", 4)
    assert rank.calls == [("save_checkpoint", (str(path), {**extra, "queue": queue}, True, QUEUE_DIR))]
    assert resumed_state(CheckpointingRank.do_load_checkpoint(str(path))) == Resumed(4, {"position": 32}, 4, queue)
    [row] = metrics.rows("checkpoint")
    assert (row["step"], row["queue_s"], row["queue_steps"]) == (4, 0.25, [4])


def test_a_checkpoint_with_nothing_in_flight_saves_no_queue(tmp_path: Path) -> None:
    rank = CheckpointingRank()
    extra = {"step": 2, "prompt_source": {}, "version": 2}
    path = save_checkpoint([rank], tmp_path, extra, None, keep=2, metrics=MetricsLog(tmp_path / "metrics.jsonl"))
    assert rank.calls == [("save_checkpoint", (str(path), extra, True, None))]
    assert not (path / QUEUE_DIR).exists()


def test_saving_keeps_the_newest_checkpoints(tmp_path: Path) -> None:
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (2, 4, 6):
        save_checkpoint([CheckpointingRank()], tmp_path, {"step": step}, None, keep=2, metrics=metrics)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]
    assert [r["step"] for r in metrics.rows("checkpoint")] == [2, 4, 6]


def test_a_restored_row_is_done_for_a_task_when_its_output_field_is_there(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    assert restored_outputs(cfg, with_reward_workers=True) == {ROLLOUT_TASK: "response_ids", REWARD_TASK: "reward"}
    agent = config(
        tmp_path, "rollout.generate_fn=workers.agents.rollout_fns:single_turn_generate", "weight_sync=memory"
    )
    assert restored_outputs(agent, with_reward_workers=False) == {ROLLOUT_TASK: "tokens"}


# ---- the KL reference ----------------------------------------------------------------------------------------------
def test_a_new_run_takes_its_current_weights_as_reference_and_saves_them(tmp_path: Path) -> None:
    rank = FakeRank()
    init_reference([rank], tmp_path, resumed=False)
    assert rank.calls == [("init_reference", ()), ("save_reference", (str(tmp_path / "reference"),))]


def test_a_resumed_run_restores_the_reference_its_first_start_saved(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "reference", {})
    assert is_complete_checkpoint(tmp_path / "reference")
    rank = FakeRank()
    init_reference([rank], tmp_path, resumed=True)
    assert rank.calls == [("init_reference", (str(tmp_path / "reference"),))]


def test_a_resumed_run_without_a_saved_reference_says_so_and_saves_one(tmp_path: Path, caplog) -> None:
    rank = FakeRank()
    with caplog.at_level(logging.WARNING, logger=run_resume.__name__):
        init_reference([rank], tmp_path, resumed=True)
    assert f"no saved KL reference in {tmp_path / 'reference'}" in caplog.text
    assert rank.names() == ["init_reference", "save_reference"]
