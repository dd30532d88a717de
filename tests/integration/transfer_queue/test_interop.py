"""Issue 14 through a real queue: what upstream TransferQueue users' code sends and calls."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import ray
import torch
from tensordict import TensorDict

import transfer_queue as tq
from transfer_queue.errors import (
    BatchSizeMismatch,
    InvalidRequest,
    InvalidSampler,
    SchemaMismatch,
    UnsupportedValue,
)
from transfer_queue.interface import _defaults
from transfer_queue.interop import from_dataproto, to_dataproto
from transfer_queue.wire.protocol import ControllerInfo

PROMOTING_QUEUE = {
    "global_batch_size": 4,
    "num_global_batch": 2,
    "default_timeout": 15.0,
    "num_storage_units": 1,
    "promote_jagged": True,
}


@pytest.fixture
def module_client(queue: Any) -> Any:
    """The module-level calls on this test's client."""
    tq.set_default_client(queue.client)
    yield queue.client
    _defaults.clear()


def test_numpy_non_tensor_arrays_round_trip_through_the_queue(queue: Any) -> None:
    partition = queue.partition()
    td = TensorDict({"ids": torch.arange(3)}, batch_size=[3])
    td.set_non_tensor("uid", np.array(["a", "b", "c"], dtype=object))
    td.set_non_tensor("source", np.array(["gsm8k", "math", "gsm8k"]))
    td.set_non_tensor("raw", np.array([{"k": 1}, [1, 2], None], dtype=object))
    queue.client.put(td, partition_id=partition)
    meta = queue.client.get_meta(["ids", "uid", "source", "raw"], 3, partition_id=partition)
    back = queue.client.get_data(meta.select_samples([2, 0]))
    assert back["source"].dtype.kind == "U" and back["source"].tolist() == ["gsm8k", "gsm8k"]
    assert back["uid"].dtype == object and back["uid"].tolist() == ["c", "a"]
    assert back["raw"].tolist() == [None, {"k": 1}]


def test_jagged_on_request_and_promotion_on_a_shape_change(queue: Any, make_view: Any) -> None:
    client, partition = queue.client, queue.partition()
    client.put({"resp": torch.ones(2, 3)}, partition_id=partition, jagged=["resp"])
    client.put({"resp": torch.ones(1, 5)}, partition_id=partition, jagged=["resp"])
    with pytest.raises(SchemaMismatch, match=r"stored as jagged float32\[\*\] .* the put has dense float32\[5\]"):
        client.put({"resp": torch.ones(1, 5)}, partition_id=partition)  # the default stays a mismatch
    got = client.get_data(client.get_meta("resp", 3, partition_id=partition))["resp"]
    assert [len(r) for r in got.unbind()] == [3, 3, 5]

    promoting = make_view(**PROMOTING_QUEUE)
    other = promoting.partition()
    promoting.client.put({"resp": torch.arange(6).reshape(2, 3)}, partition_id=other)
    meta = promoting.client.put({"resp": torch.arange(4).reshape(1, 4)}, partition_id=other)
    assert meta.fields["resp"].kind == "jagged"
    got = promoting.client.get_data(promoting.client.get_meta("resp", 3, partition_id=other))["resp"]
    assert [r.tolist() for r in got.unbind()] == [[0, 1, 2], [3, 4, 5], [0, 1, 2, 3]]  # dense blocks read jagged


def test_dataproto_shaped_batches_round_trip(queue: Any) -> None:
    from tests.unit.transfer_queue.test_interop_values import FakeDataProto, proto

    partition, original = queue.partition(), proto()
    queue.client.put(from_dataproto(original), partition_id=partition)
    meta = queue.client.get_meta(["input_ids", "responses", "uid", "meta_info"], 3, partition_id=partition)
    back = to_dataproto(queue.client.get_data(meta), dataproto_cls=FakeDataProto)
    assert back.meta_info == original.meta_info and back.batch["input_ids"].tolist() == [
        r.tolist() for r in original.batch["input_ids"]
    ]
    assert back.non_tensor_batch["uid"].tolist() == original.non_tensor_batch["uid"].tolist()


def test_untyped_errors_of_before_are_typed(queue: Any) -> None:
    client, partition = queue.client, queue.partition("kv")
    with pytest.raises(BatchSizeMismatch, match="3 keys but 2 rows of fields"):
        client.kv_batch_put(["a", "b", "c"], partition, {"x": torch.zeros(2)})
    with pytest.raises(BatchSizeMismatch, match="fields of one put must have the same number of rows"):
        client.kv_batch_put(["a", "b"], partition, {"x": torch.zeros(2), "y": torch.zeros(3)})
    with pytest.raises(InvalidRequest, match="kv_put needs fields or a tag; got neither"):
        client.kv_put("a", partition, None)
    meta = client.put({"x": torch.zeros(1)}, partition_id=queue.partition())
    if not torch.cuda.is_available():
        with pytest.raises(InvalidRequest, match=r"device='cuda' asked for, but torch.cuda.is_available\(\) is False"):
            client.get_data(meta, device="cuda")
    with pytest.raises(InvalidRequest, match="device='nonsense' is not a torch device"):
        client.get_data(meta, device="nonsense")
    with pytest.raises(InvalidRequest, match="data_fields must be a field name or a list of them, got 3"):
        client.get_meta(3, 1, partition_id=partition)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="put's metadata must be a BatchMeta"):
        client.put({"x": torch.zeros(1)}, metadata={"rows": [0]})  # type: ignore[arg-type]
    with pytest.raises(UnsupportedValue, match="a GetMeta request cannot be encoded"):
        client.get_meta("x", 1, partition_id=partition, sampler_params={"junk": object()})
    with pytest.raises(InvalidSampler, match="got int"):
        tq.register_sampler("task", 42)  # refused here, before Ray
    with pytest.raises(InvalidSampler, match="got int"):
        ray.get(queue.controller.register_sampler.remote("task", 42))  # and typed through Ray too


