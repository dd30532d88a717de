"""Inference services in the ledger: a host registers its OpenAI-compatible endpoint
(``workers/agents/openai_api.py``) and heart-beats its load; samplers send each chat completion to the least-loaded
healthy one.

    with ServiceRegistration(ledger, InferenceService(name="engine-0", url=url + "/v1"), load=lambda: inflight):
        ...                                  # registered and heart-beating; marked down on exit
    client = InferenceClient(ledger, cfg)
    completion = await client.chat(messages, n=4)   # ChatCompletion with token ids, log-probs, policy version
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx

from rl_contracts.colocate import RequestGate
from workers.api_key import bearer_headers, key_from_env
from workers.ledger.config import SamplingConfig
from workers.ledger.errors import InferenceFailed, LedgerUnavailable, NoInferenceService
from workers.ledger.models import InferenceService
from workers.ledger.store import Ledger

if TYPE_CHECKING:  # the endpoint's module imports the engines (torch): only when a completion is parsed
    from workers.agents.openai_api import ChatCompletion

log = logging.getLogger(__name__)


class ServiceRegistration:
    """Registers ``service`` on enter, heart-beats ``load()`` every ``every_s`` from a thread, marks it down on exit."""

    def __init__(
        self,
        ledger: Ledger,
        service: InferenceService,
        load: Callable[[], float] | None = None,
        policy_version: Callable[[], int] | None = None,
        every_s: float = 1.0,
    ):
        self.ledger, self.service, self.every_s = ledger, service, every_s
        self._load, self._version = load, policy_version
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"service-{service.name}", daemon=True)

    def __enter__(self) -> ServiceRegistration:
        self.ledger.register_service(self.service)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        try:  # down at once, not after service_stale_s
            self.ledger.set_service_status(self.service.name, "down")
        except LedgerUnavailable as exc:
            log.warning("could not mark service %s down: %s", self.service.name, exc)

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.ledger.service_heartbeat(
                    self.service.name,
                    load=self._load() if self._load else None,
                    policy_version=self._version() if self._version else None,
                )
            except LedgerUnavailable as exc:
                log.warning("service %s heartbeat failed: %s", self.service.name, exc)


class InferenceClient:
    """Chat completions from the least-loaded healthy ``InferenceService`` of ``config.model``. Load is the larger
    of what the service last reported and this process's own requests in flight to it. ``api_key``: the services'
    key (their endpoint's ``create_app(api_key=...)``), sent as a bearer token; None: ``TQ_API_KEY`` if set (the
    ledger never holds it). ``transport``: httpx's transport for the requests (None: the network; a test passes
    ``httpx.MockTransport``).

    :meth:`drain` holds new requests back and waits for those in flight (a colocated run releases its servers' memory
    for training only then), :meth:`resume` lets them go on; both may be called from another thread."""

    def __init__(
        self,
        ledger: Ledger,
        config: SamplingConfig,
        refresh_s: float = 1.0,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.ledger, self.config, self.refresh_s, self._transport = ledger, config, refresh_s, transport
        self._headers = bearer_headers(api_key if api_key is not None else key_from_env())
        self.inflight: Counter[str] = Counter()
        self.gate = RequestGate()  # drain() closes it: new requests wait until resume()
        self._services: list[InferenceService] = []
        self._fetched = 0.0
        self._http: httpx.AsyncClient | None = None

    async def services(self) -> list[InferenceService]:
        """The healthy services (refreshed at most every ``refresh_s``; stale ones are marked down first)."""
        if time.monotonic() - self._fetched > self.refresh_s:

            def fetch() -> list[InferenceService]:
                self.ledger.mark_stale_services(self.config.service_stale_s)
                return self.ledger.services(model=self.config.model, healthy_only=True)

            self._services = await asyncio.to_thread(fetch)
            self._fetched = time.monotonic()
        return self._services

    def load(self, service: InferenceService) -> float:
        return max(service.load, float(self.inflight[service.name]))

    async def pick(self) -> InferenceService:
        services = await self.services()
        if not services:
            raise NoInferenceService(
                f"no healthy inference service for model {self.config.model!r}: register one (ServiceRegistration) "
                f"or check `python -m workers.ledger status`"
            )
        return min(services, key=lambda s: (self.load(s), s.name))

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> ChatCompletion:
        """One chat completion of ``n`` choices (``config.num_generations`` unless ``sampling`` says); each choice has
        ``token_ids`` and ``token_logprobs``. The service is our endpoint (``workers/agents/openai_api.py``) or a bare
        vLLM or SGLang server (an ``InferenceManager``'s, registered with ``kind`` ``"vllm"`` / ``"sglang"``): its
        kind decides what is asked for (:func:`token_id_fields`) and how the reply is read
        (:func:`completion_from_reply`). Waits while the client is drained (:meth:`drain`)."""
        async with self.gate.passing_async():
            return await self._chat(messages, **sampling)

    @property
    def active(self) -> int:
        """Requests past the drain check and not answered yet."""
        return self.gate.active

    def drain(self, timeout_s: float) -> bool:
        """Hold new requests back and wait up to ``timeout_s`` for those in flight; whether none is left."""
        return self.gate.drain(timeout_s)

    def resume(self) -> None:
        """Let the requests :meth:`drain` held back go on."""
        self.gate.resume()

    async def _chat(self, messages: list[dict[str, Any]], **sampling: Any) -> ChatCompletion:
        service = await self.pick()
        body = {
            "model": self.config.model,
            "messages": messages,
            "n": self.config.num_generations,
            "max_tokens": self.config.max_new_tokens,
            "temperature": self.config.temperature,
            "top_p": self.config.top_p,
            "logprobs": True,
            **token_id_fields(service),
            **sampling,
        }
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=self.config.request_timeout_s, headers=self._headers, transport=self._transport
            )
        url = f"{service.url.rstrip('/')}/chat/completions" if service.url else None
        if url is None:
            raise InferenceFailed(f"inference service {service.name} has no url (kind {service.kind})")
        self.inflight[service.name] += 1
        try:
            response = await self._http.post(url, json=body)
        except httpx.HTTPError as exc:
            raise InferenceFailed(f"inference service {service.name} at {url}: {type(exc).__name__}: {exc}") from exc
        finally:
            self.inflight[service.name] -= 1
        if response.status_code != 200:
            raise InferenceFailed(
                f"inference service {service.name} at {url} answered {response.status_code}: {response.text[:500]}"
            )
        completion = completion_from_reply(response.json(), service)
        if len(completion.prompt_token_ids) > self.config.max_prompt_tokens:
            raise InferenceFailed(
                f"the prompt has {len(completion.prompt_token_ids)} tokens, more than max_prompt_tokens="
                f"{self.config.max_prompt_tokens}"
            )
        return completion

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def token_id_fields(service: InferenceService) -> dict[str, Any]:
    """What a chat request to ``service`` adds to be answered with token ids: SGLang's ``return_meta_info`` (each
    choice's ``meta_info.output_token_logprobs``: ``[logprob, token id, text]`` per token) and
    ``return_prompt_token_ids`` (each choice's ``prompt_token_ids``) for ``kind="sglang"``; vLLM's
    ``return_token_ids`` otherwise (our endpoint always sends the ids and ignores it). Each engine ignores the other's
    fields silently, so the kind must be right."""
    if service.kind == "sglang":
        return {"return_meta_info": True, "return_prompt_token_ids": True}
    return {"return_token_ids": True}


def completion_from_reply(reply: Any, service: InferenceService) -> ChatCompletion:
    """The ``ChatCompletion`` of ``service``'s reply: our endpoint's as it is; a bare vLLM server's (asked with
    ``return_token_ids``) completed from its own fields: each choice's ``token_logprobs`` from ``logprobs.content``,
    ``policy_version`` from the service's ledger row (vLLM does not say it: the version the service was registered
    with when it was picked), ``usage`` without vLLM's null details. A bare SGLang server's (``kind="sglang"``, asked
    as :func:`token_id_fields` says) is first read from SGLang's fields (:func:`sglang_token_ids`).

    Raises:
        InferenceFailed: a reply without the prompt's or a choice's token ids, or whose log-probs do not match the
            token ids one to one (a server that cannot return them is no sampler's service).
    """
    from workers.agents.openai_api import ChatCompletion

    where = f"inference service {service.name} at {service.url}"
    if not isinstance(reply, dict):
        raise InferenceFailed(f"{where}: expected a chat completion object, got {reply!r:.300}")
    reply = sglang_token_ids(reply, where) if service.kind == "sglang" else dict(reply)
    if reply.get("prompt_token_ids") is None:
        raise InferenceFailed(
            f"{where}: the reply has no prompt_token_ids (expected our endpoint's reply, or vLLM's to a request with "
            f"return_token_ids), got the keys {sorted(reply)}"
        )
    choices = []
    for choice in reply.get("choices") or []:
        choice = dict(choice)
        if choice.get("token_ids") is None:
            raise InferenceFailed(f"{where}: choice {choice.get('index')} has no token_ids")
        if choice.get("token_logprobs") is None:
            content = (choice.get("logprobs") or {}).get("content")
            if content is None:
                raise InferenceFailed(f"{where}: choice {choice.get('index')} has neither token_logprobs nor logprobs")
            choice["token_logprobs"] = [float(entry["logprob"]) for entry in content]
        if len(choice["token_logprobs"]) != len(choice["token_ids"]):
            raise InferenceFailed(
                f"{where}: choice {choice.get('index')} has {len(choice['token_ids'])} token_ids but "
                f"{len(choice['token_logprobs'])} log-probs"
            )
        message = dict(choice.get("message") or {})
        if message.get("content") is None:  # vLLM's empty completion
            message["content"] = ""
        choice["message"] = message
        choices.append(choice)
    reply["choices"] = choices
    reply.setdefault("policy_version", service.policy_version)
    reply["usage"] = {k: v for k, v in (reply.get("usage") or {}).items() if isinstance(v, int)}
    return ChatCompletion.model_validate(reply)


def sglang_token_ids(reply: dict[str, Any], where: str) -> dict[str, Any]:
    """SGLang's chat completion (to a request with ``logprobs``, ``return_meta_info`` and ``return_prompt_token_ids``)
    with the fields :func:`completion_from_reply` reads: ``prompt_token_ids`` (SGLang puts it on each choice), each
    choice's ``token_ids`` and ``token_logprobs`` from its ``meta_info.output_token_logprobs`` (``[logprob, token id,
    text]`` per token: the OpenAI ``logprobs.content`` has no ids), and ``policy_version`` from ``meta_info``'s
    ``weight_version`` where it is an integer (the version ``InferenceManager.sync_weights`` loaded; SGLang's
    initial ``"default"`` leaves the service's ledger row to say it).

    Raises:
        InferenceFailed: a choice without ``prompt_token_ids`` or ``meta_info.output_token_logprobs`` (SGLang's reply
            to a request without those flags), naming what is missing.
    """
    reply = dict(reply)
    choices = []
    versions = set()
    for choice in reply.get("choices") or []:
        choice = dict(choice)
        index = choice.get("index")
        prompt_ids = choice.get("prompt_token_ids")
        if prompt_ids is None and reply.get("prompt_token_ids") is None:
            raise InferenceFailed(
                f"{where}: choice {index} has no prompt_token_ids (expected SGLang's reply to a request with "
                f"return_prompt_token_ids), got the keys {sorted(choice)}"
            )
        if reply.get("prompt_token_ids") is None:
            reply["prompt_token_ids"] = prompt_ids
        meta = choice.get("meta_info") or {}
        entries = meta.get("output_token_logprobs")
        if entries is None:
            raise InferenceFailed(
                f"{where}: choice {index} has no meta_info.output_token_logprobs (expected SGLang's reply to a request "
                f"with logprobs and return_meta_info), got meta_info keys {sorted(meta)}"
            )
        try:
            ids, logprobs = [int(entry[1]) for entry in entries], [float(entry[0]) for entry in entries]
        except (TypeError, ValueError, IndexError, KeyError):
            raise InferenceFailed(
                f"{where}: choice {index}'s meta_info.output_token_logprobs: expected [logprob, token id, text] per "
                f"token, got {entries!r:.200}"
            ) from None
        choice.setdefault("token_ids", ids)
        choice.setdefault("token_logprobs", logprobs)
        if str(meta.get("weight_version", "")).isdigit():
            versions.add(int(meta["weight_version"]))
        choices.append(choice)
    reply["choices"] = choices
    if len(versions) == 1 and "policy_version" not in reply:
        reply["policy_version"] = versions.pop()
    return reply
