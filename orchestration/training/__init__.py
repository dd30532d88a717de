"""The training library: the pieces of an RL or SFT loop (samples, prompt buffer, rollout manager, training backends,
losses, filters, weight sync, logging) as plain objects and functions over our queue, workers and trainers, so a
researcher writes their own loop in a page (docs/library.md).

Every public name is importable from here; the submodules mirror the rollouts quick reference's layout
(``types``, ``datasets``, ``filters``, ``rl_losses``, ``metrics``, ``weight_sync``, ``backends``, ``rollout_gen``,
``loops``), so code written against it needs only its imports changed.
"""

from orchestration.training.backends import TrainFuture, TrainingBackend
from orchestration.training.rollout_gen import AsyncRolloutManager, generate_rollout_batches
from orchestration.training.types import (
    LibraryError,
    RLTrainingConfig,
    RolloutBatch,
    RolloutConfig,
    Sample,
    SFTTrainingConfig,
)

__all__ = [
    "AsyncRolloutManager",
    "LibraryError",
    "RLTrainingConfig",
    "RolloutBatch",
    "RolloutConfig",
    "SFTTrainingConfig",
    "Sample",
    "TrainFuture",
    "TrainingBackend",
    "generate_rollout_batches",
]
