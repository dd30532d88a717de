"""DPSampler: a task sampler that knows its data-parallel rank."""

from __future__ import annotations

from typing import Any

from transfer_queue.samplers.sequential import SequentialSampler


class DPSampler(SequentialSampler):
    """Sequential sampling shared by the ranks of a data-parallel world.

    Every ``get_meta`` through it takes part in a DP round: the first call of a round reserves
    ``dp_size * batch_size`` ready rows for the task and splits them into ``dp_size`` shares; each call returns
    the share of its ``dp_rank``, however many peers (TP/PP ranks) ask. The rank and size given here are defaults;
    ``sampler_params`` passed to ``get_meta`` override them. Without a ``dp_group_id`` the k-th call of a rank
    belongs to round k.

    Args:
        dp_rank: this process's DP rank, in ``[0, dp_size)``.
        dp_size: the number of DP ranks.
        world_rank, world_size: optional global rank and world size, checked for consistency (and logged).
    """

    def __init__(self, dp_rank: int, dp_size: int, world_rank: int | None = None, world_size: int | None = None):
        if not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"DPSampler: dp_size must be an int >= 1, got {dp_size!r}")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"DPSampler: dp_rank must lie in [0, dp_size={dp_size}), got {dp_rank!r}")
        if world_size is not None and (world_size < dp_size or world_size % dp_size):
            raise ValueError(f"DPSampler: world_size={world_size} must be a multiple of dp_size={dp_size}")
        if world_rank is not None and world_size is not None and not 0 <= world_rank < world_size:
            raise ValueError(f"DPSampler: world_rank must lie in [0, world_size={world_size}), got {world_rank}")
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.world_rank = world_rank
        self.world_size = world_size

    def default_sampler_params(self) -> dict[str, Any]:
        return {"dp_rank": self.dp_rank, "dp_size": self.dp_size}

    def __repr__(self) -> str:
        return f"DPSampler(dp_rank={self.dp_rank}, dp_size={self.dp_size})"
