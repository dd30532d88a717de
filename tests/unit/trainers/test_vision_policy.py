"""The trainer's log-prob pass and a policy-gradient step on a tiny vision-language model (LLaVA) over samples
that carry images: the log-probs are the engine's at sampling for the same weights, and the loss reaches the vision
tower's projector. ``model_token_logprobs`` is the pass ``FSDPPolicy`` runs; the last test runs ``FSDPPolicy`` itself
in a world of one."""

from __future__ import annotations

import copy
import math
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist

from trainers.advantages import group_advantages
from trainers.fsdp import PIXEL_VALUES, AdamWConfig, FSDPPolicy, init_process_group, model_token_logprobs
from trainers.grpo import pad_sequences
from trainers.losses import grpo_loss
from workers.engines import HFEngine, SamplingParams
from workers.models import build_tiny_vlm
from workers.vision import solid_png

N, TEMPERATURE = 2, 0.9
COLOURS = [(255, 0, 0), (0, 0, 255), (0, 255, 0)]


def sampled_batch():
    """Three prompts with one image each (the texts differ in length), two sampled responses per prompt: the
    trainer's batch (right-padded), the images as ``[B, 1, 3, H, W]`` and the engine's log-probs aligned with it."""
    vlm = build_tiny_vlm()
    engine = HFEngine(copy.deepcopy(vlm.model))
    prompts, images = [], []
    for i, colour in enumerate(COLOURS):
        content = [{"type": "image_url", "image_url": {"url": solid_png(8, 8, colour)}}]
        content.append({"type": "text", "text": "colour?" + "!" * i})
        ids, prompt_images = vlm.chat.prompt([{"role": "user", "content": content}])
        prompts.append(ids)
        images.append(prompt_images)
    params = SamplingParams(max_new_tokens=6, temperature=TEMPERATURE, seed=0)
    groups = engine.generate(prompts, n=N, params=params, images=images)
    rows = [(prompt, generation) for prompt, group in zip(prompts, groups, strict=True) for generation in group]
    batch = pad_sequences([p for p, _ in rows], [g.token_ids for _, g in rows], vlm.tokenizer.pad_token_id)
    old = torch.zeros(batch["response_mask"].shape)
    for i, (prompt, generation) in enumerate(rows):
        old[i, len(prompt) : len(prompt) + len(generation.logprobs)] = torch.tensor(generation.logprobs)
    pixels = torch.stack([vlm.image_processor(prompt_images) for prompt_images in images])
    batch[PIXEL_VALUES] = pixels.repeat_interleave(N, dim=0)
    batch["old_logprobs"] = old
    # a reward per row that differs within each group: the advantages are not all zero
    batch["advantages"] = group_advantages(torch.tensor([float(i % N) for i in range(len(rows))]), N)
    return vlm, batch


