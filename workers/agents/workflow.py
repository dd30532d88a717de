"""TaskServerWorkflow: multi-turn episodes against task servers, token in / token out.

    episode = POST /api/episode/start {sample_id}                 (least busy healthy server; retried elsewhere)
    messages = format_observation_to_messages(observation, [])   (the hook; templated once -> prompt tokens)
    until done / max_turns / max_total_tokens:
        ids, logprobs = engine samples from the tokens so far      (appended, loss mask 1)
        POST /api/episode/step {action: {type: text, content: decode(ids)}}
        messages = format_observation_to_messages(observation, messages)
        the new messages' tokens are appended                      (loss mask 0, log-prob 0)
    reward = postprocess_reward(sum of step rewards, num_turns, terminal info)

A GRPO group is ``n`` episodes of one sample; when one of them fails (the server died, a step timed out or
answered malformed JSON, the engine or the sampler raised) the others are cancelled and the group is dropped whole: a
group is never trained on half, and the other groups of the step go on.
Subclass and override the two hooks to change what the policy sees and how it is scored, exactly as in the seed's
``CustomOSWorkflow``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from workers.agents.servers import Episode, MalformedResponse, TaskServerError, TaskServerPool
from workers.agents.trajectory import ChatFormat, Message, Trajectory, TrajectoryBuilder
from workers.engines.base import Generation, SamplingParams

logger = logging.getLogger(__name__)


class TurnFailed(RuntimeError):
    """A turn of an episode failed outside the task server (the engine or the sampler raised, or a hook did); the
    message names the episode, its server, the turn and the cause, which is chained."""


class TokenSampler(Protocol):
    """What a workflow samples turns from (see ``workers.agents.samplers``): token ids in, one generation out."""

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> tuple[int, Generation]:
        """``(policy version, generation)`` for one prompt."""
        ...


@dataclass
class GroupResult:
    """The ``n`` trajectories of one sample, or ``None`` with the error that dropped the group."""

    sample_id: str
    trajectories: list[Trajectory] | None
    error: str | None = None


@dataclass
class WorkflowStats:
    """Counters since the workflow was made: groups kept and dropped, and failed episodes by error type."""

    groups: int = 0
    dropped_groups: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class TaskServerWorkflow:
    """Runs episodes on task servers and returns them as token-exact trajectories (see the module docstring).

    Args:
        task_server_url: one server URL or a list (health-checked, least-busy balanced, episodes sticky).
        chat: how messages become tokens (``HFChatFormat(tokenizer)`` or ``PlainChatFormat(...)``).
        sampling: sampling parameters of every turn (``max_new_tokens`` is per turn).
        timeout: seconds any call to a task server may take (a step over it ends the episode).
        max_turns: model turns per episode at most (the server's ``info.max_turns`` too, whichever is smaller).
        max_total_tokens: tokens per trajectory at most, first observation included (truncated beyond).
        system_prompt: when set, a system message before the first observation.
        episode_config: the ``config`` sent with every ``/episode/start``.
        start_wait: seconds an episode's start keeps retrying, with a jittered backoff, while the servers answer 503
            (their ``--max-episodes`` running) before it fails and drops its group.
        api_key: the task servers' key (``TaskServerProcess.api_key``); None: ``TQ_API_KEY`` if set.
    """

    def __init__(
        self,
        task_server_url: str | Sequence[str],
        chat: ChatFormat,
        sampling: SamplingParams,
        timeout: float = 60.0,
        max_turns: int = 8,
        max_total_tokens: int = 2048,
        system_prompt: str | None = None,
        episode_config: dict[str, Any] | None = None,
        start_wait: float = 300.0,
        api_key: str | None = None,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.pool = TaskServerPool(task_server_url, timeout, start_wait, api_key)
        self.chat = chat
        self.sampling = sampling
        self.timeout = timeout
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.system_prompt = system_prompt
        self.episode_config = episode_config or {}
        self.stats = WorkflowStats()

    # ---- hooks (override in a subclass) ------------------------------------------------------------------------
    def format_observation_to_messages(self, observation: dict[str, Any], history: list[Message]) -> list[Message]:
        """The conversation after ``observation``: by default ``history`` plus one user message with its content."""
        return [*history, {"role": "user", "content": str(observation["content"])}]

    def postprocess_reward(self, reward: float, num_turns: int, info: dict[str, Any]) -> float:
        """The trajectory's reward from the sum of the environment's rewards; by default unchanged."""
        return reward

    def format_action(self, text: str) -> dict[str, Any]:
        """The ``action`` sent to ``/episode/step`` for the model's turn."""
        return {"type": "text", "content": text}

    # ---- episodes ----------------------------------------------------------------------------------------------
    async def run_episode(self, sampler: TokenSampler, sample_id: str) -> Trajectory:
        """One episode of ``sample_id``.

        Raises:
            TaskServerError: typed (``EpisodeStartError``, ``StepTimeout``, ``MalformedResponse``,
                ``ServerUnavailable``); the episode is cancelled on its server first.
            TurnFailed: the engine, the sampler or a hook raised (the cause chained); cancelled on its server too.
        """
        abandoned = asyncio.Event()
        starting = asyncio.ensure_future(self.pool.start(sample_id, self.episode_config, abandoned))
        try:
            episode = await asyncio.shield(starting)
        except asyncio.CancelledError:
            # its group was dropped while the server was starting it: once started it is cancelled there too, so
            # no episode is left running on a server that nobody plays; a start waiting for a busy server gives up
            abandoned.set()
            with contextlib.suppress(TaskServerError):
                await self.pool.finish(await starting, cancel=True)
            raise
        finished = False
        try:
            trajectory, finished = await self._play(sampler, episode, sample_id)
        finally:
            await _to_the_end(self.pool.finish(episode, cancel=not finished))
        return trajectory

    async def _play(self, sampler: TokenSampler, episode: Episode, sample_id: str) -> tuple[Trajectory, bool]:
        turns: list[int] = [1]  # the turn being played, for the error
        try:
            return await self._turns(sampler, episode, sample_id, turns)
        except TaskServerError:
            raise
        except Exception as exc:
            raise TurnFailed(
                f"episode {episode.episode_id} of sample {sample_id!r} on {episode.server} failed at turn {turns[0]}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    async def _turns(
        self, sampler: TokenSampler, episode: Episode, sample_id: str, turns: list[int]
    ) -> tuple[Trajectory, bool]:
        start: list[Message] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        history = self.format_observation_to_messages(episode.observation, start)
        builder = TrajectoryBuilder(self.chat.prompt_ids(history), self.max_total_tokens)
        max_turns = min(self.max_turns, int(episode.info.get("max_turns") or self.max_turns))
        total, info, done, reason = 0.0, dict(episode.info), False, "max_turns"
        while builder.num_turns < max_turns:
            turns[0] = builder.num_turns + 1
            params = replace(self.sampling, max_new_tokens=min(self.sampling.max_new_tokens, builder.room))
            version, generation = await sampler.sample(builder.tokens, params)
            whole = builder.add_model_turn(generation.token_ids, generation.logprobs, version)
            ids = generation.token_ids[:-1] if generation.finish_reason == "stop" else generation.token_ids
            text = self.chat.decode(ids)
            history = [*history, {"role": "assistant", "content": text}]
            # a turn the budget cut short is trained on but never sent; a turn that fits, even exactly, is sent (a
            # complete final answer is scored), and the trajectory stops before the environment's reply instead
            cut_by_budget = generation.finish_reason != "stop" and params.max_new_tokens < self.sampling.max_new_tokens
            if not whole or (cut_by_budget and len(generation.token_ids) >= params.max_new_tokens):
                reason = "max_tokens"
                break
            result = await self.pool.step(episode, self.format_action(text))
            total += result.reward
            info = result.info
            if result.done:
                done, reason = True, "done"
                break
            if result.observation is None:
                raise MalformedResponse(
                    f"{episode.server}: episode {episode.episode_id} is not done but sent no observation"
                )
            updated = self.format_observation_to_messages(result.observation, history)
            appended, history = updated[len(history) :], updated
            if not builder.add_env_reply(self.chat.append_ids(appended)):
                reason = "max_tokens"
                break
        reward = self.postprocess_reward(total, builder.num_turns, info)
        success = bool(info.get("success", False))
        trajectory = builder.build(
            reward=float(reward), success=success, finish_reason=reason, sample_id=sample_id, info=info
        )
        return trajectory, done

    async def run_group(self, sampler: TokenSampler, sample_id: str, n: int) -> GroupResult:
        """``n`` episodes of ``sample_id`` at once; the whole group is dropped when any of them fails."""
        tasks = [asyncio.create_task(self.run_episode(sampler, sample_id)) for _ in range(n)]
        try:
            trajectories = list(await asyncio.gather(*tasks))
        except (TaskServerError, TurnFailed) as exc:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            kind = type(exc).__name__
            self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1
            self.stats.dropped_groups += 1
            logger.warning("dropping the group of sample %r: an episode failed with %s: %s", sample_id, kind, exc)
            return GroupResult(sample_id, None, f"{kind}: {exc}")
        self.stats.groups += 1
        return GroupResult(sample_id, trajectories)

    async def run_groups(self, sampler: TokenSampler, sample_ids: Sequence[str], n: int) -> list[GroupResult]:
        """A group per sample id, all at once, after a health check of every server (dead ones come back here)."""
        await self.pool.check_health()
        return list(await asyncio.gather(*(self.run_group(sampler, s, n) for s in sample_ids)))

    async def aclose(self) -> None:
        await self.pool.aclose()


async def _to_the_end(work: Any) -> None:
    """Await ``work`` to its end even when the caller is cancelled meanwhile (then re-raise the cancellation): an
    episode's cancel request must reach its server although its group is being torn down."""
    done = asyncio.ensure_future(work)
    try:
        await asyncio.shield(done)
    except asyncio.CancelledError:
        await done
        raise
