"""benchmarks/kill_anything.py's audit of a run that trainer-group restarts started again (orchestration/
trainer_restarts.py): a step re-trained after a restart rolled the run back to a checkpoint before it is not trained
twice in the final model's lineage; a step trained twice within it is, and so is one a start trained that its own
checkpoint covered. And the rows a restart generated again: those of the steps from its checkpoint on, less those
the next start resumed with their responses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import kill_anything as KA

ROWS = 32  # the benchmark's 8 prompts x 4 samples


def audit(step: int, attempt: int, start: int, acknowledged: int = ROWS, trained: bool = True) -> dict[str, Any]:
    return {
        "step": step,
        "attempt": attempt,
        "start": start,
        "trained": trained,
        "live_groups": [g for g in range(8) for _ in range(4)],
        "policy_versions": [step] * ROWS,
        "train": {"acknowledged": acknowledged, "rows": ROWS},
        "rows_lost": 0,
    }


def figures(tmp_path: Path, audits: list[dict[str, Any]], steps: int = 4) -> dict[str, Any]:
    rows = [
        {"step": s, "policy_version": s + 1, "tokens": 64.0, "generated_rows": ROWS, "reward": 0.5}
        for s in range(steps)
    ]
    killed = {"kills": [], "held_rows": 0, "rerun_rows": 0, "restarts": [{}], "units_restarted": 0}
    (tmp_path / "kill_anything.json").write_text(
        json.dumps({**killed, "groups_put_again": 0, "seconds": 1.0, "rows": rows})
    )
    (tmp_path / "audit.jsonl").write_text("".join(json.dumps(a) + "\n" for a in audits))
    return KA.killed_figures(tmp_path, steps, ["trainer"])


def test_steps_retrained_after_a_rollback_to_a_checkpoint_before_them_are_trained_once_in_the_lineage(
    tmp_path: Path,
) -> None:
    # start 0 cleared steps 0 and 1 at checkpoint 2 and trained step 2 (kept) before its rank died; start 1 resumed
    # at 2 and trained 2 and 3 (a queue the start did not keep: its step 2 was audited when trained, then again)
    audits = [audit(0, 0, 0), audit(1, 0, 0), audit(2, 0, 0), audit(2, 1, 2), audit(3, 1, 2)]
    out = figures(tmp_path, audits)
    assert (out["samples_trained_twice"], out["rows_lost_silently"], out["steps_finished"]) == (0, 0, 4)


def test_a_step_a_start_cleared_without_training_it_counts_as_its_trainer_left_it(tmp_path: Path) -> None:
    # start 0 trained steps 0-3 and saved checkpoint 4; its rank died before it cleared step 3 (nor steps 2 and 3
    # before it: a checkpoint's queue snapshot holds them); start 1 resumed at 4 and cleared them untrained
    audits = [audit(0, 0, 0), audit(1, 0, 0), audit(2, 0, 0)]
    audits += [audit(2, 1, 0, trained=False), audit(3, 1, 0, trained=False), audit(4, 1, 4), audit(5, 1, 4)]
    out = figures(tmp_path, audits, steps=6)
    assert (out["samples_trained_twice"], out["rows_lost_silently"], out["steps_finished"]) == (0, 0, 6)


def test_a_step_trained_twice_in_the_lineage_is_counted(tmp_path: Path) -> None:
    # start 1 resumed at 2, yet trained step 1 again: checkpoint 2 covers it
    covered = [audit(0, 0, 0), audit(1, 0, 0), audit(1, 1, 2), audit(2, 1, 2), audit(3, 1, 2)]
    assert figures(tmp_path, covered)["samples_trained_twice"] == ROWS
    # one start trained step 2 twice
    again = [audit(0, 0, 0), audit(1, 0, 0), audit(2, 0, 0), audit(2, 0, 0), audit(3, 0, 0)]
    assert figures(tmp_path, again)["samples_trained_twice"] == ROWS
    # acknowledgements beyond a step's rows
    beyond = [audit(0, 0, 0), audit(1, 0, 0, acknowledged=ROWS + 8), audit(2, 0, 0), audit(3, 0, 0)]
    assert figures(tmp_path, beyond)["samples_trained_twice"] == 8


def test_a_restart_generated_again_what_it_did_not_resume_with_its_responses() -> None:
    died_rows = [{"step": s} for s in range(4)]  # the dead start trained steps 0-3; it resumes at 2
    # steps 2 and 3 trained (64 rows) and 40 rows of the steps launched ahead taken by rollout workers
    assert KA.rerun_by_restart(died_rows, 40, 2, 0, ROWS) == 104  # a new queue: all of them again
    assert KA.rerun_by_restart(died_rows, 40, 2, 96, ROWS) == 8  # the queue kept: the 8 rows in flight again


def test_regenerated_tokens_count_the_rows_being_generated_and_report_the_leased_estimate_beside(
    tmp_path: Path,
) -> None:
    """A kill costs the rows the killed worker was generating (``RolloutWorker.rows_generating``), not every leased
    row of every worker (rows taken and waiting for weights had nothing generated yet): both are reported."""
    rows = [
        {"step": s, "policy_version": s + 1, "tokens": 64.0 * ROWS, "generated_rows": ROWS, "reward": 0.5}
        for s in range(4)
    ]
    killed = {
        "kills": [], "held_rows": 8, "held_rows_leased": 24, "rerun_rows": 0, "rerun_rows_leased": 8,
        "restarts": [{}], "units_restarted": 0,
    }  # fmt: skip
    (tmp_path / "kill_anything.json").write_text(
        json.dumps({**killed, "groups_put_again": 0, "seconds": 1.0, "rows": rows})
    )
    (tmp_path / "audit.jsonl").write_text("".join(json.dumps(audit(s, 0, 0)) + "\n" for s in range(4)))
    out = KA.killed_figures(tmp_path, 4, ["rollout"])
    tokens = 4 * 64.0 * ROWS
    assert out["regenerated_token_share"] == pytest.approx(8 * 64 / (tokens + 8 * 64))
    assert out["regenerated_token_share_leased"] == pytest.approx(32 * 64 / (tokens + 32 * 64))
    assert out["regenerated_rows"] == {"held_at_kills": 8, "trainer_restarts": 0}
    assert out["regenerated_rows_leased"] == {"held_at_kills": 24, "trainer_restarts": 8}


@pytest.mark.parametrize("pid", [None, 0, -1, True, "12"])
def test_a_kill_whose_process_id_is_unknown_is_refused_not_sent_to_the_harnesss_own_group(
    pid: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine server being restarted had no pid: ``os.kill(0, SIGKILL)`` killed the soak's own process group (the
    harness, and the shell loop that ran it)."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(KA.os, "kill", lambda p, sig: sent.append((p, sig)))
    refused = rf"the engine kill: no process id to kill \(got {pid!r}\); expected a pid >= 1"
    with pytest.raises(ValueError, match=refused):
        KA.sigkill(pid, "the engine kill")
    assert sent == []
    assert KA.sigkill(4242, "the engine kill") == 4242 and sent == [(4242, KA.signal.SIGKILL)]


def test_a_pid_is_waited_for_while_the_server_restarts_and_what_came_last_is_given_after_the_wait() -> None:
    answers = iter([None, None, 0, 777])
    assert KA.pid_when_known(lambda: next(answers), 10.0) == 777
    assert KA.pid_when_known(lambda: None, 0.0) is None  # then sigkill refuses it
