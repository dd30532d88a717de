"""The client half of the task-server protocol: the calls, their typed failures, and a pool of servers.

:class:`TaskServerPool` keeps one ``httpx.AsyncClient``, knows which servers are healthy and how many episodes each
runs, starts each episode on the least busy healthy server (another one when a start fails; all of them again, after
a jittered backoff, while they answer 503 at their ``--max-episodes``) and keeps every later call of that episode on
the server that started it. A server that stops answering is marked dead and skipped until a health check finds it
back. Starts and steps carry a ``request_id``, so a call retried after a broken connection is never applied twice.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import ValidationError

from workers.agents.protocol import EpisodeResponse
from workers.api_key import bearer_headers, key_from_env

logger = logging.getLogger(__name__)


class TaskServerError(RuntimeError):
    """An episode could not go on because of its task server; the message says which server and what happened."""


class ServerUnavailable(TaskServerError):
    """No healthy task server could take the call (connection refused, 5xx, or all marked dead)."""


class ServerBusy(ServerUnavailable):
    """The server answered 503: its ``--max-episodes`` are running (a start is retried there after a backoff)."""


class Unauthorized(TaskServerError):
    """The task server answered 401: the call carried no key, or not the server's (the pool's ``api_key``)."""


class EpisodeStartError(TaskServerError):
    """Every healthy task server refused or failed to start the episode."""


class StepTimeout(TaskServerError):
    """A call to the task server took longer than the workflow's ``timeout``."""


class MalformedResponse(TaskServerError):
    """The task server answered something that is not the protocol's JSON."""


@dataclass
class Episode:
    """A started episode: its id and the server that holds it (every later call goes there)."""

    episode_id: str
    server: str
    observation: dict[str, Any]
    info: dict[str, Any]


@dataclass
class StepResult:
    observation: dict[str, Any] | None
    reward: float
    done: bool
    info: dict[str, Any]


