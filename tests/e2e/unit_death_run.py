"""A short demo run (recipe/demo.py's configuration) during which storage units are killed (SIGKILL): the one holding
step 1's prompts right after they are put, and the one holding step 3's prompts 0.3 s later (the tiny model may have
trained that step by then: the kill then takes later rows, or none). Before each step is cleared it writes what the
queue says about it to ``audit.jsonl``: the live rows' group ids, the lost rows with the trainer's state of them, and
the trainer's acknowledgements. Run by tests/e2e/test_unit_death_run.py:

    python tests/e2e/unit_death_run.py output_dir=DIR [key=value ...]
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

import transfer_queue  # noqa: E402
from orchestration.config import config_from_cli  # noqa: E402
from orchestration.grpo_run import GRPORun, connect_ray  # noqa: E402
from rl_contracts.stages import TRAIN_TASK  # noqa: E402

KILLS = {1: 0.0, 3: 0.3}  # step -> seconds after its prompts are put


class AuditedRun(GRPORun):
    """A run that writes ``write_audit(step)`` to ``audit.jsonl`` before each step is cleared, and kills storage units
    (tests/e2e/queue_kill_run.py builds on it too)."""

    queue_task_names = (*GRPORun.queue_task_names, "probe", "audit")  # its peeks at the prompts' rows
    #: "a": a run started again in the same output_dir (a trainer-group restart) appends to the audit of the last
    audit_mode = "w"

    def __init__(self, config: Any):
        super().__init__(config)
        self.kills: list[dict[str, Any]] = []
        self.audit = (self.out / "audit.jsonl").open(self.audit_mode)
        clear = self.client.clear

        def audit_then_clear(global_step: int | None = None, partition_id: str | None = None) -> None:
            if global_step is not None:
                self.write_audit(global_step)
            clear(global_step=global_step, partition_id=partition_id)

        self.client.clear = audit_then_clear  # type: ignore[method-assign]

    def unit_holding_prompts(self, step: int) -> int:
        rows = self.cfg.prompts_per_step * self.cfg.n_samples
        meta = self.client.get_meta(["prompt_ids"], rows, global_step=step, task_name="probe", peek=True, timeout=30)
        return int(meta.blocks[0, 0]) % self.cfg.num_storage_units

    def kill(self, step: int, unit: int, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        self.kills.append({"step": step, "unit": unit, "pid": pid})
        print(f"killed storage unit {unit} (pid {pid}) during step {step}", flush=True)

    def write_audit(self, step: int) -> None:
        raise NotImplementedError


class UnitKillingRun(AuditedRun):
    def launch(self, step: int, min_version: int | None = None) -> tuple[list[Any], list[Any]]:
        refs = super().launch(step, min_version)
        if step in KILLS:
            unit = self.unit_holding_prompts(step)
            pid = ray.get(transfer_queue.get_controller().storage_stats.remote())[unit]["pid"]
            threading.Timer(KILLS[step], self.kill, (step, unit, pid)).start()
        return refs

    def write_audit(self, step: int) -> None:
        capacity = self.cfg.prompts_per_step * self.cfg.n_samples
        client = self.client
        live = client.get_meta(["prompt_ids"], capacity, global_step=step, task_name="audit", peek=True, timeout=30)
        lost = client.lost_rows(global_step=step)
        row = {
            "step": step,
            "live_groups": live.group_ids.tolist(),
            "lost": [(r["global_index"], r["group_id"], r["tasks"].get(TRAIN_TASK)) for r in lost],
            "train": self.client.get_consumption_status(global_step=step, task_name=TRAIN_TASK)["tasks"][TRAIN_TASK],
            "rows_lost": self.client.get_production_status(global_step=step)["rows_lost"],
        }  # fmt: skip
        self.audit.write(json.dumps(row) + "\n")
        self.audit.flush()


def main(argv: list[str]) -> int:
    config = config_from_cli(__doc__ or "", ROOT / "recipe" / "configs" / "demo.yaml", argv)
    connect_ray()
    run = UnitKillingRun(config)
    try:
        run.run()
        controller = transfer_queue.get_controller()
        deadline = time.monotonic() + 60  # a kill late in the run: the restart may come after the last step
        while time.monotonic() < deadline:
            restarts = ray.get(controller.server_stats.remote())["storage_units_restarted"]
            if sum(restarts.values()) >= len(run.kills):
                break
            time.sleep(0.2)
        summary = {"kills": run.kills, "groups_put_again": run.lost_prompts.groups_put_again, "restarts": restarts}
        (run.out / "unit_death.json").write_text(json.dumps(summary))
    finally:
        run.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
