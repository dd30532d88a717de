"""An AReaL-style JSONL dataset of sample ids (``{"index": ..., "messages": [...]}``) drives which samples a
task-server rollout plays: every line resolved to one of the environment's sample ids, or refused naming the line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from workers.agents.envs.guess_number import GuessNumberEnvironment
from workers.agents.sample_dataset import SampleDatasetError, load_sample_ids
from workers.tasks.env_chat import ChatEnvTask

IDS = GuessNumberEnvironment.sample_ids()  # game-00 ... game-15


def dataset(tmp_path: Path, *rows: Any) -> Path:
    path = tmp_path / "samples.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_indexes_and_ids_name_the_environments_samples_in_the_files_order(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "Guess the number."}]
    path = dataset(tmp_path, {"index": 3, "messages": messages}, {"index": "game-07"}, "", {"index": "3"})
    assert load_sample_ids(path, IDS) == ["game-03", "game-07", "game-03"]  # a repeat weighs a sample more


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"samples.jsonl:1: expected a JSON object, got invalid JSON \(Expecting property name"),
        ('{"messages": []}', r"samples.jsonl:1: expected an object with an 'index' key, got \['messages'\]"),
        ("[3]", r"samples.jsonl:1: expected an object with an 'index' key, got list"),
        ('{"index": 16}', r"samples.jsonl:1: index 16 is out of range: the environment has 16 samples \(0..15\)"),
        ('{"index": -1}', r"index -1 is out of range"),
        ('{"index": true}', r"samples.jsonl:1: expected 'index' to be an integer or a sample id, got True"),
        (
            '{"index": "game-99"}',
            r"the environment has no sample 'game-99' \(its ids: game-00, game-01, game-02, ...\)",
        ),
    ],
)
def test_a_bad_line_is_refused_naming_the_file_the_line_and_what_was_expected(
    tmp_path: Path, line: str, message: str
) -> None:
    with pytest.raises(SampleDatasetError, match=message):
        load_sample_ids(dataset(tmp_path, line), IDS)


def test_a_file_without_samples_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SampleDatasetError, match=r"expected at least one \{'index': ...\} line, the file has none"):
        load_sample_ids(dataset(tmp_path, ""), IDS)


def test_a_chat_task_draws_its_prompts_from_the_dataset_only(tmp_path: Path) -> None:
    path = dataset(tmp_path, {"index": 2}, {"index": 5})
    task = ChatEnvTask(env="guess-number", model_path=str(tmp_path / "model"), dataset=str(path))
    drawn = {p["sample_id"] for p in task.prompts("train", 50, seed=0)}
    assert drawn == {"game-02", "game-05"}
    every = ChatEnvTask(env="guess-number", model_path=str(tmp_path / "model"))
    assert len({p["sample_id"] for p in every.prompts("train", 200, seed=0)}) > 2
