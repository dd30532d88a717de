"""``QueueSink``: the ``TrajectorySink`` that puts a sampler's trajectories into the transfer queue, one put per GRPO
group (the group's ledger key as its group id), so that a trainer reading with ``GRPOSampler`` gets whole groups.

Row fields: ``record_id`` (int64, the ledger record: the trainer marks it trained), ``prompt_ids`` /
``response_ids`` (jagged int64), ``response_logprobs`` (jagged float32; a row's empty when it has none: a
``convert_record_to_data_func`` changed its tokens, and the trainer takes the policy's own log-probs as the old ones),
``reward`` (float32), ``policy_version`` (int64).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from rl_contracts.rows import jagged

FIELDS = ("record_id", "prompt_ids", "response_ids", "response_logprobs", "reward", "policy_version")


class QueueSink:
    """Puts groups into ``partition_id`` of the queue ``client`` (a ``TransferQueueClient``)."""

    def __init__(self, client: Any, partition_id: str = "sampling", timeout: float | None = None):
        self.client, self.partition_id, self.timeout = client, partition_id, timeout
        self.rows_put = 0  # rows this sink has put (a scheduler's pause_when can compare it with what was trained)
        self._lock = threading.Lock()

    def put_group(self, rows: list[dict[str, Any]], group_id: str, group_key: int) -> tuple[str, list[int]]:
        if not rows:
            raise ValueError(f"group {group_id} has no rows")
        fields = {
            "record_id": torch.tensor([int(r["record_id"]) for r in rows], dtype=torch.int64),
            "prompt_ids": jagged([r["prompt_ids"] for r in rows], torch.int64),
            "response_ids": jagged([r["response_ids"] for r in rows], torch.int64),
            "response_logprobs": jagged([r["response_logprobs"] for r in rows], torch.float32),
            "reward": torch.tensor([float(r["reward"]) for r in rows], dtype=torch.float32),
            "policy_version": torch.tensor([int(r["policy_version"]) for r in rows], dtype=torch.int64),
        }
        meta = self.client.put(
            fields, partition_id=self.partition_id, group_ids=[int(group_key)] * len(rows), timeout=self.timeout
        )
        with self._lock:
            self.rows_put += len(rows)
        return self.partition_id, [int(i) for i in meta.global_indexes]
