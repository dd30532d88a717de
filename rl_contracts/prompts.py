"""PromptSource: a prompt list served in epochs, shuffled deterministically per epoch, with a resumable position."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np


class PromptSource:
    """Prompts in epochs: each epoch is a permutation drawn from ``(seed, epoch)`` alone, so a run that saves
    :meth:`state_dict` and later loads it serves exactly the prompts an uninterrupted run would have.

    Args:
        prompts: the dataset (any objects; typically dicts with ``prompt_ids``).
        seed: shuffle seed.
        shuffle: ``False`` serves the prompts in order every epoch.

    >>> source = PromptSource(["a", "b", "c"], seed=0, shuffle=False)
    >>> source.next_batch(2), source.next_batch(2), source.epoch
    (['a', 'b'], ['c', 'a'], 1)
    """

    def __init__(self, prompts: list[Any], seed: int = 0, shuffle: bool = True):
        if not prompts:
            raise ValueError("PromptSource needs at least one prompt, got an empty list")
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.prompts))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def next_batch(self, size: int) -> list[Any]:
        """The next ``size`` prompts, crossing into the next epoch (reshuffled) when this one runs out."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        out: list[Any] = []
        while len(out) < size:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(size - len(out), len(self._order) - self.position)
            out.extend(self.prompts[i] for i in self._order[self.position : self.position + take].tolist())
            self.position += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": len(self.prompts)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("size") != len(self.prompts) or state.get("seed") != self.seed:
            raise ValueError(
                f"this PromptSource has {len(self.prompts)} prompts and seed {self.seed}; the state is for "
                f"{state.get('size')} prompts and seed {state.get('seed')}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


def sft_step_batch(prompts: list[Any], seed: int, step: int, size: int) -> list[Any]:
    """The ``size`` prompts of supervised step ``step`` of a run seeded ``seed``: the head of a permutation drawn
    from ``(seed, step)`` alone, so any step's batch is known without replaying the ones before it (the SFT
    warm-up's draw, on every rank and in the single-process reference alike).

    >>> sft_step_batch(list(range(10)), seed=0, step=3, size=4) == sft_step_batch(list(range(10)), 0, 3, 4)
    True
    """
    return PromptSource(prompts, seed=seed * 1_000_003 + step).next_batch(size)


def prompts_checksum(rows: Iterable[list[int]]) -> int:
    """An order-free checksum of prompt rows (token ids): the sum of each row's CRC-32 over its int64 bytes.

    The trainer logs it per step (``prompts_crc``), so a run's steps can be checked against the prompt batches an
    uninterrupted run draws: a skipped, repeated or mixed batch changes it.

    >>> prompts_checksum([[1, 2], [3]]) == prompts_checksum([[3], [1, 2]])
    True
    """
    return sum(zlib.crc32(np.asarray(row, dtype=np.int64).tobytes()) for row in rows)
