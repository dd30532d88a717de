"""The integration tier's core cases over both transports: the Unix socket (same host) and ZeroMQ over TCP with
CURVE (the path clients on other hosts take), forced on one host with ``force_tcp`` / TRANSFER_QUEUE_TRANSPORT."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict

import transfer_queue
from transfer_queue import TransferQueueClient
from transfer_queue.errors import InvalidRequest
from transfer_queue.wire.sockets import TRANSPORT_ENV
from transfer_queue.wire.transport import BlockingTransport


@pytest.fixture(params=["unix", "tcp"])
def over(request: pytest.FixtureRequest) -> Any:
    """``over(queue)``: a client of that queue talking over this test's transport; closed at the end."""
    clients: list[TransferQueueClient] = []

    def make(queue: Any) -> TransferQueueClient:
        client = TransferQueueClient(
            client_id=f"over-{request.param}", controller_info=queue.info, force_tcp=request.param == "tcp"
        )
        clients.append(client)
        return client

    make.transport = request.param  # type: ignore[attr-defined]
    yield make
    for client in clients:
        transport = client._client._transport
        assert isinstance(transport, BlockingTransport)
        used_unix = bool(transport._local.__dict__.get("unix"))  # this thread's Unix connections
        assert used_unix == (request.param == "unix"), "the client did not take the transport under test"
        client.close()


def test_put_get_meta_get_data(queue: Any, over: Any) -> None:
    client, step = over(queue), queue.step()
    data = TensorDict(
        {"x": torch.arange(8, dtype=torch.float32).unsqueeze(1).expand(8, 256).contiguous(), "t": list("abcdefgh")},
        batch_size=[8],
    )
    client.put(data, global_step=step)
    meta = client.get_meta(["x", "t"], 8, global_step=step, task_name="core")
    got = client.get_data(meta)
    assert torch.equal(got["x"], data["x"]) and list(got["t"]) == list("abcdefgh")


