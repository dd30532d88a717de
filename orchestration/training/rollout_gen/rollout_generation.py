"""Rollout generation as plain functions: calling a user's ``generate_fn`` and ``reward_fn`` (one or two arguments,
sync or async, told apart by their signatures), checking what they return, and ``generate_rollout_batches``, the
synchronous generator of batches.

``generate_rollout_batches`` is the simple case: it draws exactly the prompts a batch still needs, so it never
over-samples and never carries groups over (``RolloutConfig.over_sampling_factor`` is ignored, with a warning);
over-sampling and partial caching need ``AsyncRolloutManager``, as the rollouts quick reference says.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

from orchestration.training.types import LibraryError, RolloutBatch, RolloutConfig, Sample

log = logging.getLogger(__name__)

MAX_ROUNDS = 10  # generation rounds a batch may take before too strict a filter_fn is an error
MAX_REWARD_ERRORS = 8  # reward_fn failures a batch's metadata lists (all are counted)


class PromptBuffer(Protocol):
    """What rollout generation needs of a prompt buffer (``DataBuffer``): prompts, and its state for checkpoints."""

    def get_prompts(self, n: int) -> list[Any]: ...

    def save_state(self) -> Any: ...

    def load_state(self, state: Any) -> None: ...


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` gives a coroutine: an ``async def`` function (or a partial of one) or an object whose
    ``__call__`` is one."""
    if inspect.iscoroutinefunction(fn):
        return True
    return callable(fn) and inspect.iscoroutinefunction(type(fn).__call__)


def bind_generate_fn(generate_fn: Callable[..., Any], engine: Any) -> Callable[[list[Any]], Any]:
    """``generate_fn`` as a function of the prompts alone.

    A ``generate_fn`` with a parameter named ``engine``, or with two or more required positional parameters, is
    called ``generate_fn(prompts, engine)`` (``engine=engine`` when that parameter is keyword-only or not second);
    any other is called ``generate_fn(prompts)``. The signature decides, never a failed call.
    """
    try:
        signature = inspect.signature(generate_fn)
    except (TypeError, ValueError):  # a builtin without a signature: the seed's one-argument form
        return lambda prompts: generate_fn(prompts)
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = signature.parameters.get("engine")
    if named is not None and named.kind is not named.VAR_POSITIONAL and named.kind is not named.VAR_KEYWORD:
        if named.kind is named.POSITIONAL_ONLY or (len(positional) >= 2 and positional[1] is named):
            return lambda prompts: generate_fn(prompts, engine)
        return lambda prompts: generate_fn(prompts, engine=engine)
    required = [p for p in positional if p.default is p.empty]
    if len(required) >= 2:
        return lambda prompts: generate_fn(prompts, engine)
    return lambda prompts: generate_fn(prompts)


def split_groups(prompts: Sequence[Any], result: Any, n_samples_per_prompt: int) -> list[list[Sample]]:
    """The samples ``generate_fn`` returned for ``prompts``, cut into one group of ``n_samples_per_prompt`` per
    prompt, in prompt order.

    Raises:
        LibraryError: the result is not a list of ``Sample`` or does not hold ``n_samples_per_prompt`` per prompt.
    """
    if isinstance(result, Sample) or not isinstance(result, Sequence | Iterator):
        raise LibraryError(f"generate_fn must return a list of Sample, got {type(result).__name__}")
    samples = list(result)
    expected = len(prompts) * n_samples_per_prompt
    if len(samples) != expected:
        raise LibraryError(
            f"generate_fn returned {len(samples)} samples for {len(prompts)} prompts, expected {expected} "
            f"(n_samples_per_prompt={n_samples_per_prompt} per prompt, in prompt order)"
        )
    for i, item in enumerate(samples):
        if not isinstance(item, Sample):
            raise LibraryError(f"generate_fn must return Sample objects, item {i} is a {type(item).__name__}")
    n = n_samples_per_prompt
    return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]


def reward_value(value: Any) -> float:
    """A ``reward_fn``'s answer as a float reward.

    Raises:
        LibraryError: the answer is not a finite number.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LibraryError(f"reward_fn must return a finite number, got {value!r}")
    return float(value)


async def reward_group(group: list[Sample], reward_fn: Callable[[Sample], Any]) -> str | None:
    """Set each sample's reward to ``reward_fn(sample)`` (sync or async); the failure's text when it raises (the
    group is then unusable), else None."""
    try:
        for sample in group:
            value = reward_fn(sample)
            if inspect.isawaitable(value):
                value = await value
            sample.reward = reward_value(value)
    except Exception as error:  # a failing reward fails its group, never the batch
        log.warning("reward_fn failed on a group of prompt %r: %r", group[0].prompt if group else None, error)
        return f"{type(error).__name__}: {error}"
    return None


def reward_group_sync(group: list[Sample], reward_fn: Callable[[Sample], Any]) -> str | None:
    """``reward_group`` for synchronous callers (an async ``reward_fn`` runs under ``asyncio.run``)."""
    if is_async(reward_fn):
        result: str | None = run_coroutine(reward_group(group, reward_fn))
        return result
    try:
        for sample in group:
            value = reward_fn(sample)
            sample.reward = reward_value(run_coroutine(value) if inspect.isawaitable(value) else value)
    except Exception as error:  # a failing reward fails its group, never the batch
        log.warning("reward_fn failed on a group of prompt %r: %r", group[0].prompt if group else None, error)
        return f"{type(error).__name__}: {error}"
    return None


def run_coroutine(coroutine: Awaitable[Any]) -> Any:
    """Run ``coroutine`` to completion from synchronous code, outside any event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_awaited(coroutine))
    if inspect.iscoroutine(coroutine):
        coroutine.close()
    raise LibraryError(
        "generate_rollout_batches cannot run an async generate_fn or reward_fn inside a running event loop; "
        "use AsyncRolloutManager from async code"
    )


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def batch_metrics(groups: Sequence[list[Sample]], **counts: Any) -> dict[str, Any]:
    """A batch's metadata: ``counts`` plus ``group_size``, ``prompts`` (one per group) and ``reward_mean``."""
    rewards = [s.reward for group in groups for s in group]
    return {
        **counts,
        "group_size": len(groups[0]) if groups else 0,
        "prompts": [group[0].prompt for group in groups],
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
    }


