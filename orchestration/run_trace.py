"""A run's trace (``trace=true``): each GRPO step's stages beside the queue's requests, in one Perfetto file.

The queue's controller records every request it answers (transfer_queue/ops/trace.py: puts, get_meta with their
waits, acknowledgements, per client and task, with the rows' global indexes); this adds the RL stages of each step
on tracks of their own: the driver's step, the trainer's step, the weights' publish, and each rollout and reward
worker's part of the step (from its first batch to its return, with its busy seconds, rows and tokens as arguments).
Written to ``output_dir/trace.json`` when the run ends, however it ends; open it in https://ui.perfetto.dev.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from transfer_queue.ops.trace import chrome_trace, span

PROCESS = "RL run"


class StageTrace:
    """Starts the controller's trace; collects the stages of each step; :meth:`write` ends both into one file."""

    def __init__(self, controller: Any, path: Path, max_events: int = 200_000):
        self.controller = controller
        self.path = path
        self.spans: list[dict[str, Any]] = []
        ray.get(controller.trace_start.remote(max_events))

    def step(
        self,
        step: int,
        wall: tuple[float, float],
        train: tuple[float, float],
        rollout: list[dict[str, float]],
        reward: list[dict[str, float]],
        publish_s: float,
    ) -> None:
        """The spans of ``step``: ``wall`` and ``train`` are (start, end) in ``time.time()`` seconds as the driver saw
        them; ``rollout`` / ``reward`` the workers' stats (with ``started_at`` / ``ended_at`` where they report them);
        ``publish_s`` the seconds the weights took to reach the engines, drawn as ending with the step."""
        self.spans.append(span(f"step {step}", *wall, PROCESS, "driver", step=step))
        self.spans.append(span("train", *train, PROCESS, "trainer", step=step))
        if publish_s > 0:
            self.spans.append(span("publish", wall[1] - publish_s, wall[1], PROCESS, "weights", step=step))
        for name, stats_list, busy in (("generate", rollout, "generate_s"), ("reward", reward, "reward_s")):
            for worker, stats in enumerate(stats_list):
                if "started_at" not in stats:
                    continue  # the worker had no rows of this step, or does not report when it worked
                args = {"step": step, "rows": stats.get("rows", 0.0), busy: stats.get(busy, 0.0)}
                if "tokens" in stats:
                    args["tokens"] = stats["tokens"]
                thread = f"{'rollout' if name == 'generate' else 'reward'} worker {worker}"
                self.spans.append(span(name, stats["started_at"], stats["ended_at"], PROCESS, thread, **args))

    def write(self) -> Path:
        """Stop the controller's trace and write its spans with the stages to :attr:`path`."""
        try:
            queue_events = ray.get(self.controller.trace_stop.remote(), timeout=30)
        except Exception:  # the queue is gone (a failed run): the stages alone are still worth a look
            queue_events = []
        return chrome_trace(self.path, queue_events, self.spans)
