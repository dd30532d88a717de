"""A GRPO step on samples with images, through a real queue: a tiny vision-language model (``build_tiny_vlm``) samples
n responses to each prompt with an image, a trivial rule scores them, the rows go into the queue with their images'
blob keys (``image_refs``, not pixels), and the trainer's own step (``GRPOTrainerRank.train_step``, a process group
of one) reads them, builds its batch with ``pixel_values`` resolved from the blob store, recomputes the old policy's
log-probs (the engine's, within 1e-5) and moves the projector."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist

from orchestration.config import RLConfig
from rl_contracts.images import IMAGE_REFS, ImageSource
from rl_contracts.rows import jagged
from rl_contracts.stages import TRAIN_TASK
from rl_contracts.task import Task
from trainers.config import TrainConfig, TrainerConfig
from trainers.fsdp import IMAGE_COUNTS, PIXEL_VALUES
from trainers.grpo import GRPOTrainerRank
from workers.engines import HFEngine, SamplingParams
from workers.engines.host import EngineSpec
from workers.ledger.blobs import MemoryBlobStore
from workers.ledger.multimodal import image_refs, preprocess_mm_messages_for_sample, store_mm_messages
from workers.models import build_tiny_vlm
from workers.tasks.colors import ColorsTask
from workers.vision import BlobImageSource, solid_png

TEMPERATURE = 1.0
# four prompts, two of them on the same picture: three distinct images in the step
COLOURS = [(255, 0, 0), (0, 0, 255), (255, 0, 0), (0, 255, 0)]


class CountingSource:
    """The blob store's image source, recording the keys of every call."""

    def __init__(self, inner: ImageSource):
        self.inner, self.calls = inner, []

    def pixel_values(self, keys: Sequence[str]) -> torch.Tensor:
        self.calls.append(list(keys))
        return self.inner.pixel_values(keys)


class PictureTask(Task):
    """What the trainer rank needs of a vision task: the tokenizer, the starting policy (the engine's weights) and
    the image source over the blob store the prompts' images are in."""

    reward_fields = ()

    def __init__(self, blobs: MemoryBlobStore):
        self.vlm = build_tiny_vlm()
        self.source = CountingSource(BlobImageSource(blobs, self.vlm.image_processor))

    @property
    def tokenizer(self) -> Any:
        return self.vlm.tokenizer

    def prompts(self, split: str, num: int, seed: int) -> list[dict[str, Any]]:
        raise NotImplementedError

    def reward(self, response_text: str, **fields: str) -> float:
        raise NotImplementedError

    def build_policy(self) -> Any:
        return build_tiny_vlm().model  # the weights are a pure function of the seed: the engine's

    def image_source(self) -> ImageSource:
        return self.source


def put_sampled_step(client: Any, step: int, n: int, blobs: MemoryBlobStore) -> list[list[str]]:
    """Each prompt's image stored once, n samples per prompt from the tiny VLM, scored by a trivial rule (an even
    first token earns 1), put as the rollout leaves its rows: every field the trainer reads, and per row the blob
    keys of its prompt's images. Returns the rows' keys."""
    vlm = build_tiny_vlm()
    engine = HFEngine(vlm.model)
    prompts, images, keys = [], [], []
    for i, colour in enumerate(COLOURS):
        content = [{"type": "image_url", "image_url": {"url": solid_png(8, 8, colour)}}]
        stored = store_mm_messages([{"role": "user", "content": [*content, {"type": "text", "text": f"{i}?"}]}], blobs)
        ids, prompt_images = vlm.chat.prompt(preprocess_mm_messages_for_sample(stored, blobs))
        prompts.append(ids)
        images.append(prompt_images)
        keys.append(image_refs(stored))
    params = SamplingParams(max_new_tokens=5, temperature=TEMPERATURE, seed=0)
    groups = engine.generate(prompts, n=n, params=params, images=images)
    samples = [(p, g, k) for p, group, k in zip(prompts, groups, keys, strict=True) for g in group]
    rows = len(samples)
    client.put(
        {
            "prompt_ids": jagged([p for p, _, _ in samples], torch.int64),
            "response_ids": jagged([g.token_ids for _, g, _ in samples], torch.int64),
            "response_logprobs": jagged([g.logprobs for _, g, _ in samples], torch.float32),
            "policy_version": torch.zeros(rows, dtype=torch.int64),
            "reward": torch.tensor([float(g.token_ids[0] % 2 == 0) for _, g, _ in samples]),
            "reward_failed": torch.zeros(rows, dtype=torch.bool),
            IMAGE_REFS: [k for _, _, k in samples],  # references: a group's n rows name one stored image
        },
        global_step=step,
    )
    return [k for _, _, k in samples]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spy_on_batches(rank: Any) -> list[dict[str, torch.Tensor]]:
    """The batches ``rank``'s old-log-prob pass is given, copied as it sees them (filled as it trains)."""
    seen: list[dict[str, torch.Tensor]] = []
    recompute = rank._recompute_old_logprobs

    def spy(t: dict[str, torch.Tensor]) -> dict[str, float]:
        out = recompute(t)
        seen.append({name: value.clone() for name, value in t.items()})
        return out

    rank._recompute_old_logprobs = spy
    return seen


def projector_weights(rank: Any) -> dict[str, torch.Tensor]:
    """A copy of the VLM's projector weights (to see a training step move them)."""
    return {
        name: p.detach().full_tensor().clone()
        for name, p in rank.policy.model.named_parameters()
        if "multi_modal_projector" in name
    }


