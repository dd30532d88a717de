"""Training backends: the ``TrainingBackend`` protocol and its implementations."""

from orchestration.training.backends.base import TrainFuture, TrainingBackend
from orchestration.training.backends.checkpoints import latest_checkpoint
from orchestration.training.backends.factory import create_pytorch_backend
from orchestration.training.backends.fsdp import FSDPConfig, FSDPTrainingBackend
from orchestration.training.backends.pytorch import PyTorchTrainingBackend

__all__ = [
    "FSDPConfig",
    "FSDPTrainingBackend",
    "PyTorchTrainingBackend",
    "TrainFuture",
    "TrainingBackend",
    "create_pytorch_backend",
    "latest_checkpoint",
]
