"""Every code snippet of upstream TransferQueue's sampler guide (docs/samplers.md, "Writing your own"), run against this
package.

Each test keeps the snippet's own lines (marked ``# --- snippet``) and adds what it needs around them: a Ray
session, a client built from the controller's ``get_info``, and a global step with data put into it. Where a snippet
writes ``TransferQueueClient(...)`` the client gets real arguments; where it reads ``global_step=0`` from a queue
shared with other tests, the test's fresh step stands in for 0.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pytest
import ray
import torch
from tensordict import TensorDict

from transfer_queue import TransferQueueClient
from transfer_queue.errors import GetMetaTimeout, IncompleteGroups

# Samplers defined here travel to the controller actor, which cannot import this file: pickle them by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def rows(n: int, start: int = 0, fields: tuple[str, ...] = ("prompts",)) -> TensorDict:
    """``n`` rows whose every field holds the row's number (``start``, ``start + 1``, ...)."""
    values = torch.arange(start, start + n, dtype=torch.int64).unsqueeze(1)
    return TensorDict({name: values.clone() for name in fields}, batch_size=[n])


def new_client(client_id: str, controller_info: Any) -> TransferQueueClient:
    return TransferQueueClient(client_id=client_id, controller_info=controller_info)


def indexes(meta: Any) -> list[int]:
    return meta.global_indexes.tolist()


@pytest.fixture
def own_controllers(ray_session: Any) -> Any:
    """Stops the controllers a snippet started when the test ends; returns a client factory for them."""
    started: list[Any] = []
    clients: list[TransferQueueClient] = []

    def client_of(controller: Any, client_id: str = "sampler-test") -> TransferQueueClient:
        started.append(controller)
        controller_info = ray.get(controller.get_info.remote())
        client = TransferQueueClient(client_id=client_id, controller_info=controller_info)
        clients.append(client)
        return client

    yield client_of
    for client in clients:
        client.close()
    for controller in started:
        try:
            ray.get(controller.shutdown.remote(), timeout=30)
        finally:
            ray.kill(controller)


# ---- 1. SequentialSampler -------------------------------------------------------------------------------------
def test_sequential_sampler_controller(own_controllers: Any) -> None:
    # --- snippet
    from transfer_queue import SequentialSampler, TransferQueueController

    controller = TransferQueueController.remote(
        global_batch_size=8,
        num_global_batch=1,
        num_n_samples=1,
        sampler=SequentialSampler(),  # Optional, this is the default
    )
    # ---
    client = own_controllers(controller)
    assert ray.get(controller.get_config.remote())["sampler"] == "SequentialSampler"
    client.put(rows(4, 0), global_step=0)
    client.put(rows(4, 4), global_step=0)
    first = client.get_meta(["prompts"], batch_size=3, global_step=0, task_name="train")
    second = client.get_meta(["prompts"], batch_size=3, global_step=0, task_name="train")
    assert indexes(first) == [0, 1, 2] and indexes(second) == [3, 4, 5]
    assert client.get_data(second)["prompts"].squeeze(1).tolist() == [3, 4, 5]
    # The step is full: the rest comes as a short batch, then the end of the stream.
    assert indexes(client.get_meta(["prompts"], batch_size=3, global_step=0, task_name="train")) == [6, 7]
    assert len(client.get_meta(["prompts"], batch_size=3, global_step=0, task_name="train")) == 0
    # Another task sees every row again, in the same order.
    assert indexes(client.get_meta(["prompts"], batch_size=8, global_step=0, task_name="eval")) == list(range(8))


