"""Every code snippet of the rollouts quick reference (/tmp/rollouts-quickref.md, the seed docs/library.md maps to
``orchestration.training``), run against this package.

Each test keeps the snippet's own lines (marked ``# --- snippet`` ... ``# --- end snippet``) and adds what they need
around them: a tiny Llama and a character-level tokenizer saved to a local directory (for hub model names), a custom
engine object (for ``SGLangEngine("http://localhost:30000")``: no servers here), and real values for the ``...``
placeholders. Top-level ``await`` runs inside ``asyncio.run(main())``. The FSDP snippet is covered by
test_fsdp_backend.py, the Protocol block is a signature listing (test_pytorch_backend.py checks it), and the bash
``torchrun`` line is not Python.

Where a snippet's line had to change, the line says so (``# changed: ...``). The changes, and why:
    - step counts (``num_steps=1000``) are cut to a few steps, so the file runs in seconds on a CPU (and the
      Single-GPU SFT workflow's ``learning_rate=1e-4`` is 1e-2, so 20 steps show the loss falling);
    - the Sample snippet's ``tokens=[...]`` is four ids (its ``loss_mask`` has four weights), and the custom filter's
      config names ``n_samples_per_prompt`` (its ``my_fn`` returns groups: a filter of one sample checks nothing);
    - ``device=torch.device("cuda:0")`` / ``device_type="cuda"`` become the CPU when no GPU is here;
    - ``load_sft_dataset("gsm8k", ...)`` reads a local JSONL the test writes (the library never downloads);
    - the "Unified Training Pipeline" step 2, ``sorted(output_dir / "checkpoints" / "step_*")[-1]``, cannot run: a
      ``Path`` is not iterable (a glob was meant), and a name sort puts ``step_10`` before ``step_9``; it is
      ``latest_checkpoint(output_dir / "checkpoints")``, and ``run_sft`` / ``run_rl`` (functions of the reference's
      train.py, not of the library) are written here, ``run_rl`` loading the checkpoint with
      ``backend.load_checkpoint``;
    - the Pure Function snippet's ``for batch in batches: pass`` never ends (the generator is endless, as the
      reference's is): the body stops after three batches;
    - "RL with SGLang Inference": the snippet's ``generate_fn`` uses ``prompt_tokens`` and ``response_tokens``
      without defining them (two lines define them), and its ``filter_fn=check_quality_and_diversity`` refuses every
      group of one sample (a single reward has no spread), which the snippet's config asks for by default: the
      config gets ``n_samples_per_prompt=GROUP`` and a ``reward_fn`` (the snippet sets no reward either), and
      ``generate_fn`` rolls out each prompt ``GROUP`` times; ``run_rl_training``'s rows are kept (``metrics =``).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from orchestration.training import (
    AsyncRolloutManager,
    DataBuffer,
    JSONLLogger,
    PyTorchTrainingBackend,
    RLTrainingConfig,
    RolloutBatch,
    RolloutConfig,
    Sample,
    SFTTrainingConfig,
    check_quality_and_diversity,
    latest_checkpoint,
    next_token_loss,
    run_rl_training,
    run_sft_training,
    samples_to_batch,
    token_log_probs,
)
from tests.unit.orchestration.training.conftest import sft_samples, tiny_llama

CHECKPOINT_FILES = ("pytorch_model.bin", "optimizer.bin", "metadata.json")
VOCAB = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{str(d): 4 + d for d in range(10)}, "+": 14, "=": 15}
DIGITS = list(range(4, 14))  # the token ids of "0".."9"
GROUP = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Hugging Face directory standing in for "Qwen/Qwen2.5-7B": the tiny Llama and a character-level
    tokenizer of its 16 ids (``<pad> <s> </s> <unk> 0-9 + =``), built offline."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    core = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tiny_llama().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class MyEngine:
    """The quick reference's custom engine, recording what it was told to load."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    # --- snippet (Implement Custom Engine; the body records the path)
    async def update_weights_from_checkpoint(self, checkpoint_path: str) -> dict:
        # Custom implementation
        self.loaded.append(checkpoint_path)
        return {"success": True}

    # --- end snippet


