"""A vision-language model trained by ``FSDPPolicy`` over two gloo ranks whose micro-batches differ in whether they
hold images: rank 0's rows have pictures, rank 1's are text only (fixed micro-batches), or rank 1 has fewer
micro-batches and runs dynamic batching's filler passes while rank 0 runs micro-batches with images. The vision
tower's layers are FSDP units of their own, so without a vision pass on every rank the ranks' collectives fall out of
step (a hang or an error); with it the step completes, and the weights and log-probs are those of a world of one
given every row.

The ranks run in spawned processes under a deadline: a hang fails the test, not the suite."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainers.fsdp import IMAGE_COUNTS, PIXEL_VALUES, AdamWConfig, FSDPPolicy, init_process_group
from trainers.grpo import pad_sequences
from workers.models import build_tiny_vlm
from workers.vision import solid_png

#: each case's rows per rank: a picture's colour, or None for a text row
CASES = {
    # fixed micro-batches of one row: both of rank 1's micro-batches are text only
    "text-rank": [[(255, 0, 0), (0, 0, 255)], [None, None]],
    # dynamic batching, a row per micro-batch: rank 1 runs its text row, then two filler passes
    "filler-passes": [[(255, 0, 0), (0, 160, 0), None], [None]],
}
DEADLINE_S = 240.0  # two spawned ranks import torch and transformers (~15 s each on a loaded CPU); a hang never ends


def rows(pictures: list[tuple[int, int, int] | None]) -> dict[str, torch.Tensor]:
    """The training rows of a rank: a prompt with the picture (or none), a fixed response per row."""
    vlm = build_tiny_vlm()
    size = vlm.model.config.vision_config.image_size
    prompts, responses, pixels, counts = [], [], [], []
    for i, colour in enumerate(pictures):
        content: list[dict] = [{"type": "text", "text": f"what is {i}?"}]
        if colour is not None:
            content.insert(0, {"type": "image_url", "image_url": {"url": solid_png(8, 8, colour)}})
        ids, images = vlm.chat.prompt([{"role": "user", "content": content}])
        prompts.append(ids)
        responses.append([5 + 7 * i + j for j in range(3 + i)])
        pixels.append(vlm.image_processor(images) if images else torch.zeros(1, 3, size, size))
        counts.append(len(images))
    batch = pad_sequences(prompts, responses, vlm.tokenizer.pad_token_id)
    batch[PIXEL_VALUES] = torch.stack(pixels)
    batch[IMAGE_COUNTS] = torch.tensor(counts, dtype=torch.int64)
    return batch


def concatenated(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The ranks' rows as one batch (right-padded to the longest)."""
    width = max(b["input_ids"].shape[1] for b in batches)
    out: dict[str, list[torch.Tensor]] = {}
    for batch in batches:
        for name, value in batch.items():
            if value.dim() == 2:
                value = torch.nn.functional.pad(value, (0, width - value.shape[1]))
            out.setdefault(name, []).append(value)
    return {name: torch.cat(values) for name, values in out.items()}


def token_mean_nll(*, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    mask = batch["response_mask"]
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1), {}


def step(case: str, batch: dict[str, torch.Tensor]) -> dict:
    """One train step (and the log-probs before it) of a fresh tiny VLM on ``batch``, in the current world."""
    dynamic = case == "filler-passes"
    policy = FSDPPolicy(
        build_tiny_vlm().model,
        optimizer=AdamWConfig(lr=1e-2),
        micro_batch_size=1,
        mixed_precision=False,
        dynamic_batching=dynamic,
        max_tokens_per_micro_batch=1,  # with dynamic batching: every row a micro-batch of its own
    )
    images = {"pixel_values": batch[PIXEL_VALUES], "image_counts": batch[IMAGE_COUNTS]}
    logprobs = policy.compute_logprobs(batch["input_ids"], batch["attention_mask"], **images)
    stats = policy.train_step(batch, token_mean_nll)
    return {
        "logprobs": logprobs,
        "loss": stats["loss"],
        "micro_batches": policy.micro_batch_counts,
        "weights": policy.full_state_dict(),
    }


def _rank(rank: int, world_size: int, case: str, ports: tuple[int, int], workdir: str) -> None:
    torch.manual_seed(0)
    batches = [rows(pictures) for pictures in CASES[case]]
    init_process_group(rank, world_size, "127.0.0.1", ports[0], backend="gloo")
    try:
        result = step(case, batches[rank])
    finally:
        dist.destroy_process_group()
    if rank == 0:  # this process again, in a world of one given every row
        init_process_group(0, 1, "127.0.0.1", ports[1], backend="gloo")
        try:
            result["single"] = step(case, concatenated(batches))
        finally:
            dist.destroy_process_group()
    torch.save(result, Path(workdir) / f"rank{rank}.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(case: str, workdir: Path) -> list[dict]:
    context = mp.start_processes(
        _rank, args=(2, case, (_free_port(), _free_port()), str(workdir)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
                process.join()
            pytest.fail(f"case {case!r}: the two ranks did not finish their step within {DEADLINE_S:.0f} s (a hang)")
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(2)]


# text-rank: slow tier (make test's 10-minute budget); filler-passes runs a text-only rank's passes too
@pytest.mark.parametrize(
    "case", [pytest.param("text-rank", marks=pytest.mark.slow) if c == "text-rank" else c for c in sorted(CASES)]
)
def test_two_ranks_with_and_without_images_give_the_single_rank_step(case: str, tmp_path: Path) -> None:
    ranks = run_two_ranks(case, tmp_path)
    single = ranks[0]["single"]
    if case == "filler-passes":
        assert ranks[0]["micro_batches"] == [3, 1]  # rank 1 ran two filler passes
    assert ranks[0]["loss"] == pytest.approx(single["loss"], abs=1e-6)
    split = ranks[0]["logprobs"].shape[0]
    width = single["logprobs"].shape[1]
    for rank, part in enumerate((single["logprobs"][:split], single["logprobs"][split:])):
        logprobs = ranks[rank]["logprobs"]
        torch.testing.assert_close(logprobs, part[:, : logprobs.shape[1]], atol=1e-5, rtol=0)
        assert not part[:, logprobs.shape[1] : width].any()
    weights, expected = ranks[0]["weights"], single["weights"]
    assert weights.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    # the step did move the vision tower and the projector (the images reached the loss)
    init = build_tiny_vlm().model.state_dict()
    for name in ("model.multi_modal_projector.linear_1.weight", "model.vision_tower.embeddings.patch_embedding.weight"):
        assert not torch.allclose(weights[name], init[name], atol=1e-4), name
