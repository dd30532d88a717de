"""Your own model, prompts and reward without writing a class: the task a config's ``model``, ``data`` and ``reward``
sections build (docs/quickstart.md).

* ``model.path``: a local Hugging Face directory; the policy, the tokenizer and its chat template come from it.
* ``data.train_files`` / ``data.val_files``: JSONL (``.jsonl``, ``.json``) or Parquet (``.parquet``) files, read with
  ``datasets`` from local paths only. ``data.prompt_key`` names the column of the prompt: a string (sent as the user
  turn) or a list of ``{"role", "content"}`` messages; the chat template of ``model.path`` turns it into token ids,
  ending at the assistant header.
* ``reward.fn``: ``"module:function"`` or ``"path/to/file.py:function"``, called as ``fn(prompt, response,
  **fields)`` where ``prompt`` is the row's prompt value as in the file, ``response`` the decoded response (special
  tokens dropped) and ``fields`` the row's other columns (their values as in the file: numbers stay numbers). It
  returns a number; it may be ``async``. With ``reward.batch: true`` it scores a batch instead: ``fn(prompts,
  responses, **fields) -> list[float]``, every argument a list with one entry per response (sync or async).

A row travels through the queue as one string field, ``data_row``: the JSON of its prompt and other columns, so a
column of any name or JSON type reaches the reward function as it was.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import math
import numbers
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from rl_contracts.task import Task, load_reward_fn
from workers.tasks.arithmetic import ChatTokenizer

#: the one reward field of a file task: the JSON of a row's prompt and other columns
ROW_FIELD = "data_row"
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class FileTaskError(ValueError):
    """A file task's model, data or reward is not usable; the message names the key, what it expected and got."""


def _as_list(files: str | Sequence[str] | None) -> list[str]:
    return [files] if isinstance(files, str) else list(files or [])


def check_model_dir(path: str) -> Path:
    """``path`` if it is a directory with a tokenizer, else :class:`FileTaskError`."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FileTaskError(f"model.path={path!r} is not a directory; expected a local Hugging Face model directory")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise FileTaskError(
            f"model.path={path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); expected a Hugging Face "
            "model directory saved with save_pretrained, tokenizer included"
        )
    return directory


def load_rows(files: str | Sequence[str], key: str = "data.train_files") -> list[dict[str, Any]]:
    """The rows of local JSONL or Parquet ``files`` (one format for all), read with ``datasets``.

    Raises:
        FileTaskError: no file given, a file missing, or one that is neither JSONL nor Parquet (``key`` names the
            config key they came from).
    """
    paths = _as_list(files)
    if not paths:
        raise FileTaskError(f"{key} names no file; expected a JSONL or Parquet path or a list of them")
    formats = set()
    for path in paths:
        if not Path(path).expanduser().is_file():
            raise FileTaskError(f"{key}: no file at {path!r}")
        suffix = Path(path).suffix.lower()
        if suffix not in FORMATS:
            raise FileTaskError(f"{key}: {path!r} is neither JSONL (.jsonl, .json) nor Parquet (.parquet)")
        formats.add(FORMATS[suffix])
    if len(formats) > 1:
        raise FileTaskError(f"{key} mixes JSONL and Parquet files; give files of one format, got {paths}")
    import datasets

    datasets.disable_progress_bars()  # one bar per file and process of the run otherwise
    data_files = [str(Path(p).expanduser().resolve()) for p in paths]
    dataset = datasets.load_dataset(formats.pop(), data_files=data_files, split="train")
    return cast(list[dict[str, Any]], dataset.to_list())


def chat_messages(value: Any, key: str) -> list[dict[str, str]]:
    """The chat messages of a prompt value: a string is the user turn; a list of messages is taken as it is."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in value):
        return value
    raise FileTaskError(
        f"data.prompt_key={key!r} must hold a string or a list of {{'role', 'content'}} messages, got {value!r}"
    )


