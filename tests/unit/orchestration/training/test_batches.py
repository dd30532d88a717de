"""samples_to_batch: right padding, labels aligned with input_ids, loss masks, advantages; next_token_loss's shift."""

from __future__ import annotations

import pytest
import torch

from orchestration.training import LibraryError, Sample, next_token_loss, samples_to_batch


def two_samples() -> list[Sample]:
    return [Sample(tokens=[5, 6, 7], loss_mask=[0, 1, 1]), Sample(tokens=[5, 8], loss_mask=[0, 0.5])]


def test_a_batch_is_right_padded_with_labels_equal_to_the_input_ids() -> None:
    batch = samples_to_batch(two_samples(), pad_token_id=3)

    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 8, 3]]
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["loss_mask"].tolist() == [[0.0, 1.0, 1.0], [0.0, 0.5, 0.0]]
    assert batch["loss_mask"].dtype == torch.float32 and batch["input_ids"].dtype == torch.int64
    assert "advantages" not in batch


def test_advantages_come_one_per_sample() -> None:
    batch = samples_to_batch(two_samples(), advantages=[1.0, -1.0])
    assert batch["advantages"].tolist() == [1.0, -1.0]
    with pytest.raises(LibraryError, match="advantages needs one value per sample: 2 samples, 3 values"):
        samples_to_batch(two_samples(), advantages=[1.0, 0.0, 2.0])


@pytest.mark.parametrize(
    ("samples", "message"),
    [([], "samples_to_batch needs at least one sample, got none"), ([Sample()], "sample 0 has no tokens")],
)
def test_an_empty_batch_or_sample_is_refused(samples, message) -> None:
    with pytest.raises(LibraryError, match=message):
        samples_to_batch(samples)


def test_next_token_loss_scores_each_label_with_the_logits_one_position_before() -> None:
    vocab = 4
    labels = torch.tensor([[1, 2, 3]])
    loss_mask = torch.tensor([[0.0, 0.0, 1.0]])  # only token 3 at position 2, predicted by position 1's logits
    logits = torch.zeros(1, 3, vocab)
    logits[0, 1, 3] = 10.0
    confident = next_token_loss(logits, labels, loss_mask)
    logits[0, 2, 3] = -10.0  # the last position's logits predict nothing: no effect
    assert next_token_loss(logits, labels, loss_mask) == pytest.approx(confident.item())
    assert confident.item() < 1e-3
    assert next_token_loss(logits, labels, torch.zeros(1, 3)).item() == 0.0
