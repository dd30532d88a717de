"""The policy side of the ``guess-number`` environment (workers/agents/envs/guess_number.py) for the agent demo.

A word-level vocabulary (every word the environment says, the numbers 1..16, the chat roles) keeps the model tiny
and makes each guess one token; the environment, not this task, scores episodes. Prompts are sample ids.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from rl_contracts.task import Task
from workers.agents.envs.guess_number import GuessNumberEnvironment
from workers.agents.trajectory import PlainChatFormat
from workers.models import build_tiny_causal_lm

WORDS = ["guess", "a", "number", "from", "to", "higher", "lower", "correct", "invalid", "user:", "assistant:"]
NUMBERS = [str(i) for i in range(1, 17)]
SAMPLE_IDS = GuessNumberEnvironment.sample_ids()


class WordTokenizer:
    """Whitespace words <-> ids; ``<pad>`` is 0 and ``<eos>`` 1.

    >>> tok = WordTokenizer()
    >>> tok.decode(tok.encode("guess a number from 1 to 16"))
    'guess a number from 1 to 16'
    """

    def __init__(self) -> None:
        self.symbols = ["<pad>", "<eos>", *WORDS, *NUMBERS, "game"]  # "game" last: the older ids stay as they were
        self._id_of = {s: i for i, s in enumerate(self.symbols)}
        self.vocab_size = len(self.symbols)
        self.pad_token_id, self.eos_token_id = 0, 1

    def encode(self, text: str) -> list[int]:
        try:
            return [self._id_of[w] for w in text.split()]
        except KeyError as error:
            raise ValueError(f"word {error.args[0]!r} of {text!r} is not in the vocabulary {self.symbols}") from None

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.symbols[i] for i in ids if i > 1)


class GuessNumberTask(Task):
    """Prompts are ``{"sample_id", "prompt_ids"}`` rows over the environment's 16 games; the policy is a tiny Llama."""

    reward_fields = ()

    def __init__(self, hidden_size: int = 64, num_layers: int = 2, max_length: int = 64):
        self._tokenizer = WordTokenizer()
        self.hidden_size, self.num_layers, self.max_length = hidden_size, num_layers, max_length

    @property
    def tokenizer(self) -> WordTokenizer:
        return self._tokenizer

    def chat_format(self) -> PlainChatFormat:
        return PlainChatFormat(
            self._tokenizer.encode, self._tokenizer.decode, cue="assistant: ", template="{role}: {content} "
        )

    def prompts(self, split: str, num: int, seed: int) -> list[dict[str, Any]]:
        rng = random.Random(f"{split}-{seed}")
        chat = self.chat_format()
        rows = []
        for _ in range(num):
            sample_id = rng.choice(SAMPLE_IDS)
            first = GuessNumberEnvironment.first_observation(sample_id)
            rows.append({"sample_id": sample_id, "prompt_ids": chat.prompt_ids([{"role": "user", "content": first}])})
        return rows

    def reward(self, response_text: str, **fields: str) -> float:
        raise NotImplementedError("guess-number episodes are scored by the task server")

    def build_policy(self) -> Any:
        v = self._tokenizer.vocab_size
        return build_tiny_causal_lm(
            v, hidden_size=self.hidden_size, num_layers=self.num_layers, max_position_embeddings=self.max_length,
            pad_token_id=0, eos_token_id=1,
        )  # fmt: skip
