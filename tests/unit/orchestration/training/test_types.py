"""Sample, RolloutBatch and the configs: what they accept, what they refuse (pinned messages), and the queue fields
round trip."""

from __future__ import annotations

import asyncio

import pytest

from orchestration.training import LibraryError, RolloutBatch, RolloutConfig, Sample, TrainFuture


def sample(reward: float = 1.0) -> Sample:
    return Sample(prompt="1+1=", response="2", tokens=[5, 6, 7], loss_mask=[0.0, 0.0, 1.0], reward=reward)


def test_a_batch_goes_through_the_queue_fields_and_back() -> None:
    batch = RolloutBatch.from_samples([sample(1.0), sample(0.0)], step=3)

    back = RolloutBatch.from_fields(batch.to_fields())

    assert back.tokens == [[5, 6, 7], [5, 6, 7]]
    assert back.loss_masks == [[0.0, 0.0, 1.0]] * 2
    assert (back.rewards, back.response_lengths) == ([1.0, 0.0], [1, 1])
    assert batch.metadata["step"] == 3 and len(batch) == 2


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Sample(tokens=[1, 2], loss_mask=[1.0]), "Sample.loss_mask needs one weight per token: 2 tokens, 1"),
        (lambda: Sample(reward="1"), "Sample.reward must be a number, got str"),
        (
            lambda: RolloutBatch(tokens=[[1]], loss_masks=[[1.0]], rewards=[], response_lengths=[1]),
            "RolloutBatch needs one entry per sample in every list",
        ),
        (lambda: RolloutConfig(batch_size=0), "RolloutConfig.batch_size must be a positive integer, got 0"),
        (lambda: RolloutConfig(over_sampling_factor=0.5), "over_sampling_factor must be a number >= 1.0, got 0.5"),
        (lambda: RolloutConfig(filter_fn="x"), "RolloutConfig.filter_fn must be callable or None, got str"),
    ],
)
def test_bad_values_are_refused_saying_what_was_expected(make, message) -> None:
    with pytest.raises(LibraryError, match=message):
        make()


def test_a_train_future_is_awaited_or_waited_for() -> None:
    async def main() -> float:
        future = await TrainFuture.done_with({"loss": 0.5})  # awaiting the call gives the future itself
        return (await future.result())["loss"]

    assert asyncio.run(main()) == 0.5
    with pytest.raises(RuntimeError, match="boom"):
        TrainFuture.failed_with(RuntimeError("boom")).wait(1.0)
