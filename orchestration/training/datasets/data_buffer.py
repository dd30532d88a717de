"""``DataBuffer``: hands out prompts in batches, epoch after epoch, each epoch in its own seeded order.

The order of epoch ``e`` is a pure function of ``(seed, e)`` (``random.Random(f"{seed}/{e}")``), so two buffers
with the same prompts and seed hand out the same batches, every epoch is shuffled afresh (epoch 0 too), and a buffer
restored from ``save_state()`` continues exactly where the saved one stopped:

>>> buffer = DataBuffer(prompts=["a", "b", "c"], seed=0)
>>> first = buffer.get_prompts(2)
>>> state = buffer.save_state()
>>> again = DataBuffer(prompts=["a", "b", "c"], seed=0)
>>> again.load_state(state)
>>> again.get_prompts(4) == buffer.get_prompts(4)
True
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from typing import Any

from orchestration.training.types import LibraryError

_STATE_KEYS = ("seed", "epoch", "position", "num_prompts", "fingerprint")


def _fingerprint(prompts: Sequence[Any]) -> str:
    """A short digest of the prompts (in their given order), to refuse a state saved from other prompts."""
    text = json.dumps(list(prompts), sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class DataBuffer:
    """Prompt cycling with epochs.

    Args:
        prompts: the prompts (strings, chat message lists, dicts: anything JSON-like), at least one.
        seed: seeds every epoch's shuffle.

    ``get_prompts(n)`` takes the next ``n`` prompts of the current epoch's order; a request crossing the end of the
    epoch takes the rest of this epoch, then the start of the next one (in the next epoch's order).
    """

    def __init__(self, prompts: Sequence[Any], seed: int = 42):
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise LibraryError(f"DataBuffer needs a list of prompts, got {type(prompts).__name__}")
        if len(prompts) == 0:
            raise LibraryError("DataBuffer needs at least one prompt, got an empty list")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise LibraryError(f"DataBuffer seed must be an int, got {seed!r}")
        self.prompts = list(prompts)
        self.seed = seed
        self._fingerprint = _fingerprint(self.prompts)
        self._epoch = 0
        self._position = 0
        self._order = self._order_of(0)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def epoch(self) -> int:
        """The epoch the next prompt comes from (0 first)."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many prompts of the current epoch were handed out already (``0 <= position < len(buffer)``)."""
        return self._position

    @property
    def total_served(self) -> int:
        """How many prompts were handed out in all."""
        return self._epoch * len(self.prompts) + self._position

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def get_prompts(self, n: int) -> list[Any]:
        """The next ``n`` prompts (``n >= 1``; may exceed ``len(buffer)``: the buffer wraps as often as needed)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise LibraryError(f"get_prompts needs a number of prompts n >= 1, got {n!r}")
        out: list[Any] = []
        while len(out) < n:
            take = min(n - len(out), len(self.prompts) - self._position)
            out.extend(self.prompts[i] for i in self._order[self._position : self._position + take])
            self._position += take
            if self._position == len(self.prompts):
                self._epoch += 1
                self._position = 0
                self._order = self._order_of(self._epoch)
        return out

    def save_state(self) -> dict[str, Any]:
        """Where the buffer stands, as a plain JSON-serialisable dict (the prompts themselves are not in it)."""
        return {
            "seed": self.seed,
            "epoch": self._epoch,
            "position": self._position,
            "num_prompts": len(self.prompts),
            "fingerprint": self._fingerprint,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a ``save_state()`` of a buffer over the same prompts; its seed is taken too).

        Raises:
            LibraryError: the state misses keys, holds bad values, or was saved from other prompts.
        """
        if not isinstance(state, dict):
            raise LibraryError(
                f"DataBuffer.load_state needs the dict save_state() returned, got {type(state).__name__}"
            )
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise LibraryError(f"DataBuffer state needs keys {list(_STATE_KEYS)}, missing {missing}")
        if state["num_prompts"] != len(self.prompts) or state["fingerprint"] != self._fingerprint:
            raise LibraryError(
                f"DataBuffer state was saved from other prompts: it holds {state['num_prompts']} prompts "
                f"(fingerprint {state['fingerprint']}), this buffer {len(self.prompts)} "
                f"(fingerprint {self._fingerprint})"
            )
        epoch, position, seed = state["epoch"], state["position"], state["seed"]
        for name, value in (("epoch", epoch), ("position", position), ("seed", seed)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise LibraryError(f"DataBuffer state {name} must be an int, got {value!r}")
        if epoch < 0 or not 0 <= position < len(self.prompts):
            raise LibraryError(
                f"DataBuffer state needs epoch >= 0 and 0 <= position < {len(self.prompts)}, "
                f"got epoch={epoch} position={position}"
            )
        self.seed, self._epoch, self._position = seed, epoch, position
        self._order = self._order_of(epoch)
