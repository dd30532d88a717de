"""The training library: the pieces of an RL or SFT loop (samples, prompt buffer, rollout manager, training backends,
losses, filters, weight sync, logging) as plain objects and functions over our queue, workers and trainers, so a
researcher writes their own loop in a page (docs/library.md).

Every public name is importable from here; the submodules mirror the rollouts quick reference's layout
(``types``, ``datasets``, ``filters``, ``rl_losses``, ``metrics``, ``weight_sync``, ``backends``, ``rollout_gen``,
``loops``), so code written against it needs only its imports changed.
"""

from orchestration.training.advantages import compute_advantages, compute_group_advantages
from orchestration.training.backends import (
    FSDPConfig,
    FSDPTrainingBackend,
    PyTorchTrainingBackend,
    TrainFuture,
    TrainingBackend,
    create_pytorch_backend,
    latest_checkpoint,
)
from orchestration.training.batches import next_token_loss, samples_to_batch
from orchestration.training.datasets import DataBuffer, load_sft_dataset
from orchestration.training.filters import (
    check_min_reward,
    check_quality_and_diversity,
    check_response_diversity,
    check_reward_nonzero_std,
)
from orchestration.training.loops import run_rl_training, run_sft_training
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
from orchestration.training.weight_sync import SGLangEngine, VLLMEngine, sync_weights_to_engines

__all__ = [
    "AsyncRolloutManager",
    "DataBuffer",
    "FSDPConfig",
    "FSDPTrainingBackend",
    "JSONLLogger",
    "LibraryError",
    "PyTorchTrainingBackend",
    "RLTrainingConfig",
    "RolloutBatch",
    "RolloutConfig",
    "SFTTrainingConfig",
    "SGLangEngine",
    "Sample",
    "TrainFuture",
    "TrainingBackend",
    "VLLMEngine",
    "check_min_reward",
    "check_quality_and_diversity",
    "check_response_diversity",
    "check_reward_nonzero_std",
    "compute_advantages",
    "compute_group_advantages",
    "create_pytorch_backend",
    "generate_rollout_batches",
    "grpo_loss",
    "latest_checkpoint",
    "load_sft_dataset",
    "next_token_loss",
    "ppo_loss",
    "run_rl_training",
    "run_sft_training",
    "samples_to_batch",
    "sync_weights_to_engines",
    "token_log_probs",
]
