"""A storage unit's process killed mid-run (SIGKILL): Ray restarts it (``storage_unit_max_restarts``), the controller
attaches the new, empty incarnation on its new ports, the rows it held are reported lost (``RowsLost`` naming
partition, rows and unit; ``lost_rows``; status), the other unit's rows are intact, new puts go to both units, and
nothing hangs: a producer that keeps putting through the restart sees only typed errors."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import ray
import torch

from transfer_queue import TransferQueueClient, TransferQueueController
from transfer_queue.errors import GetMetaTimeout, RowsLost, TransferQueueError


def unit_of(meta: Any) -> int:
    return int(meta.blocks[0, 0]) % 2


@pytest.mark.slow  # ~15-50 s each: the slow tier keeps make test under 10 minutes
def test_a_killed_storage_unit_is_restarted_empty_and_its_rows_are_reported_lost(
    ray_session: Any, wait_until: Callable[..., Any]
) -> None:
    controller = TransferQueueController.remote(4, num_global_batch=2, num_storage_units=2, default_timeout=5.0)
    client = TransferQueueClient("restart", ray.get(controller.get_info.remote()))
    stop, errors, puts = threading.Event(), [], [0]

    def produce() -> None:  # keeps putting through the death and the restart
        producer = TransferQueueClient("producer", ray.get(controller.get_info.remote()))
        while not stop.is_set():
            try:
                producer.put({"x": torch.ones(2, 8)}, partition_id="stream", timeout=5.0)
                puts[0] += 1
            except Exception as exc:  # every error is collected and checked below
                errors.append(exc)
                time.sleep(0.05)
        producer.close()

    try:
        on_unit: dict[int, Any] = {}
        for value in (1.0, 2.0):
            meta = client.put({"x": torch.full((2, 8), value)}, partition_id="p")
            on_unit[unit_of(meta)] = (meta, value)
        step = client.put({"x": torch.zeros(4, 8)}, global_step=0)  # a whole step, on one unit
        assert sorted(on_unit) == [0, 1]
        pids = [stats["pid"] for stats in ray.get(controller.storage_stats.remote())]
        producer = threading.Thread(target=produce)
        producer.start()
        wait_until(lambda: puts[0] >= 3, 30, what="the producer to run")
        os.kill(pids[0], signal.SIGKILL)
        wait_until(
            lambda: ray.get(controller.server_stats.remote())["storage_units_restarted"] == {0: 1},
            90,
            what="storage unit 0 to be restarted and attached",
        )
        assert ray.get(controller.server_stats.remote())["storage_units_down"] == []
        before = puts[0]
        wait_until(lambda: puts[0] >= before + 3, 30, what="the producer to go on after the restart")
        stop.set()
        producer.join(30)
        (dead, _), (alive, alive_value) = on_unit[0], on_unit[1]
        client.ping()  # any controller reply says which units restarted
        started = time.monotonic()
        message = (
            f"rows {dead.global_indexes.tolist()} (2 of 2) of partition_id='p' were lost: storage unit 0 died and was "
            "restarted empty (restart 1), taking fields ['x'] of them; put them again as new rows (client.lost_rows "
            "lists them)"
        )
        with pytest.raises(RowsLost, match=re.escape(message)):
            client.get_data(dead, timeout=60.0)
        assert time.monotonic() - started < 5.0  # at once: no socket is tried
        assert client.get_data(alive)["x"][:, 0].tolist() == [alive_value] * 2  # the other unit's rows are intact
        lost = client.lost_rows(partition_id="p")
        assert [(r["global_index"], r["unit"], r["fields"]) for r in lost] == [
            (i, 0, ["x"]) for i in dead.global_indexes.tolist()
        ]
        assert client.get_production_status(partition_id="p")["rows_lost"] == 2
        # new puts go to both units again (the restarted one at its new address), from old and new clients alike
        fresh = TransferQueueClient("fresh", ray.get(controller.get_info.remote()))
        units = set()
        for value in (3.0, 4.0, 5.0, 6.0):
            meta = fresh.put({"x": torch.full((2, 8), value)}, partition_id="p")
            units.add(unit_of(meta))
            assert client.get_data(meta)["x"][:, 0].tolist() == [value] * 2
        assert units == {0, 1}
        # get_meta never hands out a lost row; a get_meta for a step that lost rows waits its timeout, then says so
        served = client.get_meta(["x"], 10, partition_id="p", task_name="t", timeout=5.0)
        assert not set(served.global_indexes.tolist()) & set(dead.global_indexes.tolist())
        assert len(client.get_data(served)) == 10
        if unit_of(step) == 0:
            with pytest.raises(GetMetaTimeout, match=r"0 rows are ready"):
                client.get_meta(["x"], 4, global_step=0, task_name="t", timeout=1.0)
            client.put({"x": torch.ones(4, 8)}, global_step=0)  # the producer puts the step's rows again
        assert len(client.get_data(client.get_meta(["x"], 4, global_step=0, task_name="t", timeout=5.0))) == 4
    finally:
        stop.set()
        ray.get(controller.shutdown.remote(), timeout=60)
        ray.kill(controller)
        client.close()
    untyped = [e for e in errors if not isinstance(e, TransferQueueError)]
    assert not untyped, untyped
