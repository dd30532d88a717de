"""Two-digit addition, the toy task on which GRPO visibly learns on two CPU cores.

A problem is ``"07+35="`` and its answer is the zero-padded three-digit sum ``"042"``. The vocabulary is built in
code (15 symbols), so nothing is downloaded. The recipe that works: a supervised warm-up (``sft_batch``) until the
accuracy of responses *sampled* at temperature 1 first reaches about 0.2 (greedy accuracy 0.2 is too early for this
Llama: sampled accuracy is then about 0.08 and GRPO needs 3x more steps), then GRPO with ``addition_reward``; see
``recipe/experiments/addition_single_process.py``.
"""

from __future__ import annotations

import random
from typing import Any, Protocol

import torch
from transformers import LlamaForCausalLM

from rl_contracts.task import Task
from workers.models import build_tiny_causal_lm

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
ANSWER_DIGITS = 3


class AdditionTokenizer:
    """Character-level tokenizer over ``0-9 + =`` and three special tokens.

    Ids: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, then ``0``..``9``, ``+``, ``=``.

    >>> tok = AdditionTokenizer()
    >>> tok.decode(tok.encode("07+35=") + [tok.eos_token_id, 5])
    '07+35='
    """

    def __init__(self) -> None:
        self.symbols: list[str] = [PAD, BOS, EOS, *"0123456789", "+", "="]
        self._id_of = {symbol: i for i, symbol in enumerate(self.symbols)}
        self.vocab_size = len(self.symbols)
        self.pad_token_id = self._id_of[PAD]
        self.bos_token_id = self._id_of[BOS]
        self.eos_token_id = self._id_of[EOS]

    def encode(self, text: str) -> list[int]:
        """Map each character to its id; no special tokens are added.

        Raises:
            ValueError: on a character outside ``0-9 + =``.
        """
        try:
            return [self._id_of[char] for char in text]
        except KeyError as error:
            raise ValueError(
                f"character {error.args[0]!r} in {text!r} is not in the vocabulary '0123456789+='"
            ) from None

    def decode(self, ids: list[int]) -> str:
        """Map ids back to text, stopping at the first ``<eos>`` and skipping ``<pad>`` and ``<bos>``.

        Raises:
            ValueError: on an id outside ``[0, vocab_size)``.
        """
        chars = []
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} is outside [0, {self.vocab_size})")
            if token_id == self.eos_token_id:
                break
            if token_id not in (self.pad_token_id, self.bos_token_id):
                chars.append(self.symbols[token_id])
        return "".join(chars)


def make_prompts(num: int, seed: int) -> list[dict]:
    """Draw ``num`` addition problems with operands in ``[0, 99]``, a pure function of ``seed``.

    Returns:
        Dicts with ``prompt`` (``"07+35="``), ``prompt_ids`` (``<bos>`` then the prompt's ids) and ``answer``
        (``"042"``).

    >>> make_prompts(1, seed=0)[0]["prompt"]
    '49+97='
    """
    if num < 0:
        raise ValueError(f"num={num} must be >= 0")
    tokenizer = AdditionTokenizer()
    rng = random.Random(seed)
    problems = []
    for _ in range(num):
        a, b = rng.randrange(100), rng.randrange(100)
        prompt = f"{a:02d}+{b:02d}="
        problems.append(
            {
                "prompt": prompt,
                "prompt_ids": [tokenizer.bos_token_id, *tokenizer.encode(prompt)],
                "answer": f"{a + b:0{ANSWER_DIGITS}d}",
            }
        )
    return problems


def addition_reward(response_text: str, answer: str) -> float:
    """1.0 if the response is exactly the answer, else 0.0.

    ``response_text`` is the decoded response, so it already ends at the first ``<eos>`` (see
    ``AdditionTokenizer.decode``): ``"042"`` followed by ``<eos>`` scores 1, while ``"0421"`` or ``"42"`` score 0.
    Surrounding whitespace is ignored. A response cut at ``max_new_tokens`` right after the third digit also scores
    1; generate with ``max_new_tokens >= 4`` if the model must learn to stop.

    >>> addition_reward("042", "042"), addition_reward("0420", "042")
    (1.0, 0.0)
    """
    return 1.0 if response_text.strip() == answer else 0.0


class AnswerTokenizer(Protocol):
    """What ``sft_batch`` needs of a tokenizer: an answer's ids (``encode``), and the pad and eos ids
    (``AdditionTokenizer``, or a run's adapter over another model's tokenizer)."""

    pad_token_id: int
    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...


