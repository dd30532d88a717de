"""The training-backend protocol and its futures.

A backend starts work and hands back a ``TrainFuture`` at once, so a caller can pipeline (prepare the next batch while
the backward pass runs) and collects the result later:

    fut = backend.forward_backward(batch)    # started
    ...                                      # other work
    metrics = await fut.result()             # {"loss": ..., "grad_norm": ...}
    await backend.optim_step().result()

``await backend.forward_backward(batch)`` gives the future as well (as the quick reference's protocol writes it), so
both spellings work. Backends are structural (``typing.Protocol``): nothing needs to inherit from anything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Generator
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")


class TrainFuture(Generic[T]):
    """The pending result of a backend call, backed by a ``concurrent.futures.Future`` (a worker thread, a Ray
    object ref's future, or one already done).

    ``await fut.result()`` waits without blocking the event loop; ``fut.wait(timeout)`` blocks (for sync callers);
    ``await fut`` gives the future itself. An exception raised by the work is raised by ``result()``/``wait()``.
    """

    def __init__(self, future: concurrent.futures.Future[T]):
        self._future = future

    @classmethod
    def done_with(cls, value: T) -> TrainFuture[T]:
        """A future already holding ``value`` (work done in the caller)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        future.set_result(value)
        return cls(future)

    @classmethod
    def failed_with(cls, error: BaseException) -> TrainFuture[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_exception(error)
        return cls(future)

    def done(self) -> bool:
        return self._future.done()

    async def result(self) -> T:
        return await asyncio.wrap_future(self._future)

    def wait(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    def __await__(self) -> Generator[Any, None, TrainFuture[T]]:
        if False:  # pragma: no cover - makes this a generator
            yield
        return self


@runtime_checkable
class TrainingBackend(Protocol):
    """What the loops (``run_sft_training``, ``run_rl_training``) need of a backend.

    ``batch`` is a dict of tensors: ``input_ids`` ``[B, T]`` (int64, padded), ``labels`` ``[B, T]``, ``loss_mask``
    ``[B, T]`` (float, 0 on prompt and padding), and for RL ``advantages`` ``[B]`` (and ``old_log_probs`` ``[B, T]``
    for PPO); ``orchestration.training.batches`` builds it from samples.
    """

    def forward_backward(self, batch: dict[str, Any]) -> TrainFuture[dict[str, float]]:
        """Start the forward and backward pass of ``batch`` (gradients accumulate); ``{"loss", "grad_norm"?, ...}``."""
        ...

    def optim_step(self) -> TrainFuture[dict[str, float]]:
        """Start an optimizer step on the accumulated gradients, then zero them; ``{"lr", "step", "grad_norm"}``."""
        ...

    async def save_checkpoint(self, step: int, metrics: dict[str, Any]) -> Path:
        """Write ``checkpoint_dir/step_{step}/`` (model, optimizer, ``metadata.json``); returns its path."""
        ...

    async def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Load a directory ``save_checkpoint`` wrote (model and optimizer); returns its ``metadata.json``."""
        ...
