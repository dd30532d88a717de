"""A checkpoint never stops the queue (issue 23 defect 1): a storage unit stalled (SIGSTOP) during
``save_checkpoint`` leaves every other client served, the save fails typed after its bound naming the unit, the
previous checkpoint stays current and whole; and a put that reports failure leaves none of its rows visible."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import ray
import torch

from tests.conftest import wait_until
from transfer_queue import TransferQueueClient, TransferQueueController
from transfer_queue.client import rows as client_rows
from transfer_queue.errors import PutExpired
from transfer_queue.storage.checkpoint import CheckpointError, current_checkpoint, load_unit, read_controller

# Each test starts its own queue and stalls a process for seconds: the slow tier keeps make test under 10 minutes.
pytestmark = pytest.mark.slow


def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped (the signal takes effect asynchronously)."""
    os.kill(pid, signal.SIGSTOP)
    tasks = f"/proc/{pid}/task"

    def stopped() -> bool:
        states = []
        for tid in os.listdir(tasks):
            with open(f"{tasks}/{tid}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        return all(state in "tT" for state in states)

    wait_until(stopped, timeout=10.0, what=f"process {pid} stopped")


def stop(controller: Any) -> None:
    ray.get(controller.shutdown.remote(), timeout=60)
    ray.kill(controller)


def test_a_stalled_storage_unit_fails_the_save_after_its_bound_while_every_other_client_is_served(
    ray_session, tmp_path
) -> None:
    controller = TransferQueueController.remote(
        4, num_global_batch=3, num_storage_units=2, default_timeout=5.0, checkpoint_timeout=1.5
    )
    info = ray.get(controller.get_info.remote())
    saver = TransferQueueClient("saver", info)
    root = str(tmp_path)
    pid = ray.get(controller.storage_stats.remote())[1]["pid"]
    try:
        # small puts take the units in turn: put 1 on unit 1, put 2 on unit 0, put 3 on unit 1, put 4 on unit 0
        saver.put({"x": torch.arange(2.0).reshape(2, 1)}, global_step=0)
        saver.put({"x": torch.arange(2.0, 4.0).reshape(2, 1)}, global_step=0)
        saver.put({"x": torch.arange(4.0, 6.0).reshape(2, 1)}, global_step=1)
        first = saver.save_checkpoint(root)
        os.kill(pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(saver.save_checkpoint, root)
                other = TransferQueueClient("other", info)  # a new connection while the save is pending
                try:
                    other.put({"x": torch.full((2, 1), 9.0)}, partition_id="side", timeout=3.0)  # put 4: unit 0
                    meta = other.get_meta(["x"], 2, partition_id="side", task_name="t", timeout=3.0)
                    assert torch.equal(other.get_data(meta, timeout=3.0)["x"], torch.full((2, 1), 9.0))
                    assert other.get_production_status(global_step=0) is not None
                    assert not pending.done(), "the save answered before its stalled unit wrote anything"
                finally:
                    other.close()
                with pytest.raises(
                    CheckpointError,
                    match=r"storage unit 1 did not finish its checkpoint within 1.5 s; the previous checkpoint stays "
                    "current",
                ):
                    pending.result(timeout=30)
            assert current_checkpoint(root) == first  # the previous checkpoint stays current and whole
            read_controller(first)
            assert [len(load_unit(first, unit)) for unit in (0, 1)] == [1, 2]
        finally:
            os.kill(pid, signal.SIGCONT)
        saver.put({"x": torch.zeros(2, 1)}, global_step=2)
        second = saver.save_checkpoint(root)
        assert second != first and current_checkpoint(root) == second
        assert not [n for n in os.listdir(root) if n.startswith(".staging")]
        assert sum(len(load_unit(second, unit)) for unit in (0, 1)) == 5
    finally:
        saver.close()
        stop(controller)


def test_a_put_that_reports_failure_leaves_none_of_its_rows_visible(ray_session, monkeypatch) -> None:
    controller = TransferQueueController.remote(4, num_storage_units=1, put_grace=1.0, disconnect_grace=30.0)
    client = TransferQueueClient("producer", ray.get(controller.get_info.remote()))
    pid = ray.get(controller.__ray_call__.remote(lambda self: os.getpid()))
    # the client's last commit attempt waits this long: far more than a loaded machine needs to resume the controller
    monkeypatch.setattr(client_rows, "REPLY_SLACK", 30.0)
    inner = client._client
    commit, control = inner._commit, inner._control
    # a safety net only: the controller runs again at the client's last commit attempt (below)
    resume = threading.Timer(60.0, os.kill, (pid, signal.SIGCONT))
    commits_sent: list[float] = []

    async def stalled_commit(*args: Any, **kwargs: Any) -> Any:
        # the controller stops between the put's write and its commit (stopped for sure before the commit is sent)
        stop_process(pid)
        resume.start()
        return await commit(*args, **kwargs)

    async def counting_control(body: Any, *args: Any, **kwargs: Any) -> Any:
        if type(body).__name__ == "Commit":
            commits_sent.append(time.monotonic())
            if len(commits_sent) == 2:  # the last attempt: the put's deadline has passed, the controller resumes
                os.kill(pid, signal.SIGCONT)
        return await control(body, *args, **kwargs)

    monkeypatch.setattr(inner, "_commit", stalled_commit)
    monkeypatch.setattr(inner, "_control", counting_control)
    try:
        # resumed past the deadline, the controller refuses the commit: a failure for sure, not an unknown outcome
        with pytest.raises(PutExpired, match="none of its rows are visible"):
            client.put({"x": torch.ones(4, 1)}, global_step=0, timeout=1.0)
        assert len(commits_sent) == 2
        monkeypatch.setattr(inner, "_commit", commit)
        monkeypatch.setattr(inner, "_control", control)
        status = client.get_production_status(global_step=0)
        assert (status["rows"], status["rows_in_flight"]) == (0, 0), "a put that reported failure left rows visible"
        client.put({"x": torch.ones(4, 1)}, global_step=0)  # the producer puts again: 4 rows, not 8
        assert client.get_production_status(global_step=0)["rows"] == 4
    finally:
        resume.cancel()
        os.kill(pid, signal.SIGCONT)
        client.close()
        stop(controller)
