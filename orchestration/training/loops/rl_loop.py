"""``run_rl_training`` lands here; ``compute_advantages`` is importable from here as in the quick reference."""

from orchestration.training.advantages import compute_advantages

__all__ = ["compute_advantages"]
