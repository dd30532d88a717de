"""``create_chat_completions`` / ``InferenceClient.chat``: what a sampler asks the least-loaded inference service
for (the request body) and how the reply is read (our endpoint's, a bare vLLM or SGLang server's), checked against an
in-process HTTP transport, no server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.fake_engine_server import sglang_chat_reply
from workers.ledger import AsyncSampler, InferenceClient, InferenceService, Ledger, SamplingConfig
from workers.ledger.errors import InferenceFailed


class SeedSampler(AsyncSampler):
    """The seed guide's sampler: ``create_chat_completions(messages)``, no ``n``."""

    async def run(self) -> None:
        await self.create_chat_completions([{"role": "user", "content": "Hello, who are you?"}])

    async def evaluate_record(self, record: Any) -> float:
        return 0.0


def completion(n: int, content: str = "hi") -> dict[str, Any]:
    """An OpenAI-style reply of our endpoint with ``n`` choices saying ``content`` (the samplers' tests use it too)."""
    choice = {"message": {"role": "assistant", "content": content}, "finish_reason": "stop", "token_ids": [5]}
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


def vllm_reply(n: int) -> dict[str, Any]:
    """A bare vLLM server's chat completion to a request with ``logprobs`` and ``return_token_ids`` (vLLM 0.32's
    fields: no ``token_logprobs``, no ``policy_version``, null usage details)."""
    logprobs = {"content": [{"token": "t5", "logprob": -0.25, "bytes": [116, 53], "top_logprobs": []},
                            {"token": "t2", "logprob": -1.5, "bytes": [116, 50], "top_logprobs": []}]}  # fmt: skip
    choice = {"message": {"role": "assistant", "content": "t5", "reasoning_content": None, "tool_calls": []},
              "logprobs": logprobs, "finish_reason": "stop", "stop_reason": None, "token_ids": [5, 2]}  # fmt: skip
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "policy",
        "choices": [{"index": i, **choice} for i in range(n)],
        "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None},
        "prompt_logprobs": None,
        "prompt_token_ids": [5, 6, 7],
        "kv_transfer_params": None,
    }


def vllm_client(tmp_path, reply: Any, bodies: list[dict[str, Any]]) -> InferenceClient:
    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=reply(bodies[-1]["n"]))

    cfg = SamplingConfig(output_dir=str(tmp_path))
    ledger = Ledger(cfg.ledger_url)
    ledger.register_service(InferenceService(name="inference-0", url="http://vllm/v1", model=cfg.model,
                                             policy_version=3))  # fmt: skip
    return InferenceClient(ledger, cfg, transport=httpx.MockTransport(answer))


def chat_once(client: InferenceClient, **sampling: Any) -> Any:
    async def once() -> Any:
        try:
            return await client.chat([{"role": "user", "content": "t5 t6 t7"}], **sampling)
        finally:
            await client.aclose()

    return asyncio.run(once())


def test_a_bare_vllm_servers_reply_is_a_completion_with_token_ids_and_logprobs(tmp_path):
    bodies: list[dict[str, Any]] = []

    got = chat_once(vllm_client(tmp_path, vllm_reply, bodies), n=2)

    assert bodies[0]["return_token_ids"] is True and bodies[0]["logprobs"] is True
    assert got.prompt_token_ids == [5, 6, 7] and len(got.choices) == 2
    assert [(c.token_ids, c.token_logprobs) for c in got.choices] == [([5, 2], [-0.25, -1.5])] * 2
    assert got.policy_version == 3  # vLLM does not say it: the version the service is registered with
    assert got.usage == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("prompt_token_ids", r"inference service inference-0 at http://vllm/v1: the reply has no prompt_token_ids "
                             r"\(expected our endpoint's reply, or vLLM's to a request with return_token_ids\)"),
        ("token_ids", r"inference service inference-0 at http://vllm/v1: choice 0 has no token_ids$"),
        ("logprobs", r"choice 0 has neither token_logprobs nor logprobs$"),
    ],
)  # fmt: skip
def test_a_reply_without_token_ids_or_logprobs_is_refused_naming_what_is_missing(tmp_path, drop, message):
    def reply(n: int) -> dict[str, Any]:
        body = vllm_reply(n)
        if drop == "prompt_token_ids":
            body["prompt_token_ids"] = None  # vLLM's reply to a request without return_token_ids
        else:
            body["choices"][0][drop] = None
        return body

    with pytest.raises(InferenceFailed, match=message):
        chat_once(vllm_client(tmp_path, reply, []), n=1)


