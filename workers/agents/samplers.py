"""Token samplers for agents: many concurrent episodes, one batched engine call at a time.

Episodes run as coroutines and each asks for one turn at a time; :class:`BatchingSampler` gathers the turns asked
for while the engine is busy and sends them as one batch, so a CPU engine decodes 32 episodes' turns in one pass
instead of 32.

Images (vision-language models): ``sample(prompt_ids, params, images=[...])`` sends a turn's images with it; the
batched call then gets one list of images per prompt as its ``images`` keyword (``engine_generate`` passes them to
``HFEngine.generate``); a batched call without that keyword refuses turns with images (``ImagesNotSupported``).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from workers.engines.base import Engine, Generation, SamplingParams
from workers.engines.errors import ImagesNotSupported

#: a blocking batched call: prompts + params -> (policy version, one generation per prompt)
GenerateBatch = Callable[[list[list[int]], SamplingParams], tuple[int, list[Generation]]]
#: one pending turn: prompt ids, params, the future of its result, its images (empty for text)
_Turn = tuple[list[int], SamplingParams, asyncio.Future, list[Any]]


class BatchingSampler:
    """A ``TokenSampler`` over a blocking batched generate call, run in a worker thread.

    Turns asked for with different ``max_new_tokens`` share a batch (sampled up to the largest, then cut to each
    request's own limit); turns with other differing parameters go in separate calls.

    Args:
        generate: the batched call (see :func:`engine_generate` and :func:`actor_generate`).
        window_s: how long to wait for more turns before sending a batch when the engine is idle.
    """

    def __init__(self, generate: GenerateBatch, window_s: float = 0.002):
        self._generate = generate
        self.window_s = window_s
        self._pending: list[_Turn] = []
        self._drainer: asyncio.Task | None = None
        self.calls = 0

    async def sample(
        self, prompt_ids: list[int], params: SamplingParams, images: Sequence[Any] | None = None
    ) -> tuple[int, Generation]:
        """``(policy version, generation)`` for one prompt, with its images (a vision-language model's; the prompt
        holds their placeholder tokens) if any."""
        if images and not _takes_images(self._generate):
            raise ImagesNotSupported(
                f"this sampler's batched call {getattr(self._generate, '__qualname__', self._generate)!r} takes no "
                f"images, but {len(images)} came with the prompt; expected text only"
            )
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending.append((list(prompt_ids), params, future, list(images or [])))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(self.window_s)
            batch, self._pending = self._pending, []
            groups: dict[SamplingParams, list[_Turn]] = {}
            for item in batch:
                groups.setdefault(replace(item[1], max_new_tokens=1), []).append(item)
            for items in groups.values():
                await self._run(items)

    async def _run(self, items: list[_Turn]) -> None:
        params = replace(items[0][1], max_new_tokens=max(p.max_new_tokens for _, p, _, _ in items))
        prompts = [ids for ids, _, _, _ in items]
        images = [turn_images for _, _, _, turn_images in items]
        self.calls += 1
        try:
            if any(images):  # only then: batched calls that take no images keep working as they are
                generate: Any = self._generate
                version, generations = await asyncio.to_thread(generate, prompts, params, images=images)
            else:
                version, generations = await asyncio.to_thread(self._generate, prompts, params)
        except Exception as exc:
            for _, _, future, _ in items:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, own, future, _), generation in zip(items, generations, strict=True):
            if not future.done():
                future.set_result((version, _cut(generation, own.max_new_tokens)))


def _takes_images(generate: Callable[..., Any]) -> bool:
    try:
        return "images" in inspect.signature(generate).parameters
    except (TypeError, ValueError):  # a callable without a signature to read
        return False


def _cut(generation: Generation, limit: int) -> Generation:
    if len(generation.token_ids) <= limit:
        return generation
    return Generation(generation.token_ids[:limit], generation.logprobs[:limit], "length")


def engine_generate(engine: Engine) -> GenerateBatch:
    """The batched call of an in-process engine; with ``images`` (one list per prompt), the engine's ``generate``
    gets them (``HFEngine``'s takes them for a vision-language model)."""

    def generate(
        prompts: list[list[int]], params: SamplingParams, images: list[list[Any]] | None = None
    ) -> tuple[int, list[Generation]]:
        if images is None:
            return engine.version, [group[0] for group in engine.generate(prompts, 1, params)]
        call: Any = engine.generate  # HFEngine's takes images; an engine whose generate does not raises TypeError
        return engine.version, [group[0] for group in call(prompts, 1, params, images=images)]

    return generate


def actor_generate(actor: Any) -> GenerateBatch:
    """The batched call of an ``EngineActor`` (or a ``RolloutWorker``-hosted one) by its Ray handle."""
    import ray

    def generate(prompts: list[list[int]], params: SamplingParams) -> tuple[int, list[Generation]]:
        version, groups = ray.get(actor.generate.remote(prompts, 1, params))
        return version, [group[0] for group in groups]

    return generate
