"""A training batch whose rows hold different numbers of images (a text prompt, one picture, two pictures): the
engine samples them in one call, ``build_train_batch`` resolves the rows' blob keys to ``[B, K_max, 3, H, W]``
pixels and per-row image counts, and ``FSDPPolicy`` (a world of one) gives each micro-batch exactly its rows'
images, with fixed and with dynamic micro-batches: every row's log-probs are its own computed alone (and the
engine's), and a training step's loss is the sum of the rows' pieces."""

from __future__ import annotations

import copy
import math
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist

from orchestration.config import RLConfig
from rl_contracts.images import IMAGE_REFS, UnevenImages
from rl_contracts.rows import jagged
from trainers.config import TrainConfig, TrainerConfig
from trainers.fsdp import (
    IMAGE_COUNTS,
    PIXEL_VALUES,
    AdamWConfig,
    FSDPPolicy,
    init_process_group,
    model_token_logprobs,
    plan_micro_batches,
    row_lengths,
)
from trainers.grpo import build_train_batch
from workers.engines import HFEngine, SamplingParams
from workers.ledger.blobs import MemoryBlobStore
from workers.ledger.multimodal import image_refs, preprocess_mm_messages_for_sample, store_mm_messages
from workers.models import build_tiny_vlm
from workers.vision import BlobImageSource, solid_png

N, TEMPERATURE = 2, 1.0
RED, BLUE, GREEN = (255, 0, 0), (0, 0, 255), (0, 160, 0)
# the pictures of each prompt: two pictures, none, one, one (the red one again), none
PROMPTS = [[RED, BLUE], [], [GREEN], [RED], []]


def mixed_batch():
    """The tiny VLM samples N responses to each prompt in one ``generate`` call; the rows go through
    ``build_train_batch`` as the queue returns them (blob keys). Returns the model's weights before any step, the
    batch's tensors and the engine's log-probs aligned with them."""
    from tensordict import NonTensorStack, TensorDict

    vlm, blobs = build_tiny_vlm(), MemoryBlobStore()
    prompts, images, keys = [], [], []
    for i, pictures in enumerate(PROMPTS):
        content = [{"type": "image_url", "image_url": {"url": solid_png(8, 8, rgb)}} for rgb in pictures]
        stored = store_mm_messages([{"role": "user", "content": [*content, {"type": "text", "text": f"{i}?"}]}], blobs)
        ids, prompt_images = vlm.chat.prompt(preprocess_mm_messages_for_sample(stored, blobs))
        prompts.append(ids)
        images.append(prompt_images)
        keys.append(image_refs(stored))
    assert [len(k) for k in keys] == [2, 0, 1, 1, 0]
    engine = HFEngine(copy.deepcopy(vlm.model))
    params = SamplingParams(max_new_tokens=5, temperature=TEMPERATURE, seed=0)
    groups = engine.generate(prompts, n=N, params=params, images=images)  # 2, 0, 1, 1 and 0 images in one call
    samples = [(p, g, k) for p, group, k in zip(prompts, groups, keys, strict=True) for g in group]
    rows = len(samples)
    data = TensorDict(
        {
            "prompt_ids": jagged([p for p, _, _ in samples], torch.int64),
            "response_ids": jagged([g.token_ids for _, g, _ in samples], torch.int64),
            "response_logprobs": jagged([g.logprobs for _, g, _ in samples], torch.float32),
            "policy_version": torch.zeros(rows, dtype=torch.int64),
            "reward": torch.tensor([float(i % N) for i in range(rows)]),
            "reward_failed": torch.zeros(rows, dtype=torch.bool),
            IMAGE_REFS: NonTensorStack(*[k for _, _, k in samples]),
        },
        batch_size=[rows],
    )
    config = TrainerConfig.from_run(
        RLConfig(prompts_per_step=len(PROMPTS), n_samples=N, train=TrainConfig(world_size=1))
    )
    batch = build_train_batch(
        data,
        np.repeat(np.arange(len(PROMPTS)), N),
        pad_token_id=vlm.tokenizer.pad_token_id,
        trainer_version=0,
        max_staleness=0,
        config=config,
        images=BlobImageSource(blobs, vlm.image_processor),
    )
    return vlm.model, batch.tensors


@pytest.fixture(scope="module")
def sampled():
    return mixed_batch()