# ---- 2. GRPOSampler -------------------------------------------------------------------------------------------
def test_grpo_sampler_controller_serves_whole_groups(own_controllers: Any) -> None:
    # --- snippet
    from transfer_queue import GRPOSampler, TransferQueueController

    num_n_samples = 4  # 4 responses per prompt
    controller = TransferQueueController.remote(
        global_batch_size=8,
        num_global_batch=1,
        num_n_samples=num_n_samples,
        sampler=GRPOSampler(num_n_samples=num_n_samples),
    )
    # ---
    client = own_controllers(controller)
    # Groups interleaved in index order (row i belongs to prompt i % 4): groups are never inferred from adjacency.
    client.put(rows(16, 0), global_step=0, group_ids=[i % 4 for i in range(16)])
    meta = client.get_meta(["prompts"], batch_size=8, global_step=0, task_name="train", get_n_samples=True)
    assert sorted(indexes(meta)) == [0, 1, 4, 5, 8, 9, 12, 13]
    assert sorted(np.unique(meta.group_ids, return_counts=True)[1].tolist()) == [4, 4]
    # Half of groups 4 and 5: neither is served until all four of its members are there.
    client.put(rows(4, 16), global_step=0, group_ids=[4, 4, 5, 5])
    meta = client.get_meta(["prompts"], batch_size=8, global_step=0, task_name="train", get_n_samples=True)
    assert sorted(set(meta.group_ids.tolist())) == [2, 3]
    with pytest.raises(GetMetaTimeout, match="task 'train' asked global_step=0 for 4 rows"):
        client.get_meta(["prompts"], batch_size=4, global_step=0, task_name="train", get_n_samples=True, timeout=0.2)
    client.put(rows(4, 20), global_step=0, group_ids=[5, 4, 5, 4])
    meta = client.get_meta(["prompts"], batch_size=8, global_step=0, task_name="train", get_n_samples=True)
    assert sorted(indexes(meta)) == list(range(16, 24))
    assert sorted(meta.group_ids.tolist()) == [4] * 4 + [5] * 4
    with pytest.raises(IncompleteGroups, match="batch_size=6 is not divisible by num_n_samples=4"):
        client.get_meta(["prompts"], batch_size=6, global_step=0, task_name="train")


# ---- 3. DPSampler ---------------------------------------------------------------------------------------------
def dp_get_meta(client: TransferQueueClient, global_step: int, dp_rank: int) -> Any:
    """The recommended DPSampler snippet, with this rank in place of its literal 0."""
    batch_meta = client.get_meta(
        data_fields=["prompts"],
        batch_size=4,
        global_step=global_step,
        task_name="training_task",
        sampler_params={
            "dp_rank": dp_rank,  # This rank's position in DP domain
            "dp_size": 4,  # Total number of DP groups
            "dp_group_id": "group_step0",  # Unique ID for this DP group
        },
    )
    return batch_meta


def test_dp_sampler_params_recommended(queue: Any) -> None:
    step = queue.step()
    # --- snippet (the queue's fresh step stands in for global_step=0)
    from transfer_queue import TransferQueueClient

    # In each distributed process
    client = TransferQueueClient(client_id="dp-rank-0", controller_info=queue.info)
    queue.client.put(rows(16), global_step=step)

    # Pass DP parameters via sampler_params
    batch_meta = client.get_meta(
        data_fields=["prompts"],
        batch_size=4,
        global_step=step,
        task_name="training_task",
        sampler_params={
            "dp_rank": 0,  # This rank's position in DP domain
            "dp_size": 4,  # Total number of DP groups
            "dp_group_id": "group_step0",  # Unique ID for this DP group
        },
    )
    # ---
    assert len(batch_meta) == 4
    assert batch_meta.extra == {
        "dp_rank": 0,
        "dp_size": 4,
        "dp_group_id": "group_step0",
        "round_rows": 16,
        "round_max_share": 4,
    }
    client.close()


def test_dp_sampler_params_four_ranks_share_one_round(queue: Any) -> None:
    step = queue.step()
    queue.client.put(rows(16), global_step=step)
    ranks = [queue.new_client(f"rank{r}") for r in range(4)]
    by_rank = {r: indexes(dp_get_meta(ranks[r], step, r)) for r in (2, 0, 3, 1)}  # any arrival order
    shares = [by_rank[r] for r in range(4)]
    assert all(len(s) == 4 for s in shares)
    assert sorted(r for share in shares for r in share) == list(
        range(step * 16, step * 16 + 16)
    )  # disjoint, covering the round
    # A rank asking again (or its TP/PP peers asking) gets the same share, from any client.
    for r in range(4):
        assert indexes(dp_get_meta(queue.new_client(f"peer{r}"), step, r)) == shares[r]
        assert indexes(dp_get_meta(ranks[r], step, r)) == shares[r]
    # The round took all 16 rows for the task; other tasks still see them.
    status = queue.client.get_consumption_status(global_step=step, task_name="training_task")
    states = {"ready": 0, "leased": 16, "acknowledged": 0, "dead_lettered": 0}  # leased to the round until acked
    assert status["tasks"]["training_task"] == {"consumed": 16, "rows": 16, **states}
    other = queue.client.get_meta(["prompts"], batch_size=16, global_step=step, task_name="eval")
    assert len(other) == 16


