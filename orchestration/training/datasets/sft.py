"""``load_sft_dataset``: local SFT data into ``Sample``s (tokens = prompt then response, ``loss_mask`` 0 then 1).

Where the data comes from (never the Hugging Face hub: a name that is not a local path is refused):
    - a JSONL file, one JSON object per line;
    - a directory holding ``<split>.jsonl`` (or ``<subset>/<split>.jsonl`` when ``subset`` is given);
    - a directory written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` whose ``split``
      is taken; ``<dir>/<subset>`` is read when ``subset`` names a subdirectory). This needs the ``datasets``
      package (in the ``rl`` extra; a library install may lack it): without it such a directory is refused with a
      message saying so.

What a row may hold (the first that fits wins):
    - ``messages``: a chat, a list of ``{"role", "content"}`` ending with the ``assistant`` turn trained on; every
      message before it is the prompt. With a tokenizer that has a chat template (``tokenizer.chat_template`` set),
      the template renders it (the prompt with ``add_generation_prompt=True``); otherwise the text is
      ``"role: content"`` lines and ``"assistant: "`` before the response.
    - ``prompt`` and ``response`` (or ``completion``);
    - ``question`` and ``answer`` (gsm8k's layout).

Tokens are ``tokenizer.encode(prompt)`` then ``tokenizer.encode(response, add_special_tokens=False)`` and the
tokenizer's ``eos_token_id`` (when it has one; chat templates end the turn themselves), cut to ``max_length``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from orchestration.training.types import LibraryError, Sample

_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def load_sft_dataset(
    path_or_name: str | Path,
    tokenizer: Any,
    split: str = "train",
    subset: str | None = None,
    max_samples: int | None = None,
    max_length: int | None = None,
) -> list[Sample]:
    """The SFT samples of a local dataset (module docstring: which files and rows).

    Args:
        path_or_name: a local JSONL file or dataset directory (hub names are refused).
        tokenizer: anything with ``encode(text) -> list[int]`` (a Hugging Face tokenizer, ``AdditionTokenizer``).
        split: which split of a directory (``<split>.jsonl`` or a ``DatasetDict``'s key); unused for a file.
        subset: a subdirectory of a directory (gsm8k's ``"main"``); unused for a file.
        max_samples: keep only the first rows, ``>= 1`` or None for all.
        max_length: cut every sample to this many tokens, ``>= 1`` or None.

    Raises:
        LibraryError: not a local path, an unreadable row, or bad arguments.
    """
    for name, value in (("max_samples", max_samples), ("max_length", max_length)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise LibraryError(f"load_sft_dataset {name} must be an int >= 1 or None, got {value!r}")
    if not callable(getattr(tokenizer, "encode", None)):
        raise LibraryError(f"load_sft_dataset needs a tokenizer with encode(text), got {type(tokenizer).__name__}")
    samples = []
    for index, (where, row) in enumerate(_rows(Path(path_or_name), str(path_or_name), split, subset)):
        if max_samples is not None and index >= max_samples:
            break
        sample = sample_from_row(row, tokenizer, max_length=max_length, where=where)
        sample.metadata.update({"source": str(path_or_name), "row": index})
        samples.append(sample)
    return samples


def sample_from_row(
    row: Mapping[str, Any], tokenizer: Any, max_length: int | None = None, where: str = "row"
) -> Sample:
    """The ``Sample`` of one row (``messages``, ``prompt``/``response``, or ``question``/``answer``)."""
    if not isinstance(row, Mapping):
        raise LibraryError(f"{where}: an SFT row must be a JSON object, got {type(row).__name__}")
    prompt: Any
    if "messages" in row:
        prompt, response, tokens, mask = _chat(row["messages"], tokenizer, where)
    else:
        pair = next(
            (
                (row[p], row[r])
                for p, r in (("prompt", "response"), ("prompt", "completion"), ("question", "answer"))
                if p in row and r in row
            ),
            None,
        )
        if pair is None:
            raise LibraryError(
                f"{where}: an SFT row needs 'messages', 'prompt' and 'response' (or 'completion'), or 'question' "
                f"and 'answer'; got keys {sorted(row)}"
            )
        prompt, response = str(pair[0]), str(pair[1])
        tokens, mask = _plain(prompt, response, tokenizer)
    if max_length is not None:
        tokens, mask = tokens[:max_length], mask[:max_length]
    return Sample(prompt=prompt, response=response, tokens=tokens, loss_mask=mask)


def _rows(path: Path, name: str, split: str, subset: str | None) -> Iterator[tuple[str, Any]]:
    if not path.exists():
        raise LibraryError(
            f"load_sft_dataset reads local data only, and {name!r} is no file or directory: download the dataset "
            "yourself and pass its local path (a JSONL file of prompt/response, question/answer or messages rows, "
            "or a directory written by datasets' save_to_disk)"
        )
    if path.is_file():
        yield from _jsonl(path)
        return
    base = path / subset if subset is not None and (path / subset).is_dir() else path
    for candidate in (base / f"{split}.jsonl", base / split / f"{split}.jsonl"):
        if candidate.is_file():
            yield from _jsonl(candidate)
            return
    if any((base / marker).exists() for marker in _HF_MARKERS):
        yield from _saved_dataset(base, split)
        return
    raise LibraryError(
        f"load_sft_dataset found no {split}.jsonl and no save_to_disk dataset in {str(base)!r} "
        f"(split={split!r}, subset={subset!r})"
    )


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise LibraryError(f"{path}:{number}: not a JSON object ({error.msg})") from None
            yield f"{path}:{number}", row


def _saved_dataset(path: Path, split: str) -> Iterator[tuple[str, Any]]:
    try:
        import datasets  # the rl extra's; a library install may lack it
    except ImportError:
        raise LibraryError(
            f"{str(path)!r} is a datasets save_to_disk directory, and reading it needs the 'datasets' package, which "
            "is not installed: pip install datasets, or export the split to JSONL (dataset.to_json(path))"
        ) from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, Mapping) or hasattr(loaded, "keys"):
        if split not in loaded:
            raise LibraryError(f"{str(path)!r} has splits {sorted(loaded.keys())}, not split={split!r}")
        loaded = loaded[split]
    for number, row in enumerate(loaded):
        yield f"{path}[{number}]", row


def _ids(value: Any) -> list[int]:
    """Token ids out of what ``encode`` / ``apply_chat_template`` returned (a list, a tensor, a BatchEncoding)."""
    if isinstance(value, Mapping) or hasattr(value, "input_ids"):
        value = value["input_ids"]
    if hasattr(value, "tolist"):
        value = value.tolist()
    if value and isinstance(value[0], list):  # a batch of one
        value = value[0]
    return [int(i) for i in value]


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    try:
        return _ids(tokenizer.encode(text, add_special_tokens=special))
    except TypeError:  # a tokenizer without the keyword (ours add no special tokens anyway)
        return _ids(tokenizer.encode(text))


def _plain(prompt: str, response: str, tokenizer: Any) -> tuple[list[int], list[float]]:
    prompt_ids = _encode(tokenizer, prompt, special=True)
    response_ids = _encode(tokenizer, response, special=False)
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        response_ids.append(eos)
    return prompt_ids + response_ids, [0.0] * len(prompt_ids) + [1.0] * len(response_ids)


def _chat(messages: Any, tokenizer: Any, where: str) -> tuple[list[dict[str, Any]], str, list[int], list[float]]:
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, Mapping) and "role" in m and "content" in m for m in messages)
    ):
        raise LibraryError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    if messages[-1]["role"] != "assistant":
        raise LibraryError(
            f"{where}: 'messages' must end with the assistant turn to train on, the last role is "
            f"{messages[-1]['role']!r}"
        )
    chat = [dict(m) for m in messages]
    prompt, response = chat[:-1], str(chat[-1]["content"])
    if getattr(tokenizer, "chat_template", None) and callable(getattr(tokenizer, "apply_chat_template", None)):
        prompt_ids = _ids(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
        tokens = _ids(tokenizer.apply_chat_template(chat, tokenize=True))
        shared = 0  # the rendered prompt should be a prefix of the rendered chat; train on whatever follows it
        while shared < min(len(prompt_ids), len(tokens)) and prompt_ids[shared] == tokens[shared]:
            shared += 1
        return prompt, response, tokens, [0.0] * shared + [1.0] * (len(tokens) - shared)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant: "
    tokens, mask = _plain(text, response, tokenizer)
    return prompt, response, tokens, mask