def assert_checkpoint(path: Path | str) -> None:
    for name in CHECKPOINT_FILES:
        assert (Path(path) / name).is_file(), f"{path} lacks {name}"


def digit_task_generate_fn(model: torch.nn.Module):
    """A ``generate_fn`` sampling one digit after each prompt from ``model``; reward 1 for the digit 3 (token 7)."""

    def my_generate_fn(prompts):
        with torch.no_grad():
            logits = model(torch.tensor(prompts)).logits[:, -1, DIGITS]
            picks = torch.multinomial(torch.softmax(logits, -1), 1).squeeze(-1).tolist()
        return [
            Sample(prompt=p, tokens=[*p, DIGITS[i]], loss_mask=[0.0] * len(p) + [1.0], reward=float(DIGITS[i] == 7))
            for p, i in zip(prompts, picks, strict=True)
        ]

    return my_generate_fn


def test_sft_training(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = next_token_loss
    samples = sft_samples()
    metrics_logger = JSONLLogger(tmp_path / "logs")

    async def main():
        # --- snippet (SFT Training)
        backend = PyTorchTrainingBackend(model, optimizer, loss_fn, checkpoint_dir=tmp_path / "checkpoints")
        config = SFTTrainingConfig(num_steps=30, batch_size=4, log_every=10, checkpoint_every=10)  # changed: steps
        metrics = await run_sft_training(backend, samples, config, metrics_logger)
        # --- end snippet
        backend.close()
        return metrics

    metrics = asyncio.run(main())
    losses = [row["loss"] for row in metrics]
    assert len(losses) == 30 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < 0.5 * losses[0]
    assert [row["step"] for row in metrics_logger.rows()] == [10, 20, 30]
    for step in (10, 20, 30):
        assert_checkpoint(tmp_path / "checkpoints" / f"step_{step}")
    assert latest_checkpoint(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step_30"


def test_rl_training_setup_and_run(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    my_generate_fn = digit_task_generate_fn(model)

    async def main():
        # --- snippet (RL Training)
        from orchestration.training import (
            AsyncRolloutManager,
            DataBuffer,
            PyTorchTrainingBackend,
            RLTrainingConfig,
            RolloutConfig,
            run_rl_training,
        )
        from orchestration.training.rl_losses import grpo_loss
        from orchestration.training.weight_sync import sync_weights_to_engines  # noqa: F401 (the snippet's import)

        # Setup
        buffer = DataBuffer(prompts=[[1, p] for p in range(4, 16)])
        rollout_config = RolloutConfig(batch_size=32, generate_fn=my_generate_fn)
        rollout_manager = AsyncRolloutManager(buffer, rollout_config)
        engines = [MyEngine()]  # changed: SGLangEngine("http://localhost:30000"), no server here
        backend = PyTorchTrainingBackend(model, optimizer, grpo_loss, checkpoint_dir=tmp_path / "checkpoints")
        config = RLTrainingConfig(num_steps=10, sync_every=5)  # changed: num_steps=1000

        # Run
        metrics = await run_rl_training(backend, buffer, rollout_manager, engines, config)
        # --- end snippet
        backend.close()
        return metrics, engines[0]

    metrics, engine = asyncio.run(main())
    rewards = [row["reward_mean"] for row in metrics]
    assert len(metrics) == 10 and all(math.isfinite(row["loss"]) for row in metrics)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards  # the reward rises
    ckpts = tmp_path / "checkpoints"
    assert engine.loaded == [str(ckpts / "step_5"), str(ckpts / "step_10")]
    assert [row.get("sync_failed") for row in metrics if "sync_s" in row] == [0, 0]
    assert_checkpoint(ckpts / "step_10")
    assert (ckpts / "step_10" / "rollout_state.json").is_file()


def test_sample() -> None:
    # --- snippet (Sample)
    from orchestration.training.types import Sample

    sample = Sample(
        prompt="What is 2+2?",
        response="4",
        tokens=[1, 6, 14, 6, 15, 8, 2][-4:],  # filled: the last 4 tokens, one per loss_mask weight
        loss_mask=[0.0, 0.0, 1.0, 1.0],  # 0=prompt, 1=response
        reward=1.0,  # RL only
        metadata={"correct": True},
    )
    # --- end snippet
    assert sample.response_length == 2
    (back,) = RolloutBatch.from_samples([sample]).to_samples()
    assert (back.tokens, back.loss_mask, back.reward, back.metadata) == (
        [6, 15, 8, 2],
        sample.loss_mask,
        1.0,
        {"correct": True},
    )


def test_rollout_batch() -> None:
    # --- snippet (RolloutBatch)
    from orchestration.training.types import RolloutBatch

    batch = RolloutBatch(
        tokens=[[1, 3, 4, 5, 6, 7, 2], [1, 8, 9, 2]],
        loss_masks=[[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1]],
        rewards=[1.0, 0.0],
        response_lengths=[5, 3],
        metadata={"step": 0},
    )
    # --- end snippet
    assert len(batch) == 2
    back = RolloutBatch.from_fields(batch.to_fields())
    assert (back.tokens, back.rewards, back.response_lengths) == (batch.tokens, batch.rewards, batch.response_lengths)
    assert [s.response_length for s in batch.to_samples()] == [5, 3]
    train = samples_to_batch(batch.to_samples(), advantages=[1.0, -1.0])
    assert train["input_ids"].shape == (2, 7) and train["loss_mask"].sum() == 8


def test_the_three_configs() -> None:
    def my_fn(prompts):
        return [Sample(prompt=p, tokens=[1, 4], loss_mask=[0, 1]) for p in prompts]

    # --- snippet (Configs)
    # SFT Config
    from orchestration.training.types import SFTTrainingConfig

    config = SFTTrainingConfig(
        num_steps=1000,
        batch_size=4,
        log_every=100,
        checkpoint_every=500,
    )
    # --- end snippet
    assert (config.num_steps, config.batch_size, config.log_every, config.checkpoint_every) == (1000, 4, 100, 500)

    # --- snippet (Configs)
    # RL Config
    from orchestration.training.types import RLTrainingConfig

    config = RLTrainingConfig(
        num_steps=1000,
        sync_every=10,  # Sync weights every N steps
        baseline=0.0,  # Advantage baseline
        log_every=10,
        checkpoint_every=100,
    )
    # --- end snippet
    assert (config.num_steps, config.sync_every, config.baseline, config.checkpoint_every) == (1000, 10, 0.0, 100)

    # --- snippet (Configs)
    # Rollout Config
    from orchestration.training.types import RolloutConfig

    config = RolloutConfig(
        batch_size=32,
        n_samples_per_prompt=1,
        over_sampling_factor=1.5,  # SLIME D4: over-sample by 50%
        generate_fn=my_fn,  # User-provided generation
        reward_fn=None,  # Optional reward function
        filter_fn=None,  # Optional quality filter
    )
    # --- end snippet
    assert (config.batch_size, config.over_sampling_factor, config.generate_fn) == (32, 1.5, my_fn)


def test_async_rollout_manager() -> None:
    def my_generate_fn(prompts):
        return [Sample(prompt=p, response=p[::-1], tokens=[1, 4 + len(p)], loss_mask=[0, 1]) for p in prompts]

    def my_reward_fn(sample):
        return float(sample.prompt == sample.response)

    async def main():
        # --- snippet (Async Rollout Manager)
        from orchestration.training import AsyncRolloutManager, DataBuffer, RolloutConfig

        buffer = DataBuffer(prompts=["aba", "abc", "x", "xy"] * 10)  # filled: 40 prompts
        config = RolloutConfig(batch_size=32, generate_fn=my_generate_fn)
        manager = AsyncRolloutManager(buffer, config)

        async with manager:
            batch = await manager.generate_batch(reward_fn=my_reward_fn)
            # batch.tokens, batch.loss_masks, batch.rewards ready for training
        # --- end snippet
        return batch

    batch = asyncio.run(main())
    assert len(batch) == 32 and batch.metadata["generated_groups"] == 32
    palindromes = [p in ("aba", "x") for p in batch.metadata["prompts"]]
    assert batch.rewards == [float(p) for p in palindromes] and 0 < sum(batch.rewards) < 32


def test_pure_function_rollout_generation() -> None:
    def my_generate_fn(prompts):
        return [Sample(prompt=p, tokens=[1, p], loss_mask=[0, 1], reward=float(p % 2)) for p in prompts]

    buffer = DataBuffer(prompts=list(range(4, 14)), seed=0)
    seen = []

    # --- snippet (Pure Function Rollout Generation)
    from orchestration.training.rollout_gen import generate_rollout_batches

    config = RolloutConfig(batch_size=32, generate_fn=my_generate_fn)
    batches = generate_rollout_batches(buffer, config)  # Generator

    for batch in batches:
        # batch is RolloutBatch ready for training
        seen.append(batch)  # filled: the snippet's `pass` never ends (an endless generator)
        if len(seen) == 3:
            break
    # --- end snippet
    assert [len(b) for b in seen] == [32, 32, 32]
    drawn = [t[1] for b in seen for t in b.tokens]
    assert drawn == DataBuffer(prompts=list(range(4, 14)), seed=0).get_prompts(96)  # the buffer's order, epochs on


def test_pytorch_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    my_loss_fn = next_token_loss

    # --- snippet (PyTorch Backend)
    from orchestration.training import PyTorchTrainingBackend

    backend = PyTorchTrainingBackend(
        model=model,
        optimizer=optimizer,
        loss_fn=my_loss_fn,
        checkpoint_dir=Path("checkpoints"),
        device=torch.device(DEVICE),  # changed: "cuda:0" when there is no GPU
    )
    # --- end snippet
    batch = samples_to_batch(sft_samples())
    first = backend.forward_backward(batch).wait()["loss"]
    backend.optim_step().wait()
    second = backend.forward_backward(batch).wait()["loss"]
    path = asyncio.run(backend.save_checkpoint(1, {"loss": second}))
    backend.close()
    assert math.isfinite(first) and second < first
    assert path == Path("checkpoints") / "step_1"
    assert_checkpoint(tmp_path / "checkpoints" / "step_1")


def test_create_pytorch_backend_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_dir: Path) -> None:
    monkeypatch.chdir(tmp_path)

    # --- snippet (Factory Functions)
    from orchestration.training.backends import create_pytorch_backend

    backend = create_pytorch_backend(
        model_name=str(model_dir),  # changed: "Qwen/Qwen2.5-7B", a local directory instead
        checkpoint_dir=Path("checkpoints"),
        device_type=DEVICE,  # changed: "cuda" when there is no GPU
        learning_rate=1e-4,
    )
    # --- end snippet
    reference = tiny_llama().state_dict()
    for name, tensor in backend.model.state_dict().items():
        torch.testing.assert_close(tensor.cpu(), reference[name])
    assert backend.optimizer.param_groups[0]["lr"] == 1e-4
    loss = backend.forward_backward(samples_to_batch(sft_samples())).wait()["loss"]
    assert math.isfinite(loss) and backend.optim_step().wait()["step"] == 1
    path = asyncio.run(backend.save_checkpoint(1, {"loss": loss}))
    backend.close()
    assert_checkpoint(tmp_path / path)


def test_single_gpu_sft_workflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_dir: Path) -> None:
    monkeypatch.chdir(tmp_path)
    sft_samples_ = sft_samples()

    async def main():
        # --- snippet (Single-GPU SFT)
        from orchestration.training import SFTTrainingConfig, run_sft_training
        from orchestration.training.backends import create_pytorch_backend

        backend = create_pytorch_backend(
            model_name=str(model_dir),  # changed: "Qwen/Qwen2.5-7B", a local directory instead
            checkpoint_dir=Path("ckpts"),
            learning_rate=1e-2,  # changed: 1e-4 learns nothing in 20 steps
        )

        metrics = await run_sft_training(
            backend=backend,
            samples=sft_samples_,
            config=SFTTrainingConfig(num_steps=20, batch_size=4),  # changed: num_steps=1000
        )
        # --- end snippet
        backend.close()
        return metrics

    losses = [row["loss"] for row in asyncio.run(main())]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < 0.7 * losses[0]
    assert_checkpoint(tmp_path / "ckpts" / "step_20")


def grpo_inputs():
    model = tiny_llama()
    samples = [
        Sample(tokens=[1, 5, 6, 7, 2], loss_mask=[0, 0, 0, 1, 1]),
        Sample(tokens=[1, 8, 9], loss_mask=[0, 1, 1]),
    ]
    batch = samples_to_batch(samples, advantages=[1.0, -0.5])
    return model, batch


def test_grpo_loss() -> None:
    model, batch = grpo_inputs()
    model_output = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    # --- snippet (GRPO Loss)
    from orchestration.training.rl_losses import grpo_loss

    # Compute inside forward_backward()
    loss = grpo_loss(
        logits=model_output.logits,  # [batch, seq_len, vocab_size]
        labels=batch["labels"],  # [batch, seq_len]
        loss_mask=batch["loss_mask"],  # [batch, seq_len]
        advantages=batch["advantages"],  # [batch]
    )

    # Formula: Loss = -E[log_prob(sequence) * advantage]
    # Only trains on response tokens (loss_mask > 0)
    # --- end snippet
    logp = token_log_probs(model_output.logits, batch["labels"], batch["loss_mask"])
    sequence = (logp * batch["loss_mask"]).sum(-1)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, -(sequence * batch["advantages"]).mean())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_ppo_loss() -> None:
    model, batch = grpo_inputs()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    old_log_probs = token_log_probs(logits, batch["labels"], batch["loss_mask"]).detach()

    # --- snippet (PPO Loss; filled: the batch's tensors and the sampling policy's log-probs)
    from orchestration.training.rl_losses import ppo_loss

    loss = ppo_loss(
        logits=logits,
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
        advantages=batch["advantages"],
        old_log_probs=old_log_probs,
        clip_range=0.2,
    )
    # --- end snippet
    # on-policy (ratio 1): the token-mean of -A over the 4 response tokens the losses score
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, torch.tensor(-(1.0 * 2 - 0.5 * 2) / 4))
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_weight_sync_to_a_custom_engine(tmp_path: Path) -> None:
    model = tiny_llama()
    backend = PyTorchTrainingBackend(model, torch.optim.AdamW(model.parameters()), next_token_loss, tmp_path)
    step, metrics = 3, {"loss": 0.25}

    async def main():
        # --- snippet (Sync to Inference Engines)
        from orchestration.training.weight_sync import (
            sync_weights_to_engines,
        )

        engines = [
            MyEngine(),  # changed: SGLangEngine("http://localhost:30000"), no server here
            MyEngine(),  # changed: VLLMEngine("http://localhost:30001"), no server here
        ]

        # After save_checkpoint()
        ckpt_path = await backend.save_checkpoint(step, metrics)

        # Sync in parallel
        responses = await sync_weights_to_engines(engines, str(ckpt_path))
        # --- end snippet
        return engines, ckpt_path, responses

    engines, ckpt_path, responses = asyncio.run(main())
    backend.close()
    assert [engine.loaded for engine in engines] == [[str(ckpt_path)], [str(ckpt_path)]]
    assert [r["success"] for r in responses] == [True, True]
    assert_checkpoint(ckpt_path)
    assert json.loads((ckpt_path / "metadata.json").read_text())["step"] == 3


