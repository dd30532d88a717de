"""Custom rollout functions: ``rollout.generate_fn``, ``rollout.filter_fn`` and ``rollout.reward_fn``.

    rollout:
      generate_fn: "my_pkg.agent:generate"     # async def generate(prompts, engine, **kwargs) -> list[Sample]
      generate_fn_kwargs: {max_turns: 4}       # plain data from the config, passed as keyword arguments
      filter_fn: "my_pkg.agent:keep_group"     # def keep_group(samples: list[Sample]) -> bool  (one GRPO group)
      reward_fn: "my_pkg.agent:score"          # def score(sample: Sample) -> float  (sync or async)

``prompts`` are the step's prompts, one per GRPO group (dicts: ``sample_id`` for task servers, ``prompt_ids`` and the
task's reward fields for single-turn tasks); ``engine`` is a ``TokenSampler`` (``await engine.sample(ids, params)``
-> ``(policy_version, Generation)``). A function returns ``n_samples`` Samples per prompt with
``metadata["group"]`` = the prompt's index; a group that comes back short is dropped whole and counted. Besides its
configured kwargs, a function receives whichever of ``n_samples``, ``sampling`` and ``task`` its signature names.

The built-in rollouts are such functions: :func:`single_turn_generate` and :func:`task_server_generate`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rl_contracts.task import Task, import_object
from workers.agents.trajectory import HFChatFormat, PlainChatFormat, Sample, trajectory_to_sample
from workers.agents.workflow import TaskServerWorkflow, TokenSampler
from workers.engines.base import SamplingParams

GenerateFn = Callable[..., Awaitable[list[Sample]]]


def load_rollout_fn(spec: str, kwargs: dict[str, Any] | None = None, **context: Any) -> Callable[..., Any]:
    """The function named ``"module:fn"`` with ``kwargs`` bound, plus whichever ``context`` names it accepts.

    Raises:
        ValueError: if ``spec`` does not name a callable, naming it.
    """
    fn = import_object(spec)
    if not callable(fn):
        raise ValueError(f"{spec!r} is a {type(fn).__name__}, expected a function")
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    bound = {k: v for k, v in context.items() if takes_any or k in params}
    return functools.partial(fn, **bound, **(kwargs or {}))


@dataclass
class GroupStats:
    """What happened to the groups of one call: kept, dropped (short: an episode failed) and filtered out."""

    groups: int = 0
    dropped_groups: int = 0
    filtered_groups: int = 0


async def collect_groups(
    generate: Callable[..., Awaitable[list[Sample]]],
    prompts: Sequence[dict[str, Any]],
    engine: TokenSampler,
    n_samples: int,
    reward_fn: Callable[[Sample], Any] | None = None,
    filter_fn: Callable[[list[Sample]], bool] | None = None,
) -> tuple[list[list[Sample] | None], GroupStats]:
    """Run ``generate`` on ``prompts``; returns one entry per prompt: its ``n_samples`` Samples, or ``None`` when
    the group came back short or ``filter_fn`` rejected it (never half a group)."""
    samples = await generate(list(prompts), engine)
    by_group: dict[int, list[Sample]] = {}
    for sample in samples:
        group = sample.metadata.get("group")
        if not isinstance(group, int) or not 0 <= group < len(prompts):
            raise ValueError(
                f"a Sample's metadata['group'] must be its prompt's index in [0, {len(prompts)}), got {group!r}"
            )
        by_group.setdefault(group, []).append(sample)
    stats = GroupStats()
    out: list[list[Sample] | None] = []
    for index in range(len(prompts)):
        group = by_group.get(index, [])
        if len(group) != n_samples:
            stats.dropped_groups += 1
            out.append(None)
            continue
        if reward_fn is not None:
            for sample in group:
                value = reward_fn(sample)
                sample.reward = float(await value if inspect.isawaitable(value) else value)
        if filter_fn is not None and not filter_fn(group):
            stats.filtered_groups += 1
            out.append(None)
            continue
        stats.groups += 1
        out.append(group)
    return out, stats


async def single_turn_generate(
    prompts: list[dict[str, Any]], engine: TokenSampler, *, n_samples: int, sampling: SamplingParams, task: Task
) -> list[Sample]:
    """The built-in single-turn rollout: ``n_samples`` responses per prompt, scored by the task's reward."""

    async def one(index: int, prompt: dict[str, Any]) -> Sample:
        version, generation = await engine.sample(prompt["prompt_ids"], sampling)
        text = task.decode(generation.token_ids)
        fields = {name: str(prompt[name]) for name in task.reward_fields}
        ids = list(prompt["prompt_ids"])
        return Sample(
            prompt=task.decode(ids),
            response=text,
            tokens=ids + generation.token_ids,
            loss_mask=[0.0] * len(ids) + [1.0] * len(generation.token_ids),
            reward=float(task.reward(text, **fields)),
            metadata={"group": index, "num_turns": 1, "policy_version": version},
            logprobs=[0.0] * len(ids) + generation.logprobs,
        )

    jobs = [one(i, p) for i, p in enumerate(prompts) for _ in range(n_samples)]
    return list(await asyncio.gather(*jobs))


async def task_server_generate(
    prompts: list[dict[str, Any]],
    engine: TokenSampler,
    *,
    task_server_url: str | list[str],
    n_samples: int,
    sampling: SamplingParams,
    task: Task,
    workflow: str = "workers.agents.workflow:TaskServerWorkflow",
    **workflow_kwargs: Any,
) -> list[Sample]:
    """The built-in task-server rollout: a group of ``n_samples`` episodes per ``prompt["sample_id"]`` with
    ``workflow`` (a ``TaskServerWorkflow`` subclass by ``"module:Class"``; ``workflow_kwargs`` go to it). A failed
    episode's group is left out (dropped whole, counted by :func:`collect_groups`)."""
    cls = import_object(workflow)
    flow: TaskServerWorkflow = cls(task_server_url, chat_format(task), sampling, **workflow_kwargs)
    try:
        groups = await flow.run_groups(engine, [str(p["sample_id"]) for p in prompts], n_samples)
    finally:
        await flow.aclose()
    samples = []
    for index, group in enumerate(groups):
        for trajectory in group.trajectories or ():
            sample = trajectory_to_sample(trajectory, flow.chat)
            sample.metadata["group"] = index
            samples.append(sample)
    return samples


def chat_format(task: Task) -> HFChatFormat | PlainChatFormat:
    """The task's own ``chat_format()`` if it has one; else its tokenizer's chat template; else plain text."""
    own = getattr(task, "chat_format", None)
    if callable(own):
        return own()
    tokenizer = task.tokenizer
    if getattr(tokenizer, "chat_template", None):
        return HFChatFormat(tokenizer)
    encode = getattr(tokenizer, "encode", None)
    if not callable(encode):
        raise ValueError(
            f"{type(task).__name__}'s tokenizer has neither a chat template nor encode(); a chat needs one"
        )
    return PlainChatFormat(encode, lambda ids: tokenizer.decode(list(ids)))