def test_a_read_across_several_puts_blocks_in_order(queue: Any, over: Any) -> None:
    """A unit sends the runs of several blocks end to end as one frame (a GatheredFrame; ZeroMQ joins it)."""
    client, step = over(queue), queue.step()
    parts = [
        TensorDict(
            {
                "x": torch.arange(i * 4, i * 4 + 4, dtype=torch.float64).unsqueeze(1).expand(4, 64).contiguous(),
                "r": torch.nested.nested_tensor([torch.arange(i * 4 + k) for k in range(4)], layout=torch.jagged),
            },
            batch_size=[4],
        )
        for i in range(3)
    ]
    for part in parts:
        client.put(part, global_step=step)
    got = client.get_data(client.get_meta(["x", "r"], 12, global_step=step, task_name="runs"))
    order = got["x"][:, 0].long().tolist()
    assert sorted(order) == list(range(12))
    for k, row in enumerate(order):
        assert torch.equal(got["x"][k], parts[row // 4]["x"][row % 4])
        assert torch.equal(got["r"][k], torch.arange(row))


def test_grpo_groups(grpo_queue: Any, over: Any) -> None:
    client, step = over(grpo_queue), grpo_queue.step()
    client.put(TensorDict({"x": torch.arange(8)}, batch_size=[8]), global_step=step, group_ids=[1, 2] * 4)
    meta = client.get_meta(["x"], 4, global_step=step, task_name="g", get_n_samples=True)
    groups = meta.group_ids.tolist()
    assert len(set(groups)) == 1 and sorted(client.get_data(meta)["x"].tolist()) == [
        i for i in range(8) if [1, 2][i % 2] == groups[0]
    ]


def test_dp_round(queue: Any, over: Any) -> None:
    client, partition = over(queue), queue.partition()
    client.put(TensorDict({"x": torch.arange(8)}, batch_size=[8]), partition_id=partition)
    shares = [
        client.get_meta(
            ["x"],
            4,
            partition_id=partition,
            task_name="dp",
            sampler_params={"dp_rank": r, "dp_size": 2, "dp_group_id": "r"},
        )
        for r in (0, 1, 0)
    ]
    assert shares[0].global_indexes.tolist() == shares[2].global_indexes.tolist()  # a TP peer gets the same share
    assert sorted(shares[0].global_indexes.tolist() + shares[1].global_indexes.tolist()) == list(range(8))


def test_kv(queue: Any, over: Any) -> None:
    client, partition = over(queue), queue.partition("kv")
    client.kv_batch_put(["a", "b"], partition, {"score": torch.tensor([1.0, 2.0])})
    client.kv_put("a", partition, {"score": torch.tensor(10.0)})
    assert client.kv_batch_get(["b", "a"], partition)["score"].tolist() == [2.0, 10.0]


def test_the_environment_variable_forces_tcp(queue: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRANSPORT_ENV, "tcp")
    client = TransferQueueClient(client_id="env-tcp", controller_info=queue.info)
    assert client._client._transport.force_tcp and client.ping()["client_id"] == "env-tcp"  # type: ignore[attr-defined]
    client.close()
    monkeypatch.setenv(TRANSPORT_ENV, "shm")
    with pytest.raises(InvalidRequest, match="TRANSFER_QUEUE_TRANSPORT must be 'auto' or 'tcp', got 'shm'"):
        TransferQueueClient(client_id="env-bad", controller_info=queue.info)


def test_shared_memory_over_ray_actors_gives_the_sockets_rows(make_view: Any) -> None:
    """Storage units started by the controller actor with ``shared_memory``: a client that asks for it puts and gets
    through their segments (it maps them) and reads what a socket client reads, and the reverse."""
    from tests.conftest import DEFAULT_QUEUE

    queue = make_view(**DEFAULT_QUEUE, shared_memory=True)
    shm, plain = queue.new_client("shm"), TransferQueueClient("plain", queue.info, force_tcp=True)
    step = queue.step()
    x = torch.randn(16, 4096)
    data = TensorDict(
        {"x": x, "r": torch.nested.nested_tensor([torch.arange(i * 100) for i in range(16)], layout=torch.jagged),
         "t": [f"row {i}" for i in range(16)]},
        batch_size=[16],
    )  # fmt: skip
    source = {}  # global index -> row of ``data``
    for start, client in ((0, shm), (4, shm), (8, shm), (12, plain)):  # shm's later puts go through its grants
        meta = client.put(data[start : start + 4], global_step=step)
        source.update({int(g): start + k for k, g in enumerate(meta.global_indexes)})
    meta = shm.get_meta(["x", "r", "t"], 16, global_step=step, task_name="shm")
    order = [source[int(g)] for g in meta.global_indexes]
    for client in (shm, plain):
        got = client.get_data(meta)
        assert torch.equal(got["x"], x[order]) and list(got["t"]) == [f"row {i}" for i in order]
        assert all(torch.equal(a, torch.arange(i * 100)) for a, i in zip(got["r"].unbind(), order, strict=True))
    transport = shm._client._transport
    assert any(sock.shm.maps for sock in transport._local.__dict__["unix"].values()), "no segment was mapped"
    plain.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_read_to_the_gpu_goes_from_the_units_shared_memory_straight_to_it(make_view: Any) -> None:
    """get_data(device="cuda") on a client with shared memory: dense fields described in a unit's segments are copied
    by DMA from there to the GPU (the segments page-locked for CUDA once); small ones sent in-band, jagged and text
    fields come as before; every byte arrives, in the meta's order; closing the client unlocks the segments."""
    from tests.conftest import DEFAULT_QUEUE

    queue = make_view(**DEFAULT_QUEUE, shared_memory=True)
    shm = queue.new_client("shm-gpu")
    step = queue.step()
    wide = torch.randn(16, 1 << 16)  # 4 MiB: through the segments
    small = torch.arange(16, dtype=torch.int16)  # 32 bytes: in-band
    data = TensorDict(
        {"wide": wide, "small": small, "t": [f"row {i}" for i in range(16)],
         "r": torch.nested.nested_tensor([torch.arange(i * 100) for i in range(16)], layout=torch.jagged)},
        batch_size=[16],
    )  # fmt: skip
    source = {}
    for start in (0, 8):
        meta = shm.put(data[start : start + 8], global_step=step)
        source.update({int(g): start + k for k, g in enumerate(meta.global_indexes)})
    meta = shm.get_meta(["wide", "small", "t", "r"], 16, global_step=step, task_name="gpu")
    order = [source[int(g)] for g in meta.global_indexes]
    for _ in range(2):  # the second read finds the segments registered
        got = shm.get_data(meta, device="cuda")
        assert got["wide"].is_cuda and torch.equal(got["wide"].cpu(), wide[order])
        assert got["small"].is_cuda and torch.equal(got["small"].cpu(), small[order])
        assert list(got["t"]) == [f"row {i}" for i in order]
        assert all(torch.equal(a.cpu(), torch.arange(i * 100)) for a, i in zip(got["r"].unbind(), order, strict=True))
    sockets = list(shm._client._transport._local.__dict__["unix"].values())
    registered = [address for sock in sockets for address in sock.shm.registered.values()]
    assert registered and all(registered), f"no segment was page-locked for the GPU: {registered}"
    shm.close()
    assert not any(sock.shm.registered for sock in sockets)


def test_the_environment_variable_set_after_ray_started_turns_shared_memory_on(
    ray_session: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TRANSFER_QUEUE_SHARED_MEMORY=1`` set in the driver once Ray runs: its Ray workers do not have it, so the
    controller actor built its configuration without it and ``init`` refused its own queue (ConfigMismatch); the
    driver's choice is passed on."""
    monkeypatch.setenv("TRANSFER_QUEUE_SHARED_MEMORY", "1")
    client = transfer_queue.init(global_batch_size=4, num_storage_units=1)
    try:
        assert client.config.shared_memory
    finally:
        client.close()
        transfer_queue.shutdown()
