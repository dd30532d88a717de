"""A dead controller comes back (issue 28 section 2): ``transfer_queue.init(journal_dir=...)`` journals the
controller's bookkeeping; Ray restarts it after ``ray.kill(controller, no_restart=False)``; it replays the journal,
binds the same port and finds its storage units' rows; the client made before the kill goes on."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import ray
import torch

import transfer_queue
from transfer_queue.errors import GetMetaTimeout, ServerGone


def restarted_info(controller: Any, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(controller.get_info.remote(), timeout=timeout)
        except ray.exceptions.ActorUnavailableError:  # restarting: asked again until its constructor returned
            assert time.monotonic() < deadline, "the controller was not restarted"
            time.sleep(0.2)


def test_a_killed_controller_is_restarted_from_its_journal_and_its_client_goes_on(ray_session: Any, tmp_path) -> None:
    client = transfer_queue.init(
        global_batch_size=4, num_storage_units=2, default_timeout=20.0, journal_dir=str(tmp_path / "journal")
    )
    try:
        controller = transfer_queue.get_controller()
        before = ray.get(controller.get_info.remote())
        assert before.controller.unix is None  # a journaled controller is reached over TCP: its port stays
        metas = [client.put({"x": torch.full((2, 3), float(v))}, partition_id="p") for v in (1, 2)]
        client.set_task_options("t", ack="explicit")
        acked = client.get_meta(["x"], 2, partition_id="p", task_name="t")
        client.ack(acked)
        # a get_meta parked in the controller (nothing ready in "wait") when it dies
        outcome: list[Any] = []

        def parked() -> None:
            try:
                outcome.append(client.get_meta(["x"], 2, partition_id="wait", task_name="t", timeout=15))
            except Exception as exc:  # the outcome is checked below
                outcome.append(exc)

        waiter = threading.Thread(target=parked)
        waiter.start()
        time.sleep(0.5)  # parked by now (nothing asserts on it: either outcome below is right)
        ray.kill(controller, no_restart=False)
        waiter.join(60)
        assert not waiter.is_alive()
        (got,) = outcome
        # in flight when the controller died: the typed connection error, or (re-sent to the new controller,
        # which has nothing ready in "wait") its timeout
        assert isinstance(got, (ServerGone, GetMetaTimeout)), got

        after = restarted_info(controller)  # the handle stays valid: Ray restarted the actor behind it
        assert (after.session_id, after.controller.tcp) == (before.session_id, before.controller.tcp)
        assert client.list_partitions() == ["p"]  # the same client: its socket reconnected
        for value, meta in zip((1.0, 2.0), metas, strict=True):
            assert client.get_data(meta)["x"].flatten().tolist() == [value] * 6
        client.set_task_options("t", ack="explicit")  # task options are not journaled
        rest = client.get_meta(["x"], 2, partition_id="p", task_name="t", timeout=5)
        assert sorted(rest.global_indexes.tolist()) == sorted(set(range(4)) - set(acked.global_indexes.tolist()))
        with pytest.raises(GetMetaTimeout):  # every committed row is served once: nothing more
            client.get_meta(["x"], 1, partition_id="p", task_name="t", timeout=0.5)
    finally:
        client.close()
        transfer_queue.shutdown()