def test_dp_sampler_preregistered(own_controllers: Any) -> None:
    # --- snippet
    from transfer_queue import DPSampler, TransferQueueController

    controller = TransferQueueController.remote(
        global_batch_size=16,
        num_global_batch=1,
        num_n_samples=1,
    )

    # Register DP sampler for this rank
    controller.register_sampler.remote(
        task_name="training_task",
        sampler=DPSampler(dp_rank=0, dp_size=4),
    )
    # ---
    client = own_controllers(controller)  # get_info runs after register_sampler (one caller: in order)
    client.put(rows(16), global_step=0)
    rank0 = client.get_meta(["prompts"], batch_size=4, global_step=0, task_name="training_task")
    assert indexes(rank0) == [0, 1, 2, 3]
    assert rank0.extra["dp_rank"] == 0 and rank0.extra["dp_size"] == 4
    # The other ranks of the same world override the registered rank; their first calls join the same round.
    others = [
        indexes(
            client.get_meta(["prompts"], 4, global_step=0, task_name="training_task", sampler_params={"dp_rank": r})
        )
        for r in (1, 2, 3)
    ]
    assert others == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    # Rank 0's next call is the next round: the step is full and every row taken, so the stream has ended.
    assert len(client.get_meta(["prompts"], batch_size=4, global_step=0, task_name="training_task")) == 0
    # A task without a registered sampler uses the default SequentialSampler.
    assert indexes(client.get_meta(["prompts"], batch_size=5, global_step=0, task_name="eval")) == [0, 1, 2, 3, 4]


# ---- Pattern 1: sampler_params from the environment ------------------------------------------------------------
def pattern_1(controller_info: Any, global_step: int) -> Any:
    """Pattern 1 as written (the client gets real arguments)."""
    from transfer_queue import TransferQueueClient

    # Get DP configuration from environment
    dp_rank = int(os.environ.get("DP_RANK", 0))
    dp_size = int(os.environ.get("DP_SIZE", 1))

    client = TransferQueueClient(client_id=f"pattern1-rank{dp_rank}", controller_info=controller_info)

    # Each process passes its own DP parameters
    batch_meta = client.get_meta(
        data_fields=["prompts", "responses"],
        batch_size=4,
        global_step=global_step,
        task_name="training_task",
        sampler_params={
            "dp_rank": dp_rank,
            "dp_size": dp_size,
            "dp_group_id": f"dp_group_step{global_step}",  # Must be same for all ranks in group
        },
    )
    client.close()
    return batch_meta


