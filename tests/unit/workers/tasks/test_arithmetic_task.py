"""The arithmetic task for real chat models: the first-integer reward, problems and chat prompts (no model needed).

A small fake chat tokenizer stands in for SmolLM2's; the last test (slow tier) prepares the real model and checks its
tokenizer.
"""

import pytest

from tests.conftest import requirement
from workers.hf_models import ModelNotPrepared
from workers.tasks.arithmetic import (
    ArithmeticTask,
    arithmetic_reward,
    chat_prompt_ids,
    first_integer,
    make_problems,
)


class FakeChatTokenizer:
    """Bytes as ids 0..255, plus <|im_start|>=256 and <|im_end|>=257 (eos and pad, as in SmolLM2)."""

    IM_START, IM_END = 256, 257

    def __init__(self) -> None:
        self.eos_token_id = self.pad_token_id = self.IM_END
        self.calls: list[tuple[list[dict], dict]] = []

    def apply_chat_template(self, conversation, **kwargs):
        self.calls.append((conversation, kwargs))
        ids = []
        for message in conversation:
            ids += [self.IM_START, *f"{message['role']}\n{message['content']}".encode(), self.IM_END]
        if kwargs.get("add_generation_prompt"):
            ids += [self.IM_START, *b"assistant\n"]
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}  # like transformers 5's BatchEncoding

    def decode(self, ids, skip_special_tokens=False):
        text = []
        for i in ids:
            if i < 256:
                text.append(chr(i))
            elif not skip_special_tokens:
                text.append({self.IM_START: "<|im_start|>", self.IM_END: "<|im_end|>"}[i])
        return "".join(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12", 12),
        ("12.", 12),
        (" 12<|im_end|>", 12),
        ("The answer is 12.", 12),
        ("7 + 5 = 12", 7),  # restating the question puts the wrong number first
        ("-3", -3),
        ("3-4", 3),  # a minus glued to a digit is an operator, not a sign
        ("12.5", 12),
        ("1,234", 1),
        ("007", 7),
        ("twelve", None),
        ("", None),
    ],
)
def test_first_integer(text, expected):
    assert first_integer(text) == expected


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("12", "12", 1.0),
        ("12<|im_end|>", "12", 1.0),
        ("The sum is 12", "12", 1.0),
        ("7 + 5 = 12", "12", 0.0),
        ("13", "12", 0.0),
        ("", "12", 0.0),
        ("-2", "-2", 1.0),
        ("120", "12", 0.0),
    ],
)
def test_arithmetic_reward(response, answer, reward):
    assert arithmetic_reward(response, answer) == reward


def test_problems_are_a_pure_function_of_the_seed_and_correct():
    problems = make_problems(200, seed=3, operators="+-*", min_operand=2, max_operand=12)
    assert problems == make_problems(200, seed=3, operators="+-*", min_operand=2, max_operand=12)
    assert problems != make_problems(200, seed=4, operators="+-*", min_operand=2, max_operand=12)
    seen_ops = set()
    for p in problems:
        a, op, b = p["question"].removeprefix("What is ").split("?")[0].split()
        assert 2 <= int(a) <= 12 and 2 <= int(b) <= 12
        assert int(p["answer"]) == eval(f"{a} {op} {b}")
        assert p["question"].endswith("? Answer with just the number.")
        seen_ops.add(op)
    assert seen_ops == {"+", "-", "*"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"operators": "/"}, "operators='/' must be a non-empty string of"),
        ({"operators": ""}, "operators='' must be a non-empty string of"),
        (
            {"min_operand": 5, "max_operand": 4},
            "need 0 <= min_operand <= max_operand, got min_operand=5, max_operand=4",
        ),
    ],
)
def test_bad_task_arguments_are_rejected_when_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(tokenizer=FakeChatTokenizer(), **kwargs)


def test_prompts_use_the_chat_template_and_carry_the_answer():
    tokenizer = FakeChatTokenizer()
    task = ArithmeticTask(tokenizer=tokenizer, max_operand=9)
    prompts = task.prompts("train", 5, seed=0)
    assert len(prompts) == 5
    for p in prompts:
        text = tokenizer.decode(p["prompt_ids"])
        assert text == f"<|im_start|>user\n{p['question']}<|im_end|><|im_start|>assistant\n"
        assert p["prompt_ids"] == chat_prompt_ids(tokenizer, p["question"])
        assert all(isinstance(i, int) for i in p["prompt_ids"])
        assert set(task.reward_fields) <= set(p)
    conversation, kwargs = tokenizer.calls[0]
    assert conversation == [{"role": "user", "content": prompts[0]["question"]}]
    assert kwargs["add_generation_prompt"] is True


def test_train_and_eval_splits_differ_and_repeat():
    task = ArithmeticTask(tokenizer=FakeChatTokenizer(), max_operand=99)
    train, again, eval_ = task.prompts("train", 20, 0), task.prompts("train", 20, 0), task.prompts("eval", 20, 0)
    assert train == again
    assert [p["question"] for p in train] != [p["question"] for p in eval_]
    with pytest.raises(ValueError, match="split must be 'train' or 'eval', got 'test'"):
        task.prompts("test", 1, 0)


def test_decode_drops_special_tokens_before_scoring():
    tokenizer = FakeChatTokenizer()
    task = ArithmeticTask(tokenizer=tokenizer)
    response = [*b"12", tokenizer.IM_END]
    assert task.decode(response) == "12"
    assert task.reward(task.decode(response), answer="12") == 1.0


def test_a_missing_model_says_how_to_prepare_it(tmp_path):
    task = ArithmeticTask(cache_dir=str(tmp_path))
    with pytest.raises(ModelNotPrepared, match=r"run `python recipe/smollm2/prepare.py --cache-dir .*` first"):
        task.build_policy()
    with pytest.raises(ModelNotPrepared, match="no prepared model at"):
        task.tokenizer  # noqa: B018


@pytest.mark.slow
def test_real_smollm2_tokenizer_prompt():
    for module in ("gguf", "accelerate"):
        pytest.importorskip(module, reason=requirement(f"{module} (the smollm2 extra)", "pip install -e .[test]"))
    from workers.hf_models import prepare_smollm2

    prepare_smollm2()  # once per cache (about a minute; instant when tests/e2e/test_smollm2.py ran first)
    task = ArithmeticTask()
    [prompt] = task.prompts("eval", 1, seed=0)
    text = task.tokenizer.decode(prompt["prompt_ids"])
    assert text.endswith(f"<|im_start|>user\n{prompt['question']}<|im_end|>\n<|im_start|>assistant\n")
    assert task.tokenizer.eos_token_id == 2  # <|im_end|>: the engine stops there
    assert task.decode([*task.tokenizer.encode("42", add_special_tokens=False), 2]) == "42"
