"""A short demo run (recipe/demo.py's configuration) during which a rollout worker and a reward worker are killed
(SIGKILL of the actor's process): rollout worker 0 once the rollout of step 1 holds rows (leased, not written yet),
reward worker 0 once the scoring of step 3 does. Ray restarts them, the run's supervisor makes their calls again, the
rows they held come back (orchestration/supervisor.py). Before each step is cleared it writes what the queue says about
it to ``audit.jsonl``: the live rows' group ids, the fields produced, the trainer's acknowledgements. Run by
tests/e2e/test_worker_kill_run.py:

    python tests/e2e/worker_kill_run.py output_dir=DIR [key=value ...]
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
from orchestration.grpo_run import connect_ray  # noqa: E402
from rl_contracts.inflight import inflight_partition  # noqa: E402
from rl_contracts.stages import REWARD_TASK, ROLLOUT_TASK, TRAIN_TASK  # noqa: E402
from tests.e2e.unit_death_run import AuditedRun  # noqa: E402
from transfer_queue.errors import PartitionCleared, UnknownPartition  # noqa: E402

KILLS = {1: ("rollout", ROLLOUT_TASK), 3: ("reward", REWARD_TASK)}  # step -> the worker killed while it holds rows
HOLD_WAIT_S = 60.0  # the longest the killer waits for the worker to hold rows of the step (then it kills anyway)


def kill_when_holding(
    client: Any, step: int, task: str, pid: int, deadline_s: float = HOLD_WAIT_S, checkpointed: bool = False
) -> int:
    """SIGKILL ``pid`` as soon as ``task`` holds rows of ``step`` (leased, not written), or once the step is gone
    or ``deadline_s`` passed; returns the rows it held (as far as the queue said just before). ``checkpointed``
    (``rollout.checkpoint_inflight``): not before the rows have in-flight checkpoints (the worker is mid-generation)."""
    deadline = time.monotonic() + deadline_s
    held = 0
    while time.monotonic() < deadline:
        try:
            held = int(client.get_consumption_status(global_step=step, task_name=task)["tasks"][task]["leased"])
        except (UnknownPartition, PartitionCleared):
            held = 0
            break
        if held and (not checkpointed or client.kv_list(inflight_partition(step))):
            break
        time.sleep(0.001 if held else 0.005)
    os.kill(pid, signal.SIGKILL)
    return held


class WorkerKillingRun(AuditedRun):
    def __init__(self, config: Any):
        super().__init__(config)
        self.killer = transfer_queue.TransferQueueClient("killer", self.client.controller_info)
        self.threads: list[threading.Thread] = []

    def launch(self, step: int, min_version: int | None = None) -> tuple[list[Any], list[Any]]:
        refs = super().launch(step, min_version)
        if step in KILLS:
            kind, task = KILLS[step]
            worker = (self.rollout if kind == "rollout" else self.reward)[0]
            pid = ray.get(worker.pid.remote())

            def kill() -> None:
                checkpointed = kind == "rollout" and self.cfg.rollout.checkpoint_inflight
                held = kill_when_holding(self.killer, step, task, pid, checkpointed=checkpointed)
                self.kills.append({"step": step, "kind": kind, "pid": pid, "rows_held": held})
                print(f"killed {kind} worker 0 (pid {pid}) holding {held} rows of step {step}", flush=True)

            thread = threading.Thread(target=kill, daemon=True)
            thread.start()
            self.threads.append(thread)
        return refs

    def write_audit(self, step: int) -> None:
        capacity = self.cfg.prompts_per_step * self.cfg.n_samples
        client = self.client
        live = client.get_meta(["prompt_ids"], capacity, global_step=step, task_name="audit", peek=True, timeout=30)
        production = client.get_production_status(global_step=step)
        row = {
            "step": step,
            "live_groups": live.group_ids.tolist(),
            "produced": {name: f["produced"] for name, f in production["fields"].items()},
            "train": client.get_consumption_status(global_step=step, task_name=TRAIN_TASK)["tasks"][TRAIN_TASK],
            "rows_lost": production["rows_lost"],
        }
        self.audit.write(json.dumps(row) + "\n")
        self.audit.flush()


def main(argv: list[str]) -> int:
    config = config_from_cli(__doc__ or "", ROOT / "recipe" / "configs" / "demo.yaml", argv)
    connect_ray()
    run = WorkerKillingRun(config)
    try:
        run.run()
        for thread in run.threads:
            thread.join(timeout=HOLD_WAIT_S)
        summary = {"kills": run.kills, "restarts": run.supervisor.restarts, "calls": run.supervisor.calls_made_again}
        (run.out / "worker_kill.json").write_text(json.dumps(summary))
    finally:
        run.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
