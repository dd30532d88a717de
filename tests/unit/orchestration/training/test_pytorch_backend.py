"""PyTorchTrainingBackend: futures (the quick reference's pipelining snippet), gradient accumulation, both loss
signatures, checkpoints that resume bit-identically, latest_checkpoint's numeric order, export_hf loadable by our HF
engine, and create_pytorch_backend's local-only loading."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from orchestration.training import (
    LibraryError,
    PyTorchTrainingBackend,
    TrainFuture,
    create_pytorch_backend,
    latest_checkpoint,
    next_token_loss,
    samples_to_batch,
)
from tests.unit.orchestration.training.conftest import tiny_llama
from workers.engines.base import SamplingParams
from workers.engines.hf import HFEngine


def make_backend(tmp_path, loss_fn=next_token_loss, seed: int = 0, **kwargs) -> PyTorchTrainingBackend:
    model = tiny_llama(seed)
    return PyTorchTrainingBackend(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn, tmp_path, **kwargs)


def rl_loss(logits, labels, loss_mask, advantages):
    """A REINFORCE-style loss with the seed's RL signature."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, labels[:, 1:, None]).squeeze(-1)
    per_row = (logprobs * loss_mask[:, 1:]).sum(-1)
    return -(per_row * advantages).mean(), {"mean_advantage": advantages.mean()}


async def train(backend, batch, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        fut = backend.forward_backward(batch)
        losses.append((await fut.result())["loss"])
        await backend.optim_step().result()
    return losses


def test_the_pipelining_snippet_of_the_quick_reference(tmp_path, samples) -> None:
    backend = make_backend(tmp_path)
    batch = samples_to_batch(samples)

    async def main():
        fwd_future = backend.forward_backward(batch)
        assert isinstance(fwd_future, TrainFuture)
        next_batch = samples_to_batch(samples[:2])  # ... do other work ...
        fwd_metrics = await fwd_future.result()
        opt_metrics = await backend.optim_step().result()
        also = await backend.forward_backward(next_batch)  # the protocol's `await` spelling gives the future
        return fwd_metrics, opt_metrics, await also.result()

    fwd, opt, second = asyncio.run(main())
    assert fwd["num_tokens"] == 16 and fwd["loss"] > 0
    assert opt["step"] == 1 and opt["lr"] == pytest.approx(1e-2) and opt["grad_norm"] > 0
    assert second["num_tokens"] == 8
    assert backend.optim_step().wait(timeout=60)["step"] == 2
    backend.close()


def test_gradients_accumulate_until_the_optimizer_step(tmp_path, samples) -> None:
    backend = make_backend(tmp_path)
    backend.forward_backward(samples_to_batch(samples[:2])).wait()
    one = [p.grad.clone() for p in backend.model.parameters()]
    backend.forward_backward(samples_to_batch(samples[:2])).wait()
    for p, g in zip(backend.model.parameters(), one, strict=True):
        torch.testing.assert_close(p.grad, 2 * g)
    backend.optim_step().wait()
    assert all(p.grad is None for p in backend.model.parameters())


def test_an_rl_loss_gets_the_advantages_and_an_sft_loss_does_not(tmp_path, samples) -> None:
    backend = make_backend(tmp_path, loss_fn=rl_loss)
    out = backend.forward_backward(samples_to_batch(samples, advantages=[1.0, -1.0, 0.5, 0.5])).wait()
    assert out["mean_advantage"] == pytest.approx(0.25)
    with pytest.raises(LibraryError, match=r"loss_fn rl_loss needs batch keys \['advantages'\]"):
        backend.forward_backward(samples_to_batch(samples))
    sft = make_backend(tmp_path, loss_fn=next_token_loss)
    assert sft.forward_backward(samples_to_batch(samples, advantages=[1.0] * 4)).wait()["loss"] > 0


def test_a_loss_without_logits_or_a_non_batch_is_refused(tmp_path, samples) -> None:
    with pytest.raises(LibraryError, match="loss_fn <lambda> must take a logits= argument"):
        make_backend(tmp_path, loss_fn=lambda labels: labels)
    with pytest.raises(LibraryError, match=r"a batch is a dict of tensors with input_ids \[B, T\]"):
        make_backend(tmp_path).forward_backward([1, 2, 3])  # type: ignore[arg-type]


def test_a_checkpoint_resumes_training_bit_identically(tmp_path, samples) -> None:
    batch = samples_to_batch(samples)

    async def run():
        straight = make_backend(tmp_path / "a", max_grad_norm=1.0)
        expected = await train(straight, batch, 4)

        first = make_backend(tmp_path / "b", max_grad_norm=1.0)
        got = await train(first, batch, 2)
        path = await first.save_checkpoint(2, {"loss": got[-1]})
        resumed = make_backend(tmp_path / "b", seed=7, max_grad_norm=1.0)  # other weights until loaded
        metadata = await resumed.load_checkpoint(path)
        got += await train(resumed, batch, 2)
        return straight, resumed, expected, got, path, metadata

    straight, resumed, expected, got, path, metadata = asyncio.run(run())
    assert got == expected
    for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert resumed.step == 4
    assert path == tmp_path / "b" / "step_2"
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "metadata.json",
        "optimizer.bin",
        "pytorch_model.bin",
    ]
    assert metadata["step"] == 2 and metadata["metrics"]["loss"] == got[1] and "time" in metadata
    assert metadata["config"]["backend"] == "pytorch" and metadata["config"]["max_grad_norm"] == 1.0
    assert json.loads((path / "metadata.json").read_text()) == metadata


