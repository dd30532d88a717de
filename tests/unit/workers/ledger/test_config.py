"""``SamplingConfig`` refuses every setting it does not know (a typo, a guide knob it cannot honour) with a typed
error naming the closest valid names; a recipe declares its own settings in a subclass."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.ledger import InvalidSamplingConfig, LedgerError, SamplingConfig


def test_a_misspelt_setting_is_refused_naming_the_closest_valid_ones():
    with pytest.raises(InvalidSamplingConfig) as refused:
        SamplingConfig(output_dir="/tmp/run", num_generation=8)

    assert str(refused.value) == (
        "unknown SamplingConfig setting 'num_generation'; did you mean num_generations? (a recipe's own settings go "
        "in a subclass: class MyConfig(SamplingConfig): train_file: str)"
    )


def test_a_setting_far_from_every_valid_one_is_refused_pointing_at_the_list():
    with pytest.raises(InvalidSamplingConfig, match=r"unknown SamplingConfig setting 'zzz'; expected one of \[.*"):
        SamplingConfig(zzz=1)


def test_the_refusal_is_a_ledger_error_not_a_pydantic_validation_error():
    with pytest.raises(LedgerError) as refused:
        SamplingConfig.model_validate({"target_concurency": 4})

    assert type(refused.value) is InvalidSamplingConfig and not isinstance(refused.value, ValueError)
    assert "did you mean target_concurrency?" in str(refused.value)


def test_the_guides_inference_sizing_is_a_setting_for_the_runs_inference_manager():
    assert (SamplingConfig().inf_tp_size, SamplingConfig().inf_ep_size, SamplingConfig().inf_mem_ratio) == (1, 1, None)
    cfg = SamplingConfig(inf_tp_size=4, inf_ep_size=2, inf_mem_ratio=0.6)

    assert (cfg.inf_tp_size, cfg.inf_ep_size, cfg.inf_mem_ratio) == (4, 2, 0.6)


@pytest.mark.parametrize(
    ("knob", "value", "expected"),
    [
        ("inf_tp_size", 0, "greater than or equal to 1"),
        ("inf_ep_size", -2, "greater than or equal to 1"),
        ("inf_tp_size", 1.5, "valid integer"),
        ("inf_mem_ratio", 0, "greater than 0"),
        ("inf_mem_ratio", 1.2, "less than or equal to 1"),
    ],
)
def test_an_inference_size_out_of_range_is_refused(knob, value, expected):
    with pytest.raises(ValidationError, match=rf"(?s){knob}\n.*{expected}"):
        SamplingConfig(**{knob: value})


def test_every_refused_setting_is_named_at_once():
    refused = r"'inf_mem_ration'; did you mean inf_mem_ratio, .*'inf_tp'; did you mean inf_tp_size\?"
    with pytest.raises(InvalidSamplingConfig, match=refused):
        SamplingConfig(inf_mem_ration=0.6, inf_tp=2)


class OSWorldConfig(SamplingConfig):
    train_file: str = "assets/osworld_dataset.jsonl"


def test_a_recipe_declares_its_own_settings_in_a_subclass():
    cfg = OSWorldConfig(train_file="tasks.jsonl", target_concurrency=1)

    assert (cfg.train_file, cfg.target_concurrency) == ("tasks.jsonl", 1)
    with pytest.raises(
        InvalidSamplingConfig, match=r"unknown OSWorldConfig setting 'train_fle'; did you mean train_file\?"
    ):
        OSWorldConfig(train_fle="tasks.jsonl")