def test_pattern_1_dp_params_from_environment(queue: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    step = queue.step()
    queue.client.put(rows(8, fields=("prompts",)), global_step=step)
    meta = queue.client.get_meta(["prompts"], batch_size=8, global_step=step, task_name="rollout")
    queue.client.put(rows(8, 100, fields=("responses",)), metadata=meta)  # responses arrive later, by metadata
    shares = {}
    for rank in (1, 0):
        monkeypatch.setenv("DP_RANK", str(rank))
        monkeypatch.setenv("DP_SIZE", "2")
        shares[rank] = pattern_1(queue.info, step)
        assert shares[rank].extra["dp_group_id"] == f"dp_group_step{step}"
    assert indexes(pattern_1(queue.info, step)) == indexes(shares[0])  # rank 0 (from the env) again: same share
    assert sorted(indexes(shares[0]) + indexes(shares[1])) == list(range(step * 16, step * 16 + 8))
    data = queue.client.get_data(shares[1])
    assert (data["responses"] - data["prompts"]).eq(100).all()


def test_pattern_1_without_environment_is_one_rank(queue: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DP_RANK", raising=False)
    monkeypatch.delenv("DP_SIZE", raising=False)
    step = queue.step()
    queue.client.put(rows(6, fields=("prompts", "responses")), global_step=step)
    assert len(pattern_1(queue.info, step)) == 4


# ---- Pattern 2: a default sampler for every task -----------------------------------------------------------------
def test_pattern_2_default_sampler_for_all_tasks(own_controllers: Any) -> None:
    # --- snippet
    from transfer_queue import GRPOSampler, TransferQueueController

    controller = TransferQueueController.remote(
        global_batch_size=8,
        num_global_batch=1,
        num_n_samples=4,
        sampler=GRPOSampler(num_n_samples=4),  # All tasks use GRPO
    )
    # ---
    client = own_controllers(controller)
    client.put(rows(12), global_step=0, group_ids=[0, 1, 2] * 4)
    client.put(rows(2, 12), global_step=0, group_ids=[3, 3])  # half a group: never served
    for task in ("reward", "train"):  # no get_n_samples: the default sampler serves whole groups for every task
        meta = client.get_meta(["prompts"], batch_size=8, global_step=0, task_name=task)
        assert sorted(meta.group_ids.tolist()) == [0] * 4 + [1] * 4
        assert client.get_meta(["prompts"], batch_size=4, global_step=0, task_name=task).group_ids.tolist() == [2] * 4
        with pytest.raises(GetMetaTimeout, match=f"task '{task}'"):
            client.get_meta(["prompts"], batch_size=4, global_step=0, task_name=task, timeout=0.2)


# ---- Pattern 3: task-specific samplers ---------------------------------------------------------------------------
def test_pattern_3_task_samplers_and_client_usage(own_controllers: Any) -> None:
    # --- snippet
    from transfer_queue import DPSampler, GRPOSampler, TransferQueueController

    # Create controller with default sampler
    controller = TransferQueueController.remote(
        global_batch_size=8,
        num_global_batch=1,
        num_n_samples=4,
    )

    # Register GRPO sampler for GRPO task
    ray.get(
        controller.register_sampler.remote(
            task_name="grpo_task",
            sampler=GRPOSampler(num_n_samples=4),
        )
    )

    # Register DP sampler for DP task
    ray.get(
        controller.register_sampler.remote(
            task_name="dp_task",
            sampler=DPSampler(dp_rank=0, dp_size=2),
        )
    )

    # Tasks use their registered samplers
    # "grpo_task" uses GRPOSampler
    # "dp_task" uses DPSampler
    # Other tasks use default SequentialSampler
    # ---
    controller_info = ray.get(controller.get_info.remote())
    own_controllers(controller)
    setup = new_client("producer", controller_info)
    # 8 prompts x 4 responses; row i belongs to prompt i % 8, so no group is a run of adjacent rows.
    setup.put(rows(32, fields=("prompts", "responses")), global_step=0, group_ids=[i % 8 for i in range(32)])
    setup.close()

    # --- snippet: Client Usage
    from transfer_queue import TransferQueueClient

    client = TransferQueueClient(
        client_id="my_client",
        controller_info=controller_info,
    )

    # Fetch data using the sampler registered for "grpo_task"
    batch_meta = client.get_meta(
        data_fields=["prompts", "responses"],
        batch_size=8,
        global_step=0,
        task_name="grpo_task",  # Uses GRPOSampler
        get_n_samples=True,
    )
    # ---
    assert sorted(indexes(batch_meta)) == [0, 1, 8, 9, 16, 17, 24, 25]  # prompts 0 and 1, all four responses each
    assert sorted(batch_meta.group_ids.tolist()) == [0] * 4 + [1] * 4
    data = client.get_data(batch_meta)
    assert data["prompts"].squeeze(1).tolist() == indexes(batch_meta)
    # dp_task: DP rank 0 of 2 gets the first half of its round's 2 x 4 rows.
    dp = client.get_meta(["prompts"], batch_size=4, global_step=0, task_name="dp_task")
    assert indexes(dp) == [0, 1, 2, 3] and dp.extra["dp_size"] == 2
    # Any other task: the default SequentialSampler, in order, groups or not.
    assert indexes(client.get_meta(["prompts"], batch_size=3, global_step=0, task_name="other")) == [0, 1, 2]
    client.close()


# ---- Pattern 4: a callable that builds the sampler -----------------------------------------------------------
def test_pattern_4_callable_sampler_constructor(own_controllers: Any) -> None:
    from transfer_queue import GRPOSampler, TransferQueueController

    # --- snippet
    controller = TransferQueueController.remote(
        global_batch_size=8,
        num_global_batch=1,
        num_n_samples=4,
        sampler=lambda: GRPOSampler(num_n_samples=4),  # Callable
    )
    # ---
    client = own_controllers(controller)
    assert ray.get(controller.get_config.remote())["sampler"] == "GRPOSampler"
    client.put(rows(8), global_step=0, group_ids=[0, 1] * 4)
    client.put(rows(3, 8), global_step=0, group_ids=[2, 2, 2])
    meta = client.get_meta(["prompts"], batch_size=8, global_step=0, task_name="train")
    assert sorted(meta.group_ids.tolist()) == [0] * 4 + [1] * 4
    with pytest.raises(GetMetaTimeout, match="4 rows of fields"):  # group 2 has 3 of its 4 members
        client.get_meta(["prompts"], batch_size=4, global_step=0, task_name="train", timeout=0.2)


# ---- Creating custom samplers -------------------------------------------------------------------------------
# --- snippet
from transfer_queue.samplers import BaseSampler  # noqa: E402


class MyCustomSampler(BaseSampler):
    def sample(self, ready_indices, batch_size, **kwargs):
        """Select batch_size indices from ready_indices."""
        # Your sampling logic here
        return ready_indices[:batch_size]

    def filter_ready_indices(
        self, all_indices, production_status, consumption_status, data_fields, field_mapping, **kwargs
    ):
        """Filter indices to find those ready for consumption."""
        # Your filtering logic here
        ready_mask = torch.zeros(len(all_indices), dtype=torch.bool)
        # ... determine which indices are ready ...
        return [all_indices[i] for i in range(len(all_indices)) if ready_mask[i]]


# ---


class NewestFirstSampler(MyCustomSampler):
    """The snippet with its blanks filled in: ready = every requested field produced and not yet consumed; the
    newest rows go first."""

    def sample(self, ready_indices, batch_size, **kwargs):
        return sorted(ready_indices, reverse=True)[:batch_size]

    def filter_ready_indices(
        self, all_indices, production_status, consumption_status, data_fields, field_mapping, **kwargs
    ):
        ready_mask = ~torch.as_tensor(consumption_status, dtype=torch.bool)
        for name in data_fields:
            ready_mask &= torch.as_tensor(production_status[:, field_mapping[name]], dtype=torch.bool)
        return [all_indices[i] for i in range(len(all_indices)) if ready_mask[i]]


def test_custom_sampler_as_written_never_serves(queue: Any) -> None:
    ray.get(queue.controller.register_sampler.remote("custom_task", MyCustomSampler()))
    partition = queue.partition("custom")
    queue.client.put(rows(4), partition_id=partition)
    with pytest.raises(GetMetaTimeout, match=r"timed out after 0\.2 s: task 'custom_task'.* 4 rows are ready"):
        queue.client.get_meta(["prompts"], batch_size=2, partition_id=partition, task_name="custom_task", timeout=0.2)
    # The queue keeps serving other tasks.
    assert len(queue.client.get_meta(["prompts"], batch_size=2, partition_id=partition, task_name="other")) == 2


def test_custom_sampler_newest_first(queue: Any) -> None:
    ray.get(queue.controller.register_sampler.remote("newest_task", NewestFirstSampler()))
    partition = queue.partition("newest")
    client = queue.client
    client.put(rows(4), partition_id=partition)
    first = client.get_meta(["prompts"], batch_size=2, partition_id=partition, task_name="newest_task")
    assert indexes(first) == [3, 2]
    assert client.get_data(first)["prompts"].squeeze(1).tolist() == [3, 2]
    client.put(rows(2, 4), partition_id=partition)
    assert indexes(client.get_meta(["prompts"], 2, partition_id=partition, task_name="newest_task")) == [5, 4]
    assert indexes(client.get_meta(["prompts"], 2, partition_id=partition, task_name="newest_task")) == [1, 0]
    client.close_partition(partition_id=partition)
    assert len(client.get_meta(["prompts"], 2, partition_id=partition, task_name="newest_task")) == 0


# ---- the demo ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_samplers_simple_demo_runs() -> None:
    """``python recipe/samplers_simple_demo.py`` on a fresh Ray of its own."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[4]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "recipe/samplers_simple_demo.py"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "GRPOSampler, 8 rows = 2 whole groups         rows [0, 4, 8, 12, 1, 5, 9, 13]" in out
    assert "NewestFirstSampler (user), 5 rows            rows [15, 14, 13, 12, 11]" in out
    assert "seed skeleton sampler (user), 2 rows         GetMetaTimeout" in out
    balanced = [line for line in out.splitlines() if line.startswith("SeqlenBalancedSampler")]
    assert len(balanced) == 2 and len({line.rsplit("tokens", 1)[1] for line in balanced}) == 1  # equal tokens
