"""Small arithmetic word questions for a real chat model (SmolLM2-135M-Instruct), scored on the first number.

A problem is ``"What is 7 + 5? Answer with just the number."``, sent as the user turn of the model's chat template
(the prompt ends with the assistant header), and its answer is ``"12"``. The reward reads the **first integer** of
the decoded response (:func:`first_integer`): ``"12"``, ``"12."`` and ``"The answer is 12"`` score 1, while
``"7 + 5 = 12"`` scores 0, since its first integer is 7. So the reward is format-sensitive: restating the question
costs the point, and GRPO quickly teaches the model to answer with the number first.

The model comes from the prepared directory of :func:`workers.hf_models.prepare_smollm2` (run
``recipe/smollm2/prepare.py`` once); every process of a run loads the tokenizer and weights from there.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, Protocol, cast

from rl_contracts.task import Task
from workers.hf_models import require_prepared, smollm2_path

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
QUESTION = "What is {a} {op} {b}? Answer with just the number."
# An optional sign, then digits; a sign only counts when it is not glued to a preceding digit ("3-4" is 3, then 4).
_INTEGER = re.compile(r"(?<![0-9])-?[0-9]+")


class ChatTokenizer(Protocol):
    pad_token_id: int
    eos_token_id: int

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...

    def decode(self, ids: list[int], **kwargs: Any) -> str: ...


def first_integer(text: str) -> int | None:
    """The first integer written in ``text`` (digits with an optional leading minus), or ``None`` if there is none.

    Thousands separators are not understood (``"1,234"`` reads as 1); a decimal reads as its integer part
    (``"12.5"`` is 12), so a response must put the exact integer first to be correct.

    >>> first_integer("The answer is 12."), first_integer("7 + 5 = 12"), first_integer("-3"), first_integer("none")
    (12, 7, -3, None)
    """
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


def arithmetic_reward(response_text: str, answer: str) -> float:
    """1.0 if the first integer of the response (:func:`first_integer`) equals ``answer``, else 0.0.

    >>> arithmetic_reward("12<|im_end|>", "12"), arithmetic_reward("7 + 5 = 12", "12")
    (1.0, 0.0)
    """
    value = first_integer(response_text)
    return 1.0 if value is not None and value == int(answer) else 0.0


def make_problems(
    num: int, seed: int, operators: str = "+", min_operand: int = 0, max_operand: int = 9
) -> list[dict[str, str]]:
    """``num`` problems ``{"question", "answer"}`` with operands in ``[min_operand, max_operand]``, a pure
    function of the arguments; each draws its operator uniformly from ``operators``.

    >>> make_problems(1, seed=0)[0]
    {'question': 'What is 6 + 0? Answer with just the number.', 'answer': '6'}
    """
    if num < 0:
        raise ValueError(f"num={num} must be >= 0")
    unknown = sorted(set(operators) - set(OPERATORS))
    if not operators or unknown:
        raise ValueError(f"operators={operators!r} must be a non-empty string of {''.join(OPERATORS)}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(
            f"need 0 <= min_operand <= max_operand, got min_operand={min_operand}, max_operand={max_operand}"
        )
    rng = random.Random(seed)
    problems = []
    for _ in range(num):
        op = rng.choice(operators)
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        problems.append({"question": QUESTION.format(a=a, op=op, b=b), "answer": str(OPERATORS[op](a, b))})
    return problems


def chat_prompt_ids(tokenizer: ChatTokenizer, question: str) -> list[int]:
    """Token ids of ``question`` as the user turn of the tokenizer's chat template, ending at the assistant header."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    ids = out["input_ids"] if not isinstance(out, list) else out  # transformers 5 returns a BatchEncoding
    return [int(i) for i in ids]


class ArithmeticTask(Task):
    """Arithmetic questions for SmolLM2-135M-Instruct as a :class:`~rl_contracts.task.Task`.

    Args:
        operators: the operators to draw from, e.g. ``"+"`` or ``"+*"``.
        min_operand, max_operand: operands are drawn uniformly from ``[min_operand, max_operand]``.
        model_path: a prepared Hugging Face directory; default: :func:`workers.hf_models.smollm2_path` of
            ``cache_dir``.
        cache_dir: the model cache root (default ``$TQ_MODEL_CACHE`` or ``~/.cache/transfer_queue``).
        tokenizer: a ready tokenizer (tests pass a small fake one); default: loaded from ``model_path`` on first use.

    The reward field is ``answer``, the integer as a string; prompts also carry ``question`` (the plain text).
    """

    reward_fields = ("answer",)

    def __init__(
        self,
        operators: str = "+",
        min_operand: int = 0,
        max_operand: int = 9,
        model_path: str | None = None,
        cache_dir: str | None = None,
        tokenizer: ChatTokenizer | None = None,
    ):
        make_problems(0, 0, operators, min_operand, max_operand)  # validate the arguments now
        self.operators, self.min_operand, self.max_operand = operators, min_operand, max_operand
        self.model_path = Path(model_path).expanduser() if model_path else smollm2_path(cache_dir)
        self._tokenizer = tokenizer

    @property
    def tokenizer(self) -> ChatTokenizer:
        if self._tokenizer is None:
            path = require_prepared(self.model_path)
            from transformers import AutoTokenizer

            # a Hugging Face tokenizer is a ChatTokenizer; its stubs' union of backends does not say so
            self._tokenizer = cast(ChatTokenizer, AutoTokenizer.from_pretrained(path))
        return self._tokenizer

    def prompts(self, split: str, num: int, seed: int) -> list[dict[str, Any]]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        # eval problems come from another stream of the generator, so the two splits differ for the same seed
        problems = make_problems(
            num, seed if split == "train" else seed + 7_919, self.operators, self.min_operand, self.max_operand
        )
        return [{**p, "prompt_ids": chat_prompt_ids(self.tokenizer, p["question"])} for p in problems]

    def reward(self, response_text: str, **fields: str) -> float:
        return arithmetic_reward(response_text, fields["answer"])

    def decode(self, ids: list[int]) -> str:
        # Drop <|im_end|> and other special tokens: the reward reads the answer text only.
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def build_policy(self) -> Any:
        """SmolLM2-135M-Instruct from the prepared directory, float32 on CPU, in train mode."""
        path = require_prepared(self.model_path)  # before the heavy imports: a missing model fails fast
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model.train()
