"""Test doubles for the agent tests: a task server speaking issue 9's protocol in a thread, scripted engines.

The server plays a word game with a script of special actions: the right word (the sample id's part after ``:``)
ends the episode with reward 1 and ``success``; ``SLEEP`` sleeps past any test timeout; ``GARBAGE`` answers non-JSON;
anything else answers ``"no: <action>"``. It records cancelled episodes so tests can check that failures cancel.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from workers.engines.base import Generation, SamplingParams


class StartBody(BaseModel):
    sample_id: str
    config: dict[str, Any] = {}


class StepBody(BaseModel):
    episode_id: str
    action: dict[str, Any]


class CancelBody(BaseModel):
    episode_id: str


class WordGame:
    """State of one fake server (what tests inspect)."""

    def __init__(self, max_turns: int = 4, fail_starts: int = 0):
        self.max_turns = max_turns
        self.fail_starts = fail_starts
        self.episodes: dict[str, dict[str, Any]] = {}
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.actions: list[str] = []

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/api/health")
        async def health() -> dict[str, Any]:
            return {"status": "healthy", "active_episodes": len(self.episodes), "task_name": "word-game"}

        @app.post("/api/episode/start")
        async def start(body: StartBody) -> dict[str, Any]:
            if self.fail_starts > 0:
                self.fail_starts -= 1
                raise HTTPException(500, "environment failed to reset")
            episode_id = uuid.uuid4().hex
            word = body.sample_id.split(":", 1)[-1]
            self.episodes[episode_id] = {"word": word, "turn": 0}
            self.started.append(episode_id)
            info = {"max_turns": self.max_turns, "sample_id": body.sample_id, "turn": 0}
            obs = {"type": "text", "content": f"guess {len(word)}"}
            return {"episode_id": episode_id, "observation": obs, "reward": 0, "done": False, "info": info}

        @app.post("/api/episode/step", response_model=None)
        async def step(body: StepBody) -> Any:
            episode = self.episodes.get(body.episode_id)
            if episode is None:
                raise HTTPException(404, f"unknown episode {body.episode_id}")
            action = str(body.action.get("content", ""))
            self.actions.append(action)
            episode["turn"] += 1
            if action == "SLEEP":
                await asyncio.sleep(1.5)
            if action == "GARBAGE":
                return PlainTextResponse("<html>oops</html>")
            turn = episode["turn"]
            if action == episode["word"] or turn >= self.max_turns:
                del self.episodes[body.episode_id]
                win = action == episode["word"]
                info = {"turn": turn, "success": win, "num_turns": turn}
                return {
                    "episode_id": body.episode_id,
                    "observation": None,
                    "reward": float(win),
                    "done": True,
                    "info": info,
                }
            obs = {"type": "text", "content": f"no: {action}"}
            return {
                "episode_id": body.episode_id,
                "observation": obs,
                "reward": 0.0,
                "done": False,
                "info": {"turn": turn},
            }

        @app.post("/api/episode/cancel")
        async def cancel(body: CancelBody) -> dict[str, Any]:
            self.cancelled.append(body.episode_id)
            self.episodes.pop(body.episode_id, None)
            return {"episode_id": body.episode_id, "cancelled": True}

        return app


class ScriptedSampler:
    """A TokenSampler that answers turn k of an episode with the k-th scripted ``(token_ids, logprobs)`` (the last
    one from then on); turn k is how many distinct earlier prompts are prefixes of this one. Records every prompt."""

    def __init__(self, turns: list[tuple[list[int], list[float]]], version: int = 3, stop_id: int | None = None):
        self.turns = turns
        self.version = version
        self.stop_id = stop_id
        self.prompts: list[list[int]] = []

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> tuple[int, Generation]:
        ids = list(prompt_ids)
        turn = len({tuple(p) for p in self.prompts if len(p) < len(ids) and ids[: len(p)] == p})
        self.prompts.append(ids)
        ids, lps = self.turns[min(turn, len(self.turns) - 1)]
        ids, lps = ids[: params.max_new_tokens], lps[: params.max_new_tokens]
        reason = "stop" if self.stop_id is not None and ids and ids[-1] == self.stop_id else "length"
        return self.version, Generation(list(ids), list(lps), reason)
