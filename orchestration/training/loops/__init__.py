"""The training loops over a ``TrainingBackend``: ``run_sft_training`` (``sft_loop``) and ``run_rl_training``
(``rl_loop``)."""

from orchestration.training.loops.rl_loop import run_rl_training
from orchestration.training.loops.sft_loop import run_sft_training

__all__ = ["run_rl_training", "run_sft_training"]
