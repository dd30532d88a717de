"""Training loops over a ``TrainingBackend``."""

from orchestration.training.loops.sft_loop import run_sft_training

__all__ = ["run_sft_training"]
