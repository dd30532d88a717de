"""The demo workload: where a GRPO step's time goes — the queue vs generation vs training.

Runs ``recipe/demo.py`` (SFT off: timing, not learning) in its own process with its own Ray, then reads its
``metrics.jsonl``. Per step, the queue's share is the time every actor spent inside queue calls (put, get_meta,
get_data), *minus* the time a get_meta was parked waiting for an upstream stage to produce rows (that is the
pipeline waiting, not the queue working), summed over actors and divided by the step's wall time: an upper bound on
the queue's share of the step. Target: <= 3 %.
"""

from __future__ import annotations

import statistics

from common import Result, demo_rows

WARMUP_STEPS = 5


def bench_demo(quick: bool, results) -> None:
    steps = 25 if quick else 60
    rows = demo_rows(steps)
    summary = next(r for r in rows if r["kind"] == "summary")
    rows = [r for r in rows if r["kind"] == "grpo"][WARMUP_STEPS:]

    def share(key: str) -> list[float]:
        return [100.0 * r[key] / r["step_s"] for r in rows]

    queue = share("queue_s")
    median_step = statistics.median(r["step_s"] for r in rows)
    extra = {"steps": len(rows), "step_ms": 1000 * median_step}
    results.add(
        Result(
            "demo: queue wall time (summed over actors) / step time",
            "demo",
            "%",
            queue,
            extra=extra,
        )
    )
    for key, label in (
        ("generate_s", "generation"),
        ("train_s", "training"),
        ("reward_s", "reward"),
        ("sync_s", "weight sync"),
        ("wait_s", "waiting for upstream (summed over actors)"),
    ):
        results.add(Result(f"demo: {label} share of step time", "demo", "%", share(key), extra=extra))
    results.add(Result("demo: GRPO step time", "demo", "ms", [1000 * r["step_s"] for r in rows]))
    # CPU, not wall clock: ~10 busy processes share 2 cores here, so every stage's wall time includes time spent
    # waiting for a core. The queue's CPU per step: its clients' threads inside queue calls + controller + units.
    # Every Ray actor process burns some CPU on Ray's own threads even when idle; measured for the three queue
    # processes by the run (the same as any idle actor's), it is not the queue's work and is taken out.
    server = max(summary["queue_server_cpu_s_per_step"] - summary.get("queue_idle_cpu_s_per_step", 0.0), 0.0)
    cpu_share = [100.0 * (r["queue_cpu_s"] + server) / r["step_s"] for r in rows]
    results.add(
        Result(
            "demo: queue CPU (clients + controller + storage) / step time",
            "demo",
            "%",
            cpu_share,
            target="<= 3 %",
            met=statistics.median(cpu_share) <= 3.0,
            extra={"server_cpu_ms_per_step": 1000 * server},
        )
    )
