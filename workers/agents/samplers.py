"""Token samplers for agents: many concurrent episodes, one batched engine call at a time.

Episodes run as coroutines and each asks for one turn at a time; :class:`BatchingSampler` gathers the turns asked
for while the engine is busy and sends them as one batch, so a CPU engine decodes 32 episodes' turns in one pass
instead of 32.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from workers.engines.base import Engine, Generation, SamplingParams

#: a blocking batched call: prompts + params -> (policy version, one generation per prompt)
GenerateBatch = Callable[[list[list[int]], SamplingParams], tuple[int, list[Generation]]]


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
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None
        self.calls = 0

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> tuple[int, Generation]:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending.append((list(prompt_ids), params, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(self.window_s)
            batch, self._pending = self._pending, []
            groups: dict[SamplingParams, list[tuple[list[int], SamplingParams, asyncio.Future]]] = {}
            for item in batch:
                groups.setdefault(replace(item[1], max_new_tokens=1), []).append(item)
            for items in groups.values():
                await self._run(items)

    async def _run(self, items: list[tuple[list[int], SamplingParams, asyncio.Future]]) -> None:
        params = replace(items[0][1], max_new_tokens=max(p.max_new_tokens for _, p, _ in items))
        self.calls += 1
        try:
            version, generations = await asyncio.to_thread(self._generate, [ids for ids, _, _ in items], params)
        except Exception as exc:
            for _, _, future in items:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, own, future), generation in zip(items, generations, strict=True):
            if not future.done():
                future.set_result((version, _cut(generation, own.max_new_tokens)))


def _cut(generation: Generation, limit: int) -> Generation:
    if len(generation.token_ids) <= limit:
        return generation
    return Generation(generation.token_ids[:limit], generation.logprobs[:limit], "length")


def engine_generate(engine: Engine) -> GenerateBatch:
    """The batched call of an in-process engine."""

    def generate(prompts: list[list[int]], params: SamplingParams) -> tuple[int, list[Generation]]:
        return engine.version, [group[0] for group in engine.generate(prompts, 1, params)]

    return generate


def actor_generate(actor: Any) -> GenerateBatch:
    """The batched call of an ``EngineActor`` (or a ``RolloutWorker``-hosted one) by its Ray handle."""
    import ray

    def generate(prompts: list[list[int]], params: SamplingParams) -> tuple[int, list[Generation]]:
        version, groups = ray.get(actor.generate.remote(prompts, 1, params))
        return version, [group[0] for group in groups]

    return generate
