"""Starting, finding and stopping a queue: ``transfer_queue.init`` / ``get_controller`` / ``shutdown``, sessions and
protocol versions, and controllers wired by hand."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import ray
import torch
import zmq
from tensordict import TensorDict

import transfer_queue
from transfer_queue import StorageUnit, TransferQueueClient, TransferQueueController
from transfer_queue.errors import (
    ConfigMismatch,
    ProtocolMismatch,
    QueueClosed,
    QueueNotFound,
    ServerGone,
    SessionMismatch,
)
from transfer_queue.wire import protocol as p
from transfer_queue.wire.auth import secure_client

# Remote functions defined here run in Ray workers, which cannot import this file: pickle them by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = {"global_batch_size": 4, "num_n_samples": 2, "default_timeout": 15.0, "num_storage_units": 1}


def round_trip(client: TransferQueueClient, partition: str, n: int = 4) -> list[int]:
    client.put(TensorDict({"x": torch.arange(n)}, batch_size=[n]), partition_id=partition)
    meta = client.get_meta(["x"], n, partition_id=partition, task_name="t")
    return client.get_data(meta)["x"].tolist()


@pytest.fixture(scope="module")
def started(ray_session: Any) -> Iterator[TransferQueueClient]:
    """The queue ``transfer_queue.init`` starts on this cluster (shut down when the module ends)."""
    client = transfer_queue.init(**CONFIG)
    yield client
    client.close()
    transfer_queue.shutdown()


def test_init_returns_a_ready_client(started: TransferQueueClient) -> None:
    assert started.ping()["client_id"] == started.client_id
    assert round_trip(started, "init-ready") == [0, 1, 2, 3]
    assert started.config.global_batch_size == 4 and started.config.num_n_samples == 2


def test_second_init_with_the_same_config_attaches(started: TransferQueueClient) -> None:
    again = transfer_queue.init(**CONFIG, client_id="second")
    assert again.controller_info.session_id == started.controller_info.session_id
    assert again.client_id == "second"
    assert round_trip(again, "init-attached") == [0, 1, 2, 3]
    other = transfer_queue.get_client("third")
    assert other.controller_info == started.controller_info
    again.close()
    other.close()


def test_init_with_another_config_names_the_difference(started: TransferQueueClient) -> None:
    with pytest.raises(ConfigMismatch, match=r"\(running, asked\) = \{'global_batch_size': \(4, 8\)\}"):
        transfer_queue.init(**{**CONFIG, "global_batch_size": 8})
    with pytest.raises(ConfigMismatch, match=r"'sampler': \('SequentialSampler', 'GRPOSampler'\)"):
        transfer_queue.init(**CONFIG, sampler=transfer_queue.GRPOSampler(2))
    assert started.ping()  # the running queue is untouched


@ray.remote(num_cpus=1)
def use_queue_from_a_worker(partition: str) -> tuple[str, list[int]]:
    import transfer_queue as tq

    controller = tq.get_controller()
    info = ray.get(controller.get_info.remote())
    client = tq.TransferQueueClient(client_id="ray-task", controller_info=info)
    try:
        return info.session_id, round_trip(client, partition, 2)
    finally:
        client.close()


def test_get_controller_from_another_ray_worker(started: TransferQueueClient) -> None:
    session_id, values = ray.get(use_queue_from_a_worker.remote("from-worker"), timeout=120)
    assert session_id == started.controller_info.session_id and values == [0, 1]
    assert started.get_production_status(partition_id="from-worker")["rows"] == 2


def test_controller_info_of_another_session_gets_session_mismatch(started: TransferQueueClient) -> None:
    forged = msgspec.structs.replace(started.controller_info, session_id="0" * 32)
    stale = TransferQueueClient(client_id="stale", controller_info=forged)
    with pytest.raises(SessionMismatch, match=r"another session than this controller serves .*; fetch a fresh") as err:
        stale.ping()
    assert "0" * 32 not in str(err.value) and started.controller_info.session_id not in str(err.value)
    with pytest.raises(SessionMismatch):
        stale.get_meta(["x"], 1, partition_id="init-ready", task_name="stale")
    stale.close()
    assert started.ping()


def test_wrong_protocol_version(started: TransferQueueClient) -> None:
    info = started.controller_info
    with pytest.raises(ProtocolMismatch, match="controller_info speaks protocol 99, this client 1"):
        TransferQueueClient(client_id="future", controller_info=msgspec.structs.replace(info, protocol_version=99))
    # A client of another version that sends anyway gets a typed refusal from the controller.
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, info.secret)  # it holds the queue's secret, only its version differs
    sock.connect(info.controller.tcp)
    try:
        sock.send_multipart([p.encode(p.Envelope(99, info.session_id, 7)), p.encode(p.Hello("future"))])
        assert sock.poll(15_000), "no reply"
        header = p.decode_reply_header(sock.recv_multipart()[0])
    finally:
        sock.close()
    assert header.request_id == 7 and header.error_type == "ProtocolMismatch"
    assert (
        header.error_message is not None and "the client speaks protocol 99, this controller 1" in header.error_message
    )


@pytest.mark.timeout(120)
def test_streaming_dataloader_workers_find_the_queue_init_started(started: TransferQueueClient) -> None:
    """No controller_info given: the dataset looks the queue up where it is built, not in the forked workers."""
    started.put(TensorDict({"t": ["a", "b", "c", "d"]}, batch_size=[4]), partition_id="loader")
    started.close_partition(partition_id="loader")
    dataset = transfer_queue.StreamingDataset(["t"], 2, partition_id="loader", task_name="loader")
    seen = [s for data, _ in transfer_queue.StreamingDataLoader(dataset, num_workers=1) for s in data.get("t").tolist()]
    assert seen == ["a", "b", "c", "d"]


def test_shutdown_then_init_at_once(started: TransferQueueClient) -> None:
    old = started.controller_info
    other = TransferQueueClient("other", old)
    transfer_queue.shutdown()
    with pytest.raises(QueueNotFound, match=r"call transfer_queue\.init first"):
        transfer_queue.get_controller()
    # The clients of the queue that was shut down fail at once and say why (not a RequestTimeout 65 s later).
    began = time.monotonic()
    with pytest.raises(QueueClosed, match=r"client '.*': its queue was shut down \(transfer_queue\.shutdown\)"):
        started.get_meta(["x"], 4, partition_id="after-shutdown", task_name="t")
    with pytest.raises(QueueClosed, match="its queue was shut down"):
        other.ping()
    assert time.monotonic() - began < 2.0
    other.close()
    client = transfer_queue.init(**{**CONFIG, "global_batch_size": 8})  # another config: no mismatch, it is gone
    try:
        assert client.controller_info.session_id != old.session_id
        assert round_trip(client, "after-restart") == [0, 1, 2, 3]
    finally:
        client.close()
        transfer_queue.shutdown()
    transfer_queue.shutdown()  # nothing runs: a no-op


def test_hand_built_controller_with_storage_unit_options(ray_session: Any) -> None:
    controller = TransferQueueController.options(num_cpus=0).remote(
        8, num_storage_units=1, storage_unit_options={"num_cpus": 0, "max_restarts": 0}
    )
    try:
        client = TransferQueueClient(client_id="hand-built", controller_info=ray.get(controller.get_info.remote()))
        assert round_trip(client, "hand-built", 6) == list(range(6))
        stats = ray.get(controller.storage_stats.remote())
        assert [s["unit"] for s in stats] == [0] and stats[0]["bytes"] == 6 * 8
        ray.get(controller.shutdown.remote())
        began = time.monotonic()  # this client did not shut it down: it learns from the connection, at once
        with pytest.raises(ServerGone, match=r"the controller at tcp://.*\(the server is gone\)"):
            client.ping()
        assert time.monotonic() - began < 5.0
        client.close()
    finally:
        ray.get(controller.shutdown.remote())  # twice is harmless
        ray.kill(controller)


def test_hand_built_controller_with_my_storage_units(ray_session: Any) -> None:
    units = [StorageUnit.options(num_cpus=0).remote(i, 2) for i in range(2)]  # placed by me (e.g. one per node)
    controller = TransferQueueController.remote(8, storage_units=units)
    try:
        info = ray.get(controller.get_info.remote())
        assert len(info.storage_units) == 2 and info.config["num_storage_units"] == 2
        client = TransferQueueClient(client_id="my-units", controller_info=info)
        assert round_trip(client, "my-units", 5) == list(range(5))
        held = [ray.get(u.stats.remote())["bytes"] for u in units]
        assert sum(held) == 5 * 8
        client.close()
        ray.get(controller.shutdown.remote())
        # The controller did not start these units, so it leaves them running.
        assert [ray.get(u.stats.remote())["bytes"] for u in units] == held
    finally:
        ray.kill(controller)
        for unit in units:
            ray.kill(unit)


DRIVER_WITHOUT_SHUTDOWN = r"""
import json, ray, transfer_queue
ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
client = transfer_queue.init(global_batch_size=4, num_storage_units=1)
info = client.controller_info
print(json.dumps([info.controller.unix] + [unit.unix for unit in info.storage_units]), flush=True)
"""  # and exits without transfer_queue.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_driver_that_exits_without_shutdown_leaves_no_socket_directories() -> None:
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.getcwd()
    done = subprocess.run(
        [sys.executable, "-c", DRIVER_WITHOUT_SHUTDOWN], env=env, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stderr[-3000:]
    paths = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(paths) == 2 and all(paths)
    for path in paths:
        assert not os.path.exists(os.path.dirname(path)), path
