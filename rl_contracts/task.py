"""Task: what to train on. Prompts as token ids, how to read and score responses, and the policy to start from.

Engines are token in / token out; the tokenizer lives with the task. A task travels to actors as a ``"module:Class"``
name plus constructor kwargs (:func:`load_task`), so every process builds the same task.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rl_contracts.images import ImageSource


class Tokenizer(Protocol):
    pad_token_id: int
    eos_token_id: int

    def decode(self, ids: list[int]) -> str: ...


class Task(ABC):
    """A task for RL (and its SFT warm-up).

    A prompt is a dict with ``prompt_ids`` (list[int]) and the string fields the reward needs (``reward_fields``),
    e.g. ``{"prompt_ids": [...], "answer": "042"}``; those fields travel through the queue with the prompt.
    """

    #: prompt fields (str) the reward function receives as keyword arguments
    reward_fields: tuple[str, ...] = ("answer",)

    @property
    @abstractmethod
    def tokenizer(self) -> Tokenizer: ...

    @abstractmethod
    def prompts(self, split: str, num: int, seed: int) -> list[dict[str, Any]]:
        """``num`` prompts of ``split`` ("train" or "eval"), a pure function of ``seed``."""

    @abstractmethod
    def reward(self, response_text: str, **fields: str) -> float:
        """Score one decoded response (pure)."""

    @abstractmethod
    def build_policy(self) -> Any:
        """The starting policy: a Hugging Face causal LM on CPU, in float32."""

    def rewards(self, response_texts: list[str], **fields: list[str]) -> list[float | Exception]:
        """Score a batch of decoded responses, ``fields`` a column per reward field: the reward workers call this.
        The default calls :meth:`reward` on each; a response whose reward raises holds the exception instead of a
        score (it fails alone). A task whose reward is cheaper a batch at a time overrides it."""
        out: list[float | Exception] = []
        for i, text in enumerate(response_texts):
            try:
                out.append(self.reward(text, **{name: column[i] for name, column in fields.items()}))
            except Exception as exc:  # a user function's bug fails its sample only
                out.append(exc)
        return out

    def image_source(self) -> ImageSource | None:
        """What the trainer resolves the rows' image references (``rl_contracts.images.IMAGE_REFS``) with; None (the
        default) for a text task, whose rows carry no images. A vision task returns one (e.g.
        ``workers.vision.BlobImageSource`` over the blob store its prompts' images are stored in)."""
        return None

    def sft_target(self, prompt: dict[str, Any]) -> list[int]:
        """Token ids of the reference response of ``prompt`` (eos included), for the SFT warm-up."""
        raise NotImplementedError(f"{type(self).__name__} has no SFT targets; disable sft in the config")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def accuracy(self, prompts: list[dict[str, Any]], responses: list[list[list[int]]]) -> float:
        """The fraction of responses that earn the full reward (>= 1): ``responses[i]`` holds the token ids of any
        number of responses to ``prompts[i]``, each counted alike (several samples per prompt average out the luck
        of a single draw)."""
        if len(prompts) != len(responses):
            raise ValueError(f"accuracy: {len(prompts)} prompts but responses for {len(responses)}")
        scores = [
            self.reward(self.decode(ids), **{f: str(prompt[f]) for f in self.reward_fields}) >= 1.0
            for prompt, group in zip(prompts, responses, strict=True)
            for ids in group
        ]
        if not scores:
            raise ValueError("accuracy: no responses to score")
        return sum(scores) / len(scores)


def import_object(spec: str) -> Any:
    """The object named ``"package.module:name"`` (or ``"package.module.name"``).

    Raises:
        ValueError: if the module or the name cannot be found, naming what was asked.
    """
    module_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"expected 'module:name', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} of {spec!r}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no {attr!r} (from {spec!r})") from None


def load_task(name: str, kwargs: dict[str, Any] | None = None) -> Task:
    cls = import_object(name)
    task = cls(**(kwargs or {}))
    if not isinstance(task, Task):
        raise ValueError(f"{name!r} built a {type(task).__name__}, expected a rl_contracts.task.Task")
    return task


def load_reward_fn(spec: str) -> Callable[..., float]:
    fn = import_object(spec)
    if not callable(fn):
        raise ValueError(f"reward_fn {spec!r} is a {type(fn).__name__}, not a function")
    return fn