def test_the_batch_pads_each_row_to_the_most_images_and_counts_them(sampled):
    _, t = sampled
    assert t[PIXEL_VALUES].shape == (len(PROMPTS) * N, 2, 3, 16, 16)
    assert t[IMAGE_COUNTS].tolist() == [2, 2, 0, 0, 1, 1, 1, 1, 0, 0]
    assert torch.equal(t[PIXEL_VALUES][0, 0], t[PIXEL_VALUES][6, 0])  # the red picture, in both prompts
    assert not t[PIXEL_VALUES][2].any() and not t[PIXEL_VALUES][4, 1].any()  # padding


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alone(model, t, i):
    """Row ``i``'s log-probs computed alone: its own tokens and exactly its own images (none for a text row)."""
    count = int(t[IMAGE_COUNTS][i])
    pixels = t[PIXEL_VALUES][i : i + 1, :count] if count else None
    rows = slice(i, i + 1)
    return model_token_logprobs(
        model, t["input_ids"][rows], t["attention_mask"][rows], TEMPERATURE, pixel_values=pixels
    )


@pytest.mark.parametrize(
    "batching",
    [{"micro_batch_size": 4}, {"dynamic_batching": True, "max_tokens_per_micro_batch": 180}],
    ids=["fixed", "dynamic"],
)
def test_a_mixed_batch_gives_every_row_its_own_log_probs_and_trains(sampled, batching):
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    model, t = sampled
    t = {name: value.clone() for name, value in t.items()}
    reference = copy.deepcopy(model).eval()
    rows = t["input_ids"].shape[0]
    if batching.get("dynamic_batching"):  # the plan mixes rows with different numbers of images in a micro-batch
        plan = plan_micro_batches(row_lengths(t["attention_mask"]).tolist(), batching["max_tokens_per_micro_batch"])
        assert any(len({int(t[IMAGE_COUNTS][r]) for r in mb}) > 1 for mb in plan), plan
    alone = torch.cat([_alone(reference, t, i) for i in range(rows)])
    mask = t["response_mask"] > 0
    assert torch.allclose(alone[mask], t["rollout_logprobs"][mask], atol=1e-5)  # the engine's, row by row

    init_process_group(0, 1, "127.0.0.1", _free_port(), backend="gloo")
    try:
        policy = FSDPPolicy(copy.deepcopy(model), optimizer=AdamWConfig(lr=1e-2), mixed_precision=False, **batching)
        scored = policy.compute_logprobs(
            t["input_ids"], t["attention_mask"], TEMPERATURE, pixel_values=t[PIXEL_VALUES], image_counts=t[IMAGE_COUNTS]
        )
        assert torch.allclose(scored, alone, atol=1e-5)

        tokens = float(t["response_mask"].sum())

        def loss_fn(*, logprobs, batch):
            # a token mean per micro-batch: the step weighs it by the micro-batch's tokens
            weighted = logprobs * batch["advantages"][:, None] * batch["response_mask"]
            return -weighted.sum() / batch["response_mask"].sum(), {}

        pieces = [
            -float((alone[i].detach() * t["advantages"][i] * t["response_mask"][i]).sum()) / tokens for i in range(rows)
        ]
        before = {n: p.detach().full_tensor().clone() for n, p in policy.model.named_parameters() if "projector" in n}
        stats = policy.train_step(t, loss_fn, temperature=TEMPERATURE)
        assert stats["loss"] == pytest.approx(sum(pieces), abs=1e-6)
        assert math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0 and stats["skipped"] == 0.0
        after = dict(policy.model.named_parameters())
        assert all(not torch.equal(after[n].detach().full_tensor(), before[n]) for n in before)
    finally:
        dist.destroy_process_group()


def test_image_counts_that_do_not_fit_the_pixels_are_refused(sampled):
    model, t = sampled
    counts = t[IMAGE_COUNTS].clone()
    counts[0] = 3
    with pytest.raises(
        UnevenImages,
        match=r"image_counts must be \[10\] integers between 0 and 2 for pixel_values of shape \(10, 2, 3, 16, 16\), "
        r"got \[3, 2, 0, 0, 1, 1, 1, 1, 0, 0\]",
    ):
        model_token_logprobs(
            model, t["input_ids"], t["attention_mask"], pixel_values=t[PIXEL_VALUES], image_counts=counts
        )
    with pytest.raises(UnevenImages, match=r"image_counts must be \[10\] integers .* \(shape \(5,\), torch.int64\)"):
        model_token_logprobs(
            model, t["input_ids"], t["attention_mask"], pixel_values=t[PIXEL_VALUES], image_counts=counts[:5]
        )
