"""A short demo run (recipe/demo.py's configuration) during which one queue actor is killed: ``kill=unit`` SIGKILLs the
storage unit holding step 1's prompts right after they are put (run it with ``queue_replicas=2``: its rows have a
second copy), ``kill=controller`` kills the controller as step 1 is launched (``ray.kill(..., no_restart=False)``:
Ray restarts it; run it with ``queue_journal=true``). Before each step is cleared it writes what the queue says about
it to ``audit.jsonl``: the trainer's acknowledgements and the rows lost. Run by tests/e2e/test_queue_kill_run.py:

    python tests/e2e/queue_kill_run.py kill=unit|controller output_dir=DIR [key=value ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

import transfer_queue  # noqa: E402
from orchestration.config import config_from_cli  # noqa: E402
from orchestration.grpo_run import connect_ray  # noqa: E402
from rl_contracts.stages import TRAIN_TASK  # noqa: E402
from tests.e2e.unit_death_run import AuditedRun  # noqa: E402

KILL_STEP = 1


class QueueKillingRun(AuditedRun):
    def __init__(self, config: Any, kill: str):
        super().__init__(config)
        self.kill_what = kill

    def launch(self, step: int, min_version: int | None = None) -> tuple[list[Any], list[Any]]:
        refs = super().launch(step, min_version)
        if step == KILL_STEP:
            controller = transfer_queue.get_controller()
            if self.kill_what == "unit":
                unit = self.unit_holding_prompts(step)
                self.kill(step, unit, ray.get(controller.storage_stats.remote())[unit]["pid"])
            else:
                ray.kill(controller, no_restart=False)
                self.kills.append({"step": step, "controller": True})
                print(f"killed the controller during step {step}", flush=True)
        return refs

    def write_audit(self, step: int) -> None:
        row = {
            "step": step,
            "train": self.client.get_consumption_status(global_step=step, task_name=TRAIN_TASK)["tasks"][TRAIN_TASK],
            "rows_lost": self.client.get_production_status(global_step=step)["rows_lost"],
        }
        self.audit.write(json.dumps(row) + "\n")
        self.audit.flush()


def main(argv: list[str]) -> int:
    kill = next(a.split("=", 1)[1] for a in argv if a.startswith("kill="))
    assert kill in ("unit", "controller"), kill
    argv = [a for a in argv if not a.startswith("kill=")]
    config = config_from_cli(__doc__ or "", ROOT / "recipe" / "configs" / "demo.yaml", argv)
    connect_ray()
    run = QueueKillingRun(config, kill)
    try:
        run.run()
        summary = {"kills": run.kills, "groups_put_again": run.lost_prompts.groups_put_again}
        if kill == "unit":
            summary["restarts"] = ray.get(transfer_queue.get_controller().server_stats.remote())[
                "storage_units_restarted"
            ]
        (run.out / "queue_kill.json").write_text(json.dumps(summary))
    finally:
        run.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
