"""Every sampler of transfer_queue on one small queue, and what each ``get_meta`` returns.

One global step holds 4 prompts x 4 responses (16 rows). Each task consumes every row once, so every sampler below
sees the same 16 rows: the default SequentialSampler, GRPOSampler (whole groups), DP rounds through
``sampler_params``, a registered DPSampler, SeqlenBalancedSampler (DP shares of equal token count) and two samplers
written by a user (the seed's skeleton, which never serves, and one that serves the newest rows first).

Run: ``python recipe/samplers_simple_demo.py`` (starts a local Ray, or joins the one ``ray job submit`` gives it).
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray binds 127.0.0.1

import ray
import torch
from tensordict import TensorDict

from rl_contracts.actors import actor_class
from transfer_queue import (
    BaseSampler,
    BatchMeta,
    DPSampler,
    GRPOSampler,
    SeqlenBalancedSampler,
    TransferQueueClient,
    TransferQueueController,
)
from transfer_queue.errors import GetMetaTimeout
from transfer_queue.runtime import init_ray

PROMPTS, N = 4, 4  # a step: 4 prompts x 4 responses each


class SeedSkeletonSampler(BaseSampler):
    """The custom sampler of the samplers guide, as written: its ready mask is never filled in."""

    def sample(self, ready_indices, batch_size, **kwargs):
        return ready_indices[:batch_size]

    def filter_ready_indices(
        self, all_indices, production_status, consumption_status, data_fields, field_mapping, **kwargs
    ):
        ready_mask = torch.zeros(len(all_indices), dtype=torch.bool)
        return [all_indices[i] for i in range(len(all_indices)) if ready_mask[i]]


class NewestFirstSampler(BaseSampler):
    """A user sampler: ready = every asked field produced and not consumed by the task; newest rows first."""

    def sample(self, ready_indices, batch_size, **kwargs):
        return sorted(ready_indices, reverse=True)[:batch_size]

    def filter_ready_indices(
        self, all_indices, production_status, consumption_status, data_fields, field_mapping, **kwargs
    ):
        ready_mask = ~torch.as_tensor(consumption_status, dtype=torch.bool)
        for name in data_fields:
            ready_mask &= torch.as_tensor(production_status[:, field_mapping[name]], dtype=torch.bool)
        return [all_indices[i] for i in range(len(all_indices)) if ready_mask[i]]


def show(title: str, meta: BatchMeta, client: TransferQueueClient | None = None) -> None:
    line = f"{title:<44} rows {meta.global_indexes.tolist()}  groups {meta.group_ids.tolist()}"
    if client is not None:  # the tokens of each row's response
        tokens = [len(r) for r in client.get_data(meta.select_fields(["responses"]))["responses"].unbind()]
        line += f"  tokens {sum(tokens)}"
    print(line)


def main() -> None:
    if not ray.is_initialized():
        init_ray()
    controller = actor_class(TransferQueueController).remote(
        global_batch_size=PROMPTS, num_global_batch=1, num_n_samples=N
    )
    for task, sampler in {
        "grpo": GRPOSampler(num_n_samples=N),
        "dp": DPSampler(dp_rank=0, dp_size=2),
        "balanced": SeqlenBalancedSampler(),
        "skeleton": SeedSkeletonSampler(),
        "newest": NewestFirstSampler(),
    }.items():
        ray.get(controller.register_sampler.remote(task, sampler))  # other tasks: the default SequentialSampler
    client = TransferQueueClient(client_id="demo", controller_info=ray.get(controller.get_info.remote()))

    # One step: row r answers prompt r % 4 (groups are explicit ids, not runs of adjacent rows); response lengths vary.
    lengths = [1 + (7 * r) % 13 for r in range(PROMPTS * N)]
    client.put(
        TensorDict(
            {
                "prompts": torch.tensor([r % PROMPTS for r in range(PROMPTS * N)]),
                "responses": torch.nested.nested_tensor(
                    [torch.ones(n, dtype=torch.int64) for n in lengths], layout=torch.jagged
                ),
            },
            batch_size=[PROMPTS * N],
        ),
        global_step=0,
        group_ids=[r % PROMPTS for r in range(PROMPTS * N)],
    )
    print(f"put 16 rows into global_step=0; response tokens per row: {lengths}\n")

    def get(task: str, batch_size: int, **kwargs: Any) -> BatchMeta:
        return client.get_meta(["prompts", "responses"], batch_size, global_step=0, task_name=task, **kwargs)

    show("SequentialSampler (default), 6 rows", get("sequential", 6))
    show("SequentialSampler, get_n_samples=True, 8", get("sequential-groups", 8, get_n_samples=True))
    show("GRPOSampler, 8 rows = 2 whole groups", get("grpo", 8))
    for rank in (1, 0):  # ranks may ask in any order; both get their share of one round of 2 x 4 rows
        params = {"dp_rank": rank, "dp_size": 2, "dp_group_id": "step0-round0"}
        show(f"sampler_params dp_rank={rank} of 2, 4 rows", get("train", 4, sampler_params=params))
    show("  the same rank 0 asking again", get("train", 4, sampler_params=params))
    show("DPSampler(dp_rank=0, dp_size=2), 4 rows", get("dp", 4))
    show("  its peer overriding dp_rank=1", get("dp", 4, sampler_params={"dp_rank": 1}))
    for task, name in (("balanced", "SeqlenBalancedSampler"), ("contrast", "SequentialSampler (contrast)")):
        for rank in (0, 1):  # DP shares of whole groups: balanced ones hold near-equal tokens
            params = {"dp_rank": rank, "dp_size": 2, "dp_group_id": "round0"}
            show(f"{name} dp_rank={rank}, 8", get(task, 8, sampler_params=params, get_n_samples=True), client)
    show("NewestFirstSampler (user), 5 rows", get("newest", 5))
    # The guide's skeleton marks nothing ready. On an open partition a get_meta through it waits, then times out
    # (on a full step, where nothing more can come, it would return the empty batch that ends the stream).
    client.put(TensorDict({"prompts": torch.arange(4)}, batch_size=[4]), partition_id="open")
    try:
        client.get_meta(["prompts"], 2, partition_id="open", task_name="skeleton", timeout=1)
    except GetMetaTimeout as exc:
        print(f"{'seed skeleton sampler (user), 2 rows':<44} GetMetaTimeout: {str(exc)[:60]}...")

    client.close()
    ray.get(controller.shutdown.remote())
    ray.kill(controller)


if __name__ == "__main__":
    main()
