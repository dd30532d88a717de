"""Multi-turn trajectories, token in / token out: what a policy is trained on after acting in an environment.

The chat template is applied once, to the first observation; from then on every turn only appends tokens:

    tokens    = [first observation, templated] [model turn 1] [env reply 1, templated] [model turn 2] ...
    loss_mask = [0 ...................... 0  ] [1 ....... 1 ] [0 ....................0 ] [1 ....... 1 ]
    logprobs  = [0 ...................... 0  ] [sampled lps] [0 ....................0 ] [sampled lps]

The model's turns are the ids the engine sampled, never decoded and re-encoded, so the ids trained on are exactly
the ids sampled even where a tokenizer's decode -> encode does not round-trip. Environment replies are templated
on their own (:class:`ChatFormat`) and appended; the history is never re-tokenised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from rl_contracts.rows import jagged

#: why a trajectory ended: the environment said done, the turn or token budget ran out, or the episode failed
FinishReason = Literal["done", "max_turns", "max_tokens", "error"]
Message = dict[str, str]


class ChatFormat(Protocol):
    """Turns chat messages into token ids: a whole first prompt, and the tokens of messages appended later."""

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The templated conversation so far, ending with the cue for the assistant to answer."""
        ...

    def append_ids(self, messages: Sequence[Message]) -> list[int]:
        """The tokens that follow an assistant turn when ``messages`` (user/tool turns) come next, ending with the
        cue for the assistant to answer again."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFChatFormat:
    """:class:`ChatFormat` over a Hugging Face tokenizer's own chat template.

    The tokens of appended messages are the template's text for ``[u, a] + messages`` minus its text for
    ``[u, a]`` (a fixed two-turn stand-in), tokenised on their own: the same construction as verl's agent loop, so
    templates that add a system prompt or a BOS only at the start do not repeat them at every turn. What a template
    puts between the model's end-of-turn token and the next message (ChatML's ``"\n"``) is not in the stream: the
    model's turn is exactly what it sampled, as in verl's and slime's token-in/token-out loops.
    """

    _BASE: tuple[Message, ...] = ({"role": "user", "content": "u"}, {"role": "assistant", "content": "a"})

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{type(tokenizer).__name__} has no chat_template; use PlainChatFormat or set one")
        self.tokenizer = tokenizer

    def _render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        return self.tokenizer.encode(self._render(messages, True), add_special_tokens=False)

    def append_ids(self, messages: Sequence[Message]) -> list[int]:
        base = self._render(self._BASE, False)
        full = self._render([*self._BASE, *messages], True)
        if not full.startswith(base):
            raise ValueError("the chat template renders a conversation's start differently once turns follow")
        return self.tokenizer.encode(full[len(base) :], add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


class PlainChatFormat:
    """:class:`ChatFormat` for tokenizers without a chat template (the tiny in-process models): each message is
    ``"{role}: {content}\\n"`` and the assistant cue is ``"assistant: "``; ``encode``/``decode`` are the
    tokenizer's. A system message, if any, is only ever in the first prompt."""

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
        cue: str = "assistant: ",
        template: str = "{role}: {content}\n",
    ):
        self._encode, self._decode, self.cue, self.template = encode, decode, cue, template

    def _text(self, messages: Sequence[Message]) -> str:
        return "".join(self.template.format(role=m["role"], content=m["content"]) for m in messages) + self.cue

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        return self._encode(self._text(messages))

    def append_ids(self, messages: Sequence[Message]) -> list[int]:
        return self._encode("\n" + self._text(messages))

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(list(ids))


@dataclass
class Trajectory:
    """One episode as token ids, with what the environment said about it.

    Attributes:
        tokens, loss_mask, logprobs: same length; see the module docstring.
        prompt_len: how many leading tokens are the templated first observation.
        reward: the episode's reward after ``postprocess_reward``.
        num_turns: model turns taken.
        success: the environment's terminal ``info["success"]`` (False when it gave none).
        policy_version: the oldest policy version that sampled any of its turns (-1 before the first turn).
        finish_reason: why it ended (:data:`FinishReason`).
    """

    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_len: int
    reward: float = 0.0
    num_turns: int = 0
    success: bool = False
    policy_version: int = -1
    finish_reason: FinishReason | None = None
    sample_id: str = ""
    info: dict[str, Any] = field(default_factory=dict)


