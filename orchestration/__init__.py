"""The run's orchestration: the only layer that knows the queue, the workers (producers) and the trainers
(consumers) together. Recipes use it; workers and trainers never import it, nor each other."""

from orchestration.grpo_run import GRPORun, connect_ray, train_and_report

__all__ = ["GRPORun", "connect_ray", "train_and_report"]