def test_module_level_kv_calls_tags_and_batch_one_tensordicts(module_client: Any, queue: Any) -> None:
    partition = queue.partition("kv")
    meta = tq.kv_put("k1", partition, TensorDict({"ids": torch.tensor([[1, 2, 3]])}, batch_size=[1]), tag={"s": 1})
    assert meta.custom_meta == [{"s": 1}]
    assert tq.kv_batch_get("k1", partition)["ids"].shape == (1, 3)  # one row of shape [3], not [1, 1, 3]
    tq.kv_put("k1", partition, {"reward": torch.tensor(0.5)})
    assert set(tq.kv_batch_get_by_meta(meta).keys()) == {"ids", "reward"}  # every field its key has now
    tq.kv_put("k1", partition, None, tag={"s": 2})  # tag-only update: no field written
    tq.kv_put("k2", partition, {}, tag={"s": 3})  # a new key from its tag alone
    tq.kv_batch_put(["k3"], partition, {"ids": torch.tensor([[4, 5, 6]])})
    assert tq.kv_list(partition) == {partition: {"k1": {"s": 2}, "k2": {"s": 3}, "k3": {}}}
    assert tq.kv_list()[partition] == tq.kv_list(partition)[partition]
    assert tq.kv_list("no-such-partition") == {}
    tq.kv_clear(["k2"], partition)

    async def async_calls() -> Any:
        await tq.async_kv_put("k4", partition, {"ids": torch.tensor([7, 8, 9])}, tag={"s": 4})
        got = await tq.async_kv_batch_get(["k4", "k3"], partition, "ids")
        listed = await tq.async_kv_list(partition)
        await tq.async_kv_clear(None, partition)
        return got, listed

    got, listed = asyncio.run(async_calls())
    assert got["ids"].tolist() == [[7, 8, 9], [4, 5, 6]] and list(listed[partition]) == ["k1", "k3", "k4"]
    assert tq.kv_list(partition) == {}


def test_custom_meta_peek_clear_samples_and_status_words(queue: Any) -> None:
    client, partition = queue.client, queue.partition()
    put = client.put({"x": torch.arange(4.0)}, partition_id=partition)
    some = put.select_samples([0, 2])
    some.update_custom_meta([{"w": 0}, {"w": 1}])
    client.set_custom_meta(some)  # upstream's way: the meta's own values
    client.set_custom_meta(put.select_samples([2]), [{"w": 2}])
    assert client.get_custom_meta(put) == [{"w": 0}, {}, {"w": 2}, {}]
    peeked = client.get_meta("x", 4, partition_id=partition, task_name="t", peek=True)
    assert peeked.custom_meta == [{"w": 0}, {}, {"w": 2}, {}]
    assert not client.check_consumption_status("t", partition)  # a peek consumes nothing
    assert client.check_production_status(["x"], partition)
    assert not client.check_production_status(["x", "y"], partition_id=partition)
    assert not client.check_production_status(["x"], partition_id="never-opened")
    client.clear_samples(put.select_samples([1]))
    got = client.get_meta("x", 3, partition_id=partition, task_name="t")
    assert got.global_indexes.tolist() == [0, 2, 3] and client.check_consumption_status("t", partition)
    assert client.get_data(got)["x"].tolist() == [0.0, 2.0, 3.0]
    step = queue.step()  # a step is produced once all its global_batch_size rows are
    client.put({"x": torch.zeros(8)}, global_step=step)
    assert not client.check_production_status("x", global_step=step)
    client.put({"x": torch.zeros(8)}, global_step=step)
    assert client.check_production_status("x", global_step=step)


def test_controller_info_as_json_serves_a_new_client(queue: Any) -> None:
    info = ControllerInfo.from_json(queue.info.to_json())
    client = tq.TransferQueueClient(client_id="from-json", controller_info=info)
    try:
        assert client.ping()["client_id"] == "from-json"
    finally:
        client.close()


def test_a_user_group_sampler_serves_whole_groups(grpo_queue: Any) -> None:
    from tests.unit.transfer_queue.test_interop_values import LastGroupsFirst  # importable by the controller's process

    client, step = grpo_queue.client, grpo_queue.step()
    ray.get(grpo_queue.controller.register_sampler.remote("groups_task", LastGroupsFirst()))
    # members of groups 0..3 (4 each) arrive interleaved over two puts; group 3 stays incomplete
    client.put({"x": torch.arange(8)}, global_step=step, group_ids=[0, 1, 2, 3, 0, 1, 2, 3])
    client.put({"x": torch.arange(8, 14)}, global_step=step, group_ids=[0, 1, 2, 0, 1, 2])
    meta = client.get_meta("x", 8, global_step=step, task_name="groups_task", get_n_samples=True, timeout=5)
    groups = meta.group_ids.tolist()
    assert groups == [2, 2, 2, 2, 1, 1, 1, 1]  # the newest complete groups, whole, members side by side
