"""Issue 8 section 2 against a live queue: a dead producer's reservation is freed (4), TP peers over their own
connections share an automatic DP round (6), kv_batch_get racing kv_put (12), a commit whose reply was lost (13)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from transfer_queue.errors import RequestTimeout
from transfer_queue.metadata import FieldSchema
from transfer_queue.wire import protocol as p
from transfer_queue.wire.transport import run_sync


def ids(meta: Any) -> list[int]:
    return meta.global_indexes.tolist()


def test_a_closed_producers_reservation_is_freed_after_the_disconnect_grace(fast_queue: Any, wait_until: Any) -> None:
    partition = fast_queue.partition()
    producer = fast_queue.new_client("producer")
    producer.put({"x": torch.zeros(1)}, partition_id=partition)  # opens the partition
    inner = producer._client
    # a producer that reserved rows with a huge timeout and then died before it wrote them
    reserve = p.Reserve(partition, 4, {"x": FieldSchema("dense", "float32", ())}, 16, timeout=1e5)
    reservation = run_sync(inner._control(reserve, p.Reservation, 5.0))
    status = fast_queue.client.get_production_status(partition_id=partition)
    assert status["rows_in_flight"] == 4
    producer.close()  # its process died: the connection closes, the put never commits
    wait_until(
        lambda: fast_queue.watcher.get_production_status(partition_id=partition)["rows_in_flight"] == 0,
        timeout=15.0,
        what="the closed producer's reservation to be aborted",
    )
    assert fast_queue.watcher.get_production_status(partition_id=partition)["rows"] == 1
    assert reservation.put_id > 0


def test_tp_peers_of_one_dp_rank_over_their_own_connections_get_the_same_share(queue: Any) -> None:
    step = queue.step()
    queue.client.put({"x": torch.arange(16.0)}, global_step=step)
    tp0, tp1, other = queue.new_client("tp0"), queue.new_client("tp1"), queue.new_client("rank1")

    def get(client: Any, rank: int) -> list[int]:
        params = {"dp_rank": rank, "dp_size": 2}
        return ids(client.get_meta(["x"], 2, global_step=step, task_name="tp", sampler_params=params))

    base = step * queue.config["global_batch_size"]  # global index of the step's row 0 (groups of 1)
    for expected in ([0, 1], [4, 5]):
        first, second, peer = get(tp0, 0), get(tp1, 0), get(other, 1)
        assert first == second == [base + i for i in expected]
        assert not set(first) & set(peer)


def test_kv_batch_get_racing_a_kv_put_of_the_same_key_reads_a_whole_value(queue: Any, wait_until: Any) -> None:
    partition = queue.partition("kv")
    reader, writer = queue.client, queue.new_client("writer")
    writer.kv_put("k", partition, {"v": torch.full((64,), 1.0), "w": torch.full((8,), 1.0)})
    held = queue.storage_bytes()
    inner, read = reader._client, reader._client.get_data
    raced = []

    async def get_data_after_an_overwrite(meta: Any, *args: Any, **kwargs: Any) -> TensorDict:
        if not raced:  # between the lookup and the read: the key gets a new value and its old payload is dropped
            raced.append(meta)
            writer.kv_put("k", partition, {"v": torch.full((64,), 2.0), "w": torch.full((8,), 2.0)})
            wait_until(lambda: queue.storage_bytes() == held, what="the old value's payload to be dropped")
        return await read(meta, *args, **kwargs)

    inner.get_data = get_data_after_an_overwrite
    try:
        got = reader.kv_batch_get(["k"], partition)
    finally:
        del inner.get_data
    assert raced
    assert torch.equal(got["v"][0], torch.full((64,), 2.0)) and torch.equal(got["w"][0], torch.full((8,), 2.0))


def test_a_commit_whose_reply_is_lost_is_retried_without_doubling_rows(queue: Any) -> None:
    partition = queue.partition()
    client = queue.client
    inner, control = client._client, client._client._control
    lost = []

    async def control_losing_the_first_commit_reply(body: Any, *args: Any) -> Any:
        reply = await control(body, *args)
        if isinstance(body, p.Commit) and not lost:
            lost.append(reply)
            raise RequestTimeout("the controller at ... did not answer (is it alive?): no reply (simulated loss)")
        return reply

    inner._control = control_losing_the_first_commit_reply
    try:
        meta = client.put({"x": torch.arange(4.0)}, partition_id=partition)
    finally:
        del inner._control
    assert lost and ids(meta) == [0, 1, 2, 3]
    assert client.get_production_status(partition_id=partition)["rows"] == 4
    data = client.get_data(client.get_meta(["x"], 4, partition_id=partition, task_name="t"))
    assert np.array_equal(data["x"].numpy(), np.arange(4.0, dtype=np.float32))
