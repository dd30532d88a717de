"""SeqlenBalancedSampler: DP shares with near-equal total sequence length."""

from __future__ import annotations

import heapq

import numpy as np

from transfer_queue.samplers.sequential import SequentialSampler


def balanced_shares(lengths: np.ndarray, num_shares: int) -> list[list[int]]:
    """Split items into ``num_shares`` shares of equal count (±1) minimising the largest total length.

    Greedy longest-first with a count limit per share (LPT): each item goes to the share with the smallest total
    that still has room; any share may take one of the ``len % num_shares`` extra items. Returns item positions
    per share, each sorted.
    """
    base, extra = divmod(len(lengths), num_shares)
    heap = [(0, i) for i in range(num_shares)]
    shares: list[list[int]] = [[] for _ in range(num_shares)]
    for item in np.argsort(-lengths, kind="stable").tolist():
        full = []
        while True:
            total, share = heapq.heappop(heap)
            if len(shares[share]) < base or (len(shares[share]) == base and extra):
                break
            full.append((total, share))
        if len(shares[share]) == base:
            extra -= 1
        shares[share].append(item)
        heapq.heappush(heap, (total + int(lengths[item]), share))
        for entry in full:
            heapq.heappush(heap, entry)
    return [sorted(s) for s in shares]


class SeqlenBalancedSampler(SequentialSampler):
    """Sequential selection; a DP round's rows are split so that every rank gets the same number of rows (whole
    groups under GRPO) and near-equal total tokens. Row lengths come from the puts (jagged fields' row lengths
    plus the row sums of 2-D masks such as ``attention_mask``), computed by the client."""

    def split(self, rows: np.ndarray, num_shares: int, lengths: np.ndarray, group_size: int) -> list[np.ndarray]:
        unit_lengths = lengths.reshape(-1, group_size).sum(axis=1)
        units = rows.reshape(-1, group_size)
        return [units[positions].reshape(-1) for positions in balanced_shares(unit_lengths, num_shares)]
