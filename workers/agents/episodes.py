"""EpisodeTable: which episodes a task server holds, their turns, limits and idle expiry. Plain bookkeeping, no HTTP.

The server calls into the environments; this table only decides: may an episode start (``max_episodes``), which
episode an id names and whether it can still step, what a step's ``info`` says, and which idle episodes have expired.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.agents.environment import Environment, Step

#: how many ended episode ids the table remembers, to say why an id no longer steps
_ENDED_KEPT = 65536


class EpisodeRefused(Exception):
    """Base of the table's refusals; ``status`` is the HTTP status the server answers with."""

    status = 400


class BadRequest(EpisodeRefused):
    status = 400


class NotFound(EpisodeRefused, LookupError):
    status = 404


class UnknownEpisode(NotFound):
    pass


class TooManyEpisodes(EpisodeRefused):
    status = 503


class EnvironmentFailure(EpisodeRefused):
    """The environment raised (or returned something malformed): the episode is ended."""

    status = 500


@dataclass
class Episode:
    episode_id: str
    sample_id: str
    environment: Environment
    max_turns: int
    last_active: float
    turn: int = 0
    #: set once the environment's close() has been called (it is called once)
    closed: bool = False
    #: set when that close() call has returned (the server's shutdown retries one cut off by a cancelled request)
    close_returned: bool = False
    #: held while a reset/step runs, so one episode's calls never overlap and a busy episode never expires
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class EpisodeTable:
    """The live episodes of one task server.

    Args:
        max_episodes: most episodes running at once (``None``: no limit); a start beyond it is refused (503).
        idle_timeout: seconds without a call after which an episode expires and its environment is closed.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self, max_episodes: int | None = None, idle_timeout: float = 300.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_episodes is not None and max_episodes < 1:
            raise ValueError(f"max_episodes={max_episodes} must be >= 1 (or None for no limit)")
        if not idle_timeout > 0:
            raise ValueError(f"idle_timeout={idle_timeout} must be > 0 seconds")
        self.max_episodes = max_episodes
        self.idle_timeout = idle_timeout
        self._clock = clock
        self._live: dict[str, Episode] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        # per episode, its last step's request_id and reply: a re-sent step is answered again, never applied twice
        self._replies: OrderedDict[str, tuple[str, Any]] = OrderedDict()
        # per start request_id, its reply: a re-sent start is answered with the same episode, never a second one
        self._starts: OrderedDict[str, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._live)

    def check_capacity(self) -> None:
        """Raise TooManyEpisodes if ``max_episodes`` are running."""
        if self.max_episodes is not None and len(self._live) >= self.max_episodes:
            raise TooManyEpisodes(
                f"{len(self._live)} episodes are running, the server's --max-episodes={self.max_episodes}; "
                "retry later or on another server"
            )

    def open(self, sample_id: str, environment: Environment, max_turns: int) -> Episode:
        """Admit a new episode (not yet reset). Raises TooManyEpisodes at ``max_episodes``."""
        self.check_capacity()
        episode = Episode(uuid.uuid4().hex, sample_id, environment, max_turns, self._clock())
        self._live[episode.episode_id] = episode
        return episode

    def get(self, episode_id: str) -> Episode:
        """The live episode ``episode_id``, its idle clock restarted.

        Raises:
            BadRequest: the episode is already done.
            UnknownEpisode: never started, cancelled, expired or failed (the message says which).
        """
        episode = self._live.get(episode_id)
        if episode is not None:
            episode.last_active = self._clock()
            return episode
        why = self._ended.get(episode_id)
        if why == "done":
            raise BadRequest(f"episode {episode_id!r} is already done")
        if why is not None:
            raise UnknownEpisode(f"episode {episode_id!r} is no longer running: {why}")
        raise UnknownEpisode(f"unknown episode_id={episode_id!r}")

    def replay(self, episode_id: str, request_id: str | None) -> Any | None:
        """The reply of the episode's last step if ``request_id`` names it (a client re-sending a step whose reply
        it lost), else None."""
        if request_id is None:
            return None
        last = self._replies.get(episode_id)
        return last[1] if last is not None and last[0] == request_id else None

    def remember(self, episode_id: str, request_id: str | None, reply: Any) -> None:
        """Keep ``reply`` as the answer to a re-sent ``request_id`` (the episode's last step only; bounded)."""
        if request_id is None:
            return
        self._replies[episode_id] = (request_id, reply)
        self._replies.move_to_end(episode_id)
        while len(self._replies) > _ENDED_KEPT:
            self._replies.popitem(last=False)

    def replay_start(self, request_id: str | None) -> Any | None:
        """The reply of the start that ``request_id`` named (a client re-sending a start whose reply it lost), else
        None."""
        return None if request_id is None else self._starts.get(request_id)

    def remember_start(self, request_id: str | None, reply: Any) -> None:
        """Keep ``reply`` as the answer to a re-sent start ``request_id`` (bounded: the latest starts only)."""
        if request_id is None:
            return
        self._starts[request_id] = reply
        while len(self._starts) > _ENDED_KEPT:
            self._starts.popitem(last=False)

    def end(self, episode: Episode, why: str) -> Environment | None:
        """Remove ``episode`` (``why``: done, cancelled, expired, failed); its environment is the caller's to close.

        Returns None if it had already ended (so an environment is closed once).
        """
        if self._live.pop(episode.episode_id, None) is None:
            return None
        self._ended[episode.episode_id] = why
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)
        return episode.environment

    def expire_idle(self) -> list[Episode]:
        """End every episode idle for longer than ``idle_timeout`` (not one with a call in flight); return them."""
        deadline = self._clock() - self.idle_timeout
        idle = [e for e in self._live.values() if e.last_active < deadline and not e.lock.locked()]
        for episode in idle:
            self.end(episode, f"expired after {self.idle_timeout:g} s without a call")
        return idle

    def drain(self) -> list[Episode]:
        """End every episode (server shutdown); return them."""
        live = list(self._live.values())
        for episode in live:
            self.end(episode, "the server shut down")
        return live

    def record_step(self, episode: Episode, step: Step) -> tuple[bool, dict[str, Any]]:
        """Count a turn, apply the turn limit and return ``(done, info)`` as the protocol reports them.

        Raises:
            EnvironmentFailure: ``step`` is not a well-formed :class:`Step`.
        """
        check_step(step)
        episode.turn += 1
        done = bool(step.done)
        info = {**step.info, "turn": episode.turn}
        if not done and episode.turn >= episode.max_turns:
            done = True
            info["truncated"] = True
        if done:
            info["success"] = bool(info.get("success", False))
            info["num_turns"] = episode.turn
            self.end(episode, "done")
        return done, info


def check_step(step: Any) -> None:
    """Raise EnvironmentFailure unless ``step`` is ``(str | None, finite number, bool, dict)``."""
    ok = (
        isinstance(step, tuple)
        and len(step) == 4
        and (step[0] is None or isinstance(step[0], str))
        and isinstance(step[1], int | float)
        and math.isfinite(step[1])
        and isinstance(step[3], dict)
    )
    if not ok:
        raise EnvironmentFailure(
            f"environment step returned {step!r}; expected Step(observation: str | None, reward: finite float, "
            "done: bool, info: dict)"
        )
