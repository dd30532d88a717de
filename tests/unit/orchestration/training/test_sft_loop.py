"""run_sft_training: a tiny Llama learns a few samples (the loss falls), rows are logged every log_every, the
checkpoints land where the config says, the batches cycle deterministically."""

from __future__ import annotations

import asyncio

import pytest
import torch

from orchestration.training import (
    LibraryError,
    PyTorchTrainingBackend,
    SFTTrainingConfig,
    TrainFuture,
    latest_checkpoint,
    next_token_loss,
    run_sft_training,
)
from tests.unit.orchestration.training.conftest import tiny_llama


class ListLogger:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def log(self, metrics: dict, step: int) -> None:
        self.rows.append((step, metrics))


def test_a_tiny_llama_learns_its_samples(tmp_path, samples) -> None:
    model = tiny_llama()
    backend = PyTorchTrainingBackend(model, torch.optim.AdamW(model.parameters(), lr=3e-2), next_token_loss, tmp_path)
    logger = ListLogger()
    config = SFTTrainingConfig(num_steps=12, batch_size=2, log_every=4, checkpoint_every=8)

    rows = asyncio.run(run_sft_training(backend, samples, config, logger, progress=False))

    assert [row["step"] for row in rows] == list(range(1, 13))
    first, last = sum(r["loss"] for r in rows[:2]) / 2, sum(r["loss"] for r in rows[-2:]) / 2
    assert last < 0.75 * first, (first, last)
    assert [step for step, _ in logger.rows] == [4, 8, 12]
    assert {"loss", "num_tokens", "grad_norm", "lr", "seconds"} <= set(logger.rows[0][1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_12", "step_8"]
    assert rows[7]["checkpoint"] == str(tmp_path / "step_8") and latest_checkpoint(tmp_path) == tmp_path / "step_12"


class RecordingBackend:
    """Records the batches it is given; every call done at once."""

    def __init__(self) -> None:
        self.batches: list[list[list[int]]] = []
        self.saved: list[int] = []

    def forward_backward(self, batch):
        self.batches.append(batch["input_ids"].tolist())
        return TrainFuture.done_with({"loss": 1.0, "num_tokens": 1})

    def optim_step(self):
        return TrainFuture.done_with({"lr": 0.1, "step": len(self.batches), "grad_norm": 0.0})

    async def save_checkpoint(self, step, metrics):
        self.saved.append(step)
        return f"step_{step}"

    async def load_checkpoint(self, path):
        return {}


def test_batches_cycle_through_the_samples_in_order(samples) -> None:
    backend = RecordingBackend()
    config = SFTTrainingConfig(num_steps=3, batch_size=3, log_every=1, checkpoint_every=0)
    asyncio.run(run_sft_training(backend, samples, config, progress=False))
    firsts = [[row[1] for row in batch] for batch in backend.batches]  # each sample's first prompt token
    assert firsts == [[3, 6, 9], [12, 3, 6], [9, 12, 3]]
    assert backend.saved == [3]  # checkpoint_every=0: only at the end


def test_no_samples_or_a_backend_without_the_protocol_is_refused(samples) -> None:
    config = SFTTrainingConfig(num_steps=1, batch_size=1)
    with pytest.raises(LibraryError, match="run_sft_training needs at least one sample, got none"):
        asyncio.run(run_sft_training(RecordingBackend(), [], config))
    with pytest.raises(
        LibraryError, match=r"backend object lacks \['forward_backward', 'optim_step', 'save_checkpoint'\]"
    ):
        asyncio.run(run_sft_training(object(), samples, config))  # type: ignore[arg-type]
