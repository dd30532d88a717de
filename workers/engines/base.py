"""The engine contract shared by the Hugging Face, vLLM and SGLang engines: token ids in, token ids out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

FinishReason = Literal["stop", "length", "abort"]
AbortCheck = Callable[[], bool]  # polled by an engine while it decodes; True stops every row where it is


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch of responses.

    Args:
        max_new_tokens: the most tokens generated per response (the stop token included).
        temperature: softmax temperature; 0 means greedy decoding.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p``; 1 keeps all.
        top_k: keep the ``top_k`` most likely tokens; 0 keeps all.
        stop_token_ids: tokens that end a response, in addition to the engine's eos token.
        seed: when set, the same call with the same weights returns the same samples.

    Raises:
        ValueError: on an out-of-range value, naming the expected range and the value got.

    >>> SamplingParams(max_new_tokens=4, temperature=0.7, seed=1).temperature
    0.7
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if any(token_id < 0 for token_id in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {list(self.stop_token_ids)}")
        # Accept any iterable (a list from YAML) but store a tuple, so the params stay hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


@dataclass
class Generation:
    """One sampled response.

    Attributes:
        token_ids: the response's tokens; a stop token, when one ended the response, is the last of them.
        logprobs: per token, ``log_softmax(logits / temperature)`` at the sampled token (``temperature=1`` when
            greedy); top-k/top-p truncation is not applied to them. Same length as ``token_ids``.
        finish_reason: ``"stop"`` if a stop token ended the response, ``"length"`` if ``max_new_tokens`` did,
            ``"abort"`` if ``should_abort`` stopped it (an unfinished response, kept for a partial rollout).
        versions: per token, the policy version that sampled it (partial rollouts, where one response may span
            weight updates); None when one version, the call's, sampled every token.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    versions: list[int] | None = None


class Engine(ABC):
    """An inference engine that samples responses and takes new policy weights.

    Engines never see text: prompts and responses are token ids, so the tokenizer lives with the task.

    ``supports_abort``: the engine's ``generate`` takes ``should_abort`` (a callable polled between decoding steps;
    when it returns True every unfinished response comes back as it is, with ``finish_reason="abort"``). Partial
    rollouts (``workers.engines.partial``) use it so that a weight update does not wait for long generations;
    engines without it are driven in bounded chunks instead.
    """

    supports_abort: bool = False

    @abstractmethod
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Generation]]:
        """Sample ``n`` responses for each prompt.

        Args:
            prompts: prompt token ids, one list per prompt (unpadded).
            n: responses per prompt (a GRPO group).
            params: sampling parameters shared by the whole call.

        Returns:
            One list per prompt, in order, each holding its ``n`` generations.
        """

    @abstractmethod
    def update_weights(
        self, version: int, state_dict: dict[str, torch.Tensor] | None = None, path: str | None = None
    ) -> None:
        """Load new policy weights, from memory or from a Hugging Face directory (exactly one), and set ``version``.

        Raises:
            ValueError: if not exactly one source is given, the version goes backwards, or the weights do not fit
                the model.
        """

    @property
    @abstractmethod
    def version(self) -> int:
        """The policy version of the loaded weights (0 before the first update)."""

    @abstractmethod
    def health(self) -> dict[str, Any]:
        """A small status dict with at least ``ok``, ``version`` and ``device``."""


def check_prompts(
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    vocab_size: int | None = None,
    max_len: tuple[str, int] | None = None,
) -> None:
    """The checks every engine makes before sampling: ``n >= 1``, no empty prompt and, where the engine knows them,
    token ids inside ``[0, vocab_size)`` and prompt + ``max_new_tokens`` within ``max_len`` (its name and value).

    Raises:
        ValueError: naming the prompt, what was expected and what arrived.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if vocab_size is not None and (min(prompt) < 0 or max(prompt) >= vocab_size):
            raise ValueError(f"prompt {i} holds a token id outside [0, {vocab_size}): {prompt}")
        if max_len is not None and len(prompt) + params.max_new_tokens > max_len[1]:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={params.max_new_tokens} that exceeds "
                f"{max_len[0]}={max_len[1]}"
            )


def check_weight_update(
    current: int, version: int, state_dict: dict[str, torch.Tensor] | None, path: str | None
) -> None:
    """``update_weights``' argument checks: exactly one source, and a version that does not go backwards.

    Raises:
        ValueError: naming what was given.
    """
    if (state_dict is None) == (path is None):
        raise ValueError(
            f"give exactly one of state_dict and path, got state_dict={'set' if state_dict is not None else None}, "
            f"path={path!r}"
        )
    check_version(current, version)


def check_version(current: int, version: int) -> None:
    """Raises ValueError if ``version`` is lower than the engine's ``current`` one."""
    if version < current:
        raise ValueError(f"version must not go backwards: current version={current}, got {version}")
