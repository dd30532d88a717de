"""workers/ledger/convert.py: ``convert_record_to_data_func`` (AgentRL's hook turning a ledger Record into training
data) given as a callable or a dotted name, its result checked; what does not import, or the wrong shape, is refused
naming what was expected and what arrived."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.ledger import (
    InvalidRecordConverter,
    InvalidRecordData,
    Record,
    convert_record,
    resolve_convert_record_to_data_func,
)
from workers.ledger.convert import sampled_row

RECORD = Record(
    id=7,
    task_key=1,
    task_id="problem-0",
    split="train",
    epoch=0,
    messages=[{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}],
    score=1.0,
)


def code_points(record: Record):
    """A hook: the code points of the question and of the answer; a record without an answer is skipped."""
    if not record.messages[-1]["content"]:
        return None
    return {"prompt_ids": [ord(c) for c in record.messages[0]["content"]], "response_ids": [ord("3")]}


def test_a_hook_is_a_callable_or_the_dotted_name_of_one_in_either_spelling():
    assert resolve_convert_record_to_data_func(code_points) is code_points
    assert resolve_convert_record_to_data_func(None) is None
    here = __name__
    assert resolve_convert_record_to_data_func(f"{here}:code_points") is code_points
    assert resolve_convert_record_to_data_func(f"{here}.code_points") is code_points


def test_a_name_that_does_not_import_a_function_is_refused_naming_it():
    with pytest.raises(InvalidRecordConverter, match=r"dotted name .* got 'no_such_module:f': cannot import"):
        resolve_convert_record_to_data_func("no_such_module:f")
    with pytest.raises(InvalidRecordConverter, match=r"got 'json:no_such_function': module 'json' has no"):
        resolve_convert_record_to_data_func("json:no_such_function")
    with pytest.raises(
        InvalidRecordConverter, match=r"expected 'math:pi' to name a function of one Record, got a float"
    ):
        resolve_convert_record_to_data_func("math:pi")
    with pytest.raises(InvalidRecordConverter, match=r"expected a callable or a dotted name .*, got a int \(3\)"):
        resolve_convert_record_to_data_func(3)  # type: ignore[arg-type]


def test_the_hooks_data_comes_back_checked_and_none_or_an_empty_list_skips_the_record():
    assert convert_record(code_points, RECORD) == {"prompt_ids": [49, 43, 50, 61], "response_ids": [51]}
    tensors = lambda r: {"prompt_ids": torch.tensor([1, 2]), "response_ids": (3,)}  # noqa: E731
    assert convert_record(tensors, RECORD) == {"prompt_ids": [1, 2], "response_ids": [3]}
    numpy_ints = lambda r: {"prompt_ids": [np.int64(1)], "response_ids": [np.int32(3)]}  # noqa: E731
    assert convert_record(numpy_ints, RECORD) == {"prompt_ids": [1], "response_ids": [3]}
    unanswered = RECORD.model_copy(update={"messages": [*RECORD.messages[:1], {"role": "assistant", "content": ""}]})
    assert convert_record(code_points, unanswered) is None
    assert convert_record(lambda r: [], RECORD) is None


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (
            "3",
            r"hook of record 7 \(task problem-0\): expected a dict \{'prompt_ids'.* None / \[\] to skip the record, "
            r"got a str",
        ),
        ([{"prompt_ids": [1], "response_ids": [2]}], r"expected a dict .*, got a list"),
        ({"prompt_ids": [1]}, r"got a dict without \['response_ids'\]: keys \['prompt_ids'\]"),
        ({"prompt_ids": "1+2=", "response_ids": [2]}, r"expected prompt_ids a list of ints, got '1\+2='"),
        ({"prompt_ids": [1], "response_ids": [2.5]}, r"expected response_ids a list of ints, got \[2.5\]"),
        (
            {"prompt_ids": [1], "response_ids": []},
            r"expected a non-empty response_ids \(the answer trained on\), got \[\]",
        ),
    ],
)
def test_a_hook_returning_the_wrong_shape_is_refused_naming_what_was_expected_and_what_arrived(result, message):
    def hook(record):
        return result

    with pytest.raises(InvalidRecordData, match=message) as refused:
        convert_record(hook, RECORD)
    assert str(refused.value).startswith("convert_record_to_data_func test_a_hook_returning_the_wrong_shape")


ROW = {"record_id": 7, "prompt_ids": [1, 2], "response_ids": [3], "response_logprobs": [-0.5], "reward": 1.0,
       "policy_version": 4}  # fmt: skip


def test_a_sampled_row_keeps_its_log_probs_for_its_own_tokens_loses_them_for_others_and_is_skipped_for_none():
    assert sampled_row(lambda r: {"prompt_ids": (1, 2), "response_ids": torch.tensor([3])}, RECORD, ROW) is ROW
    changed = sampled_row(lambda r: {"prompt_ids": [1, 2], "response_ids": [3, 4]}, RECORD, ROW)
    assert changed == {**ROW, "response_ids": [3, 4], "response_logprobs": []}  # the trainer takes its own
    assert sampled_row(lambda r: None, RECORD, ROW) is None and sampled_row(lambda r: [], RECORD, ROW) is None
    with pytest.raises(InvalidRecordData, match=r"of record 7 \(task problem-0\): expected a non-empty response_ids"):
        sampled_row(lambda r: {"prompt_ids": [1, 2], "response_ids": []}, RECORD, ROW)
