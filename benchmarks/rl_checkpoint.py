"""What the queue's snapshot adds to an RL checkpoint: the demo (``recipe/configs/demo.yaml``: sync mode with the shm
weight channel, so one step of 32 x 8 rows is in flight at every save) with a checkpoint after every step, once with
``checkpoint_queue=true`` (the default) and once with ``false``; the median over the run's saves of the whole save
(``checkpoint_s``: model, optimizer, RNG of 2 FSDP ranks, and the queue) and of the queue's share (``queue_s``).

    python benchmarks/rl_checkpoint.py [--steps 40]

SFT is off (timing, not learning). Each run starts its own Ray.
"""

from __future__ import annotations

import argparse
import statistics

from common import demo_rows


def saves(steps: int, with_queue: bool) -> list[dict]:
    """The ``kind: checkpoint`` rows of one demo run (the save after SFT and the final one hold no queue: left out)."""
    rows = demo_rows(steps, "checkpoint_every=1", f"checkpoint_queue={str(with_queue).lower()}")
    return [r for r in rows if r["kind"] == "checkpoint" and 0 < r["step"] < steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    for with_queue in (False, True):
        rows = saves(args.steps, with_queue)
        total = statistics.median(r["checkpoint_s"] for r in rows)
        queue = statistics.median(r["queue_s"] for r in rows)
        queued = sorted({len(r["queue_steps"]) for r in rows})
        print(
            f"checkpoint_queue={str(with_queue).lower():5}  saves {len(rows)}  steps in the snapshot {queued}  "
            f"median checkpoint {1000 * total:.0f} ms, of which the queue {1000 * queue:.0f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
