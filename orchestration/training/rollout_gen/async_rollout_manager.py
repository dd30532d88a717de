"""``AsyncRolloutManager``: rollout batches generated concurrently, over-sampled, filtered, with the surplus groups
carried to the next batch (SLIME's over-sampling and partial caching).

One batch: take the groups carried over (oldest first), draw ``ceil(batch_size * over_sampling_factor)`` prompts
less those, generate each prompt's group in its own task (at most ``max_concurrency`` calls of ``generate_fn`` at a
time), set rewards, drop the groups ``filter_fn`` refuses, keep ``batch_size`` groups in order and carry the rest.
When too many groups were dropped it draws again (``max_rounds`` rounds at most), sized by the share of groups that
passed so far: ``ceil(missing * over_sampling_factor / pass_rate)``, at most ``MAX_ROUND_GROWTH`` times
``ceil(missing * over_sampling_factor)``, so a filter that keeps one group in ten early in training costs a few large
rounds rather than many rounds of one group. The carried groups are part of
``state()``, so a resumed run loses none.
"""

from __future__ import annotations

import asyncio
import copy
import math
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any

from orchestration.training.rollout_gen.rollout_generation import (
    MAX_REWARD_ERRORS,
    MAX_ROUNDS,
    PromptBuffer,
    batch_metrics,
    bind_generate_fn,
    is_async,
    reward_group,
    split_groups,
    too_few_groups,
)
from orchestration.training.types import LibraryError, RolloutBatch, RolloutConfig, Sample

SAMPLE_FIELDS = ("prompt", "response", "tokens", "loss_mask", "reward", "metadata")


MAX_ROUND_GROWTH = 4  # a round draws at most this many times the groups a batch still misses (over-sampled)


def next_round_size(short: int, over_sampling_factor: float, passed: int, generated: int) -> int:
    """Prompts to draw for the ``short`` groups a batch still misses, given ``passed`` of ``generated`` groups kept
    so far in this batch: the over-sampled need divided by the pass rate, never more than ``MAX_ROUND_GROWTH`` times
    the need.

    >>> next_round_size(2, 1.0, 1, 3), next_round_size(2, 1.5, 0, 12), next_round_size(4, 1.0, 6, 6)
    (6, 12, 4)
    """
    need = math.ceil(short * over_sampling_factor)
    pass_rate = max(passed / generated if generated else 1.0, 1 / MAX_ROUND_GROWTH)
    return min(math.ceil(need / pass_rate), need * MAX_ROUND_GROWTH)


