"""FSDPTrainingBackend on 2 CPU ranks (gloo, torch.multiprocessing spawn): its steps match one unsharded model on the
whole batch, and a DCP checkpoint at step_N (with metadata.json) restores the run exactly."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from orchestration.training import (
    FSDPConfig,
    FSDPTrainingBackend,
    LibraryError,
    latest_checkpoint,
    next_token_loss,
    samples_to_batch,
)
from tests.unit.orchestration.training.conftest import sft_samples, tiny_llama

WORLD_SIZE, LR = 2, 1e-2


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


async def steps(backend, batch, count: int) -> list[float]:
    losses = []
    for _ in range(count):
        losses.append((await backend.forward_backward(batch).result())["loss"])
        await backend.optim_step().result()
    return losses


def _rank(rank: int, port: int, workdir: str) -> None:
    from trainers.fsdp import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, WORLD_SIZE, "127.0.0.1", port, backend="gloo")
    try:
        samples = sft_samples()[2 * rank : 2 * rank + 2]  # each rank its half of the batch
        batch = samples_to_batch(samples)
        # rank 1 builds other weights: sync_module_states gives it rank 0's
        backend = FSDPTrainingBackend(tiny_llama(seed=rank), adamw, next_token_loss, workdir, FSDPConfig())

        async def run():
            losses = await steps(backend, batch, 2)
            path = await backend.save_checkpoint(2, {"loss": losses[-1]})
            after = await steps(backend, batch, 1)
            metadata = await backend.load_checkpoint(path)
            again = await steps(backend, batch, 1)
            return losses, after, again, metadata, backend.step

        losses, after, again, metadata, step = asyncio.run(run())
        record = {"losses": losses, "after": after, "again": again, "metadata": metadata, "step": step}
        with open(f"{workdir}/rank{rank}.json", "w") as f:
            json.dump(record, f)
        backend.close()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # two spawned ranks importing transformers: ~60 s on 2 shared cores
def test_two_ranks_train_like_one_model_and_resume_from_their_checkpoint(tmp_path) -> None:
    mp.spawn(_rank, args=(_free_port(), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]

    model = tiny_llama(seed=0)
    optimizer = adamw(model)
    batch = samples_to_batch(sft_samples())  # equal token counts per rank: the mean of the ranks' means
    expected = []
    for _ in range(3):
        loss = next_token_loss(
            model(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits, batch["labels"], batch["loss_mask"]
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())

    for record in ranks:
        assert record["losses"] + record["after"] == pytest.approx(expected, rel=1e-4)
        assert record["again"] == record["after"]  # restored at step 2: the third step again, bit for bit
        assert record["step"] == 3 and record["metadata"]["step"] == 2
        assert record["metadata"]["config"]["backend"] == "fsdp" and record["metadata"]["config"]["world_size"] == 2
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"


def test_the_backend_needs_a_process_group_and_a_known_strategy() -> None:
    with pytest.raises(LibraryError, match=r"FSDPConfig\.sharding_strategy='HYBRID' is not one of"):
        FSDPConfig(sharding_strategy="HYBRID")
    with pytest.raises(LibraryError, match=r"FSDPTrainingBackend needs an initialised torch\.distributed world"):
        FSDPTrainingBackend(tiny_llama(), adamw, next_token_loss, "ckpts")