def sft_batch(problems: list[dict], tokenizer: AnswerTokenizer) -> dict[str, torch.Tensor]:
    """Teacher-forcing batch for the supervised warm-up: prompt, answer, ``<eos>``; loss on answer and ``<eos>``.

    Returns:
        ``input_ids`` and ``attention_mask`` ``[B, T]`` int64, right-padded, and ``labels`` ``[B, T]`` int64 holding
        the input ids on answer and ``<eos>`` positions and -100 elsewhere (Hugging Face shifts labels inside the
        model, so they are aligned with ``input_ids``).
    """
    rows = []
    for problem in problems:
        target = [*tokenizer.encode(problem["answer"]), tokenizer.eos_token_id]
        rows.append((problem["prompt_ids"], target))
    length = max(len(prompt) + len(target) for prompt, target in rows)
    input_ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for row, (prompt, target) in enumerate(rows):
        ids = torch.tensor(prompt + target, dtype=torch.long)
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
        labels[row, len(prompt) : len(ids)] = ids[len(prompt) :]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def build_model(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_positions: int = 32,
    seed: int = 0,
) -> LlamaForCausalLM:
    """The addition task's policy: a ~100k-parameter Llama with tied embeddings and 32 positions by default."""
    tokenizer = AdditionTokenizer()
    return build_tiny_causal_lm(
        vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        seed=seed,
    )


class AdditionTask(Task):
    """Two-digit addition as a :class:`~rl_contracts.task.Task`: prompts, reward, tokenizer and the tiny Llama.

    Args:
        hidden_size, num_layers, num_heads: the policy's shape (about 100k parameters by default).
        max_positions: the longest prompt + response the policy takes (32 fits every answer; more lets an untrained
            policy ramble, e.g. for long-tailed generations in async runs with ``rollout.max_new_tokens``).
        model_seed: the initial weights' seed.
    """

    reward_fields = ("answer",)

    def __init__(
        self,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        model_seed: int = 0,
        max_positions: int = 32,
    ):
        if max_positions < 32:
            raise ValueError(f"max_positions must be at least 32 (the longest prompt + answer), got {max_positions}")
        self._tokenizer = AdditionTokenizer()
        self.model_kwargs = {
            "hidden_size": hidden_size,
            "num_layers": num_layers,
            "num_heads": num_heads,
            "max_positions": max_positions,
        }
        self.model_seed = model_seed

    @property
    def tokenizer(self) -> AdditionTokenizer:
        return self._tokenizer

    def prompts(self, split: str, num: int, seed: int) -> list[dict]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        # eval problems come from another stream of the generator, so the two splits differ for the same seed
        return make_prompts(num, seed if split == "train" else seed + 7_919)

    def reward(self, response_text: str, **fields: str) -> float:
        return addition_reward(response_text, fields["answer"])

    def build_policy(self) -> LlamaForCausalLM:
        return build_model(self._tokenizer.vocab_size, seed=self.model_seed, **self.model_kwargs)

    def sft_target(self, prompt: dict) -> list[int]:
        return [*self._tokenizer.encode(prompt["answer"]), self._tokenizer.eos_token_id]


class AdditionChat:
    """The endpoint's ChatFormat for this single-turn task: the prompt is ``<bos>`` + the question."""

    def __init__(self, tokenizer: AdditionTokenizer):
        self.tokenizer = tokenizer

    def prompt_ids(self, messages):
        return [self.tokenizer.bos_token_id, *self.tokenizer.encode(messages[-1]["content"])]

    def append_ids(self, messages):
        raise ValueError("the addition task is single-turn")

    def decode(self, ids):
        return self.tokenizer.decode(list(ids))

    def response_ids(self, text: str) -> list[int]:
        """An answer's tokens as sampled, rebuilt from a record's text: the answer, then ``<eos>``."""
        return [*self.tokenizer.encode(text), self.tokenizer.eos_token_id]


class PretrainedChat:
    """The endpoint's ChatFormat over a model directory's tokenizer: the question rendered with its chat template
    (as the assistant's turn to answer) if it has one, else as plain text; answers decoded without special tokens
    (the eos the engine stops at)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))

    def prompt_ids(self, messages):
        if self.templated:
            text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return list(self.tokenizer.encode(messages[-1]["content"]))

    def append_ids(self, messages):
        raise ValueError("the addition task is single-turn")

    def decode(self, ids):
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def response_ids(self, text: str) -> list[int]:
        """An answer's tokens rebuilt from a record's text: the text's tokens, then the eos token."""
        return [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
