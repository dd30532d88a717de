"""In-flight generations as recoverable state (``rollout.checkpoint_inflight``, issue 28 section 3).

While a partial-rollout engine generates a step's rows in chunks, it writes each chunk's partial responses (token
ids, log-probs, the policy version of each token, the finish reason once there is one) into the queue by key: the
kv partition :func:`inflight_partition` of the step, one key per row (:func:`row_keys`: the row's group id and its
place in the group, which the rows keep when a dead worker's lease ends and they are served again). A worker whose
call of that step is made again (its process was killed; Ray restarted it) reads the keys of the rows it is served
and resumes each response from its partial instead of starting over: its tokens, log-probs and versions are kept.

A partial is resumed only while its oldest token is within ``max_staleness`` versions of the policy that will train
the step (:func:`fresh_enough`); an older one is dropped and its row generated again from the prompt (counted). The
checkpoints of a batch are cleared once its rows are written, and the whole partition when the driver clears the
step, so none outlives its step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rl_contracts.rows import jagged, rows_of

#: the fields of one checkpointed row
FIELDS = ("response_ids", "response_logprobs", "response_versions", "finish_reason")


def inflight_partition(step: int) -> str:
    """The kv partition holding the in-flight checkpoints of global step ``step``."""
    return f"inflight/step_{step}"


def row_keys(group_ids: Sequence[int] | np.ndarray, n: int) -> list[str]:
    """The checkpoint key of each row of a whole-groups batch (rows come group by group, ``n`` rows per group):
    ``"<group id>/<place in the group>"``."""
    groups = [int(g) for g in group_ids]
    return [f"{group}/{i % n}" for i, group in enumerate(groups)]


@dataclass
class Partial:
    """A response generated so far: its tokens, their log-probs and versions; ``finish_reason`` once it ended."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(
                f"a partial response needs one log-prob and one version per token: {len(self.token_ids)} tokens, "
                f"{len(self.logprobs)} log-probs, {len(self.versions)} versions"
            )


def fresh_enough(partial: Partial, train_version: int | None, max_staleness: int) -> bool:
    """Whether every token of ``partial`` was sampled within ``max_staleness`` versions of ``train_version`` (the
    policy that trains its step; None: unknown, every partial is kept)."""
    if train_version is None or not partial.versions:
        return True
    return train_version - min(partial.versions) <= max_staleness


@dataclass(frozen=True)
class InflightCall:
    """What a generation needs to checkpoint its rows as it goes: the queue, the step's partition, one key per row
    (``n`` rows per prompt, in order) and the partials to resume from (None where a row starts from its prompt);
    ``train_version`` and ``max_staleness``: what :func:`fresh_enough` checks a partial against (the engine's own
    newer partials, :class:`WrittenPartials`)."""

    controller_info: Any
    partition: str
    keys: list[str]
    resume: list[Partial | None]
    train_version: int | None = None
    max_staleness: int = 0


class WrittenPartials:
    """The partials an engine checkpointed lately, by (partition, key), with each row's prompt: the newest
    ``capacity`` rows (the oldest forgotten first).

    An engine that outlives its caller (a rollout worker SIGKILLed mid-generation: the engine is the run's actor,
    not the worker's) goes on with the dead call and checkpoints every chunk of it. The call made again (after the
    worker's restart) read the queue's checkpoints before it reached the engine, which was still busy with the dead
    call: :meth:`newer` hands it what the engine wrote since, so nothing the dead call generated is generated
    again."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._rows: dict[tuple[str, str], tuple[tuple[int, ...], Partial]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def write(self, partition: str, key: str, prompt: Sequence[int], partial: Partial) -> None:
        row = (partition, key)
        self._rows.pop(row, None)  # the newest last
        self._rows[row] = (tuple(prompt), partial)
        while len(self._rows) > self.capacity:
            del self._rows[next(iter(self._rows))]

    def newer(self, call: InflightCall, prompts: Sequence[Sequence[int]]) -> tuple[InflightCall, int]:
        """``call`` resuming each row (``prompts``: one per row) from the partial written here for it where that one
        goes on from what ``call`` resumes (has its tokens, and more), was written for the same prompt, and is
        fresh enough for the step (:func:`fresh_enough`: a row whose queue partial the caller found too stale stays
        None); returns it and the tokens it gained."""
        resume, gained = list(call.resume), 0
        for i, (key, given, prompt) in enumerate(zip(call.keys, call.resume, prompts, strict=True)):
            found = self._rows.get((call.partition, key))
            if found is None or found[0] != tuple(prompt):
                continue
            partial, have = found[1], [] if given is None else given.token_ids
            if len(partial.token_ids) <= len(have) or partial.token_ids[: len(have)] != have:
                continue
            if not fresh_enough(partial, call.train_version, call.max_staleness):
                continue
            resume[i] = partial
            gained += len(partial.token_ids) - len(have)
        if not gained:
            return call, 0
        return dataclasses.replace(call, resume=resume), gained


class InflightCheckpoints:
    """The queue side: ``save`` a chunk's partials, ``load`` those of some keys, ``clear`` them; ``client`` is a
    :class:`~transfer_queue.TransferQueueClient`."""

    def __init__(self, client: Any, partition: str):
        self.client, self.partition = client, partition

    def save(self, keys: Sequence[str], partials: Sequence[Partial]) -> None:
        """One put of the rows' partials (rows with no token yet are left out: nothing to resume)."""
        rows = [(k, p) for k, p in zip(keys, partials, strict=True) if p.token_ids]
        if not rows:
            return
        fields = {
            "response_ids": jagged([p.token_ids for _, p in rows], torch.int64),
            "response_logprobs": jagged([p.logprobs for _, p in rows], torch.float32),
            "response_versions": jagged([p.versions for _, p in rows], torch.int64),
            "finish_reason": [p.finish_reason or "" for _, p in rows],
        }
        self.client.kv_batch_put([k for k, _ in rows], self.partition, fields)

    def load(self, keys: Sequence[str]) -> dict[str, Partial]:
        """The partials checkpointed under ``keys`` (those that have one)."""
        present = set(self.client.kv_list(self.partition))
        found = [k for k in keys if k in present]
        if not found:
            return {}
        data = self.client.kv_batch_get(found, self.partition, list(FIELDS))
        reasons = data["finish_reason"]
        reasons = reasons.tolist() if hasattr(reasons, "tolist") else list(reasons)
        return {
            key: Partial([int(t) for t in ids], [float(x) for x in lps], [int(v) for v in vs], str(reason) or None)
            for key, ids, lps, vs, reason in zip(
                found,
                rows_of(data["response_ids"]),
                rows_of(data["response_logprobs"]),
                rows_of(data["response_versions"]),
                reasons,
                strict=True,
            )
        }

    def clear(self, keys: Sequence[str] | None = None) -> None:
        """Forget ``keys`` (None: the whole partition)."""
        self.client.kv_clear(None if keys is None else list(keys), self.partition)