def too_few_groups(batch_size: int, have: int, passed: int, generated: int, failed: int, rounds: int) -> LibraryError:
    """The error of a batch that stayed short after ``rounds`` generation rounds."""
    return LibraryError(
        f"only {have} of batch_size={batch_size} groups after max_rounds={rounds} generation rounds: "
        f"{passed} of {generated} generated groups passed filter_fn ({failed} failed reward_fn)"
    )


def generate_rollout_batches(
    buffer: PromptBuffer,
    config: RolloutConfig,
    *,
    engine: Any = None,
    num_batches: int | None = None,
    max_rounds: int = MAX_ROUNDS,
) -> Iterator[RolloutBatch]:
    """Batches of ``config.batch_size`` groups of ``config.n_samples_per_prompt`` samples, forever (or
    ``num_batches`` of them), generated one call of ``generate_fn`` per round.

    Each round draws the prompts the batch still needs, calls ``generate_fn(prompts)`` (or ``(prompts, engine)``;
    an async one under ``asyncio.run``), sets rewards with ``reward_fn`` (a group whose reward fails is dropped and
    counted), drops the groups ``filter_fn`` refuses and draws again until the batch is full. No over-sampling, no
    carried groups: use ``AsyncRolloutManager`` for those.

    >>> batches = generate_rollout_batches(buffer, RolloutConfig(batch_size=2, generate_fn=fn), num_batches=1)
    >>> [len(batch) for batch in batches]
    [2]

    Raises:
        LibraryError: no ``generate_fn``; ``generate_fn`` returned the wrong samples; ``max_rounds`` rounds left the
            batch short (the message counts the groups that passed out of those generated).
    """
    if config.generate_fn is None:
        raise LibraryError("RolloutConfig.generate_fn is required to generate rollouts, got None")
    if num_batches is not None and (not isinstance(num_batches, int) or num_batches < 0):
        raise LibraryError(f"num_batches must be a non-negative integer or None, got {num_batches!r}")
    if not isinstance(max_rounds, int) or max_rounds < 1:
        raise LibraryError(f"max_rounds must be a positive integer, got {max_rounds!r}")
    if config.over_sampling_factor > 1.0:
        warnings.warn(
            f"generate_rollout_batches does not over-sample (over_sampling_factor={config.over_sampling_factor} "
            "ignored); AsyncRolloutManager over-samples and carries the surplus",
            stacklevel=2,
        )
    return _batches(buffer, config, bind_generate_fn(config.generate_fn, engine), num_batches, max_rounds)


def _batches(
    buffer: PromptBuffer,
    config: RolloutConfig,
    generate: Callable[[list[Any]], Any],
    num_batches: int | None,
    max_rounds: int,
) -> Iterator[RolloutBatch]:
    made = 0
    while num_batches is None or made < num_batches:
        yield _one_batch(buffer, config, generate, max_rounds)
        made += 1


def _one_batch(
    buffer: PromptBuffer, config: RolloutConfig, generate: Callable[[list[Any]], Any], max_rounds: int
) -> RolloutBatch:
    ready: list[list[Sample]] = []
    generated = filtered = failed = rounds = 0
    errors: list[str] = []
    started = time.perf_counter()
    while len(ready) < config.batch_size:
        if rounds == max_rounds:
            raise too_few_groups(config.batch_size, len(ready), len(ready), generated, failed, rounds)
        rounds += 1
        prompts = list(buffer.get_prompts(config.batch_size - len(ready)))
        result = generate(prompts)
        if inspect.isawaitable(result):
            result = run_coroutine(result)
        groups = split_groups(prompts, result, config.n_samples_per_prompt)
        generated += len(groups)
        for group in groups:
            error = reward_group_sync(group, config.reward_fn) if config.reward_fn is not None else None
            if error is not None:
                failed += 1
                errors.append(error)
            elif config.filter_fn is not None and not config.filter_fn(group):
                filtered += 1
            else:
                ready.append(group)
    metadata = batch_metrics(
        ready,
        generated_groups=generated,
        filtered_groups=filtered,
        reward_failed_groups=failed,
        reward_errors=errors[:MAX_REWARD_ERRORS],
        rounds=rounds,
        generation_seconds=time.perf_counter() - started,
    )
    return RolloutBatch.from_samples([s for group in ready for s in group], **metadata)
