"""The client against a live queue: round trips, the GRPO pipeline through metadata puts, every API method, errors
across the wire, the async client, clients in other processes and event loops, kv, and StreamingDataset."""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from transfer_queue import AsyncTransferQueueClient, BatchMeta, StreamingDataLoader, StreamingDataset
from transfer_queue.errors import (
    BatchSizeMismatch,
    ClientClosed,
    FieldAlreadyProduced,
    GetMetaTimeout,
    IncompleteGroups,
    InvalidRequest,
    PartitionCleared,
    PartitionOverfilled,
    QueueFull,
    SchemaMismatch,
    StaleBatchMeta,
    TransferQueueError,
    UnknownField,
    UnknownKey,
    UnknownPartition,
    UnsupportedValue,
)
from transfer_queue.wire import protocol as p

DENSE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8]


def dense_batch(n: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    fields: dict[str, torch.Tensor] = {}
    for dtype in DENSE_DTYPES:
        name = str(dtype).removeprefix("torch.")
        if dtype.is_floating_point:
            fields[name] = torch.randn(n, 3, 2, generator=g).to(dtype)
        else:
            fields[name] = torch.randint(0, 100, (n, 5), generator=g).to(dtype)
    fields["mask"] = torch.rand(n, 7, generator=g) > 0.5
    fields["scalar"] = torch.arange(n, dtype=torch.float32) + seed  # one value per row: shape [n]
    return TensorDict(fields, batch_size=[n])


def jagged(lengths: list[int], seed: int, trailing: tuple[int, ...] = ()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nested.nested_tensor([torch.randn(n, *trailing, generator=g) for n in lengths], layout=torch.jagged)


def assert_same_rows(got: torch.Tensor, want: list[torch.Tensor]) -> None:
    assert got.is_nested, "a jagged field must come back jagged"
    rows = got.unbind()
    assert len(rows) == len(want)
    for a, b in zip(rows, want, strict=True):
        assert torch.equal(a, b)


def ids(meta: BatchMeta) -> list[int]:
    return meta.global_indexes.tolist()


# ---- round trips ----------------------------------------------------------------------------------------------
def test_dense_round_trip_stays_dense(queue: Any) -> None:
    client, partition = queue.client, queue.partition()
    batches = [dense_batch(5, seed) for seed in range(3)]  # three puts: rows spread over both storage units
    for batch in batches:
        client.put(batch, partition_id=partition)
    whole = torch.cat(batches)
    meta = client.get_meta(list(whole.keys()), batch_size=15, partition_id=partition, task_name="t")
    assert ids(meta) == list(range(15))
    data = client.get_data(meta)
    assert data.batch_size == torch.Size([15])
    for name, want in whole.items():
        got = data[name]
        assert not got.is_nested and got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name
    # A subset of fields and rows, out of put order (release hands rows back; a newest-first pick is not needed).
    sub = client.get_data(meta.select_samples([14, 0, 7]).select_fields(["bfloat16", "scalar"]))
    assert list(sub.keys()) == ["bfloat16", "scalar"]
    assert torch.equal(sub["bfloat16"], whole["bfloat16"][[14, 0, 7]])
    assert sub["scalar"].tolist() == whole["scalar"][[14, 0, 7]].tolist()


def test_a_put_spread_over_both_units_reads_back_in_place_and_in_any_order(queue: Any) -> None:
    """A large put is split over the units; reading its rows in order receives each unit's run straight into the
    output, any other order takes the general path: both give the rows asked for, in the order asked."""
    client, partition = queue.client, queue.partition()
    rows = 512
    batch = dense_batch(rows, 7)
    batch["big"] = torch.arange(rows * 1024, dtype=torch.float64).reshape(rows, 1024)  # 4 MB: split over units
    meta = client.put(batch, partition_id=partition)
    assert len(np.unique(meta.blocks % 2)) == 2, "the put was expected to be split over both units"
    meta = client.get_meta(list(batch.keys()), rows, partition_id=partition, task_name="t")
    for order in (np.arange(rows), np.arange(rows)[::-1], np.random.default_rng(0).permutation(rows)):
        data = client.get_data(meta.select_samples(order))
        for name, want in batch.items():
            assert torch.equal(data[name], want[torch.from_numpy(order.copy())]), name


def test_jagged_round_trip_comes_back_jagged(queue: Any) -> None:
    client, partition = queue.client, queue.partition()
    lengths_a, lengths_b = [3, 1, 4, 1], [5, 9, 2]
    tokens_a = [torch.arange(n) * 10 + i for i, n in enumerate(lengths_a)]
    tokens_b = [torch.arange(n) * 10 + 100 + i for i, n in enumerate(lengths_b)]
    feats_a, feats_b = jagged(lengths_a, 0, (2,)), jagged(lengths_b, 1, (2,))
    for tokens, feats in ((tokens_a, feats_a), (tokens_b, feats_b)):
        nested = torch.nested.nested_tensor(tokens, layout=torch.jagged)
        client.put(TensorDict({"tokens": nested, "feats": feats}, batch_size=[len(tokens)]), partition_id=partition)
    meta = client.get_meta(["tokens", "feats"], batch_size=7, partition_id=partition, task_name="t")
    data = client.get_data(meta)
    assert_same_rows(data["tokens"], tokens_a + tokens_b)
    assert_same_rows(data["feats"], list(feats_a.unbind()) + list(feats_b.unbind()))
    # Rows taken across blocks and out of order are gathered right.
    picked = client.get_data(meta.select_samples([6, 0, 4]))
    assert_same_rows(picked["tokens"], [tokens_b[2], tokens_a[0], tokens_b[0]])
    # A strided nested tensor travels too (as jagged).
    strided = [torch.ones(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)]
    client.put(TensorDict({"tokens": torch.nested.nested_tensor(strided)}, batch_size=[2]), partition_id=partition)
    more = client.get_meta(["tokens"], batch_size=2, partition_id=partition, task_name="t")
    assert_same_rows(client.get_data(more)["tokens"], strided)


def test_objects_round_trip_as_non_tensor_stack(queue: Any) -> None:
    client, partition = queue.client, queue.partition()
    texts = ["a prompt", "", "ünïcode ✓", "x" * 10_000]
    blobs = [b"\x00\x01", b"", b"raw", bytes(range(256))]
    records = [{"turn": 1, "tools": ["ls"]}, [1, 2.5, None], 7, {"nested": {"k": [True, False]}}]
    client.put(TensorDict({"text": texts, "blob": blobs, "record": records}, batch_size=[4]), partition_id=partition)
    meta = client.get_meta(["text", "blob", "record"], batch_size=4, partition_id=partition, task_name="t")
    data = client.get_data(meta)
    assert isinstance(data.get("text"), NonTensorStack)
    assert data.get("text").tolist() == texts
    assert data.get("blob").tolist() == blobs
    assert data.get("record").tolist() == records
    assert client.get_data(meta.select_samples([3, 1])).get("text").tolist() == [texts[3], texts[1]]
    with pytest.raises(UnsupportedValue, match="field 'bad': non-tensor values must be str, bytes or msgpack"):
        client.put(TensorDict({"bad": [object(), object()]}, batch_size=[2]), partition_id=partition)


def test_a_list_of_sets_is_refused_at_put_time_instead_of_coming_back_as_lists(queue: Any) -> None:
    client, partition = queue.client, queue.partition()
    with pytest.raises(UnsupportedValue, match=r"^field 'tags': row 0 holds a set, which would not come back"):
        client.put(TensorDict({"tags": NonTensorStack({1}, {2})}, batch_size=[2]), partition_id=partition)
    assert partition not in client.list_partitions()  # refused before anything was sent


def test_mixed_fields_in_one_put(queue: Any) -> None:
    client, partition = queue.client, queue.partition()
    lengths = [2, 6, 3]
    tokens = [torch.arange(n) for n in lengths]
    batch = TensorDict(
        {
            "input_ids": torch.nested.nested_tensor(tokens, layout=torch.jagged),
            "attention_mask": torch.ones(3, 6, dtype=torch.int64),
            "reward": torch.tensor([0.5, -1.0, 2.0]),
            "prompt": ["p0", "p1", "p2"],
        },
        batch_size=[3],
    )
    client.put(batch, partition_id=partition)
    meta = client.get_meta(["prompt", "reward", "input_ids"], batch_size=3, partition_id=partition, task_name="t")
    data = client.get_data(meta)
    assert data.get("prompt").tolist() == ["p0", "p1", "p2"]
    assert torch.equal(data["reward"], batch["reward"]) and not data["reward"].is_nested
    assert_same_rows(data["input_ids"], tokens)
    status = client.get_production_status(partition_id=partition)
    assert status["fields"]["input_ids"]["schema"] == "jagged int64[*]"
    assert status["fields"]["attention_mask"]["schema"] == "dense int64[6]"
    assert status["fields"]["prompt"]["schema"] == "object"


# ---- the GRPO pipeline: metadata puts, explicit groups --------------------------------------------------------
def test_rollout_reward_trainer_pipeline(grpo_queue: Any) -> None:
    queue, step = grpo_queue, grpo_queue.step()
    rollout, reward, trainer = (queue.new_client(name) for name in ("rollout", "reward", "trainer"))
    got: dict[str, Any] = {}

    def train() -> None:  # asks before anything exists: waits for complete groups with rewards
        try:
            got["meta"] = trainer.get_meta(
                ["prompt_ids", "responses", "rewards"], 8, global_step=step, task_name="train", get_n_samples=True
            )
        except Exception as exc:  # surfaced by the assertion below
            got["error"] = exc

    waiting = threading.Thread(target=train)
    waiting.start()
    # 4 prompts x 4 samples; row r belongs to prompt r // 4.
    prompt_ids = torch.arange(16).unsqueeze(1) // 4
    queue.client.put(TensorDict({"prompt_ids": prompt_ids}, batch_size=[16]), global_step=step)
    for _ in range(2):
        meta = rollout.get_meta(["prompt_ids"], 8, global_step=step, task_name="rollout", get_n_samples=True)
        prompts = rollout.get_data(meta)["prompt_ids"]
        responses = torch.nested.nested_tensor(
            [torch.full((int(p) + 1,), int(p)) for p in prompts.squeeze(1)], layout=torch.jagged
        )
        rollout.put(TensorDict({"responses": responses}, batch_size=[8]), metadata=meta)
        meta = reward.get_meta(["responses"], 8, global_step=step, task_name="reward")
        lengths = [len(r) for r in reward.get_data(meta)["responses"].unbind()]
        reward.put(TensorDict({"rewards": torch.tensor(lengths, dtype=torch.float32)}, batch_size=[8]), metadata=meta)
    waiting.join(timeout=30)
    assert "error" not in got, got.get("error")
    meta = got["meta"]
    assert len(meta) == 8 and sorted(np.unique(meta.group_ids, return_counts=True)[1].tolist()) == [4, 4]
    data = trainer.get_data(meta)
    for row in range(8):
        prompt = int(data["prompt_ids"][row])
        assert prompt == meta.group_ids[row]
        assert torch.equal(data["responses"][row], torch.full((prompt + 1,), prompt))
        assert data["rewards"][row] == prompt + 1
    rest = trainer.get_meta(["prompt_ids", "responses", "rewards"], 8, global_step=step, task_name="train")
    assert sorted(set(rest.group_ids.tolist()) | set(meta.group_ids.tolist())) == [0, 1, 2, 3]
    # A field is written once: rewriting rewards is refused, and the stored value is unchanged.
    with pytest.raises(FieldAlreadyProduced, match=r"fields \['rewards'\] of global index \d+ .* already produced"):
        reward.put(TensorDict({"rewards": torch.zeros(8)}, batch_size=[8]), metadata=rest)
    assert torch.equal(
        trainer.get_data(rest)["rewards"],
        torch.tensor([len(r) for r in trainer.get_data(rest)["responses"].unbind()], dtype=torch.float32),
    )


def test_explicit_group_ids_across_puts(grpo_queue: Any) -> None:
    client, step = grpo_queue.client, grpo_queue.step()
    one = TensorDict({"x": torch.arange(4)}, batch_size=[4])
    client.put(one, global_step=step, group_ids=[7, 9, 7, 9])
    client.put(one + 10, global_step=step, group_ids=[9, 9, 7, 8])
    with pytest.raises(GetMetaTimeout, match="for 8 rows of fields"):  # group 7 has 3 members, 8 has 1
        client.get_meta(["x"], 8, global_step=step, task_name="t", get_n_samples=True, timeout=1)
    meta = client.get_meta(["x"], 4, global_step=step, task_name="t", get_n_samples=True)
    assert meta.group_ids.tolist() == [9] * 4 and client.get_data(meta)["x"].tolist() == [1, 3, 10, 11]
    client.put(one[:1] + 20, global_step=step, group_ids=[7])
    meta = client.get_meta(["x"], 4, global_step=step, task_name="t", get_n_samples=True)
    assert meta.group_ids.tolist() == [7] * 4 and sorted(client.get_data(meta)["x"].tolist()) == [0, 2, 12, 20]
    with pytest.raises(IncompleteGroups, match=r"group 7 would have 5 members in global_step=\d+; num_n_samples=4"):
        client.put(one[:1], global_step=step, group_ids=[7])
    with pytest.raises(IncompleteGroups, match=r"a put of 3 rows without group_ids must hold whole groups .*\(got 3"):
        client.put(one[:3], global_step=step)


# ---- every API method ------------------------------------------------------------------------------------------
def test_status_listing_and_unknown_partitions(queue: Any) -> None:
    client, step, partition = queue.client, queue.step(), queue.partition()
    client.put(TensorDict({"a": torch.ones(4, 2)}, batch_size=[4]), global_step=step)
    client.put(TensorDict({"b": ["x", "y"]}, batch_size=[2]), partition_id=partition)
    assert {step, partition} <= set(client.list_partitions())
    status = client.get_production_status(global_step=step)
    assert status["partition_id"] == step and status["capacity"] == 16 and status["rows"] == 4
    assert status["closed"] is False and status["bytes"] == 4 * 2 * 4
    assert status["fields"] == {"a": {"schema": "dense float32[2]", "produced": 4}}
    client.get_meta(["a"], 3, global_step=step, task_name="t1")
    consumption = client.get_consumption_status(global_step=step)
    states = {"ready": 1, "leased": 3, "acknowledged": 0, "dead_lettered": 0}
    assert consumption["tasks"] == {"t1": {"consumed": 3, "rows": 4, **states}}
    assert client.get_consumption_status(global_step=step, task_name="t2")["tasks"]["t2"]["consumed"] == 0
    assert client.get_production_status(partition_id=partition)["capacity"] is None
    with pytest.raises(UnknownPartition, match="partition_id='never-seen' not found; live partitions"):
        client.get_production_status(partition_id="never-seen")
    with pytest.raises(UnknownPartition, match="global_step=999999 not found"):
        client.get_consumption_status(global_step=999999)
    with pytest.raises(InvalidRequest, match="give exactly one of global_step and partition_id"):
        client.get_meta(["a"], 1, global_step=step, partition_id=partition)
    with pytest.raises(InvalidRequest, match="give exactly one of global_step and partition_id"):
        client.put(TensorDict({"a": torch.ones(1, 2)}, batch_size=[1]))
    with pytest.raises(InvalidRequest, match="global_step must be an int >= 0, got -1"):
        client.clear(global_step=-1)
    assert client.ping() == {"client_id": client.client_id, "protocol_version": p.PROTOCOL_VERSION}


def test_release_and_reset_consumption(queue: Any) -> None:
    client, partition = queue.client, queue.partition()
    client.put(TensorDict({"a": torch.arange(6)}, batch_size=[6]), partition_id=partition)
    first = client.get_meta(["a"], 4, partition_id=partition, task_name="t")
    client.release(first.select_samples([1, 2]))
    again = client.get_meta(["a"], 4, partition_id=partition, task_name="t")
    assert sorted(ids(again)) == [1, 2, 4, 5]
    with pytest.raises(InvalidRequest, match="release needs a BatchMeta from get_meta"):
        client.release(client.put(TensorDict({"a": torch.arange(1)}, batch_size=[1]), partition_id=partition))
    client.reset_consumption("t", partition_id=partition)
    assert ids(client.get_meta(["a"], 7, partition_id=partition, task_name="t")) == list(range(7))
    client.get_meta(["a"], 7, partition_id=partition, task_name="u")
    client.reset_consumption(partition_id=partition)  # every task
    assert client.get_consumption_status(partition_id=partition)["tasks"] == {}
    client.reset_consumption()  # every task of every partition: no error
    assert len(client.get_meta(["a"], 7, partition_id=partition, task_name="u")) == 7


def test_clear_is_idempotent_and_final(queue: Any) -> None:
    client, step, partition = queue.client, queue.step(), queue.partition()
    client.put(TensorDict({"a": torch.arange(4)}, batch_size=[4]), global_step=step)
    client.clear(global_step=step)
    client.clear(global_step=step)  # idempotent
    client.clear(partition_id=partition)  # never opened: a no-op
    assert step not in client.list_partitions()
    with pytest.raises(PartitionCleared, match=f"global_step={step} was cleared"):
        client.get_meta(["a"], 1, global_step=step, task_name="t")
    with pytest.raises(PartitionCleared, match=f"global_step={step} was cleared"):
        client.put(TensorDict({"a": torch.arange(4)}, batch_size=[4]), global_step=step)
    with pytest.raises(UnknownPartition):
        client.get_production_status(global_step=step)


def test_close_partition_final_short_batch_then_empty(queue: Any) -> None:
    client, partition = queue.client, queue.partition()
    reader = queue.new_client("reader")
    client.put(TensorDict({"a": torch.arange(10)}, batch_size=[10]), partition_id=partition)
    assert len(reader.get_meta(["a"], 4, partition_id=partition, task_name="t")) == 4
    assert len(reader.get_meta(["a"], 4, partition_id=partition, task_name="t")) == 4
    got: dict[str, Any] = {}
    parked = threading.Thread(
        target=lambda: got.update(meta=reader.get_meta(["a"], 4, partition_id=partition, task_name="t"))
    )
    parked.start()  # waits: 2 rows are ready, 4 asked, and more may come
    client.close_partition(partition_id=partition)
    parked.join(timeout=30)
    assert ids(got["meta"]) == [8, 9]
    assert reader.get_data(got["meta"])["a"].tolist() == [8, 9]
    end = reader.get_meta(["a"], 4, partition_id=partition, task_name="t")
    assert len(end) == 0 and len(reader.get_data(end).keys()) == 0
    assert client.get_production_status(partition_id=partition)["closed"] is True
    with pytest.raises(InvalidRequest, match="is closed; no more rows can be put into it"):
        client.put(TensorDict({"a": torch.arange(1)}, batch_size=[1]), partition_id=partition)
    with pytest.raises(UnknownPartition):
        client.close_partition(partition_id=queue.partition())


def test_closed_client_raises_client_closed(queue: Any) -> None:
    client = queue.new_client("closing")
    assert client.ping()["client_id"] == client.client_id
    client.close()
    with pytest.raises(ClientClosed, match="is closed"):
        client.ping()
    with pytest.raises(ClientClosed):
        client.get_meta(["a"], 1, partition_id="p", task_name="t")
    assert queue.client.ping()  # other clients are unaffected


def test_timeout_none_is_the_configured_default(fast_queue: Any) -> None:
    client, partition = fast_queue.client, fast_queue.partition()
    client.put(TensorDict({"a": torch.arange(2)}, batch_size=[2]), partition_id=partition)
    with pytest.raises(GetMetaTimeout, match=r"get_meta timed out after 2\.0 s: task 't' asked .* for 3 rows"):
        client.get_meta(["a"], 3, partition_id=partition, task_name="t", timeout=None)
    with pytest.raises(InvalidRequest, match=r"timeout must be a finite number of seconds > 0 \(or None\), got 0"):
        client.get_meta(["a"], 3, partition_id=partition, task_name="t", timeout=0)


def test_get_data_device(queue: Any) -> None:
    client, partition = queue.client, queue.partition()
    client.put(TensorDict({"a": torch.arange(3.0), "s": ["x", "y", "z"]}, batch_size=[3]), partition_id=partition)
    meta = client.get_meta(["a", "s"], 3, partition_id=partition, task_name="t")
    data = client.get_data(meta, device="cpu")
    assert data.device == torch.device("cpu") and data["a"].tolist() == [0.0, 1.0, 2.0]
    assert data.get("s").tolist() == ["x", "y", "z"]
    on_meta = client.get_data(meta.select_fields(["a"]), device=torch.device("meta"))
    assert on_meta["a"].device.type == "meta" and on_meta["a"].shape == (3,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_through_the_queue(queue: Any) -> None:
    client, partition = queue.client, queue.partition()
    dense = torch.randn(4, 8, device="cuda", dtype=torch.bfloat16)
    tokens = [torch.arange(n, device="cuda") for n in (1, 5, 2, 3)]
    batch = TensorDict(
        {"dense": dense, "tokens": torch.nested.nested_tensor(tokens, layout=torch.jagged)}, batch_size=[4]
    )
    client.put(batch, partition_id=partition)
    data = client.get_data(
        client.get_meta(["dense", "tokens"], 4, partition_id=partition, task_name="t"), device="cuda"
    )
    assert data["dense"].is_cuda and torch.equal(data["dense"], dense)
    assert data["tokens"].is_cuda and [t.tolist() for t in data["tokens"].unbind()] == [t.tolist() for t in tokens]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_through_the_queue_land_whole_after_their_page_locked_copies(queue: Any) -> None:
    """8 MiB a field, one of them strided on the GPU: sent from page-locked copies, received into page-locked
    buffers, then copied to the GPU without waiting per tensor; every byte arrives, in the meta's order."""
    client, partition = queue.client, queue.partition()
    wide = torch.randn(16, 1 << 17, device="cuda")
    strided = torch.randn(1 << 17, 16, device="cuda", dtype=torch.bfloat16).t()
    client.put(TensorDict({"wide": wide, "strided": strided}, batch_size=[16]), partition_id=partition)
    meta = client.get_meta(["wide", "strided"], 16, partition_id=partition, task_name="t")
    data = client.get_data(meta, device="cuda:0")
    order = torch.tensor(list(meta.global_indexes), device="cuda") - min(meta.global_indexes)
    assert data["wide"].device == torch.device("cuda:0") and torch.equal(data["wide"], wide[order])
    assert torch.equal(data["strided"], strided[order])


# ---- backpressure, validation before waiting, DP shares handed back ---------------------------------------------
def test_a_full_step_ring_makes_puts_wait_then_fail(fast_queue: Any) -> None:
    client = fast_queue.client
    first, second, third = fast_queue.step(), fast_queue.step(), fast_queue.step()
    rows = TensorDict({"x": torch.zeros(8, 4)}, batch_size=[8])
    client.put(rows, global_step=first)
    client.put(rows, global_step=second)
    with pytest.raises(QueueFull, match=rf"put to global_step={third} waited 1\.0 s for a free slot in the step ring"):
        client.put(rows, global_step=third, timeout=1)
    done: dict[str, Any] = {}
    parked = threading.Thread(target=lambda: done.update(meta=client.put(rows, global_step=third, timeout=30)))
    parked.start()  # waits for a slot ...
    fast_queue.new_client("trainer").clear(global_step=first)  # ... which a clear frees
    parked.join(timeout=30)
    assert done["meta"].partition_id == third and len(done["meta"]) == 8
    assert sorted(k for k in client.list_partitions() if isinstance(k, int) and k >= first) == [second, third]


def test_a_put_a_step_can_never_hold_fails_at_once_instead_of_waiting(fast_queue: Any) -> None:
    client, step = fast_queue.client, fast_queue.step()  # steps of 8 rows
    with pytest.raises(PartitionOverfilled, match=r"^a put of 9 rows can never fit global_step=\d+: a step holds at"):
        client.put(TensorDict({"x": torch.zeros(9)}, batch_size=[9]), global_step=step, timeout=30)


def test_a_full_storage_budget_makes_puts_wait_then_fail(fast_queue: Any) -> None:
    client, big, other = fast_queue.client, fast_queue.partition("big"), fast_queue.partition("other")
    rows = TensorDict({"x": torch.zeros(150, 1024)}, batch_size=[150])  # 600 KiB of the queue's 1 MiB
    client.put(rows, partition_id=big)
    with pytest.raises(QueueFull, match=rf"put to partition_id='{other}' waited 1\.0 s for storage space"):
        client.put(rows, partition_id=other, timeout=1)
    with pytest.raises(QueueFull, match="can never fit: the storage units hold 1048576 bytes in all"):
        client.put(TensorDict({"x": torch.zeros(300, 1024)}, batch_size=[300]), partition_id=other, timeout=1)
    done: dict[str, Any] = {}
    parked = threading.Thread(target=lambda: done.update(meta=client.put(rows, partition_id=other, timeout=30)))
    parked.start()
    fast_queue.new_client("trainer").clear(partition_id=big)
    parked.join(timeout=30)
    assert len(done["meta"]) == 150
    assert fast_queue.storage_bytes() == 150 * 1024 * 4


def test_validation_happens_before_any_waiting(grpo_queue: Any) -> None:
    client, step = grpo_queue.client, grpo_queue.step()  # the step is never opened: a valid get_meta would wait
    with pytest.raises(IncompleteGroups, match="batch_size=6 is not divisible by num_n_samples=4"):
        client.get_meta(["x"], 6, global_step=step, task_name="t", get_n_samples=True, timeout=60)
    with pytest.raises(InvalidRequest, match=r"dp_rank must lie in \[0, dp_size=2\), got dp_rank=5"):
        client.get_meta(
            ["x"], 4, global_step=step, task_name="t", sampler_params={"dp_rank": 5, "dp_size": 2}, timeout=60
        )
    with pytest.raises(InvalidRequest, match=r"data_fields names a field twice: \['x', 'x'\]"):
        client.get_meta(["x", "x"], 4, global_step=step, task_name="t", timeout=60)


def test_a_released_dp_share_is_served_again(queue: Any) -> None:
    client, partition = queue.client, queue.partition()
    client.put(TensorDict({"x": torch.arange(8)}, batch_size=[8]), partition_id=partition)

    def share(rank: int, round_id: str) -> BatchMeta:
        params = {"dp_rank": rank, "dp_size": 2, "dp_group_id": round_id}
        return client.get_meta(["x"], 2, partition_id=partition, task_name="train", sampler_params=params)

    rank0, rank1 = share(0, "r0"), share(1, "r0")
    assert ids(rank0) == [0, 1] and ids(rank1) == [2, 3]
    client.release(rank1)  # rank 1 crashed before training on its share: hand it back
    with pytest.raises(InvalidRequest, match="the share of dp_rank=1 in dp_group_id 'r0' was released"):
        share(1, "r0")
    later = ids(share(0, "r1")) + ids(share(1, "r1"))
    client.close_partition(partition_id=partition)
    later += ids(share(0, "r2")) + ids(share(1, "r2"))  # the final short round
    assert sorted(later) == [2, 3, 4, 5, 6, 7]  # the released rows come back, and nothing twice
    assert len(share(0, "r3")) == 0


# ---- errors cross the wire typed; the queue keeps serving -----------------------------------------------------
def test_typed_errors_keep_type_and_message_and_the_queue_keeps_serving(queue: Any) -> None:
    client, step, partition = queue.client, queue.step(), queue.partition()
    good = TensorDict({"x": torch.randn(4, 3), "s": ["a", "b", "c", "d"]}, batch_size=[4])
    client.put(good, partition_id=partition)
    client.put(TensorDict({"x": torch.randn(16, 3)}, batch_size=[16]), global_step=step)

    checks = itertools.count()

    def still_serving() -> None:  # a new task each time reads the first rows again: the data is unchanged
        meta = client.get_meta(["x", "s"], 4, partition_id=partition, task_name=f"check{next(checks)}")
        data = client.get_data(meta)
        assert torch.equal(data["x"], good["x"]) and data.get("s").tolist() == ["a", "b", "c", "d"]

    errors: list[tuple[type[TransferQueueError], str, Callable[[], Any]]] = [
        (
            SchemaMismatch,
            rf"field 'x' is stored as dense float32\[3\] in partition_id='{partition}'; the put has dense int64\[3\]",
            lambda: client.put(
                TensorDict({"x": torch.zeros(2, 3, dtype=torch.int64)}, batch_size=[2]), partition_id=partition
            ),
        ),
        (
            SchemaMismatch,
            r"field 's' is stored as object .*; the put has dense float32\[\]",
            lambda: client.put(TensorDict({"s": torch.zeros(2)}, batch_size=[2]), partition_id=partition),
        ),
        (
            PartitionOverfilled,
            rf"a put of 1 rows overfills global_step={step}: it holds 16 rows .* and 16 are already taken",
            lambda: client.put(TensorDict({"x": torch.randn(1, 3)}, batch_size=[1]), global_step=step),
        ),
        (
            BatchSizeMismatch,
            r"the metadata names 4 rows; the data has 2",
            lambda: client.put(
                TensorDict({"y": torch.zeros(2)}, batch_size=[2]),
                metadata=client.put(
                    TensorDict({"x": torch.randn(4, 3), "s": list("wxyz")}, batch_size=[4]), partition_id=partition
                ),
            ),
        ),
        (
            InvalidRequest,
            r"dp_rank must lie in \[0, dp_size=2\), got dp_rank=2",
            lambda: client.get_meta(
                ["x"], 2, partition_id=partition, task_name="t", sampler_params={"dp_rank": 2, "dp_size": 2}
            ),
        ),
        (
            InvalidRequest,
            r"batch_size must be an int >= 1, got 0",
            lambda: client.get_meta(["x"], 0, partition_id=partition, task_name="t"),
        ),
        (
            UnknownField,
            r"fields \['nope'\] are not in this batch; it has \['x'\]",
            lambda: client.get_data(
                client.get_meta(["x"], 1, partition_id=partition, task_name="u").select_fields(["nope"])
            ),
        ),
    ]
    for error_type, message, call in errors:
        with pytest.raises(error_type, match=message) as caught:
            call()
        assert type(caught.value) is error_type
        still_serving()


# ---- stale metadata --------------------------------------------------------------------------------------------
def test_stale_batch_meta_never_reads_other_bytes(queue: Any) -> None:
    client, partition = queue.client, queue.partition()
    client.put(TensorDict({"a": torch.full((4,), 1.0)}, batch_size=[4]), partition_id=partition)
    old = client.get_meta(["a"], 4, partition_id=partition, task_name="t")
    client.clear(partition_id=partition)
    with pytest.raises(StaleBatchMeta, match="cleared"):
        client.get_data(old)
    # The id is used again: a new partition, new bytes; the old meta still reads nothing.
    client.put(TensorDict({"a": torch.full((4,), 2.0)}, batch_size=[4]), partition_id=partition)
    with pytest.raises(StaleBatchMeta):
        client.get_data(old)
    with pytest.raises(StaleBatchMeta, match=f"before a clear of partition_id='{partition}'"):
        client.put(TensorDict({"b": torch.zeros(4)}, batch_size=[4]), metadata=old)
    new = client.get_meta(["a"], 4, partition_id=partition, task_name="t")
    assert client.get_data(new)["a"].tolist() == [2.0] * 4
    with pytest.raises(StaleBatchMeta, match="was cleared"):  # releasing a stale meta is an error like any use
        client.release(old)


# ---- the async client, event loops, other processes ------------------------------------------------------------
def test_async_client_same_methods_as_coroutines(queue: Any) -> None:
    partition, step = queue.partition(), queue.step()

    async def main() -> None:
        client = AsyncTransferQueueClient("async", queue.info)
        assert (await client.ping())["client_id"] == client.client_id
        # A get_meta parked before the data exists is served by a put on the same client and loop.
        waiting = asyncio.ensure_future(client.get_meta(["a"], 4, partition_id=partition, task_name="t"))
        await asyncio.sleep(0)
        await client.put(TensorDict({"a": torch.arange(6)}, batch_size=[6]), partition_id=partition)
        meta = await waiting
        assert ids(meta) == [0, 1, 2, 3]
        assert (await client.get_data(meta, device="cpu"))["a"].tolist() == [0, 1, 2, 3]
        await client.release(meta.select_samples([0]))
        await client.close_partition(partition_id=partition)
        assert sorted(ids(await client.get_meta(["a"], 4, partition_id=partition, task_name="t"))) == [0, 4, 5]
        assert len(await client.get_meta(["a"], 4, partition_id=partition, task_name="t")) == 0
        await client.reset_consumption("t", partition_id=partition)
        assert (await client.get_consumption_status(partition_id=partition))["tasks"] == {}
        assert (await client.get_production_status(partition_id=partition))["rows"] == 6
        assert partition in await client.list_partitions()
        await client.put(TensorDict({"a": torch.arange(16)}, batch_size=[16]), global_step=step)
        await client.clear(global_step=step)
        await client.kv_put("k", queue.partition("kv"), {"v": torch.tensor([1.0])})
        with pytest.raises(GetMetaTimeout):
            await client.get_meta(["zzz"], 1, partition_id=partition, task_name="t", timeout=0.5)
        client.close()
        with pytest.raises(ClientClosed):
            await client.ping()

    asyncio.run(main())


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_async_client_across_many_event_loops(queue: Any) -> None:
    """One ``asyncio.run`` per call: each loop's sockets are closed once a later loop starts, none pile up."""
    client = AsyncTransferQueueClient("many-loops", queue.info)
    assert asyncio.run(client.ping())["client_id"] == client.client_id
    before = open_fds()
    for _ in range(40):
        assert asyncio.run(client.ping())["client_id"] == client.client_id
    assert open_fds() - before < 10
    client.close()


def test_one_sync_client_shared_by_threads(queue: Any) -> None:
    client, partitions = queue.new_client("shared"), [queue.partition(f"thread{i}") for i in range(4)]
    failures: list[BaseException] = []

    def work(partition: str, seed: int) -> None:
        try:
            for i in range(15):
                values = torch.full((3, 8), float(seed * 100 + i))
                client.put(TensorDict({"x": values}, batch_size=[3]), partition_id=partition)
                meta = client.get_meta(["x"], 3, partition_id=partition, task_name="t")
                assert torch.equal(client.get_data(meta)["x"], values)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(p, i)) for i, p in enumerate(partitions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures, failures[0]


def test_a_sync_client_used_from_short_lived_threads_keeps_no_socket_per_thread(queue: Any) -> None:
    """Each thread uses its own connections; when the thread ends they go back to the client and the next thread
    takes them (a thread pool keeps as many as it runs at once, not one set per thread it saw, else it leaks them
    on both sides and every server poll walks them all)."""
    client, partition = queue.new_client("threads"), queue.partition()
    client.put(TensorDict({"x": torch.arange(4)}, batch_size=[4]), partition_id=partition)
    client.get_production_status(partition_id=partition)  # this thread's own connections exist before counting
    before = open_fds()
    for _ in range(30):
        thread = threading.Thread(target=lambda: client.get_production_status(partition_id=partition))
        thread.start()
        thread.join(timeout=30)
    gc.collect()
    assert open_fds() - before < 5
    meta = client.get_meta(["x"], 4, partition_id=partition, task_name="t")  # the client still works
    assert client.get_data(meta)["x"].tolist() == [0, 1, 2, 3]
    client.close()


def test_sync_client_inside_a_running_event_loop(queue: Any) -> None:
    client, partition = queue.client, queue.partition()

    async def inside() -> list[int]:
        client.put(TensorDict({"a": torch.arange(3)}, batch_size=[3]), partition_id=partition)
        meta = client.get_meta(["a"], 3, partition_id=partition, task_name="t")
        return client.get_data(meta)["a"].tolist()

    assert asyncio.run(inside()) == [0, 1, 2]


SUBPROCESS_CLIENT = """
import pickle, sys, torch
from tensordict import TensorDict
from transfer_queue import TransferQueueClient
info, partition = pickle.load(sys.stdin.buffer)
client = TransferQueueClient(client_id="subprocess", controller_info=info)
client.put(TensorDict({"a": torch.arange(5) * 3}, batch_size=[5]), partition_id=partition)
meta = client.get_meta(["a", "from_parent"], 2, partition_id=partition, task_name="child")
print(client.get_data(meta)["from_parent"].tolist())
client.close()
"""


def test_client_in_a_plain_subprocess(queue: Any) -> None:
    partition = queue.partition()
    queue.client.put(
        TensorDict({"a": torch.arange(2), "from_parent": ["p0", "p1"]}, batch_size=[2]), partition_id=partition
    )
    done = subprocess.run(
        [sys.executable, "-c", SUBPROCESS_CLIENT],
        input=pickle.dumps((queue.info, partition)),
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert done.stdout.decode().strip().splitlines()[-1] == "['p0', 'p1']"
    meta = queue.client.get_meta(["a"], 7, partition_id=partition, task_name="parent")
    assert queue.client.get_data(meta)["a"].tolist() == [0, 1, 0, 3, 6, 9, 12]


# ---- kv ------------------------------------------------------------------------------------------------------------
def test_kv_calls_take_a_bare_str_as_one_key(queue: Any) -> None:
    client, partition = queue.client, queue.partition("kv-str")
    client.kv_batch_put(["a", "b", "ab"], partition, {"score": torch.tensor([1.0, 2.0, 3.0])})
    client.kv_batch_put("b", partition, {"score": torch.tensor([20.0])})  # one key, one row
    assert client.kv_batch_get("ab", partition, select_fields="score")["score"].tolist() == [3.0]
    client.kv_clear("ab", partition)  # only the key 'ab': never 'a' and 'b'
    assert client.kv_list(partition) == ["a", "b"]
    assert client.kv_batch_get(["a", "b"], partition)["score"].tolist() == [1.0, 20.0]


def test_kv_insert_upsert_tags_get_list_clear(queue: Any) -> None:
    client, partition = queue.client, queue.partition("kv")
    meta = client.kv_batch_put(
        ["a", "b", "c"],
        partition,
        {"score": torch.tensor([1.0, 2.0, 3.0]), "text": ["ta", "tb", "tc"]},
        tags=[{"v": 1}, {"v": 1}, {"v": 1}],
    )
    assert meta.keys == ["a", "b", "c"]
    before_d = client.get_production_status(partition_id=partition)["bytes"]
    client.kv_put("d", partition, {"score": torch.tensor(4.0), "text": "td"}, tag={"v": 2})
    bytes_of_d = client.get_production_status(partition_id=partition)["bytes"] - before_d
    assert bytes_of_d > 0
    assert client.kv_list(partition) == ["a", "b", "c", "d"]
    # Upsert: existing keys get new values, a new key gets a new row.
    client.kv_batch_put(["c", "e", "a"], partition, {"score": torch.tensor([30.0, 50.0, 10.0])}, tags=[{"v": 3}] * 3)
    assert client.kv_list(partition) == ["a", "b", "c", "d", "e"]
    data = client.kv_batch_get(["e", "a", "d", "c"], partition, select_fields=["score"])
    assert data["score"].tolist() == [50.0, 10.0, 4.0, 30.0]
    # tags are the rows' custom meta (as upstream's), not a field
    assert client.kv_list(partition, with_tags=True) == {
        k: {"v": v} for k, v in zip("abcde", [3, 1, 3, 2, 3], strict=True)
    }
    both = client.kv_batch_get(["b", "d"], partition)  # default: the fields every asked key has
    assert set(both.keys()) == {"score", "text"} and both.get("text").tolist() == ["tb", "td"]
    assert set(client.kv_batch_get(["e"], partition).keys()) == {"score"}
    with pytest.raises(UnknownField, match=r"field 'text' is not set for keys \['e'\]"):
        client.kv_batch_get(["a", "e"], partition, select_fields=["text"])
    with pytest.raises(UnknownKey, match=r"keys \['zz'\] are not in"):
        client.kv_batch_get(["a", "zz"], partition)
    held = client.get_production_status(partition_id=partition)["bytes"]
    client.kv_clear(["b", "zz"], partition)  # unknown keys are ignored
    assert client.kv_list(partition) == ["a", "c", "d", "e"]
    # Bytes are freed block by block: b's block still holds a and c, so nothing is freed yet ...
    assert client.get_production_status(partition_id=partition)["bytes"] == held
    assert client.kv_batch_get(["d"], partition)["score"].tolist() == [4.0]
    client.kv_clear(["d"], partition)  # ... d's block held d alone: exactly its bytes are freed
    assert client.get_production_status(partition_id=partition)["bytes"] == held - bytes_of_d
    assert client.kv_list(partition) == ["a", "c", "e"]
    client.kv_clear(None, partition)  # the whole partition
    assert client.kv_list(partition) == []
    row_partition = queue.partition()
    client.put(TensorDict({"a": torch.zeros(1)}, batch_size=[1]), partition_id=row_partition)
    with pytest.raises(InvalidRequest, match=f"partition_id='{row_partition}' is used by row"):
        client.kv_list(row_partition)


# ---- StreamingDataset / StreamingDataLoader ------------------------------------------------------------------------
def closed_text_partition(queue: Any, rows: int) -> str:
    partition = queue.partition("stream")
    for start in range(0, rows, 7):
        n = min(7, rows - start)
        queue.client.put(
            TensorDict({"text": [f"row{start + i}" for i in range(n)]}, batch_size=[n]), partition_id=partition
        )
    queue.client.close_partition(partition_id=partition)
    return partition


def test_streaming_dataset_two_dp_ranks(queue: Any) -> None:
    partition = closed_text_partition(queue, 23)
    seen: dict[int, list[str]] = {}

    def rank(dp_rank: int) -> None:
        dataset = StreamingDataset(
            ["text"],
            batch_size=3,
            partition_id=partition,
            task_name="train",
            dp_rank=dp_rank,
            dp_size=2,
            controller_info=queue.info,
        )
        seen[dp_rank] = [s for data, meta in dataset for s in data.get("text").tolist()]

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not set(seen[0]) & set(seen[1])
    # Rounds of 6 rows: three full ones; the short last round (5 rows) is dropped on both ranks (drop_last).
    assert len(seen[0]) == len(seen[1]) == 9
    assert sorted(seen[0] + seen[1]) == sorted(f"row{i}" for i in range(18))


def test_streaming_dataloader_with_workers(queue: Any) -> None:
    partition = closed_text_partition(queue, 30)
    seen: dict[int, list[str]] = {}
    for dp_rank in (0, 1):
        dataset = StreamingDataset(
            ["text"],
            batch_size=2,
            partition_id=partition,
            task_name="train",
            dp_rank=dp_rank,
            dp_size=2,
            micro_batch_size=1,
            controller_info=queue.info,
        )
        loader = StreamingDataLoader(dataset, num_workers=2)
        seen[dp_rank] = []
        for data, meta in loader:
            assert len(meta) == 1 and meta.extra["dp_rank"] == dp_rank
            seen[dp_rank] += data.get("text").tolist()
    assert not set(seen[0]) & set(seen[1])
    # Rounds of 4 rows in round order on each rank; the short last round (2 rows) is dropped on both.
    assert seen[0] == [f"row{i}" for r in range(0, 28, 4) for i in (r, r + 1)]
    assert seen[1] == [f"row{i}" for r in range(0, 28, 4) for i in (r + 2, r + 3)]


def test_a_second_pass_over_a_streaming_dataset_takes_new_rounds(queue: Any) -> None:
    partition = closed_text_partition(queue, 6)
    dataset = StreamingDataset(
        ["text"], batch_size=2, partition_id=partition, task_name="epochs", controller_info=queue.info
    )
    first = [s for data, _ in dataset for s in data.get("text").tolist()]
    assert [s for data, _ in dataset for s in data.get("text").tolist()] == []  # every row consumed by the task
    queue.client.reset_consumption(task_name="epochs", partition_id=partition)
    second = [s for data, _ in dataset for s in data.get("text").tolist()]
    assert sorted(first) == sorted(second) == sorted(f"row{i}" for i in range(6))
    assert dataset.epoch == 3
