"""An OpenAI-compatible endpoint in front of the run's engines: agent code written against the ``openai`` client
works unchanged, and its turns still come back as the exact token ids sampled.

    POST /v1/chat/completions   messages, n, temperature, top_p, max_tokens, stop, logprobs (+ seed)
    GET  /v1/models

Each choice carries, besides the OpenAI fields, ``token_ids`` and ``token_logprobs`` (the sampled ids and their
log-probs, as vLLM's ``return_token_ids``); the response carries ``prompt_token_ids`` and ``policy_version``. With
the ``openai`` client they are ``choice.model_extra["token_ids"]`` and so on.

    app = create_app(sampler, chat, model="policy", api_key=key)   # a TokenSampler over the engines, a ChatFormat
    with serve_in_background(app) as url: ...          # (workers.agents.task_server) 127.0.0.1, a free port
    openai.OpenAI(base_url=url + "/v1", api_key=key)

A message's ``content`` is a string or a list of OpenAI content parts: the ``text`` parts are joined with newlines.
An ``image_url`` part (a base64 ``data:`` URL, as the sampling ledger's samplers send images:
``workers/ledger/multimodal.py``) is taken when ``chat`` renders images, a ``workers.vision.VisionChatFormat`` in
front of a vision-language model (its ``prompt(messages)`` gives the prompt ids with the image placeholders and the
images, which go to ``sampler.sample(..., images=...)``); with a text-only ``chat`` it gets a 400 naming it, never a
silent drop.

With ``api_key`` every route answers 401 (OpenAI's error shape) without ``Authorization: Bearer <api_key>``, which
is what the ``openai`` client sends; ``AgentRolloutWorker.serve_openai`` draws a fresh key for its endpoint.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from transfer_queue.errors import TransferQueueError
from workers.agents.trajectory import ChatFormat
from workers.agents.workflow import TokenSampler
from workers.api_key import BearerAuth
from workers.engines.base import Generation, SamplingParams


class ChatMessage(BaseModel):
    role: str
    content: str


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class RequestMessage(BaseModel):
    """A request's message: ``content`` a string, or OpenAI content parts (``text``, ``image_url``)."""

    role: str
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]


class ContentNotSupported(TransferQueueError, ValueError):
    """A request's content part the endpoint's engine cannot take (an image for a text-only model)."""


class ChatCompletionRequest(BaseModel):
    """The subset of OpenAI's chat completion request that the engines can honour (other fields are ignored)."""

    model: str | None = None
    messages: list[RequestMessage] = Field(min_length=1)
    n: int = Field(1, ge=1, le=64)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    logprobs: bool = False
    seed: int | None = None


class ChoiceLogprobs(BaseModel):
    content: list[dict[str, Any]]


class Choice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int]
    token_logprobs: list[float]


class ChatCompletion(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: dict[str, int]
    prompt_token_ids: list[int]
    policy_version: int


def create_app(
    sampler: TokenSampler,
    chat: ChatFormat,
    model: str = "policy",
    max_tokens: int = 256,
    api_key: str | None = None,
) -> FastAPI:
    """The endpoint's app over ``sampler`` (e.g. a ``BatchingSampler`` over the run's engine actors).

    Args:
        sampler: where completions are sampled; ``n`` choices are ``n`` concurrent samples (batched together).
        chat: renders ``messages`` to prompt ids (the chat template) and decodes sampled ids.
        model: the model id ``/v1/models`` lists and responses name.
        max_tokens: the completion length when a request gives none.
        api_key: when set, every route refuses a request without ``Authorization: Bearer <api_key>`` (401).
    """
    app = FastAPI(title="transfer_queue OpenAI-compatible endpoint")
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, f"invalid request: {exc.errors()}")

    @app.exception_handler(ValueError)
    async def bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return _error(400, str(exc))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "tq"}]}

    @app.post("/v1/chat/completions", response_model=ChatCompletion)
    async def chat_completions(body: ChatCompletionRequest) -> ChatCompletion:
        prompt, images = _prompt(chat, body.messages, body.model or model)
        params = SamplingParams(
            max_new_tokens=body.max_completion_tokens or body.max_tokens or max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
        )
        with_images: dict[str, Any] = {"images": images} if images else {}  # a text sampler keeps its own call
        results = await asyncio.gather(
            *(sampler.sample(prompt, _seeded(params, i), **with_images) for i in range(body.n))
        )
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        choices = [_choice(i, generation, chat, stops, body.logprobs) for i, (_, generation) in enumerate(results)]
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=body.model or model,
            choices=choices,
            usage={
                "prompt_tokens": len(prompt),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt) * body.n + completion_tokens,
            },
            prompt_token_ids=prompt,
            policy_version=min(version for version, _ in results),
        )

    return app


def _prompt(chat: ChatFormat, messages: list[RequestMessage], model: str) -> tuple[list[int], list[Any]]:
    """The prompt ids and the images: ``chat.prompt`` when ``chat`` renders images (a ``VisionChatFormat``), else
    ``chat.prompt_ids`` of the text messages (an image part refused)."""
    render = getattr(chat, "prompt", None)
    if callable(render):
        ids, images = render([m.model_dump(exclude_none=True) for m in messages])
        return list(ids), list(images)
    return chat.prompt_ids(_text_messages(messages, model)), []


def _text_messages(messages: list[RequestMessage], model: str) -> list[dict[str, Any]]:
    """The messages with string content: text parts joined with newlines; an image part refused."""
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if not isinstance(content, str):
            for j, part in enumerate(content):
                if isinstance(part, ImagePart):
                    raise ContentNotSupported(
                        f"messages[{i}].content[{j}] is an image_url part, but model {model!r} behind this endpoint "
                        f"takes text only: expected string content or 'text' parts"
                    )
            content = "\n".join(part.text for part in content if isinstance(part, TextPart))
        out.append({"role": message.role, "content": content})
    return out


def _seeded(params: SamplingParams, index: int) -> SamplingParams:
    # n choices with one seed must still differ from each other
    if params.seed is None:
        return params
    return SamplingParams(
        params.max_new_tokens, params.temperature, params.top_p, params.top_k, (), params.seed + index
    )


def _choice(index: int, generation: Generation, chat: ChatFormat, stops: list[str], logprobs: bool) -> Choice:
    """One choice; a stop string cuts the ids after the first token whose text completes it (the stop string is
    not in ``content``, as in OpenAI's API; the ids keep the token that held it, since the model sampled it)."""
    ids, lps, reason = generation.token_ids, generation.logprobs, generation.finish_reason
    text = chat.decode(ids[:-1] if reason == "stop" else ids)
    if stops:
        for end in range(1, len(ids) + 1):
            piece = chat.decode(ids[:end])
            hit = min((piece.find(s) for s in stops if s in piece), default=-1)
            if hit >= 0:
                ids, lps, reason, text = ids[:end], lps[:end], "stop", piece[:hit]
                break
    content = None
    if logprobs:
        content = [
            {"token": chat.decode([t]), "logprob": lp, "bytes": list(chat.decode([t]).encode()), "top_logprobs": []}
            for t, lp in zip(ids, lps, strict=True)
        ]
    return Choice(
        index=index,
        message=ChatMessage(role="assistant", content=text),
        finish_reason=reason,
        logprobs=ChoiceLogprobs(content=content) if content is not None else None,
        token_ids=list(ids),
        token_logprobs=list(lps),
    )


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}, "detail": message}, status)