class AsyncRolloutManager:
    """Generates ``RolloutBatch``es of ``config.batch_size`` whole groups from ``buffer``'s prompts.

    Args:
        buffer: the prompts (``DataBuffer``: ``get_prompts(n)``, ``save_state()``, ``load_state(state)``).
        config: batch size, group size, over-sampling factor and the user's functions.
        engine: handed to a two-argument ``generate_fn(prompts, engine)``.
        max_concurrency: calls of ``generate_fn`` running at once (a sync one runs in a worker thread).
        max_rounds: generation rounds one batch may take when ``filter_fn`` drops groups.
        max_cached_groups: groups carried between batches at most (default ``batch_size``); past it the oldest are
            dropped (they come from the oldest policy) and counted in ``cached_groups_dropped``.

    >>> manager = AsyncRolloutManager(buffer, RolloutConfig(batch_size=32, generate_fn=my_generate_fn))
    >>> async with manager:
    ...     batch = await manager.generate_batch(reward_fn=my_reward_fn)
    """

    def __init__(
        self,
        buffer: PromptBuffer,
        config: RolloutConfig,
        engine: Any = None,
        *,
        max_concurrency: int = 32,
        max_rounds: int = MAX_ROUNDS,
        max_cached_groups: int | None = None,
    ):
        if config.generate_fn is None:
            raise LibraryError("RolloutConfig.generate_fn is required to generate rollouts, got None")
        for name, value in (("max_concurrency", max_concurrency), ("max_rounds", max_rounds)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LibraryError(f"AsyncRolloutManager {name} must be a positive integer, got {value!r}")
        if max_cached_groups is not None and (not isinstance(max_cached_groups, int) or max_cached_groups < 0):
            raise LibraryError(f"AsyncRolloutManager max_cached_groups must be >= 0 or None, got {max_cached_groups!r}")
        self.buffer = buffer
        self.config = config
        self.engine = engine
        self.max_concurrency = max_concurrency
        self.max_rounds = max_rounds
        self.max_cached_groups = config.batch_size if max_cached_groups is None else max_cached_groups
        self._generate = bind_generate_fn(config.generate_fn, engine)
        self._generate_is_async = is_async(config.generate_fn)
        self._cache: deque[list[Sample]] = deque()
        self._batches = 0
        self._closed = False
        self._lock: asyncio.Lock | None = None
        self._slots: asyncio.Semaphore | None = None
        self._work: set[asyncio.Task[RolloutBatch]] = set()

    @property
    def cached_groups(self) -> int:
        """Groups waiting to go into the next batch."""
        return len(self._cache)

    async def __aenter__(self) -> AsyncRolloutManager:
        if self._closed:
            raise LibraryError("AsyncRolloutManager is closed; make a new one")
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel the batches being generated (their ``generate_batch`` raises ``CancelledError``) and wait until
        their tasks are gone. A sync ``generate_fn`` already running in a thread finishes there, its result unused."""
        self._closed = True
        work = list(self._work)
        for task in work:
            task.cancel()
        if work:
            await asyncio.gather(*work, return_exceptions=True)

    async def generate_batch(self, reward_fn: Callable[[Sample], Any] | None = None) -> RolloutBatch:
        """The next batch: ``config.batch_size * config.n_samples_per_prompt`` samples, group by group.

        Args:
            reward_fn: sets each sample's reward (sync or async); overrides ``config.reward_fn``. A group whose
                reward raises is dropped and counted in ``metadata["reward_failed_groups"]``.

        Returns:
            The batch; its ``metadata`` holds ``generated_groups``, ``filtered_groups``, ``reward_failed_groups``,
            ``reward_errors``, ``cached_groups_used`` (carried from the previous batch), ``cached_groups_carried``
            (left for the next), ``cached_groups_dropped``, ``prompts_drawn``, ``rounds``, ``generation_seconds``,
            ``reward_mean``, ``group_size``, ``prompts`` and ``batch_index``.

        Raises:
            LibraryError: the manager is closed; ``generate_fn`` returned the wrong samples; ``max_rounds`` rounds
                left the batch short (the groups already kept stay cached for the next call).
        """
        if self._closed:
            raise LibraryError("AsyncRolloutManager is closed: generate_batch after its async with block ended")
        if self._lock is None:
            self._lock = asyncio.Lock()
            self._slots = asyncio.Semaphore(self.max_concurrency)
        async with self._lock:
            score = reward_fn if reward_fn is not None else self.config.reward_fn
            task = asyncio.ensure_future(self._fill_batch(score))
            self._work.add(task)
            try:
                return await task
            finally:
                self._work.discard(task)

    def state(self) -> dict[str, Any]:
        """The manager's checkpoint: the buffer's state, the carried groups (samples as plain dicts) and the batch
        count. Take it between batches."""
        if self._lock is not None and self._lock.locked():
            raise LibraryError("AsyncRolloutManager.state() while generate_batch runs: take it between batches")
        return {
            "buffer": self.buffer.save_state(),
            "cache": [[_sample_state(s) for s in group] for group in self._cache],
            "batches": self._batches,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore ``state()``: the buffer's position and the carried groups."""
        missing = [key for key in ("buffer", "cache", "batches") if key not in state]
        if missing:
            raise LibraryError(f"AsyncRolloutManager state needs keys buffer, cache and batches; missing {missing}")
        cache = deque([Sample(**copy.deepcopy(sample)) for sample in group] for group in state["cache"])
        self.buffer.load_state(state["buffer"])
        self._cache = cache
        self._batches = int(state["batches"])

    async def _fill_batch(self, reward_fn: Callable[[Sample], Any] | None) -> RolloutBatch:
        config = self.config
        ready = list(self._cache)
        self._cache.clear()
        carried_in = len(ready)
        generated = filtered = failed = rounds = drawn = 0
        errors: list[str] = []
        started = time.perf_counter()
        want = max(0, math.ceil(config.batch_size * config.over_sampling_factor) - carried_in)
        try:
            while want > 0:
                if rounds == self.max_rounds:
                    passed = len(ready) - carried_in
                    raise too_few_groups(config.batch_size, len(ready), passed, generated, failed, rounds)
                rounds += 1
                prompts = list(self.buffer.get_prompts(want))
                drawn += len(prompts)
                for group, error in await self._generate_round(prompts, reward_fn):
                    generated += 1
                    if error is not None:
                        failed += 1
                        errors.append(error)
                    elif config.filter_fn is not None and not config.filter_fn(group):
                        filtered += 1
                    else:
                        ready.append(group)
                short = config.batch_size - len(ready)
                passed = len(ready) - carried_in
                want = next_round_size(short, config.over_sampling_factor, passed, generated) if short > 0 else 0
        except BaseException:
            self._cache.extendleft(reversed(ready))  # groups already made are not lost with the batch
            self._trim_cache()
            raise
        batch, surplus = ready[: config.batch_size], ready[config.batch_size :]
        self._cache.extend(surplus)
        dropped = self._trim_cache()
        metadata = batch_metrics(
            batch,
            batch_index=self._batches,
            generated_groups=generated,
            filtered_groups=filtered,
            reward_failed_groups=failed,
            reward_errors=errors[:MAX_REWARD_ERRORS],
            cached_groups_used=min(carried_in, config.batch_size),
            cached_groups_carried=len(self._cache),
            cached_groups_dropped=dropped,
            prompts_drawn=drawn,
            rounds=rounds,
            generation_seconds=time.perf_counter() - started,
        )
        self._batches += 1
        return RolloutBatch.from_samples([s for group in batch for s in group], **metadata)

    def _trim_cache(self) -> int:
        dropped = 0
        while len(self._cache) > self.max_cached_groups:
            self._cache.popleft()
            dropped += 1
        return dropped

    async def _generate_round(
        self, prompts: list[Any], reward_fn: Callable[[Sample], Any] | None
    ) -> list[tuple[list[Sample], str | None]]:
        """Each prompt's group and its reward failure (None when fine), in prompt order; the first generation error
        cancels the other groups and is raised."""
        tasks = [asyncio.ensure_future(self._group(prompt, reward_fn)) for prompt in prompts]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            return [task.result() for task in tasks]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _group(self, prompt: Any, reward_fn: Callable[[Sample], Any] | None) -> tuple[list[Sample], str | None]:
        assert self._slots is not None
        async with self._slots:
            if self._generate_is_async:
                result = await self._generate([prompt])
            else:
                result = await asyncio.to_thread(self._generate, [prompt])
                if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                    result = await result
        group = split_groups([prompt], result, self.config.n_samples_per_prompt)[0]
        error = await reward_group(group, reward_fn) if reward_fn is not None else None
        return group, error


def _sample_state(sample: Sample) -> dict[str, Any]:
    """A sample as a plain dict (``Sample(**it)`` gives it back)."""
    return {name: copy.deepcopy(getattr(sample, name)) for name in SAMPLE_FIELDS}