class TrajectoryBuilder:
    """Appends turns to a trajectory within a token budget (``max_total_tokens``, the first prompt included).

    >>> b = TrajectoryBuilder([1, 2, 3], max_total_tokens=8)
    >>> b.add_model_turn([7, 8], [-0.5, -0.25], version=0)
    True
    >>> b.add_env_reply([4, 5, 6, 9])  # one token over the budget: truncated, and the trajectory is full
    False
    >>> b.tokens, b.loss_mask
    ([1, 2, 3, 7, 8, 4, 5, 6], [0, 0, 0, 1, 1, 0, 0, 0])
    """

    def __init__(self, prompt_ids: Sequence[int], max_total_tokens: int):
        if not prompt_ids:
            raise ValueError("the first observation templated to no tokens")
        if len(prompt_ids) >= max_total_tokens:
            raise ValueError(
                f"the first observation is {len(prompt_ids)} tokens, max_total_tokens={max_total_tokens} leaves no "
                "room for a turn"
            )
        self.max_total_tokens = max_total_tokens
        self.tokens = list(prompt_ids)
        self.loss_mask = [0] * len(prompt_ids)
        self.logprobs = [0.0] * len(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.num_turns = 0
        self.policy_version = -1

    @property
    def room(self) -> int:
        """Tokens left in the budget."""
        return self.max_total_tokens - len(self.tokens)

    def add_model_turn(self, token_ids: Sequence[int], logprobs: Sequence[float], version: int) -> bool:
        """Append the sampled ids (mask 1, their log-probs); returns whether they fit whole (False: the budget cut
        them, and the trajectory is full). A turn that fits exactly returns True and leaves no ``room``."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"a turn has {len(token_ids)} tokens but {len(logprobs)} log-probs")
        fits = len(token_ids) <= self.room
        keep = len(token_ids) if fits else self.room
        self.tokens += token_ids[:keep]
        self.loss_mask += [1] * keep
        self.logprobs += [float(x) for x in logprobs[:keep]]
        self.num_turns += 1
        self.policy_version = version if self.policy_version < 0 else min(self.policy_version, version)
        return fits

    def add_env_reply(self, token_ids: Sequence[int]) -> bool:
        """Append the environment's templated reply (mask 0, log-prob 0); returns False when it did not fit
        whole or left no room for another turn."""
        keep = min(len(token_ids), self.room)
        self.tokens += token_ids[:keep]
        self.loss_mask += [0] * keep
        self.logprobs += [0.0] * keep
        return keep == len(token_ids) and self.room > 0

    def build(self, **fields: Any) -> Trajectory:
        return Trajectory(
            tokens=list(self.tokens),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            prompt_len=self.prompt_len,
            num_turns=self.num_turns,
            policy_version=self.policy_version,
            **fields,
        )


@dataclass
class Sample:
    """The universal training unit of a custom rollout (``rollout.generate_fn``), with the seed's fields.

    Attributes:
        prompt: the prompt text (for logs).
        response: the response text, every turn after the prompt (for logs and text rewards).
        tokens: the whole sequence of token ids, prompt first.
        loss_mask: per token, 1 where the policy sampled it (trained on), 0 elsewhere.
        reward: the sample's reward.
        metadata: anything else; ``num_turns``, ``success``, ``policy_version``, ``group`` are read when present.
        logprobs: per token, the sampler's log-prob where ``loss_mask`` is 1 and 0 elsewhere (empty: unknown,
            then the trainer's own recomputed log-probs stand in for them).
    """

    prompt: str
    response: str
    tokens: list[int]
    loss_mask: list[float]
    reward: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    logprobs: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.loss_mask) != len(self.tokens):
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {len(self.tokens)} tokens")
        if self.logprobs and len(self.logprobs) != len(self.tokens):
            raise ValueError(f"logprobs has {len(self.logprobs)} entries for {len(self.tokens)} tokens")


def trajectory_to_sample(trajectory: Trajectory, chat: ChatFormat) -> Sample:
    """The :class:`Sample` of a trajectory (text decoded for logs; the ids stay the sampled ids)."""
    t = trajectory
    return Sample(
        prompt=chat.decode(t.tokens[: t.prompt_len]),
        response=chat.decode(t.tokens[t.prompt_len :]),
        tokens=t.tokens,
        loss_mask=[float(m) for m in t.loss_mask],
        reward=t.reward,
        metadata={
            "num_turns": t.num_turns,
            "success": t.success,
            "policy_version": t.policy_version,
            "finish_reason": t.finish_reason,
            "sample_id": t.sample_id,
        },
        logprobs=t.logprobs,
    )


def samples_to_fields(samples: Sequence[Sample]) -> dict[str, Any]:
    """The queue fields of samples: jagged ``tokens``, ``loss_mask``, ``logprobs`` plus ``reward``, ``num_turns``,
    ``success``, ``policy_version`` (and ``reward_failed``, False: the reward came with the sample)."""
    meta = [s.metadata for s in samples]
    return {
        "tokens": jagged([s.tokens for s in samples], torch.int64),
        "loss_mask": jagged([s.loss_mask for s in samples], torch.float32),
        "logprobs": jagged([s.logprobs or [0.0] * len(s.tokens) for s in samples], torch.float32),
        "reward": torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
        "num_turns": torch.tensor([int(m.get("num_turns", 1)) for m in meta], dtype=torch.int64),
        "success": torch.tensor([bool(m.get("success", s.reward >= 1.0)) for m, s in zip(meta, samples, strict=True)]),
        "policy_version": torch.tensor([int(m.get("policy_version", 0)) for m in meta], dtype=torch.int64),
        "reward_failed": torch.zeros(len(samples), dtype=torch.bool),
    }
