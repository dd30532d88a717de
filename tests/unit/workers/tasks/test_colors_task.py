"""The colours task (a vision-language toy task): its prompts carry their pictures' blob keys, every process that
builds it resolves them alike, the engine a run builds for it samples with those keys, and the rule-based reward."""

from __future__ import annotations

import pytest
import torch

from rl_contracts.images import IMAGE_REFS, rows_pixel_values
from workers.engines import SamplingParams
from workers.engines.errors import ImagesNotSupported, ImageTokenMismatch
from workers.engines.host import EngineActor, EngineSpec
from workers.tasks.colors import COLOURS, ColorsTask, colour_reward

TASK = "workers.tasks.colors:ColorsTask"


@pytest.fixture(scope="module")
def task() -> ColorsTask:
    return ColorsTask()


def test_prompts_carry_one_picture_key_and_the_colour_and_are_a_pure_function_of_the_seed(task):
    prompts = task.prompts("train", 12, seed=3)
    assert prompts == ColorsTask().prompts("train", 12, seed=3)  # another process's task: the same rows, same keys
    assert prompts != task.prompts("eval", 12, seed=3)
    assert {p["answer"] for p in prompts} <= set(COLOURS) and len({p["answer"] for p in prompts}) > 1
    for p in prompts:
        assert p[IMAGE_REFS] == [task.image_keys[p["answer"]]]
        assert p["prompt_ids"].count(100) == 16  # <image> expanded to the tiny LLaVA's tokens per image
    with pytest.raises(ValueError, match="split must be 'train' or 'eval', got 'test'"):
        task.prompts("test", 1, seed=0)


def test_two_pictures_mixes_prompts_with_two_pictures_and_both_names_as_the_answer(task):
    prompts = ColorsTask(two_pictures=0.5).prompts("train", 12, seed=3)
    two = [p for p in prompts if len(p[IMAGE_REFS]) == 2]
    assert 0 < len(two) < len(prompts)
    for p in two:
        first, second = p["answer"].split(" and ")
        assert first != second and p[IMAGE_REFS] == [task.image_keys[first], task.image_keys[second]]
        assert p["prompt_ids"].count(100) == 32 and p["prompt_ids"] == task.two_prompt_ids
    # the rows of both kinds resolve in one batch: padded to two images, one and two counted
    pixels = rows_pixel_values([p[IMAGE_REFS] for p in prompts], task.image_source())
    assert pixels is not None and pixels.shape == (12, 2, 3, 16, 16)
    assert [p for p in ColorsTask(two_pictures=1.0).prompts("eval", 4, seed=0) if len(p[IMAGE_REFS]) != 2] == []
    with pytest.raises(ValueError, match=r"two_pictures is a fraction of the prompts, in \[0, 1\]; got 1.5"):
        ColorsTask(two_pictures=1.5)


def test_the_image_source_gives_each_colour_its_own_pixels(task):
    keys = [[task.image_keys["red"]], [task.image_keys["blue"]], [task.image_keys["red"]]]
    pixels = rows_pixel_values(keys, task.image_source())
    assert pixels is not None and tuple(pixels.shape) == (3, 1, 3, 16, 16)
    assert torch.equal(pixels[0], pixels[2]) and not torch.equal(pixels[0], pixels[1])


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [("red", "red", 1.0), ("  RED.", "red", 1.0), ("re", "red", 2 / 3), ("g", "green", 0.2), ("xred", "red", 0.0)],
)
def test_the_reward_is_the_fraction_of_the_colour_name_the_response_starts_with(response, answer, reward):
    assert colour_reward(response, answer) == pytest.approx(reward)


def test_the_hf_engine_of_a_run_samples_with_the_rows_image_keys(task):
    """EngineSpec.build gives the hf engine the task's image source: a row's keys are its images."""
    engine = EngineSpec(kind="hf", task_name=TASK).build()
    prompts = task.prompts("train", 2, seed=0)
    params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=0)
    groups = engine.generate([p["prompt_ids"] for p in prompts], 2, params, images=[p[IMAGE_REFS] for p in prompts])
    assert [len(g) for g in groups] == [2, 2] and all(s.token_ids for g in groups for s in g)
    with pytest.raises(ImageTokenMismatch, match=r"prompt 0 holds 16 image tokens .* for 0 images"):
        engine.generate([prompts[0]["prompt_ids"]], 1, params)


def test_an_engine_with_partial_rollouts_refuses_image_refs(task):
    actor = EngineActor.__ray_metadata__.modified_class(EngineSpec(kind="hf", task_name=TASK, partial_rollout=True))  # type: ignore[attr-defined]
    [prompt] = task.prompts("train", 1, seed=0)
    with pytest.raises(ImagesNotSupported, match="engine 'hf with partial_rollout' was given image_refs for 1 prompts"):
        actor.generate([prompt["prompt_ids"]], 1, SamplingParams(max_new_tokens=2), None, [prompt[IMAGE_REFS]])
