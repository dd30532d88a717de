"""``create_chat_completions`` / ``InferenceClient.chat``: what a sampler asks the least-loaded inference service
for (the request body), checked against an in-process HTTP transport, no server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from workers.ledger import AsyncSampler, InferenceClient, InferenceService, Ledger, SamplingConfig


class SeedSampler(AsyncSampler):
    """The seed guide's sampler: ``create_chat_completions(messages)``, no ``n``."""

    async def run(self) -> None:
        await self.create_chat_completions([{"role": "user", "content": "Hello, who are you?"}])

    async def evaluate_record(self, record: Any) -> float:
        return 0.0


def completion(n: int) -> dict[str, Any]:
    choice = {"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop", "token_ids": [5]}
    return {
        "id": "c",
        "created": 0,
        "model": "policy",
        "choices": [{"index": i, **choice, "token_logprobs": [-0.5]} for i in range(n)],
        "usage": {},
        "prompt_token_ids": [1, 2],
        "policy_version": 0,
    }


def ask(sampler: SeedSampler, **sampling: Any) -> Any:
    async def once() -> Any:
        try:
            return await sampler.create_chat_completions([{"role": "user", "content": "1+1="}], **sampling)
        finally:
            await sampler.inference.aclose()

    return asyncio.run(once())


@pytest.fixture
def asked(tmp_path) -> tuple[list[dict[str, Any]], Any]:
    """The request bodies the service received, and a sampler factory over a ledger with that service registered."""
    bodies: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        return httpx.Response(200, json=completion(body.get("n", 1)))

    def sampler(**settings: Any) -> SeedSampler:
        cfg = SamplingConfig(output_dir=str(tmp_path), **settings)
        ledger = Ledger(cfg.ledger_url)
        ledger.register_service(InferenceService(name="engine-0", url="http://engine/v1", model=cfg.model))
        client = InferenceClient(ledger, cfg, transport=httpx.MockTransport(answer))
        return SeedSampler(cfg, ledger=ledger, inference=client)

    return bodies, sampler


def test_a_completion_without_n_has_num_generations_choices(asked):
    bodies, sampler = asked

    got = ask(sampler(num_generations=3))

    assert len(got.choices) == 3 and bodies[0]["n"] == 3


def test_the_callers_n_overrides_num_generations(asked):
    bodies, sampler = asked

    got = ask(sampler(num_generations=3), n=1)

    assert len(got.choices) == 1 and bodies[0]["n"] == 1
