"""A tiny Llama and a few SFT samples for the training-library tests (built in process, nothing downloaded)."""

from __future__ import annotations

import pytest

from orchestration.training import Sample
from workers.models import build_tiny_causal_lm

VOCAB = 16


def tiny_llama(seed: int = 0):
    return build_tiny_causal_lm(VOCAB, hidden_size=32, num_layers=1, num_heads=2, eos_token_id=2, seed=seed)


def sft_samples() -> list[Sample]:
    """Four prompt -> response pairs (response = the prompt's digits reversed, then <eos>=2)."""
    out = []
    for prompt in ([3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14]):
        response = [*reversed(prompt), 2]
        out.append(Sample(tokens=[1, *prompt, *response], loss_mask=[0.0] * 4 + [1.0] * len(response)))
    return out


@pytest.fixture
def samples() -> list[Sample]:
    return sft_samples()
