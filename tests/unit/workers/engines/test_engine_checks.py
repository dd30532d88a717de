"""The argument checks every engine shares (workers/engines/base.py): one message per mistake, whichever engine."""

import pytest

from workers.engines.base import SamplingParams, check_prompts, check_version, check_weight_update

PARAMS = SamplingParams(max_new_tokens=4)


@pytest.mark.parametrize(
    ("prompts", "n", "message"),
    [
        ([[1]], 0, r"n must be >= 1, got 0"),
        ([[1], []], 1, r"prompt 1 is empty; every prompt needs at least one token"),
        ([[1, 10]], 1, r"prompt 0 holds a token id outside \[0, 10\): \[1, 10\]"),
        ([[-1]], 1, r"prompt 0 holds a token id outside \[0, 10\)"),
        ([[1] * 5], 1, r"prompt 0 has 5 tokens; with max_new_tokens=4 that exceeds max_model_len=8"),
    ],
)
def test_check_prompts_names_the_prompt_and_the_limit(prompts, n, message):
    with pytest.raises(ValueError, match=message):
        check_prompts(prompts, n, PARAMS, vocab_size=10, max_len=("max_model_len", 8))


def test_check_prompts_skips_what_the_engine_does_not_know():
    check_prompts([[10_000] * 50], 2, PARAMS)  # no vocabulary, no length limit: an HTTP engine's server checks those
    check_prompts([[1, 2, 3, 4]], 1, PARAMS, vocab_size=10, max_len=("max_model_len", 8))  # 4 + 4 fits exactly


def test_check_weight_update_wants_one_source_and_no_step_back():
    with pytest.raises(ValueError, match=r"give exactly one of state_dict and path, got state_dict=None, path=None"):
        check_weight_update(0, 1, None, None)
    with pytest.raises(ValueError, match=r"got state_dict=set, path='/x'"):
        check_weight_update(0, 1, {}, "/x")
    with pytest.raises(ValueError, match=r"version must not go backwards: current version=3, got 2"):
        check_weight_update(3, 2, None, "/x")
    check_weight_update(3, 3, {}, None)
    with pytest.raises(ValueError, match=r"current version=1, got 0"):
        check_version(1, 0)