def load_reward(spec: str) -> Callable[..., Any]:
    """The function of ``reward.fn``: ``"module:function"`` (imported), or ``"path/to/file.py:function"`` (the file
    loaded as a module of its own: nothing to install, and every actor of the run finds it at that path).

    Raises:
        FileTaskError: the file or the function is missing, or is not callable.
    """
    target, _, name = spec.rpartition(":")
    if not target.endswith(".py"):
        return load_reward_fn(spec)
    path = Path(target).expanduser()
    if not path.is_file():
        raise FileTaskError(f"reward.fn={spec!r}: no file at {target!r}")
    module_spec = importlib.util.spec_from_file_location(f"reward_fn_{path.stem}", path)
    assert module_spec is not None and module_spec.loader is not None  # a .py file always has a spec and a loader
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise FileTaskError(f"reward.fn={spec!r}: {target} has no function {name!r}")
    return cast(Callable[..., Any], fn)


def check_reward(value: Any, spec: str) -> float:
    """``value`` as a float if it is a real number, else :class:`FileTaskError` naming the function."""
    if not isinstance(value, numbers.Real):
        raise FileTaskError(f"reward.fn {spec!r} returned {value!r} ({type(value).__name__}); expected a number")
    return float(value)


def _resolve(value: Any) -> Any:
    """The result of a sync call, or of an async one run to completion."""
    if inspect.isawaitable(value):
        return asyncio.run(_awaited(value))
    return value


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class FileTask(Task):
    """Prompts from your JSONL or Parquet files, a Hugging Face model directory, and a plain reward function.

    Args:
        model_path: ``model.path``.
        train_files, val_files: ``data.train_files`` and ``data.val_files`` (None: evaluate on the training files).
        reward_fn: ``reward.fn``, ``"module:function"``.
        prompt_key: ``data.prompt_key``.
        reward_batch: ``reward.batch``: ``reward_fn`` takes lists and returns one score per response.

    Raises:
        FileTaskError: ``model_path`` is not a model directory with a tokenizer, a data file is missing or of
            another format, or ``prompt_key`` is not a column of the training files (the message lists those there
            are).
    """

    reward_fields = (ROW_FIELD,)

    def __init__(
        self,
        model_path: str,
        train_files: str | list[str],
        reward_fn: str,
        val_files: str | list[str] | None = None,
        prompt_key: str = "prompt",
        reward_batch: bool = False,
    ):
        self.model_path = check_model_dir(model_path)
        self.reward_spec, self.reward_batch, self.prompt_key = reward_fn, reward_batch, prompt_key
        self.reward_fn = load_reward(reward_fn)
        self.train_files, self.val_files = train_files, val_files
        self._rows: dict[str, list[dict[str, Any]]] = {}
        self._rows_of("train")  # a missing file or column fails when the run starts, not at the first step
        self._tokenizer: ChatTokenizer | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the rows read (the task travels to the trainer ranks, which use only its tokenizer and
        policy): they are read again where prompts are drawn."""
        return {**self.__dict__, "_rows": {}}

    def _rows_of(self, split: str) -> list[dict[str, Any]]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if split not in self._rows:
            key, files = "data.train_files", self.train_files
            if split == "eval" and self.val_files:
                key, files = "data.val_files", self.val_files
            rows = load_rows(files, key)
            if not rows:
                raise FileTaskError(f"{key}={files!r} holds no rows")
            if self.prompt_key not in rows[0]:
                raise FileTaskError(
                    f"data.prompt_key={self.prompt_key!r} is not a column of {key}={files!r}; its columns are "
                    f"{sorted(rows[0])}"
                )
            self._rows[split] = rows
        return self._rows[split]

    @property
    def tokenizer(self) -> ChatTokenizer:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = cast(ChatTokenizer, AutoTokenizer.from_pretrained(self.model_path))
            if not getattr(tokenizer, "chat_template", None):
                raise FileTaskError(
                    f"the tokenizer of model.path={str(self.model_path)!r} has no chat template; use a chat (instruct) "
                    "model, or set tokenizer.chat_template and save it there"
                )
            self._tokenizer = tokenizer
        return self._tokenizer

    def prompt_ids(self, value: Any) -> list[int]:
        """Token ids of a prompt value through the chat template, ending at the assistant header."""
        messages = chat_messages(value, self.prompt_key)
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = out["input_ids"] if not isinstance(out, list) else out  # transformers 5 returns a BatchEncoding
        return [int(i) for i in ids]

    def prompts(self, split: str, num: int, seed: int) -> list[dict[str, Any]]:
        """``num`` rows of ``split`` in an order drawn from ``seed`` (every row when the files hold fewer)."""
        rows = self._rows_of(split)
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        out = []
        for index in order[:num]:
            row = rows[index]
            fields = {name: value for name, value in row.items() if name != self.prompt_key}
            encoded = json.dumps({"prompt": row[self.prompt_key], "fields": fields}, default=str)
            out.append({"prompt_ids": self.prompt_ids(row[self.prompt_key]), ROW_FIELD: encoded})
        return out

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def reward(self, response_text: str, **fields: str) -> float:
        (score,) = self.rewards([response_text], **{name: [value] for name, value in fields.items()})
        if isinstance(score, Exception):
            raise score
        return score

    def rewards(self, response_texts: list[str], **fields: list[str]) -> list[float | Exception]:
        """Score a batch: one call of a batch ``reward.fn``; a per-sample one on each response (an async one on all
        of them at once). A response whose score fails holds the exception."""
        rows = [json.loads(encoded) for encoded in fields[ROW_FIELD]]
        prompts = [row["prompt"] for row in rows]
        if self.reward_batch:
            return self._batch_rewards(prompts, response_texts, rows)
        outcomes: list[Any] = []
        for prompt, text, row in zip(prompts, response_texts, rows, strict=True):
            try:
                outcomes.append(self.reward_fn(prompt, text, **row["fields"]))
            except Exception as exc:  # the sample fails, not the batch
                outcomes.append(exc)
        pending = [i for i, value in enumerate(outcomes) if inspect.isawaitable(value)]
        if pending:
            done = asyncio.run(_gathered([outcomes[i] for i in pending]))
            for i, value in zip(pending, done, strict=True):
                outcomes[i] = value
        return [self._checked(value) for value in outcomes]

    def _batch_rewards(self, prompts: list[Any], texts: list[str], rows: list[dict[str, Any]]) -> list[Any]:
        columns = {name: [row["fields"].get(name) for row in rows] for name in (rows[0]["fields"] if rows else {})}
        scores = _resolve(self.reward_fn(prompts, texts, **columns))
        if not isinstance(scores, list | tuple) or len(scores) != len(texts):
            raise FileTaskError(
                f"reward.fn {self.reward_spec!r} with reward.batch=true must return a list of {len(texts)} numbers "
                f"(one per response), got {scores!r}"
            )
        return [self._checked(value) for value in scores]

    def _checked(self, value: Any) -> float | Exception:
        if isinstance(value, Exception):
            return value
        try:
            return check_reward(value, self.reward_spec)
        except FileTaskError as exc:
            return exc

    def accuracy(self, prompts: list[dict[str, Any]], responses: list[list[list[int]]]) -> float:
        """The fraction of responses whose reward is >= 1, scored a prompt's group at a time (:meth:`rewards`)."""
        if len(prompts) != len(responses):
            raise ValueError(f"accuracy: {len(prompts)} prompts but responses for {len(responses)}")
        scores = []
        for prompt, group in zip(prompts, responses, strict=True):
            texts = [self.decode(ids) for ids in group]
            for value in self.rewards(texts, **{ROW_FIELD: [prompt[ROW_FIELD]] * len(texts)}):
                scores.append(not isinstance(value, Exception) and math.isfinite(value) and value >= 1.0)
        if not scores:
            raise ValueError("accuracy: no responses to score")
        return sum(scores) / len(scores)

    def build_policy(self) -> Any:
        """The model of ``model.path``, float32 on CPU, in train mode."""
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).train()


async def _gathered(awaitables: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*awaitables, return_exceptions=True))
