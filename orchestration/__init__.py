"""The run's orchestration: the only layer that knows the queue, the workers (producers) and the trainers
(consumers) together. Recipes use it; workers and trainers never import it, nor each other.

Its names are imported on first use: ``orchestration.run_plan`` (what a recipe checks before it starts anything)
loads without the run's machinery (Ray, the queue, the workers), so a refused run is refused in a moment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestration.grpo_run import GRPORun, connect_ray, train_and_report, train_from_command_line

__all__ = ["GRPORun", "connect_ray", "train_and_report", "train_from_command_line"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from orchestration import grpo_run

        return getattr(grpo_run, name)
    raise AttributeError(f"module 'orchestration' has no attribute {name!r}")
