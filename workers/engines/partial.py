"""Partial rollouts: a weight update does not wait for long generations (``rollout.partial_rollout: true``).

:class:`PartialRollout` wraps any :class:`~workers.engines.base.Engine`. While it generates, a weight update
(``update_weights`` from another thread, or a newer version appearing in a weight source it polls) makes the
engine stop where it is (``should_abort`` for engines that support it, otherwise generation runs in bounded chunks
of ``chunk_tokens``), keeps every unfinished response, loads the new weights, and resumes each response from prompt
+ partial response on the new weights with the budget it has left. Every token records the policy version that
sampled it (``Generation.versions``), so the trainer can mask tokens older than ``max_staleness``
(:func:`mask_offpolicy_tokens`, ``train.mask_offpolicy_in_partial_rollout`` as in slime).

Resuming re-reads prompt + partial response as a new prompt: the new weights' KV cache is rebuilt from the tokens,
never mixed with the old one.

In-flight checkpoints (``rollout.checkpoint_inflight``, rl_contracts/inflight.py): ``generate(..., on_chunk=...)``
runs every engine in chunks of ``chunk_tokens`` (an abortable one too) and hands the rows each chunk advanced to
``on_chunk``; ``resume=`` starts rows from partials a generation killed mid-way had checkpointed, their tokens,
log-probs and versions kept (``resumed_tokens`` counts them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from rl_contracts.inflight import Partial
from rl_contracts.partial import mask_offpolicy_tokens
from workers.engines.base import Engine, Generation, SamplingParams

__all__ = ["PartialRollout", "mask_offpolicy_tokens"]

WeightsUpdate = tuple[int, Any, Any]  # (version, state_dict, path)


class PartialRollout:
    """Generation across weight updates; see the module docstring.

    Args:
        engine: the engine that samples.
        newer_weights: polled while generating: returns a :data:`WeightsUpdate` to load when newer weights are
            waiting elsewhere (e.g. a weight channel), else None. Updates given to ``update_weights`` need no poll.
        chunk_tokens: for engines without ``supports_abort``: tokens generated per call between checks.
    """

    def __init__(
        self,
        engine: Engine,
        newer_weights: Callable[[], WeightsUpdate | None] | None = None,
        chunk_tokens: int = 16,
    ):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.engine = engine
        self.newer_weights = newer_weights
        self.chunk_tokens = chunk_tokens
        self._pending: WeightsUpdate | None = None
        self._lock = threading.Lock()  # guards _pending
        self._generating = threading.Lock()  # held while a generation runs
        self._loaded = threading.Condition()
        self.resumes = 0  # responses resumed after an update (a counter for metrics)
        self.resumed_tokens = 0  # tokens taken from in-flight checkpoints instead of generated (``resume``)
        self.updates_during_generation = 0

    @property
    def version(self) -> int:
        return self.engine.version

    def update_weights(
        self,
        version: int,
        state_dict: dict[str, torch.Tensor] | None = None,
        path: str | None = None,
        wait: bool = True,
    ) -> int:
        """Load new weights now if nothing generates; otherwise hand them to the running generation, which stops
        at its next decoding step, loads them and resumes. ``wait``: return once they are loaded (within one
        decoding step of a running generation), else at once. Returns ``version``."""
        if self._generating.acquire(blocking=False):
            try:
                self.engine.update_weights(version, state_dict=state_dict, path=path)
            finally:
                self._generating.release()
            return version
        with self._lock:
            self._pending = (version, state_dict, path)
        if wait:
            with self._loaded:
                self._loaded.wait_for(lambda: self.engine.version >= version or not self._generating.locked())
            if self.engine.version < version:  # the generation ended before taking it: load it here
                with self._lock:
                    if self._pending is not None and self._pending[0] == version:
                        self._pending = None
                return self.update_weights(version, state_dict, path)
        return version

    def _update_waiting(self) -> bool:
        with self._lock:
            if self._pending is None and self.newer_weights is not None:
                self._pending = self.newer_weights()
            return self._pending is not None

    def _load_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None and pending[0] >= self.engine.version:
            version, state_dict, path = pending
            self.engine.update_weights(version, state_dict=state_dict, path=path)
            self.updates_during_generation += 1
            with self._loaded:
                self._loaded.notify_all()

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        resume: Sequence[Partial | None] | None = None,
        on_chunk: Callable[[list[int], list[Partial]], None] | None = None,
    ) -> list[list[Generation]]:
        """``n`` responses per prompt, each with ``versions`` (one per token); see the module docstring.

        ``resume``: one entry per response (``n`` per prompt, in order), the partial it starts from (None: from its
        prompt). ``on_chunk(rows, partials)``: after each chunk, the responses it advanced (their indices in that
        order) with everything generated so far; given, every engine runs in chunks of ``chunk_tokens``."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if resume is not None and len(resume) != len(prompts) * n:
            raise ValueError(f"resume needs one entry per response ({len(prompts)} prompts x {n}), got {len(resume)}")
        try:
            with self._generating:
                return self._generate(prompts, n, params, resume, on_chunk)
        finally:  # after the release: a waiting update_weights sees the generation ended
            with self._loaded:
                self._loaded.notify_all()

    def _generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        resume: Sequence[Partial | None] | None,
        on_chunk: Callable[[list[int], list[Partial]], None] | None,
    ) -> list[list[Generation]]:
        rows = [list(prompt) for prompt in prompts for _ in range(n)]
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        versions: list[list[int]] = [[] for _ in rows]
        reasons: list[str | None] = [None] * len(rows)
        for i, partial in enumerate(resume or []):
            if partial is not None:
                tokens[i], logprobs[i], versions[i] = (
                    list(partial.token_ids),
                    list(partial.logprobs),
                    list(partial.versions),
                )
                reasons[i] = partial.finish_reason
                if reasons[i] is None and len(tokens[i]) >= params.max_new_tokens:
                    reasons[i] = "length"
                self.resumed_tokens += len(tokens[i])
        # checkpointing: chunks for every engine, so that a kill loses at most one chunk per response
        abortable = bool(getattr(self.engine, "supports_abort", False)) and on_chunk is None
        segment = 0
        while True:
            self._load_pending()
            active = [i for i, reason in enumerate(reasons) if reason is None]
            if not active:
                break
            # rows with the same budget left go in one call (the budget is a call-wide parameter)
            by_budget: dict[int, list[int]] = {}
            for i in active:
                by_budget.setdefault(params.max_new_tokens - len(tokens[i]), []).append(i)
            for budget, members in sorted(by_budget.items(), reverse=True):
                step = budget if abortable else min(budget, self.chunk_tokens)
                seed = None if params.seed is None else params.seed + 7919 * segment
                call = replace(params, max_new_tokens=step, seed=seed)
                inputs = [rows[i] + tokens[i] for i in members]
                version = self.engine.version
                if abortable:
                    out = self.engine.generate(inputs, 1, call, should_abort=self._update_waiting)  # type: ignore[call-arg]
                else:
                    out = self.engine.generate(inputs, 1, call)
                for i, [g] in zip(members, out, strict=True):
                    if segment > 0 and tokens[i] and g.token_ids:
                        self.resumes += 1
                    tokens[i].extend(g.token_ids)
                    logprobs[i].extend(g.logprobs)
                    versions[i].extend([version] * len(g.token_ids))
                    if g.finish_reason == "stop":
                        reasons[i] = "stop"
                    elif len(tokens[i]) >= params.max_new_tokens:
                        reasons[i] = "length"
                if on_chunk is not None:
                    on_chunk(
                        list(members),
                        [Partial(list(tokens[i]), list(logprobs[i]), list(versions[i]), reasons[i]) for i in members],
                    )
                if self._update_waiting():
                    break  # load before the other budgets' rows run on old weights
            segment += 1
        generations = [
            Generation(token_ids=t, logprobs=lp, finish_reason=r, versions=v)  # type: ignore[arg-type]
            for t, lp, r, v in zip(tokens, logprobs, reasons, versions, strict=True)
        ]
        return [generations[i * n : (i + 1) * n] for i in range(len(prompts))]

    def health(self) -> dict[str, Any]:
        return {
            **self.engine.health(),
            "partial_rollout": True,
            "resumes": self.resumes,
            "resumed_tokens": self.resumed_tokens,
            "updates_during_generation": self.updates_during_generation,
        }
