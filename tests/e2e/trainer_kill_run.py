"""A short demo run (recipe/demo.py's configuration, through ``train_from_command_line``) during which trainer rank 1
is killed (SIGKILL of its process, its pid asked of the rank actor) shortly after the training of step ``KILL_STEP``
was launched (on a machine fast enough to train the step within that delay, before the next step's training). The
run stops what it started and resumes from its last checkpoint in the same process (orchestration/trainer_restarts.py).
Run by tests/e2e/test_trainer_kill_run.py:

    python tests/e2e/trainer_kill_run.py output_dir=DIR [key=value ...]
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from orchestration.config import config_from_cli  # noqa: E402
from orchestration.grpo_run import GRPORun, train_from_command_line  # noqa: E402

KILL_STEP = 3  # the step whose training is under way when rank 1 is killed
KILL_DELAY_S = 0.3  # after that step's train() began
KILLED_RANK = 1


def main(argv: list[str]) -> int:
    config = config_from_cli(__doc__ or "", ROOT / "recipe" / "configs" / "demo.yaml", argv)
    killed: list[int] = []

    def loop(run: GRPORun) -> list[dict[str, Any]]:
        if not killed:  # the first start of the run: kill the rank once, in step KILL_STEP's training
            train = run.train

            def killing_train(step: int) -> dict[str, float]:
                if step != KILL_STEP or killed:
                    return train(step)
                pid = ray.get(run.trainer[KILLED_RANK].pid.remote())
                killed.append(pid)
                timer = threading.Timer(KILL_DELAY_S, os.kill, (pid, signal.SIGKILL))
                timer.start()
                print(f"killing trainer rank {KILLED_RANK} (pid {pid}) in step {step}", flush=True)
                try:
                    return train(step)
                finally:  # a step that trained faster than the delay: the rank dies before the next one
                    timer.join()

            run.train = killing_train  # type: ignore[method-assign]
        return run.run()

    return train_from_command_line(config, loop=loop)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