class TaskServerPool:
    """Task servers behind one client; see the module docstring.

    Args:
        urls: server base URLs (``http://127.0.0.1:5000``); the API lives under ``/api``.
        timeout: seconds each call may take.
        start_wait: seconds a start may keep retrying while servers answer 503 (their ``--max-episodes`` running),
            after a jittered exponential backoff (:func:`start_backoff`) each time every healthy server refused.
        api_key: the servers' key, sent as ``Authorization: Bearer`` on every call (None: ``TQ_API_KEY`` if set).
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        timeout: float = 60.0,
        start_wait: float = 300.0,
        api_key: str | None = None,
    ):
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("task_server_url is empty; expected a URL or a list of URLs")
        if not start_wait >= 0:
            raise ValueError(f"start_wait={start_wait} must be >= 0 seconds")
        self.timeout = timeout
        self.start_wait = start_wait
        self._headers = bearer_headers(api_key if api_key is not None else key_from_env())
        self.active = {url: 0 for url in self.urls}
        self.healthy = {url: True for url in self.urls}
        #: why each server was last found not healthy (its health check's or its last call's error)
        self.down_reason: dict[str, str] = {}
        self._rng = random.Random()
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        # Made inside the event loop that uses it (again when a later asyncio.run brings a new loop).
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            # Idle connections are dropped after 2 s, before the server's keep-alive (uvicorn: 5 s) closes them:
            # reusing one the server is closing fails the request with a ReadError although the server is fine.
            limits = httpx.Limits(max_connections=256, keepalive_expiry=2.0)
            self._client = httpx.AsyncClient(timeout=self.timeout, limits=limits, headers=self._headers)
            self._loop = loop
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def check_health(self) -> dict[str, bool]:
        """Ask every server ``GET /api/health``; a server is healthy when it answers ``status: healthy``."""

        results = await asyncio.gather(*(self._answers_health(u, record=True) for u in self.urls))
        for url, ok in zip(self.urls, results, strict=True):
            if ok and not self.healthy[url]:
                logger.info("task server %s is healthy again", url)
            self.healthy[url] = ok
        return dict(self.healthy)

    def mark_dead(self, url: str, reason: str) -> None:
        if self.healthy.get(url):
            logger.warning("task server %s marked dead: %s", url, reason)
        self.healthy[url] = False
        self.down_reason[url] = reason

    def least_busy(self, exclude: set[str]) -> str | None:
        candidates = [u for u in self.urls if self.healthy[u] and u not in exclude]
        return min(candidates, key=lambda u: self.active[u]) if candidates else None

    async def start(
        self, sample_id: str, config: dict[str, Any] | None = None, abandoned: asyncio.Event | None = None
    ) -> Episode:
        """Start an episode on the least busy healthy server, trying the next one when a start fails; while servers
        answer 503 (busy), try them again after a backoff, for up to ``start_wait`` seconds or until ``abandoned``
        is set (the episode is no longer wanted: its group was dropped meanwhile).

        Raises:
            EpisodeStartError: when every healthy server failed, or stayed busy; the message names every server and
                what it answered (or why it was not tried), the last failure chained.
        """
        # request_id: a retry of this call (a connection that broke) gets the episode the server may already have
        # started, never a second one left to expire while holding its environment
        payload = {"sample_id": sample_id, "config": config or {}, "request_id": uuid.uuid4().hex}
        deadline = time.monotonic() + self.start_wait
        failed: set[str] = set()  # servers that failed other than busy: not tried again by this start
        errors: dict[str, str] = {}  # each server's last error
        last: Exception | None = None
        for attempt in itertools.count():
            tried, busy = set(failed), False
            while (url := self.least_busy(tried)) is not None:
                tried.add(url)
                try:
                    return await self._start_on(url, sample_id, payload)
                except (TaskServerError, ValidationError) as exc:
                    last, errors[url] = exc, str(exc)
                    if isinstance(exc, ServerBusy):  # expected at --max-episodes: retried, not worth a warning
                        busy = True
                        logger.debug("starting sample %r on %s: busy (%s)", sample_id, url, exc)
                        continue
                    failed.add(url)
                    logger.warning("starting sample %r on %s failed (%s); trying another server", sample_id, url, exc)
            left = deadline - time.monotonic()
            if not busy or left <= 0 or await _set_within(abandoned, min(left, start_backoff(attempt, self._rng))):
                break
        raise EpisodeStartError(
            f"no task server could start sample {sample_id!r}"
            + (f" within start_wait={self.start_wait:g} s" if busy else "")
            + ": "
            + "; ".join(f"{url}: {errors.get(url) or self._why_not_tried(url)}" for url in self.urls)
        ) from last

    async def _start_on(self, url: str, sample_id: str, payload: dict[str, Any]) -> Episode:
        self.active[url] += 1  # taken before the call, so concurrent starts spread over the servers
        try:
            body = await self._call(url, "POST", "/episode/start", payload)
            reply = EpisodeResponse.model_validate(body)
            if reply.observation is None:
                raise MalformedResponse(f"{url} started an episode without an observation")
        except BaseException:
            self.active[url] -= 1
            raise
        return Episode(reply.episode_id, url, reply.observation.model_dump(), reply.info)

    def _why_not_tried(self, url: str) -> str:
        if self.healthy[url]:
            return "not tried"
        return f"not tried, not healthy: {self.down_reason.get(url, 'marked dead')}"

    async def step(self, episode: Episode, action: dict[str, Any]) -> StepResult:
        """``POST /api/episode/step`` on the episode's server.

        Raises:
            StepTimeout, MalformedResponse, ServerUnavailable, TaskServerError: typed, naming server and episode.
        """
        # request_id: a retry of this call (a connection that broke) gets the reply of the step the server may
        # already have applied, never a second step
        payload = {"episode_id": episode.episode_id, "action": action, "request_id": uuid.uuid4().hex}
        body = await self._call(episode.server, "POST", "/episode/step", payload)
        try:
            reply = EpisodeResponse.model_validate(body)
        except ValidationError as exc:
            raise MalformedResponse(
                f"{episode.server} answered a step of episode {episode.episode_id} that is not the protocol's "
                f"EpisodeResponse ({exc.error_count()} errors: {exc.errors()[0]['loc']} {exc.errors()[0]['msg']}): "
                f"{str(body)[:200]}"
            ) from None
        observation = reply.observation.model_dump() if reply.observation is not None else None
        return StepResult(observation, reply.reward, reply.done, reply.info)

    async def finish(self, episode: Episode, cancel: bool) -> None:
        """The episode is over for the workflow: free its slot, and ``POST /api/episode/cancel`` if it is not done
        on the server (best effort: a dead server cannot be told)."""
        self.active[episode.server] = max(0, self.active[episode.server] - 1)
        if cancel and self.healthy.get(episode.server):
            try:
                await self._call(episode.server, "POST", "/episode/cancel", {"episode_id": episode.episode_id})
            except TaskServerError as exc:
                logger.info("cancelling episode %s on %s failed: %s", episode.episode_id, episode.server, exc)

    async def _answers_health(self, url: str, record: bool = False) -> bool:
        """Whether ``url`` answers ``/api/health`` now: one failed call is not a dead server (a connection can
        break under a live one). ``record``: keep why not in ``down_reason``."""
        try:
            status = (await self._call(url, "GET", "/health")).get("status")
        except TaskServerError as exc:
            reason = str(exc)
        else:
            if status == "healthy":
                return True
            reason = f"GET {url.rstrip('/')}/api/health answered status {status!r}, expected 'healthy'"
        if record:
            self.down_reason[url] = reason
        return False

    async def _call(
        self, url: str, method: str, path: str, payload: dict[str, Any] | None = None, retry: bool = True
    ) -> dict[str, Any]:
        """One call; a broken connection to a server that still answers ``/health`` is retried once.

        The retry is safe for a start and a step: both carry a ``request_id``, and a server that had applied it
        answers the retry with the same reply (a connection can break after the server applied the step: seen under load
        as a retried winning guess answered "episode ... is already done").
        """
        endpoint = f"{url.rstrip('/')}/api{path}"
        try:
            response = await self.client.request(method, endpoint, json=payload)
        except httpx.TimeoutException:
            raise StepTimeout(f"{method} {endpoint} timed out after {self.timeout} s") from None
        except httpx.TransportError as exc:
            alive = path != "/health" and await self._answers_health(url)
            if not alive:
                self.mark_dead(url, repr(exc))
            elif retry:
                logger.info("%s %s: connection broke (%r); the server is alive, retrying once", method, endpoint, exc)
                return await self._call(url, method, path, payload, retry=False)
            raise ServerUnavailable(f"{method} {endpoint} failed: {exc!r}") from None
        if response.status_code >= 400:
            detail = _detail(response)
            error = _ERROR_OF_STATUS.get(response.status_code, TaskServerError)
            raise error(f"{method} {endpoint} answered {response.status_code}: {detail}")
        try:
            body = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise MalformedResponse(f"{method} {endpoint} answered non-JSON: {response.text[:200]!r}") from None
        if not isinstance(body, dict):
            raise MalformedResponse(f"{method} {endpoint} answered a JSON {type(body).__name__}, expected an object")
        return body


#: the typed error of an error status (any other: TaskServerError)
_ERROR_OF_STATUS: dict[int, type[TaskServerError]] = {
    401: Unauthorized,
    502: ServerUnavailable,
    503: ServerBusy,
    504: ServerUnavailable,
}

#: the backoff between start retries while servers are busy: first delay, doubling up to the cap
_BACKOFF_FIRST_S = 0.05
_BACKOFF_CAP_S = 2.0


def start_backoff(attempt: int, rng: random.Random) -> float:
    """Seconds to wait before start retry ``attempt`` (0-based): ``min(0.05 * 2**attempt, 2.0)`` with jitter, a
    uniform fraction in [1/2, 1] of it, so the starts refused together do not all come back together."""
    return min(_BACKOFF_FIRST_S * 2 ** min(attempt, 16), _BACKOFF_CAP_S) * rng.uniform(0.5, 1.0)


async def _set_within(event: asyncio.Event | None, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``event`` (just sleep without one); whether it was set."""
    if event is None:
        await asyncio.sleep(seconds)
        return False
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        return False
    return True


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail", response.text))[:300]
    except (ValueError, AttributeError):
        return response.text[:300]
