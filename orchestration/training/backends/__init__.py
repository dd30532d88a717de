"""Training backends: the ``TrainingBackend`` protocol and its implementations."""

from orchestration.training.backends.base import TrainFuture, TrainingBackend

__all__ = ["TrainFuture", "TrainingBackend"]
