"""The task-server protocol's bodies: what crosses HTTP between a task server and its clients, on one page.

Every path is under ``/api``. Errors answer ``{"detail": "..."}`` with 400 (bad request, episode already done), 404
(unknown sample or episode), 503 (``--max-episodes`` running) or 500 (the environment failed).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Observation(BaseModel):
    type: str = "text"
    content: str


class Action(BaseModel):
    type: str = "text"
    content: str


class StartRequest(BaseModel):
    """``POST /episode/start``. A decimal ``sample_id`` may also name the sample at that index. ``request_id``
    (optional, ours): an idempotency key; a start re-sent with the ``request_id`` of an earlier one (still in flight
    or answered) gets that start's episode instead of a second one, so a client may retry a start whose reply it
    lost without leaving an orphaned episode behind."""

    sample_id: str | int
    config: dict[str, Any] = Field(default_factory=dict)
    request_id: str | None = Field(None, min_length=1, max_length=128)


class StepRequest(BaseModel):
    """``POST /episode/step``. ``request_id`` (optional, ours): an idempotency key; a step re-sent with the
    ``request_id`` of the episode's last step gets that step's reply again instead of being applied twice, so a
    client may retry a step whose reply it lost (even one that ended the episode)."""

    episode_id: str
    action: Action
    request_id: str | None = Field(None, min_length=1, max_length=128)


class CancelRequest(BaseModel):
    """``POST /episode/cancel``."""

    episode_id: str


class EpisodeResponse(BaseModel):
    """The answer to a start or a step. ``info`` holds ``turn``; at start also ``max_turns`` and ``sample_id``; when
    ``done``, ``success`` and ``num_turns`` (and ``truncated`` at the turn limit)."""

    episode_id: str
    observation: Observation | None
    reward: float
    done: bool
    info: dict[str, Any]


class CancelResponse(BaseModel):
    """``cancelled`` is false for an episode that was already done (a cancel is idempotent)."""

    episode_id: str
    cancelled: bool


class HealthResponse(BaseModel):
    """``GET /health``."""

    status: str
    active_episodes: int
    task_name: str


class TaskInfo(BaseModel):
    """``GET /task/info``."""

    name: str
    num_samples: int
    max_episode_length: int
    observation_type: str
    action_type: str
    description: str


class SampleList(BaseModel):
    """``GET /task/samples``: every sample id, in order."""

    sample_ids: list[str]