# --- a bare SGLang server's reply (issue 27): the service's kind decides what is asked for and how it is read -------
def sglang_client(tmp_path, reply: Any, bodies: list[dict[str, Any]]) -> InferenceClient:
    """A client whose one service is a bare SGLang server (``kind="sglang"``, registered at version 3) answering
    ``reply(body)``."""

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=reply(bodies[-1]))

    cfg = SamplingConfig(output_dir=str(tmp_path))
    ledger = Ledger(cfg.ledger_url)
    ledger.register_service(InferenceService(name="inference-0", kind="sglang", url="http://sglang/v1",
                                             model=cfg.model, policy_version=3))  # fmt: skip
    return InferenceClient(ledger, cfg, transport=httpx.MockTransport(answer))


def test_a_bare_sglang_servers_reply_is_a_completion_with_token_ids_and_logprobs(tmp_path):
    bodies: list[dict[str, Any]] = []

    got = chat_once(sglang_client(tmp_path, lambda body: sglang_chat_reply(body, "default"), bodies), n=2)

    asked = bodies[0]
    assert asked["logprobs"] is True and asked["return_meta_info"] is True and asked["return_prompt_token_ids"] is True
    assert "return_token_ids" not in asked  # vLLM's: SGLang would ignore it silently
    assert got.prompt_token_ids == [ord(c) for c in "t5 t6 t7"] and len(got.choices) == 2
    assert [(c.token_ids, c.token_logprobs) for c in got.choices] == [([5, 2], [-0.25, -1.5])] * 2
    assert got.policy_version == 3  # SGLang's initial weight_version "default": the service's ledger row says it
    assert got.usage == {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12}

    synced = chat_once(sglang_client(tmp_path / "b", lambda body: sglang_chat_reply(body, "4"), []), n=1)
    assert synced.policy_version == 4  # the weights that answered (InferenceManager.sync_weights' weight_version)


def test_a_vllm_kind_service_is_asked_for_vllms_token_ids():
    from workers.ledger.services import token_id_fields

    assert token_id_fields(InferenceService(name="v", kind="vllm")) == {"return_token_ids": True}
    assert token_id_fields(InferenceService(name="o")) == {"return_token_ids": True}  # our endpoint ignores it
    assert token_id_fields(InferenceService(name="s", kind="sglang")) == {
        "return_meta_info": True,
        "return_prompt_token_ids": True,
    }


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("return_prompt_token_ids", r"^inference service inference-0 at http://sglang/v1: choice 0 has no "
                                    r"prompt_token_ids \(expected SGLang's reply to a request with "
                                    r"return_prompt_token_ids\), got the keys \['finish_reason', 'index', "),
        ("return_meta_info", r"^inference service inference-0 at http://sglang/v1: choice 0 has no "
                             r"meta_info.output_token_logprobs \(expected SGLang's reply to a request with logprobs "
                             r"and return_meta_info\), got meta_info keys \[\]$"),
        ("logprobs", r"choice 0 has no meta_info.output_token_logprobs .*got meta_info keys \['completion_tokens', "),
        ("entries", r"choice 0's meta_info.output_token_logprobs: expected \[logprob, token id, text\] per token, "
                    r"got \[\[-0.25\], \[-1.5\]\]$"),
    ],
)  # fmt: skip
def test_an_sglang_reply_without_what_is_needed_is_refused_naming_what_is_missing(tmp_path, drop, message):
    def reply(body: dict[str, Any]) -> dict[str, Any]:
        if drop == "entries":
            out = sglang_chat_reply(body, "default")
            out["choices"][0]["meta_info"]["output_token_logprobs"] = [[-0.25], [-1.5]]
            return out
        return sglang_chat_reply({**body, drop: False}, "default")  # as SGLang answers a request without the flag

    with pytest.raises(InferenceFailed, match=message):
        chat_once(sglang_client(tmp_path, reply, []), n=1)