def test_a_grpo_step_on_samples_with_images_reads_references_and_trains_on_pixels(grpo_queue: Any) -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    n, prompts = grpo_queue.config["num_n_samples"], grpo_queue.config["global_batch_size"]
    assert prompts == len(COLOURS)
    blobs = MemoryBlobStore()
    step = grpo_queue.step()
    row_keys = put_sampled_step(grpo_queue.client, step, n, blobs)
    assert len(set(map(tuple, row_keys))) == 3 and all(len(k) == 1 for k in row_keys)

    task = PictureTask(blobs)
    train = TrainConfig(world_size=1, backend="gloo", lr=1e-2, micro_batch_size=8, recompute_old_logprobs=True)
    cfg = TrainerConfig.from_run(RLConfig(prompts_per_step=prompts, n_samples=n, train=train))
    assert cfg.temperature == TEMPERATURE and cfg.train.weight_decay == 0.0  # a moved weight is the gradient's
    rank = GRPOTrainerRank.__ray_metadata__.modified_class(0, 1, grpo_queue.info, cfg, task)  # type: ignore[attr-defined]
    seen = spy_on_batches(rank)
    try:
        rank.setup("127.0.0.1", _free_port())
        projector = projector_weights(rank)
        assert projector
        stats = rank.train_step(step)

        [batch] = seen
        assert batch[PIXEL_VALUES].shape == (prompts * n, 1, 3, 16, 16)
        # the rows' 16 references were resolved in one call of the 3 distinct images
        assert [sorted(call) for call in task.source.calls] == [sorted({k for row in row_keys for k in row})]
        mask = batch["response_mask"] > 0
        assert mask.sum() > 0
        assert torch.allclose(batch["old_logprobs"][mask], batch["rollout_logprobs"][mask], atol=1e-5)
        assert stats["optimizer_steps"] == 1 and stats["rows"] == prompts * n and stats["policy_version"] == 1.0
        assert stats["grad_norm"] > 0
        after = dict(rank.policy.model.named_parameters())
        assert all(not torch.equal(after[name].detach().full_tensor(), before) for name, before in projector.items())
        status = grpo_queue.client.get_consumption_status(global_step=step, task_name=TRAIN_TASK)
        assert status["tasks"][TRAIN_TASK]["acknowledged"] == prompts * n
    finally:
        rank.client.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_grpo_step_on_colours_prompts_with_one_and_two_pictures_trains_them_in_one_batch(grpo_queue: Any) -> None:
    """``ColorsTask(two_pictures=...)``: the engine a run builds for the task samples prompts with one and with two
    pictures in one call, their rows go through the queue with their keys, and the trainer's step takes them in one
    batch (it refused rows with different numbers of images before): each row's recomputed log-probs are the
    engine's, and the step moves the projector."""
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    n, num_prompts = grpo_queue.config["num_n_samples"], grpo_queue.config["global_batch_size"]
    kwargs = {"two_pictures": 0.5}
    task = ColorsTask(**kwargs)
    prompts = task.prompts("train", num_prompts, seed=1)
    assert sorted(len(p[IMAGE_REFS]) for p in prompts) == [1, 1, 2, 2]
    engine = EngineSpec(kind="hf", task_name="workers.tasks.colors:ColorsTask", task_kwargs=kwargs).build()
    params = SamplingParams(max_new_tokens=5, temperature=TEMPERATURE, seed=0)
    groups = engine.generate([p["prompt_ids"] for p in prompts], n, params, images=[p[IMAGE_REFS] for p in prompts])
    samples = [(p, g) for p, group in zip(prompts, groups, strict=True) for g in group]
    rows = len(samples)
    step = grpo_queue.step()
    grpo_queue.client.put(
        {
            "prompt_ids": jagged([p["prompt_ids"] for p, _ in samples], torch.int64),
            "response_ids": jagged([g.token_ids for _, g in samples], torch.int64),
            "response_logprobs": jagged([g.logprobs for _, g in samples], torch.float32),
            "policy_version": torch.zeros(rows, dtype=torch.int64),
            "reward": torch.tensor([float(g.token_ids[0] % 2 == 0) for _, g in samples]),
            "reward_failed": torch.zeros(rows, dtype=torch.bool),
            IMAGE_REFS: [p[IMAGE_REFS] for p, _ in samples],
        },
        global_step=step,
    )

    train = TrainConfig(world_size=1, backend="gloo", lr=1e-2, micro_batch_size=8, recompute_old_logprobs=True)
    cfg = TrainerConfig.from_run(RLConfig(prompts_per_step=num_prompts, n_samples=n, train=train))
    rank = GRPOTrainerRank.__ray_metadata__.modified_class(0, 1, grpo_queue.info, cfg, ColorsTask(**kwargs))  # type: ignore[attr-defined]
    seen = spy_on_batches(rank)
    try:
        rank.setup("127.0.0.1", _free_port())
        projector = projector_weights(rank)
        stats = rank.train_step(step)

        [batch] = seen
        assert batch[PIXEL_VALUES].shape == (rows, 2, 3, 16, 16)
        assert sorted(batch[IMAGE_COUNTS].tolist()) == [1] * (2 * n) + [2] * (2 * n)
        mask = batch["response_mask"] > 0
        assert mask.sum() > 0
        assert torch.allclose(batch["old_logprobs"][mask], batch["rollout_logprobs"][mask], atol=1e-5)
        assert stats["optimizer_steps"] == 1 and stats["rows"] == rows and stats["grad_norm"] > 0
        after = dict(rank.policy.model.named_parameters())
        assert all(not torch.equal(after[name].detach().full_tensor(), before) for name, before in projector.items())
    finally:
        rank.client.close()
        if dist.is_initialized():
            dist.destroy_process_group()