def test_loading_a_directory_that_is_not_a_checkpoint_fails(tmp_path) -> None:
    with pytest.raises(LibraryError, match="is not a checkpoint written by save_checkpoint"):
        asyncio.run(make_backend(tmp_path).load_checkpoint(tmp_path))


def test_latest_checkpoint_orders_steps_by_number(tmp_path) -> None:
    assert latest_checkpoint(tmp_path / "none") is None
    for step in (2, 9, 10):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "metadata.json").write_text("{}")
    (tmp_path / "step_11").mkdir()  # unfinished: no metadata.json
    (tmp_path / ".step_12.tmp").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"


def test_export_hf_and_checkpoints_load_in_the_hf_engine(tmp_path, samples) -> None:
    backend = make_backend(tmp_path / "ckpt")

    async def run():
        await train(backend, samples_to_batch(samples), 1)
        return await backend.export_hf(tmp_path / "hf"), await backend.save_checkpoint(1, {})

    hf_dir, ckpt = asyncio.run(run())
    assert (hf_dir / "config.json").is_file() and (hf_dir / "model.safetensors").is_file()
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    for directory in (hf_dir, ckpt):
        engine = HFEngine(model_path=str(directory), pad_token_id=0, eos_token_id=2)
        for a, b in zip(engine.model.state_dict().values(), backend.model.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        assert len(engine.generate([[1, 3, 4]], 1, params)[0][0].token_ids) <= 4


def test_create_pytorch_backend_loads_a_local_directory_only(tmp_path, samples) -> None:
    tiny_llama().save_pretrained(tmp_path / "model")
    backend = create_pytorch_backend(
        model_name=str(tmp_path / "model"), checkpoint_dir=tmp_path / "ck", learning_rate=1e-3
    )
    assert backend.forward_backward(samples_to_batch(samples)).wait()["loss"] > 0
    assert backend.optim_step().wait()["lr"] == pytest.approx(1e-3)
    with pytest.raises(LibraryError, match=r"model_name='Qwen/Qwen2.5-7B' is not a local directory; models are never"):
        create_pytorch_backend(model_name="Qwen/Qwen2.5-7B", checkpoint_dir=tmp_path / "ck")
