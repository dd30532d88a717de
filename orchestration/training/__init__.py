"""The training library: the pieces of an RL or SFT loop (samples, prompt buffer, rollout manager, training backends,
losses, filters, weight sync, logging) as plain objects and functions over our queue, workers and trainers, so a
researcher writes their own loop in a page (docs/library.md).

Every public name is importable from here; the submodules mirror the rollouts quick reference's layout
(``types``, ``datasets``, ``filters``, ``rl_losses``, ``metrics``, ``weight_sync``, ``backends``, ``rollout_gen``,
``loops``), so code written against it needs only its imports changed.
"""

from orchestration.training.advantages import compute_advantages, compute_group_advantages
from orchestration.training.backends import TrainFuture, TrainingBackend
from orchestration.training.datasets import DataBuffer, load_sft_dataset
from orchestration.training.filters import (
    check_min_reward,
    check_quality_and_diversity,
    check_response_diversity,
    check_reward_nonzero_std,
)
from orchestration.training.metrics import JSONLLogger
from orchestration.training.rl_losses import grpo_loss, ppo_loss, token_log_probs
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
    "DataBuffer",
    "JSONLLogger",
    "LibraryError",
    "RLTrainingConfig",
    "RolloutBatch",
    "RolloutConfig",
    "SFTTrainingConfig",
    "Sample",
    "TrainFuture",
    "TrainingBackend",
    "check_min_reward",
    "check_quality_and_diversity",
    "check_response_diversity",
    "check_reward_nonzero_std",
    "compute_advantages",
    "compute_group_advantages",
    "generate_rollout_batches",
    "grpo_loss",
    "load_sft_dataset",
    "ppo_loss",
    "token_log_probs",
]
