"""DataBuffer (epochs, seeded shuffles, state round trip) and load_sft_dataset (local JSONL only, masks, truncation)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestration.training import DataBuffer, LibraryError, load_sft_dataset
from workers.tasks.addition import AdditionTokenizer

PROMPTS = [f"p{i}" for i in range(7)]


def test_each_epoch_is_a_fresh_seeded_shuffle_of_every_prompt() -> None:
    buffer = DataBuffer(prompts=PROMPTS, seed=42)

    epochs = [buffer.get_prompts(7) for _ in range(3)]

    assert all(sorted(epoch) == PROMPTS for epoch in epochs)
    assert epochs[0] != PROMPTS  # epoch 0 is shuffled too
    assert len({tuple(epoch) for epoch in epochs}) == 3
    assert buffer.epoch == 3 and buffer.position == 0
    assert DataBuffer(PROMPTS, seed=42).get_prompts(7) == epochs[0]
    assert DataBuffer(PROMPTS, seed=43).get_prompts(7) != epochs[0]


def test_a_request_crossing_the_epoch_end_takes_the_rest_then_the_next_epochs_start() -> None:
    reference = DataBuffer(PROMPTS, seed=1)
    epoch0, epoch1 = reference.get_prompts(7), reference.get_prompts(7)
    buffer = DataBuffer(PROMPTS, seed=1)

    assert buffer.get_prompts(5) == epoch0[:5]
    assert buffer.get_prompts(4) == epoch0[5:] + epoch1[:2]
    assert (buffer.epoch, buffer.position, buffer.total_served) == (1, 2, 9)
    assert DataBuffer(PROMPTS, seed=1).get_prompts(16) == epoch0 + epoch1 + reference.get_prompts(2)


def test_a_restored_buffer_continues_exactly_where_the_saved_one_was() -> None:
    buffer = DataBuffer(PROMPTS, seed=5)
    buffer.get_prompts(10)
    state = json.loads(json.dumps(buffer.save_state()))

    restored = DataBuffer(list(PROMPTS), seed=0)
    restored.load_state(state)

    assert (restored.epoch, restored.position, restored.seed) == (1, 3, 5)
    assert restored.get_prompts(12) == buffer.get_prompts(12)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DataBuffer(prompts=[]), "at least one prompt, got an empty list"),
        (lambda: DataBuffer(prompts="abc"), "a list of prompts, got str"),
        (lambda: DataBuffer(PROMPTS).get_prompts(0), r"n >= 1, got 0"),
        (lambda: DataBuffer(["a", "b"]).load_state(DataBuffer(["a", "c"]).save_state()), "saved from other prompts"),
        (lambda: DataBuffer(["a", "b"]).load_state({"seed": 1}), r"missing \['epoch', 'position'"),
    ],
)
def test_bad_input_is_refused_with_what_was_expected(make: Any, message: str) -> None:
    with pytest.raises(LibraryError, match=message):
        make()


class ChatTokenizer:
    """Char-level ids (ord) with a BOS only when special tokens are asked for, an EOS, and a toy chat template."""

    bos_token_id, eos_token_id = 1, 2
    chat_template = "toy"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([self.bos_token_id] if add_special_tokens else []) + [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool = False) -> Any:
        text = "".join(f"<{m['role']}>{m['content']}<end>" for m in messages) + (
            "<assistant>" if add_generation_prompt else ""
        )
        return {"input_ids": [ord(c) for c in text]}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_jsonl_rows_become_samples_masked_on_the_response(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "sft.jsonl",
        [
            {"prompt": "1+2=", "response": "3"},
            {"question": "10+5=", "answer": "15"},
            {"prompt": "1+1=", "completion": "2"},
        ],
    )
    tok = AdditionTokenizer()

    samples = load_sft_dataset(path, tokenizer=tok, max_samples=2)

    assert len(samples) == 2
    first = samples[0]
    assert first.tokens == tok.encode("1+2=") + tok.encode("3") + [tok.eos_token_id]
    assert first.loss_mask == [0.0] * 4 + [1.0, 1.0]
    assert (first.prompt, first.response, first.metadata["row"]) == ("1+2=", "3", 0)
    assert samples[1].tokens[:5] == tok.encode("10+5=") and samples[1].response_length == 3


def test_max_length_truncates_tokens_and_mask(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "sft.jsonl", [{"question": "10+5=", "answer": "15"}])

    (sample,) = load_sft_dataset(path, tokenizer=AdditionTokenizer(), max_length=6)

    assert len(sample.tokens) == len(sample.loss_mask) == 6 and sample.loss_mask == [0.0] * 5 + [1.0]


def test_chat_messages_use_the_tokenizers_template_and_train_on_the_last_assistant_turn(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])

    (sample,) = load_sft_dataset(path, tokenizer=ChatTokenizer())

    rendered = "<user>hi<end><assistant>yo<end>"
    assert sample.tokens == [ord(c) for c in rendered]
    trained = "".join(chr(t) for t, w in zip(sample.tokens, sample.loss_mask, strict=True) if w)
    assert trained == "yo<end>" and sample.response == "yo"


def test_chat_messages_without_a_template_are_role_lines(tmp_path: Path) -> None:
    tok = ChatTokenizer()
    tok.chat_template = None  # type: ignore[assignment]
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
    )

    (sample,) = load_sft_dataset(path, tokenizer=tok)

    assert sample.tokens == [*tok.encode("user: hi\nassistant: "), ord("y"), ord("o"), tok.eos_token_id]
    assert sum(sample.loss_mask) == 3


def test_a_directory_holds_split_files_under_the_subset(tmp_path: Path) -> None:
    (tmp_path / "gsm8k" / "main").mkdir(parents=True)
    write_jsonl(tmp_path / "gsm8k" / "main" / "test.jsonl", [{"question": "1+1=", "answer": "2"}])

    samples = load_sft_dataset(tmp_path / "gsm8k", tokenizer=AdditionTokenizer(), split="test", subset="main")

    assert [s.response for s in samples] == ["2"]


@pytest.mark.parametrize(
    ("rows", "kwargs", "message"),
    [
        ([{"text": "x"}], {}, r"needs 'messages', .* got keys \['text'\]"),
        ([{"messages": [{"role": "user", "content": "x"}]}], {}, "must end with the assistant turn"),
        ([{"prompt": "1", "response": "2"}], {"max_length": 0}, "max_length must be an int >= 1 or None, got 0"),
    ],
)
def test_bad_rows_and_arguments_are_refused(tmp_path: Path, rows: list[dict], kwargs: dict, message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(LibraryError, match=message):
        load_sft_dataset(path, tokenizer=AdditionTokenizer(), **kwargs)


def test_a_hub_name_is_refused_never_downloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LibraryError, match="reads local data only, and 'gsm8k' is no file or directory"):
        load_sft_dataset("gsm8k", tokenizer=AdditionTokenizer(), subset="main")


def test_a_save_to_disk_directory_needs_the_datasets_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # as without the package: its import raises ImportError
    (tmp_path / "state.json").write_text("{}")
    with pytest.raises(LibraryError, match="needs the 'datasets' package, which is not installed"):
        load_sft_dataset(tmp_path, tokenizer=AdditionTokenizer())
