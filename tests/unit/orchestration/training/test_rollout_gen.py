"""AsyncRolloutManager and generate_rollout_batches: the quick reference's snippets, over-sampling with partial
caching, the four shapes of generate_fn, pinned errors, reward failures isolated to their group, the cache in the
checkpoint, and cancellation on exit."""

from __future__ import annotations

import asyncio
import json
import warnings
from typing import Any

import pytest

from orchestration.training import (
    AsyncRolloutManager,
    DataBuffer,
    LibraryError,
    RolloutConfig,
    Sample,
    generate_rollout_batches,
)


class InOrderBuffer:
    """A prompt buffer serving its prompts in order (DataBuffer's interface without the shuffle), so the tests
    know which prompt each group comes from."""

    def __init__(self, prompts: list[Any]):
        self.prompts = list(prompts)
        self.position = 0

    def get_prompts(self, n: int) -> list[Any]:
        out = [self.prompts[(self.position + i) % len(self.prompts)] for i in range(n)]
        self.position += n
        return out

    def save_state(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


PROMPTS = [f"p{i}" for i in range(100)]


def make_samples(prompts: list[Any], n: int = 1) -> list[Sample]:
    return [
        Sample(prompt=p, response=f"{p}/{k}", tokens=[1, 2, 3], loss_mask=[0.0, 1.0, 1.0], metadata={"k": k})
        for p in prompts
        for k in range(n)
    ]


def my_generate_fn(prompts: list[Any]) -> list[Sample]:
    return make_samples(prompts)


def my_reward_fn(sample: Sample) -> float:
    return float(sample.prompt[1:]) / 100


def group_prompts(batch: Any) -> list[Any]:
    return batch.metadata["prompts"]


def test_the_quick_reference_async_rollout_manager_snippet_runs() -> None:
    async def main() -> Any:
        buffer = DataBuffer(prompts=PROMPTS)  # the snippet's [...]
        config = RolloutConfig(batch_size=32, generate_fn=my_generate_fn)
        manager = AsyncRolloutManager(buffer, config)

        async with manager:
            batch = await manager.generate_batch(reward_fn=my_reward_fn)
            # batch.tokens, batch.loss_masks, batch.rewards ready for training
        return batch

    batch = asyncio.run(main())

    assert len(batch) == 32 and batch.tokens[0] == [1, 2, 3] and batch.loss_masks[0] == [0.0, 1.0, 1.0]
    prompts = group_prompts(batch)
    assert len(set(prompts)) == 32 and set(prompts) <= set(PROMPTS)
    assert batch.rewards == [my_reward_fn(Sample(prompt=p)) for p in prompts]


def test_the_quick_reference_pure_function_snippet_runs() -> None:
    buffer = DataBuffer(prompts=PROMPTS)
    seen = []

    config = RolloutConfig(batch_size=32, generate_fn=my_generate_fn)
    batches = generate_rollout_batches(buffer, config)  # Generator

    for batch in batches:
        # batch is RolloutBatch ready for training
        seen.append(group_prompts(batch))
        if len(seen) == 4:
            break

    assert [len(prompts) for prompts in seen] == [32] * 4
    assert len(set(seen[0] + seen[1] + seen[2])) == 96  # one epoch: no prompt twice
    assert set(seen[3]) <= set(PROMPTS)  # the buffer wrapped around into the next epoch


def drop(*prompts: str) -> Any:
    return lambda group: group[0].prompt not in prompts


def test_over_sampling_keeps_batch_size_groups_and_carries_the_surplus_to_the_next_batch() -> None:
    config = RolloutConfig(
        batch_size=4,
        n_samples_per_prompt=2,
        over_sampling_factor=1.5,
        generate_fn=lambda prompts: make_samples(prompts, 2),
        filter_fn=drop("p1"),
    )
    manager = AsyncRolloutManager(InOrderBuffer(PROMPTS), config)

    async def main() -> list[Any]:
        async with manager:
            return [await manager.generate_batch() for _ in range(2)]

    first, second = asyncio.run(main())

    assert group_prompts(first) == ["p0", "p2", "p3", "p4"]  # 6 drawn, p1 filtered, p5 carried
    assert len(first) == 8 and [s["k"] for s in first.metadata["samples"][:2]] == [0, 1]
    assert {k: first.metadata[k] for k in ("generated_groups", "filtered_groups", "cached_groups_carried")} == {
        "generated_groups": 6,
        "filtered_groups": 1,
        "cached_groups_carried": 1,
    }
    assert group_prompts(second) == ["p5", "p6", "p7", "p8"]  # 6 - 1 cached = 5 drawn: p6..p10
    assert second.metadata["cached_groups_used"] == 1 and second.metadata["prompts_drawn"] == 5
    assert second.metadata["cached_groups_carried"] == 2 and manager.cached_groups == 2


def test_a_batch_short_after_filtering_draws_again() -> None:
    config = RolloutConfig(batch_size=3, generate_fn=my_generate_fn, filter_fn=drop("p0", "p1"))
    batch = asyncio.run(AsyncRolloutManager(InOrderBuffer(PROMPTS), config).generate_batch())

    assert group_prompts(batch) == ["p2", "p3", "p4"]
    # 1 of 3 passed in round 1, so round 2 draws the 2 missing / (1/3) = 6 (p3..p8); 4 left over, 3 carried
    assert (batch.metadata["rounds"], batch.metadata["generated_groups"]) == (2, 9)
    assert (batch.metadata["cached_groups_carried"], batch.metadata["cached_groups_dropped"]) == (3, 1)


def test_a_filter_that_keeps_few_groups_gets_larger_rounds_rather_than_running_out_of_them() -> None:
    # one group in ten passes: rounds of the missing groups alone (12, then 1 at a time) would need 49 rounds
    config = RolloutConfig(
        batch_size=8,
        over_sampling_factor=1.5,
        generate_fn=my_generate_fn,
        filter_fn=lambda group: int(group[0].prompt[1:]) % 10 == 0,
    )
    manager = AsyncRolloutManager(InOrderBuffer(PROMPTS), config, max_concurrency=4)
    batch = asyncio.run(manager.generate_batch())

    assert group_prompts(batch) == [f"p{i}" for i in range(0, 80, 10)]
    assert batch.metadata["rounds"] <= 5, batch.metadata


def test_a_filter_that_keeps_too_little_fails_after_max_rounds_saying_how_many_passed() -> None:
    config = RolloutConfig(
        batch_size=4, over_sampling_factor=1.5, generate_fn=my_generate_fn, filter_fn=lambda group: False
    )
    manager = AsyncRolloutManager(InOrderBuffer(PROMPTS), config, max_rounds=2)

    with pytest.raises(LibraryError) as caught:
        asyncio.run(manager.generate_batch())
    assert str(caught.value) == (
        "only 0 of batch_size=4 groups after max_rounds=2 generation rounds: "
        "0 of 30 generated groups passed filter_fn (0 failed reward_fn)"  # 6, then 6 / (1/4)
    )


def test_the_generator_fails_the_same_way_when_the_filter_keeps_too_little() -> None:
    config = RolloutConfig(batch_size=2, generate_fn=my_generate_fn, filter_fn=drop("p1", "p2", "p3"))

    with pytest.raises(
        LibraryError, match="only 1 of batch_size=2 groups after max_rounds=3 generation rounds: 1 of 4"
    ):
        next(generate_rollout_batches(InOrderBuffer(PROMPTS), config, max_rounds=3))


ENGINE = object()


def sync_one(prompts):  # type: ignore[no-untyped-def]
    return make_samples(prompts, 2)


async def async_one(prompts):  # type: ignore[no-untyped-def]
    await asyncio.sleep(0)
    return make_samples(prompts, 2)


def sync_two(prompts, engine):  # type: ignore[no-untyped-def]
    assert engine is ENGINE
    return make_samples(prompts, 2)


async def async_two(prompts, engine):  # type: ignore[no-untyped-def]
    assert engine is ENGINE
    return make_samples(prompts, 2)


async def async_keyword(prompts, *, temperature=1.0, engine=None):  # type: ignore[no-untyped-def]
    assert engine is ENGINE
    return make_samples(prompts, 2)


def sync_default(prompts, temperature=1.0):  # type: ignore[no-untyped-def]
    assert temperature == 1.0  # a one-argument function with options does not get the engine
    return make_samples(prompts, 2)


class AsyncCallable:
    async def __call__(self, prompts, engine):  # type: ignore[no-untyped-def]
        assert engine is ENGINE
        return make_samples(prompts, 2)


GENERATE_FNS = [sync_one, async_one, sync_two, async_two, async_keyword, sync_default, AsyncCallable()]


@pytest.mark.parametrize("generate_fn", GENERATE_FNS, ids=lambda fn: getattr(fn, "__name__", type(fn).__name__))
def test_every_shape_of_generate_fn_works_in_the_manager(generate_fn: Any) -> None:
    config = RolloutConfig(batch_size=3, n_samples_per_prompt=2, generate_fn=generate_fn)
    batch = asyncio.run(AsyncRolloutManager(InOrderBuffer(PROMPTS), config, engine=ENGINE).generate_batch())

    assert group_prompts(batch) == ["p0", "p1", "p2"] and len(batch) == 6


@pytest.mark.parametrize("generate_fn", GENERATE_FNS, ids=lambda fn: getattr(fn, "__name__", type(fn).__name__))
def test_every_shape_of_generate_fn_works_in_the_generator(generate_fn: Any) -> None:
    config = RolloutConfig(batch_size=3, n_samples_per_prompt=2, generate_fn=generate_fn)
    batches = list(generate_rollout_batches(InOrderBuffer(PROMPTS), config, engine=ENGINE, num_batches=2))

    assert [group_prompts(batch) for batch in batches] == [["p0", "p1", "p2"], ["p3", "p4", "p5"]]


def test_a_generate_fn_returning_the_wrong_number_of_samples_is_refused() -> None:
    config = RolloutConfig(batch_size=2, n_samples_per_prompt=2, generate_fn=my_generate_fn)
    message = (
        "generate_fn returned 1 samples for 1 prompts, expected 2 (n_samples_per_prompt=2 per prompt, in prompt order)"
    )

    with pytest.raises(LibraryError) as caught:
        asyncio.run(AsyncRolloutManager(InOrderBuffer(PROMPTS), config).generate_batch())
    assert str(caught.value) == message
    with pytest.raises(LibraryError, match=r"returned 2 samples for 2 prompts, expected 4 \(n_samples_per_prompt=2"):
        next(generate_rollout_batches(InOrderBuffer(PROMPTS), config))


def test_a_generate_fn_returning_something_else_than_samples_is_refused() -> None:
    config = RolloutConfig(batch_size=1, generate_fn=lambda prompts: ["text"])

    with pytest.raises(LibraryError, match="generate_fn must return Sample objects, item 0 is a str"):
        asyncio.run(AsyncRolloutManager(InOrderBuffer(PROMPTS), config).generate_batch())


def failing_on_p1(sample: Sample) -> float:
    if sample.prompt == "p1":
        raise ValueError("no reward for p1")
    return 1.0


async def async_failing_on_p1(sample: Sample) -> float:
    return failing_on_p1(sample)


@pytest.mark.parametrize("reward_fn", [failing_on_p1, async_failing_on_p1])
def test_a_failing_reward_fn_drops_only_its_group(reward_fn: Any) -> None:
    config = RolloutConfig(batch_size=2, n_samples_per_prompt=2, generate_fn=sync_one)
    batch = asyncio.run(AsyncRolloutManager(InOrderBuffer(PROMPTS), config).generate_batch(reward_fn=reward_fn))
    config.reward_fn = reward_fn
    from_generator = next(generate_rollout_batches(InOrderBuffer(PROMPTS), config))

    for made in (batch, from_generator):
        assert group_prompts(made) == ["p0", "p2"] and made.rewards == [1.0] * 4
        assert made.metadata["reward_failed_groups"] == 1
        assert made.metadata["reward_errors"] == ["ValueError: no reward for p1"]
        assert made.metadata["reward_mean"] == 1.0


def test_the_reward_fn_of_generate_batch_overrides_the_configs() -> None:
    config = RolloutConfig(batch_size=2, generate_fn=my_generate_fn, reward_fn=lambda sample: 5.0)
    manager = AsyncRolloutManager(InOrderBuffer(PROMPTS), config)

    assert asyncio.run(manager.generate_batch(reward_fn=lambda sample: 2.0)).rewards == [2.0, 2.0]
    assert asyncio.run(manager.generate_batch()).rewards == [5.0, 5.0]


def test_a_reward_fn_returning_no_number_fails_its_group() -> None:
    config = RolloutConfig(batch_size=1, generate_fn=my_generate_fn)
    manager = AsyncRolloutManager(InOrderBuffer(PROMPTS), config, max_rounds=1)

    with pytest.raises(LibraryError, match=r"0 of 1 generated groups passed filter_fn \(1 failed reward_fn\)"):
        asyncio.run(manager.generate_batch(reward_fn=lambda sample: "good"))


def test_generation_runs_at_most_max_concurrency_calls_at_once() -> None:
    running = peak = 0

    async def generate(prompts: list[Any]) -> list[Sample]:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        for _ in range(3):
            await asyncio.sleep(0)
        running -= 1
        return make_samples(prompts)

    config = RolloutConfig(batch_size=8, generate_fn=generate)
    batch = asyncio.run(AsyncRolloutManager(InOrderBuffer(PROMPTS), config, max_concurrency=3).generate_batch())

    assert peak == 3 and group_prompts(batch) == PROMPTS[:8]


def test_the_carried_groups_are_bounded_and_the_oldest_dropped() -> None:
    config = RolloutConfig(batch_size=2, over_sampling_factor=3.0, generate_fn=my_generate_fn)
    manager = AsyncRolloutManager(InOrderBuffer(PROMPTS), config, max_cached_groups=1)
    batch = asyncio.run(manager.generate_batch())

    assert batch.metadata["cached_groups_dropped"] == 3 and batch.metadata["cached_groups_carried"] == 1
    assert group_prompts(asyncio.run(manager.generate_batch())) == ["p5", "p6"]


def test_the_state_round_trip_keeps_the_carried_groups() -> None:
    def config() -> RolloutConfig:
        return RolloutConfig(
            batch_size=2, n_samples_per_prompt=2, over_sampling_factor=2.0, generate_fn=sync_one, reward_fn=my_reward_fn
        )

    original = AsyncRolloutManager(InOrderBuffer(PROMPTS), config())
    asyncio.run(original.generate_batch())
    state = json.loads(json.dumps(original.state()))  # plain data: a checkpoint file holds it
    assert [[s["prompt"] for s in group] for group in state["cache"]] == [["p2", "p2"], ["p3", "p3"]]

    resumed = AsyncRolloutManager(InOrderBuffer(PROMPTS), config())
    resumed.load_state(state)
    after_resume = asyncio.run(resumed.generate_batch())
    straight_on = asyncio.run(original.generate_batch())

    assert group_prompts(after_resume) == group_prompts(straight_on) == ["p2", "p3"]
    assert after_resume.rewards == straight_on.rewards == [0.02, 0.02, 0.03, 0.03]
    assert after_resume.metadata["samples"] == straight_on.metadata["samples"]
    assert after_resume.metadata["batch_index"] == 1
    assert group_prompts(asyncio.run(resumed.generate_batch())) == ["p4", "p5"]


def test_the_state_round_trip_with_a_data_buffer_resumes_where_the_run_stood() -> None:
    config = RolloutConfig(batch_size=3, over_sampling_factor=2.0, generate_fn=my_generate_fn)
    original = AsyncRolloutManager(DataBuffer(prompts=PROMPTS, seed=7), config)
    asyncio.run(original.generate_batch())
    resumed = AsyncRolloutManager(DataBuffer(prompts=PROMPTS, seed=7), config)
    resumed.load_state(json.loads(json.dumps(original.state())))

    for _ in range(3):
        assert group_prompts(asyncio.run(resumed.generate_batch())) == group_prompts(
            asyncio.run(original.generate_batch())
        )


def test_closing_the_manager_cancels_generation_in_flight_and_leaves_no_task() -> None:
    started: list[Any] = []
    cancelled: list[Any] = []

    async def generate(prompts: list[Any]) -> list[Sample]:
        started.append(prompts[0])
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(prompts[0])
            raise
        return make_samples(prompts)

    async def main() -> tuple[Any, set[Any]]:
        manager = AsyncRolloutManager(InOrderBuffer(PROMPTS), RolloutConfig(batch_size=4, generate_fn=generate))
        async with manager:
            pending = asyncio.create_task(manager.generate_batch())
            while len(started) < 4:
                await asyncio.sleep(0)
        outcome = await asyncio.gather(pending, return_exceptions=True)
        with pytest.raises(LibraryError, match="AsyncRolloutManager is closed: generate_batch after its async with"):
            await manager.generate_batch()
        return outcome[0], asyncio.all_tasks() - {asyncio.current_task()}

    outcome, left = asyncio.run(main())

    assert isinstance(outcome, asyncio.CancelledError)
    assert sorted(cancelled) == sorted(started) == ["p0", "p1", "p2", "p3"]
    assert left == set()


def test_the_generator_warns_that_it_does_not_over_sample() -> None:
    config = RolloutConfig(batch_size=2, over_sampling_factor=1.5, generate_fn=my_generate_fn)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = generate_rollout_batches(InOrderBuffer(PROMPTS), config, num_batches=1)
    assert "does not over-sample (over_sampling_factor=1.5 ignored)" in str(caught[0].message)
    assert [group_prompts(batch) for batch in batches] == [["p0", "p1"]]


def test_a_config_without_generate_fn_is_refused() -> None:
    with pytest.raises(LibraryError, match=r"RolloutConfig\.generate_fn is required to generate rollouts, got None"):
        AsyncRolloutManager(InOrderBuffer(PROMPTS), RolloutConfig(batch_size=1))