def test_the_trainer_pass_gives_the_engines_log_probs_and_the_loss_reaches_the_projector():
    vlm, batch = sampled_batch()
    model = vlm.model.train()  # the weights the engine sampled with (it holds a copy); dropout is 0
    logprobs = model_token_logprobs(
        model, batch["input_ids"], batch["attention_mask"], TEMPERATURE, pixel_values=batch[PIXEL_VALUES]
    )
    mask = batch["response_mask"] > 0
    assert torch.allclose(logprobs[mask], batch["old_logprobs"][mask], atol=1e-5)
    # without the images the same tokens score differently: the pass did use them
    text_only = model_token_logprobs(
        model, batch["input_ids"].masked_fill(batch["input_ids"] == vlm.image_token_id, 0), batch["attention_mask"]
    )
    assert not torch.allclose(text_only[mask], batch["old_logprobs"][mask], atol=1e-3)

    loss, metrics = grpo_loss(logprobs, batch["old_logprobs"], batch["advantages"], batch["response_mask"])
    assert math.isfinite(loss.item()) and metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    loss.backward()
    projector = model.model.multi_modal_projector
    grads = [p.grad for p in projector.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    patch = model.model.vision_tower.embeddings.patch_embedding.weight.grad
    assert patch is not None and float(patch.abs().sum()) > 0


def test_pixel_values_of_the_wrong_rank_are_refused():
    vlm, batch = sampled_batch()
    with pytest.raises(
        ValueError, match=r"pixel_values has shape \(6, 768\), expected \[B, K, 3, H, W\] or \[B, 3, H, W\]"
    ):
        model_token_logprobs(
            vlm.model, batch["input_ids"], batch["attention_mask"], pixel_values=batch[PIXEL_VALUES].flatten(1)
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_fsdp_policy_step_on_samples_with_images():
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    vlm, batch = sampled_batch()
    init_process_group(0, 1, "127.0.0.1", _free_port(), backend="gloo")
    try:
        policy = FSDPPolicy(vlm.model, optimizer=AdamWConfig(lr=1e-2), micro_batch_size=4, mixed_precision=False)
        scored = policy.compute_logprobs(
            batch["input_ids"], batch["attention_mask"], TEMPERATURE, pixel_values=batch[PIXEL_VALUES]
        )
        mask = batch["response_mask"] > 0
        assert torch.allclose(scored[mask], batch["old_logprobs"][mask], atol=1e-5)
        before = {n: p.detach().full_tensor().clone() for n, p in policy.model.named_parameters() if "projector" in n}

        def loss_fn(*, logprobs, batch):
            return grpo_loss(logprobs, batch["old_logprobs"], batch["advantages"], batch["response_mask"])

        stats = policy.train_step(batch, loss_fn, temperature=TEMPERATURE)
        assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0 and stats["skipped"] == 0.0
        after = dict(policy.model.named_parameters())
        assert all(not torch.equal(after[n].detach().full_tensor(), before[n]) for n in before)
    finally:
        dist.destroy_process_group()


def test_the_training_batch_resolves_the_rows_image_references_to_pixel_values():
    """Rows as the queue returns them: a group of two rows naming one stored image (its blob key, not its pixels),
    a group of two naming another; ``build_train_batch`` resolves them through the blob store's image source."""
    from tensordict import NonTensorStack, TensorDict

    from orchestration.config import RLConfig
    from rl_contracts.images import IMAGE_REFS, ImagesUnavailable
    from rl_contracts.rows import jagged
    from trainers.config import TrainConfig, TrainerConfig
    from trainers.grpo import build_train_batch
    from workers.ledger.blobs import MemoryBlobStore
    from workers.ledger.multimodal import image_refs, store_mm_messages
    from workers.vision import BlobImageSource

    vlm, blobs = build_tiny_vlm(), MemoryBlobStore()
    pictures = [solid_png(8, 8, (255, 0, 0)), solid_png(8, 8, (0, 0, 255))]
    messages = [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": p}}]}] for p in pictures]
    keys = [image_refs(store_mm_messages(m, blobs)) for m in messages]
    rows = [keys[0], keys[0], keys[1], keys[1]]
    data = TensorDict(
        {
            "prompt_ids": jagged([[1, 2]] * 4, torch.int64),
            "response_ids": jagged([[5, 6]] * 4, torch.int64),
            "response_logprobs": jagged([[-0.5, -0.5]] * 4, torch.float32),
            "policy_version": torch.zeros(4, dtype=torch.int64),
            "reward": torch.tensor([1.0, 0.0, 1.0, 0.0]),
            "reward_failed": torch.zeros(4, dtype=torch.bool),
            IMAGE_REFS: NonTensorStack(*rows),
        },
        batch_size=[4],
    )
    config = TrainerConfig.from_run(RLConfig(prompts_per_step=2, n_samples=2, train=TrainConfig(world_size=1)))
    kwargs = {"pad_token_id": 0, "trainer_version": 0, "max_staleness": 0, "config": config}
    source = BlobImageSource(blobs, vlm.image_processor)
    batch = build_train_batch(data, np.array([0, 0, 1, 1]), images=source, **kwargs)
    expected = vlm.image_processor(pictures)[[0, 0, 1, 1]][:, None]
    assert torch.equal(batch.tensors[PIXEL_VALUES], expected)
    with pytest.raises(ImagesUnavailable, match="the trainer has no image source"):
        build_train_batch(data, np.array([0, 0, 1, 1]), **kwargs)
    text_only = build_train_batch(data.exclude(IMAGE_REFS), np.array([0, 0, 1, 1]), **kwargs)
    assert PIXEL_VALUES not in text_only.tensors
