"""recipe/agentrl_demo.py's metrics: metrics.jsonl rows as GRPORun writes them, and a metrics.png like every recipe."""

from __future__ import annotations

from orchestration.metrics import MetricsLog, plotted_panels
from recipe.agentrl_demo import RunRecord


def test_the_run_record_plots_the_warm_up_and_the_steps_while_the_run_goes_and_at_its_end(tmp_path):
    record = RunRecord(tmp_path, None, "AgentRL demo", min_interval_s=0.0)
    record.write({"kind": "sft", "step": 25, "sft_loss": 1.5, "accuracy": 0.1})
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:4] == b"\x89PNG"  # drawn during the run, not only at its end
    png.unlink()
    for step in range(4):
        record.write({"kind": "grpo", "step": step, "reward": step / 4, "staleness": step % 2, "step_s": 0.1})
    assert record.finish() == png and png.exists()
    assert [key for key, _ in plotted_panels(record.log.rows("grpo"))] == ["reward", "staleness"]


def test_a_resumed_run_cuts_the_metrics_back_to_its_checkpoint_and_a_fresh_one_starts_over(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"kind": "sft", "step": 25, "accuracy": 0.2})
    for step in range(5):
        log.write({"kind": "grpo", "step": step, "reward": 0.5})
    RunRecord(tmp_path, 3, "resumed")  # the checkpoint of step 3: steps 3 and 4 are trained again
    assert [(r["kind"], r["step"]) for r in log.rows()] == [("sft", 25), ("grpo", 0), ("grpo", 1), ("grpo", 2)]
    RunRecord(tmp_path, None, "fresh")
    assert log.rows() == []
