"""The training library: the pieces of an RL or SFT loop (samples, prompt buffer, rollout manager, training backends,
losses, filters, weight sync, logging) as plain objects and functions over our queue, workers and trainers, so a
researcher writes their own loop in a page (docs/library.md).

Every public name is importable from here; the submodules mirror the rollouts quick reference's layout
(``types``, ``datasets``, ``filters``, ``rl_losses``, ``metrics``, ``weight_sync``, ``backends``, ``rollout_gen``,
``loops``), so code written against it needs only its imports changed.
"""

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
from orchestration.training.loops import run_sft_training
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
    "FSDPConfig",
    "FSDPTrainingBackend",
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
    "create_pytorch_backend",
    "latest_checkpoint",
    "next_token_loss",
    "run_sft_training",
    "samples_to_batch",
    "sync_weights_to_engines",
]