def test_data_buffer_state_round_trip() -> None:
    # --- snippet (DataBuffer)
    from orchestration.training.datasets import DataBuffer

    buffer = DataBuffer(
        prompts=["What is 2+2?", "Calculate 5*7", "What is 3+3?", "Calculate 6*8", "What is 9-4?"],  # filled
        seed=42,
    )

    # Get prompts (handles epoch wraparound)
    batch = buffer.get_prompts(32)

    # Deterministic shuffling on epoch boundary
    # save_state() / load_state() for checkpointing
    state = buffer.save_state()
    buffer.load_state(state)
    # --- end snippet
    prompts = ["What is 2+2?", "Calculate 5*7", "What is 3+3?", "Calculate 6*8", "What is 9-4?"]
    assert len(batch) == 32 and buffer.epoch == 6 and buffer.position == 2
    assert all(sorted(batch[i : i + 5]) == sorted(prompts) for i in range(0, 30, 5))  # each epoch: every prompt once
    restored = DataBuffer(prompts=list(prompts), seed=0)
    restored.load_state(json.loads(json.dumps(state)))
    assert restored.get_prompts(13) == buffer.get_prompts(13)  # the same prompts continue


def test_load_sft_dataset(tmp_path: Path, model_dir: Path) -> None:
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(4)]
    (tmp_path / "gsm8k" / "main").mkdir(parents=True)
    (tmp_path / "gsm8k" / "main" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    # --- snippet (SFT Dataset Loading)
    from transformers import AutoTokenizer

    from orchestration.training.datasets import load_sft_dataset

    tokenizer = AutoTokenizer.from_pretrained(model_dir)  # changed: "Qwen/Qwen2.5-7B", a local directory instead

    samples = load_sft_dataset(
        tmp_path / "gsm8k",  # changed: "gsm8k", the local copy the test wrote
        tokenizer=tokenizer,
        split="train",
        subset="main",
        max_samples=10,  # changed: 1000 (the file holds 12 rows)
        max_length=2048,
    )
    # --- end snippet
    assert len(samples) == 10
    first = samples[0]  # "0+0=" then "0" and </s>
    assert first.tokens == [4, 14, 4, 15, 4, 2] and first.loss_mask == [0, 0, 0, 0, 1, 1]
    assert samples[7].prompt == "1+3=" and samples[7].tokens[-2:] == [8, 2]


def test_sft_then_rl_unified_pipeline(tmp_path: Path, model_dir: Path) -> None:
    from orchestration.training.backends import create_pytorch_backend
    from orchestration.training.rl_losses import grpo_loss

    config = {"sft_steps": 12, "rl_steps": 3}
    output_dir = tmp_path / "run"
    mode = "sft+rl"
    seen: dict[str, object] = {}

    async def run_sft(config, output_dir):
        backend = create_pytorch_backend(model_dir, output_dir / "checkpoints", learning_rate=1e-2)
        sft = SFTTrainingConfig(num_steps=config["sft_steps"], batch_size=4, checkpoint_every=5)
        seen["sft"] = await run_sft_training(backend, sft_samples(), sft, progress=False)
        seen["sft_weights"] = {k: v.clone() for k, v in backend.model.state_dict().items()}
        backend.close()

    async def run_rl(config, output_dir, latest_ckpt):
        backend = create_pytorch_backend(model_dir, output_dir / "rl", learning_rate=1e-2, loss_fn=grpo_loss)
        seen["loaded"] = await backend.load_checkpoint(latest_ckpt)
        seen["rl_start"] = {k: v.clone() for k, v in backend.model.state_dict().items()}
        buffer = DataBuffer(prompts=[[1, p] for p in range(4, 16)])
        manager = AsyncRolloutManager(
            buffer, RolloutConfig(batch_size=8, generate_fn=digit_task_generate_fn(backend.model))
        )
        rl = RLTrainingConfig(num_steps=config["rl_steps"], checkpoint_every=0)
        seen["rl"] = await run_rl_training(backend, buffer, manager, [], rl, progress=False)
        backend.close()

    async def main():
        # --- snippet (Unified Training Pipeline)
        # Config specifies mode
        if mode == "sft+rl":
            # Step 1: SFT Training
            await run_sft(config, output_dir)

            # Step 2: Find latest checkpoint
            latest_ckpt = latest_checkpoint(output_dir / "checkpoints")  # changed: sorted(... / "step_*")[-1]

            # Step 3: RL Training from that checkpoint
            await run_rl(config, output_dir, latest_ckpt)
        # --- end snippet
        return latest_ckpt

    latest_ckpt = asyncio.run(main())
    # the checkpoint flow: step_5, step_10, step_12 (the last); the numerically latest is taken
    for step in (5, 10, 12):
        assert_checkpoint(output_dir / "checkpoints" / f"step_{step}")
    assert latest_ckpt == output_dir / "checkpoints" / "step_12"
    assert seen["loaded"]["step"] == 12
    for name, tensor in seen["sft_weights"].items():
        torch.testing.assert_close(seen["rl_start"][name], tensor)  # RL starts from the SFT weights
    assert len(seen["rl"]) == 3 and all(math.isfinite(row["loss"]) for row in seen["rl"])
    assert_checkpoint(output_dir / "rl" / "step_3")


def test_jsonl_logger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)

    # --- snippet (Simple File-Based Logging)
    from orchestration.training.metrics import JSONLLogger

    logger = JSONLLogger(Path("logs/experiment_001"))

    # Called from training loops
    logger.log({"loss": 0.5, "reward": 1.0, "step": 42}, step=42)

    # Finishes JSONL file
    logger.finish()
    # --- end snippet
    lines = (tmp_path / "logs" / "experiment_001" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert (row["loss"], row["reward"], row["step"]) == (0.5, 1.0, 42)


def test_compute_advantages() -> None:
    rl_batch: dict[str, torch.Tensor] = {}
    rewards = [1.0, 0.0, 0.5, 2.0]

    # --- snippet (Advantage Computation)
    from orchestration.training.loops.rl_loop import compute_advantages

    # Simple: reward - baseline
    advantages = compute_advantages(rewards, baseline=0.5)

    # Used in prepare_grpo_batch()
    rl_batch["advantages"] = torch.tensor(advantages)
    # --- end snippet
    assert advantages == [0.5, -0.5, 0.0, 1.5]
    assert rl_batch["advantages"].shape == (4,)


def test_custom_filter() -> None:
    def my_fn(prompts):  # GROUP distinct replies per prompt; half of them rewarded, none when p % 3 == 0
        return [
            Sample(prompt=p, tokens=[1, p, 4 + (p + k) % 10], loss_mask=[0, 0, 1], reward=float(k < 2 and p % 3 > 0))
            for p in prompts
            for k in range(GROUP)
        ]

    # --- snippet (Sample Filtering)
    from orchestration.training.filters import (
        check_min_reward,
        check_response_diversity,
    )

    # Custom filter function
    def my_filter(samples: list[Sample]) -> bool:
        """Return True if group passes quality checks"""
        return all(
            [
                check_min_reward(samples, threshold=0.5),
                check_response_diversity(samples),
            ]
        )

    config = RolloutConfig(
        batch_size=32,
        generate_fn=my_fn,
        filter_fn=my_filter,
        n_samples_per_prompt=GROUP,  # filled: my_fn's groups
    )
    # --- end snippet
    low = Sample(tokens=[1, 4], loss_mask=[0, 1], reward=0.0)
    high = Sample(tokens=[1, 5], loss_mask=[0, 1], reward=1.0)
    assert my_filter([high, Sample(tokens=[1, 6], loss_mask=[0, 1], reward=0.0)])  # mean 0.5, two responses
    assert not my_filter([low, Sample(tokens=[1, 5], loss_mask=[0, 1])])  # mean 0
    assert not my_filter([high, high, high])  # one response of three

    async def main():
        async with AsyncRolloutManager(DataBuffer(prompts=list(range(3, 12))), config) as manager:
            return await manager.generate_batch()

    batch = asyncio.run(main())
    # the prompts with p % 3 > 0 (mean reward 0.5) pass, p % 3 == 0 (mean 0) are dropped
    assert len(batch) == 32 * GROUP and {p % 3 for p in batch.metadata["prompts"]} == {1, 2}
    assert batch.metadata["filtered_groups"] > 0


def test_pipelining_with_futures(tmp_path: Path) -> None:
    model = tiny_llama()
    backend = PyTorchTrainingBackend(model, torch.optim.AdamW(model.parameters(), lr=1e-2), next_token_loss, tmp_path)
    batch = samples_to_batch(sft_samples())

    async def main():
        # --- snippet (Pipelining with Futures)
        # Trio-based futures allow pipelining
        fwd_future = backend.forward_backward(batch)
        # ... do other work ...
        other = samples_to_batch(sft_samples()[:2])  # filled: the other work
        fwd_metrics = await fwd_future.result()

        # Or wait immediately
        opt_metrics = await backend.optim_step().result()
        # --- end snippet
        again = await backend.forward_backward(batch).result()
        return fwd_metrics, opt_metrics, other, again

    fwd, opt, other, again = asyncio.run(main())
    backend.close()
    assert math.isfinite(fwd["loss"]) and fwd["num_tokens"] == 16 and other["input_ids"].shape[0] == 2
    assert opt["step"] == 1 and opt["lr"] == pytest.approx(1e-2)
    assert again["loss"] < fwd["loss"]


@dataclass
class Response:
    text: str
    correct: bool


class DigitAgent:
    """An agent answering ``"a+b="`` with one digit sampled from the model being trained; the whole transcript is its
    text. ``correct``: the digit is even (so a group of four is often mixed)."""

    def __init__(self, model: torch.nn.Module, tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer

    async def rollout(self, prompt: str) -> Response:
        with torch.no_grad():
            logits = self.model(torch.tensor([self.tokenizer.encode(prompt)])).logits[0, -1, DIGITS]
            digit = int(torch.multinomial(torch.softmax(logits, -1), 1))
        return Response(text=prompt + str(digit), correct=digit % 2 == 0)


@pytest.mark.slow  # ~13 s: the snippet's quality filter sends the tiny model through many rounds
def test_rl_with_sglang_inference_generate_fn(tmp_path: Path, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from orchestration.training.backends import create_pytorch_backend
    from orchestration.training.rl_losses import grpo_loss

    torch.manual_seed(0)
    random.seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    backend = create_pytorch_backend(model_dir, tmp_path / "checkpoints", learning_rate=1e-2, loss_fn=grpo_loss)
    agent = DigitAgent(backend.model, tokenizer)
    buffer = DataBuffer(prompts=[f"{a}+{b}=" for a in range(10) for b in range(10)])
    rl_config = RLTrainingConfig(num_steps=2, sync_every=2)
    my_engine = MyEngine()

    async def main():
        # --- snippet (RL with SGLang Inference)
        async def generate_fn(prompts):
            """User-provided: prompts → samples"""
            samples = []
            for prompt in [p for p in prompts for _ in range(GROUP)]:  # changed: each prompt GROUP times
                response = await agent.rollout(prompt)
                prompt_tokens = tokenizer.encode(prompt)  # added: undefined in the snippet
                response_tokens = tokenizer.encode(response.text)[len(prompt_tokens) :]  # added: likewise
                sample = Sample(
                    prompt=prompt,
                    response=response.text,
                    tokens=tokenizer.encode(response.text),
                    loss_mask=[0] * len(prompt_tokens) + [1] * len(response_tokens),
                    metadata={"correct": response.correct},
                )
                samples.append(sample)
            return samples

        # Setup
        rollout_config = RolloutConfig(
            batch_size=32,
            generate_fn=generate_fn,
            filter_fn=check_quality_and_diversity,
            n_samples_per_prompt=GROUP,  # added: a group of one never passes check_quality_and_diversity
            reward_fn=lambda s: float(s.metadata["correct"]),  # added: the snippet sets no reward
        )

        manager = AsyncRolloutManager(buffer, rollout_config)
        engines = [my_engine]  # changed: SGLangEngine("http://localhost:30000"), no server here

        metrics = await run_rl_training(backend, buffer, manager, engines, rl_config)  # changed: `metrics =` added
        # --- end snippet
        return metrics

    metrics = asyncio.run(main())
    backend.close()
    assert len(metrics) == 2 and all(math.isfinite(row["loss"]) for row in metrics)
    assert all(0 < row["reward_mean"] < 1 for row in metrics)  # mixed groups only (the filter)
    assert metrics[0]["response_length_mean"] == 1.0  # one digit after "a+b="
    assert my_engine.loaded == [str(tmp_path / "checkpoints" / "step_2")]
    assert_checkpoint(tmp_path / "checkpoints" / "step_2")
