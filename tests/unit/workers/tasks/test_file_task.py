"""The file task: a config's model.path, data.* and reward.fn as a Task (workers/tasks/files.py), without Ray."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from workers.models import save_tiny_chat_model
from workers.reward import score_task
from workers.tasks.files import ROW_FIELD, FileTask, FileTaskError

HERE = "tests.unit.workers.tasks.test_file_task"
ROWS = [
    {"prompt": "What is 2+3?", "answer": 5, "level": "easy"},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 4+4?"}], "answer": 8,
     "level": "easy"},
    {"prompt": "What is 9+9?", "answer": 18, "level": "hard"},
]  # fmt: skip
CALLS: list[tuple[Any, ...]] = []


def exact(prompt: Any, response: str, answer: int, level: str) -> float:
    CALLS.append((prompt, response, answer, level))
    return 1.0 if response.strip() == str(answer) else 0.0


async def exact_async(prompt: Any, response: str, answer: int, **fields: Any) -> float:
    await asyncio.sleep(0)
    return 1.0 if response.strip() == str(answer) else 0.0


def exact_batch(prompts: list[Any], responses: list[str], answer: list[int], level: list[str]) -> list[float]:
    CALLS.append((prompts, responses, answer, level))
    return [1.0 if r.strip() == str(a) else 0.0 for r, a in zip(responses, answer, strict=True)]


async def exact_batch_async(prompts: list[Any], responses: list[str], **fields: list[Any]) -> list[float]:
    return exact_batch(prompts, responses, **fields)


def not_a_number(prompt: Any, response: str, **fields: Any) -> str:
    return "high"


def raising(prompt: Any, response: str, **fields: Any) -> float:
    if response == "boom":
        raise RuntimeError("boom")
    return 0.5


def short_batch(prompts: list[Any], responses: list[str], **fields: Any) -> list[float]:
    return [1.0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def task_of(model_dir: Path, files: Any, fn: str = "exact", **kwargs: Any) -> FileTask:
    return FileTask(str(model_dir), str(files) if isinstance(files, Path) else files, f"{HERE}:{fn}", **kwargs)


def test_prompts_go_through_the_chat_template_of_the_model(model_dir: Path, jsonl: Path) -> None:
    task = task_of(model_dir, jsonl)
    prompts = task.prompts("train", 10, seed=0)
    assert len(prompts) == 3  # every row, when the file holds fewer than asked
    texts = {task.tokenizer.decode(p["prompt_ids"]) for p in prompts}
    assert texts == {
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 4+4?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nWhat is 9+9?<|im_end|>\n<|im_start|>assistant\n",
    }
    assert [p[ROW_FIELD] for p in task.prompts("train", 2, seed=0)] == [p[ROW_FIELD] for p in prompts[:2]]
    assert task.prompts("eval", 3, seed=0) == prompts  # no val_files: the training rows


def test_parquet_rows_and_val_files(model_dir: Path, jsonl: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "1+1?", "answer": 2, "level": "easy"}]), path)
    task = task_of(model_dir, [str(path)], prompt_key="question")
    (prompt,) = task.prompts("train", 4, seed=1)
    assert json.loads(prompt[ROW_FIELD]) == {"prompt": "1+1?", "fields": {"answer": 2, "level": "easy"}}
    val = tmp_path / "val2.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1?", "answer": 2, "level": "easy"}]), val)
    task = task_of(model_dir, jsonl, val_files=str(val))
    assert [json.loads(p[ROW_FIELD])["prompt"] for p in task.prompts("eval", 4, seed=0)] == ["1+1?"]


def test_the_reward_gets_the_prompt_the_response_and_the_other_columns_as_in_the_file(
    model_dir: Path, jsonl: Path
) -> None:
    task = task_of(model_dir, jsonl)
    (prompt,) = [p for p in task.prompts("train", 3, seed=0) if "2+3" in p[ROW_FIELD]]
    CALLS.clear()
    assert task.reward(" 5", **{ROW_FIELD: prompt[ROW_FIELD]}) == 1.0
    assert CALLS == [("What is 2+3?", " 5", 5, "easy")]
    assert task.reward("6", **{ROW_FIELD: prompt[ROW_FIELD]}) == 0.0


@pytest.mark.parametrize("fn, batch", [("exact", False), ("exact_async", False), ("exact_batch", True),
                                       ("exact_batch_async", True)])  # fmt: skip
def test_every_reward_form_scores_alike(model_dir: Path, jsonl: Path, fn: str, batch: bool) -> None:
    task = task_of(model_dir, jsonl, fn, reward_batch=batch)
    rows = sorted(
        (p[ROW_FIELD] for p in task.prompts("train", 3, seed=0)), key=lambda r: json.loads(r)["fields"]["answer"]
    )
    CALLS.clear()
    assert task.rewards(["5", "7", "18"], **{ROW_FIELD: rows}) == [1.0, 0.0, 1.0]
    if fn == "exact_batch":
        assert len(CALLS) == 1 and CALLS[0][2:] == ([5, 8, 18], ["easy", "easy", "hard"])  # one call for the batch


def test_a_failing_reward_fails_its_sample_in_the_reward_worker(model_dir: Path, jsonl: Path) -> None:
    task = task_of(model_dir, jsonl, "raising")
    rows = [p[ROW_FIELD] for p in task.prompts("train", 2, seed=0)]
    scores = score_task(task, ["ok", "boom"], {ROW_FIELD: rows}, sample_ids=[7, 8])
    assert scores.rewards == [0.5, 0.0] and scores.failed == [False, True]
    assert scores.errors == ["RuntimeError: boom"]


def test_a_reward_that_is_not_a_number_is_a_typed_error(model_dir: Path, jsonl: Path) -> None:
    task = task_of(model_dir, jsonl, "not_a_number")
    row = task.prompts("train", 1, seed=0)[0][ROW_FIELD]
    with pytest.raises(FileTaskError) as error:
        task.reward("x", **{ROW_FIELD: row})
    assert str(error.value) == f"reward.fn '{HERE}:not_a_number' returned 'high' (str); expected a number"
    batch = task_of(model_dir, jsonl, "short_batch", reward_batch=True)
    scores = score_task(batch, ["a", "b"], {ROW_FIELD: [row, row]})
    assert scores.failed == [True, True]
    assert scores.errors[0] == (
        f"FileTaskError: reward.fn '{HERE}:short_batch' with reward.batch=true must return a list of 2 numbers (one "
        "per response), got [1.0]"
    )


def test_errors_name_the_key_what_it_expected_and_what_arrived(model_dir: Path, jsonl: Path, tmp_path: Path) -> None:
    def message(**kwargs: Any) -> str:
        with pytest.raises(FileTaskError) as error:
            FileTask(
                **{"model_path": str(model_dir), "train_files": str(jsonl), "reward_fn": f"{HERE}:exact", **kwargs}
            )
        return str(error.value)

    missing = tmp_path / "missing.jsonl"
    assert message(train_files=str(missing)) == f"data.train_files: no file at {str(missing)!r}"
    (tmp_path / "rows.csv").write_text("prompt\nhi\n")
    assert message(train_files=str(tmp_path / "rows.csv")) == (
        f"data.train_files: {str(tmp_path / 'rows.csv')!r} is neither JSONL (.jsonl, .json) nor Parquet (.parquet)"
    )
    assert message(prompt_key="question") == (
        f"data.prompt_key='question' is not a column of data.train_files={str(jsonl)!r}; its columns are "
        "['answer', 'level', 'prompt']"
    )
    assert message(model_path=str(tmp_path / "nowhere")) == (
        f"model.path={str(tmp_path / 'nowhere')!r} is not a directory; expected a local Hugging Face model directory"
    )
    assert message(model_path=str(tmp_path)) == (
        f"model.path={str(tmp_path)!r} has no tokenizer (none of tokenizer.json, tokenizer_config.json, "
        "tokenizer.model); expected a Hugging Face model directory saved with save_pretrained, tokenizer included"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": 3}) + "\n")
    with pytest.raises(FileTaskError, match=r"data.prompt_key='prompt' must hold a string or a list of \{'role', "):
        task_of(model_dir, bad).prompts("train", 1, seed=0)


def test_the_policy_is_the_model_of_model_path(model_dir: Path, jsonl: Path) -> None:
    import torch

    model = task_of(model_dir, jsonl).build_policy()
    assert model.training and next(model.parameters()).dtype == torch.float32
    assert model.config.vocab_size == len(task_of(model_dir, jsonl).tokenizer)


def test_reward_fn_may_name_a_python_file(model_dir: Path, jsonl: Path, tmp_path: Path) -> None:
    (tmp_path / "my_reward.py").write_text("def score(prompt, response, answer, **fields):\n    return len(response)\n")
    task = FileTask(str(model_dir), str(jsonl), f"{tmp_path}/my_reward.py:score")
    row = task.prompts("train", 1, seed=0)[0][ROW_FIELD]
    assert task.reward("abc", **{ROW_FIELD: row}) == 3.0
    with pytest.raises(FileTaskError, match=r"my_reward.py has no function 'nothing'$"):
        FileTask(str(model_dir), str(jsonl), f"{tmp_path}/my_reward.py:nothing")
    with pytest.raises(FileTaskError, match=r"no file at '.*/other.py'$"):
        FileTask(str(model_dir), str(jsonl), f"{tmp_path}/other.py:score")


def test_the_rows_read_do_not_travel_with_the_pickled_task(model_dir: Path, tmp_path: Path) -> None:
    import pickle

    path = tmp_path / "big.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=" + "x" * 200, "answer": 2 * i}) + "\n" for i in range(300))
    )
    task = task_of(model_dir, path)
    copy = pickle.loads(pickle.dumps(task))
    assert len(pickle.dumps(task)) < 20_000  # the 300 rows hold 60 kB
    assert copy.prompts("train", 2, seed=3) == task.prompts("train", 2, seed=3)  # read again where drawn
