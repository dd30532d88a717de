"""``SamplingConfig`` refuses every setting it does not know (a typo, a guide knob it cannot honour) with a typed
error naming the closest valid names; a recipe declares its own settings in a subclass."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("knob", ["inf_tp_size", "inf_ep_size", "inf_mem_ratio"])
def test_a_guide_knob_the_run_cannot_honour_is_refused_saying_why(knob):
    with pytest.raises(InvalidSamplingConfig) as refused:
        SamplingConfig(**{knob: 2})

    assert str(refused.value) == (
        f"{knob}=2: AgentRL's guide sizes the inference services it starts with it, and this run starts none (an "
        "engine registers itself as an InferenceService: ServiceRegistration, docs/sampling.md); remove it, and size "
        "your engine where you start it"
    )


def test_every_refused_setting_is_named_at_once():
    with pytest.raises(InvalidSamplingConfig, match=r"inf_mem_ratio=0.6: .*; inf_tp_size=2: .*"):
        SamplingConfig(inf_mem_ratio=0.6, inf_tp_size=2)


class OSWorldConfig(SamplingConfig):
    train_file: str = "assets/osworld_dataset.jsonl"


def test_a_recipe_declares_its_own_settings_in_a_subclass():
    cfg = OSWorldConfig(train_file="tasks.jsonl", target_concurrency=1)

    assert (cfg.train_file, cfg.target_concurrency) == ("tasks.jsonl", 1)
    with pytest.raises(
        InvalidSamplingConfig, match=r"unknown OSWorldConfig setting 'train_fle'; did you mean train_file\?"
    ):
        OSWorldConfig(train_fle="tasks.jsonl")
