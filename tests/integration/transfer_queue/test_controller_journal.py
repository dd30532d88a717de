"""A dead controller comes back (issue 28 section 2): ``transfer_queue.init(journal_dir=...)`` journals the
controller's bookkeeping; Ray restarts it after ``ray.kill(controller, no_restart=False)``; it replays the journal,
binds the same port and finds its storage units' rows; the client made before the kill goes on."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import ray
import torch

import transfer_queue
from transfer_queue import TransferQueueClient, TransferQueueController
from transfer_queue.errors import GetMetaTimeout, RowsLost, ServerGone
from transfer_queue.runtime import start_storage_units


def restarted_info(controller: Any, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(controller.get_info.remote(), timeout=timeout)
        except ray.exceptions.ActorUnavailableError:  # restarting: asked again until its constructor returned
            assert time.monotonic() < deadline, "the controller was not restarted"
            time.sleep(0.2)


def journaled_queue(tmp_path: Any) -> TransferQueueClient:
    """A queue journaled under ``tmp_path``, whose client asks again for 30 s what failed with ServerGone (as a run's
    clients do: its first call after the restart may find its old connection gone)."""
    return transfer_queue.init(global_batch_size=4, num_storage_units=2, default_timeout=20.0,
                               journal_dir=str(tmp_path / "journal"), restart_retry_s=30.0)  # fmt: skip


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
        client.set_task_options("t", ack="explicit")  # the journal kept them; setting them again is harmless
        rest = client.get_meta(["x"], 2, partition_id="p", task_name="t", timeout=5)
        assert sorted(rest.global_indexes.tolist()) == sorted(set(range(4)) - set(acked.global_indexes.tolist()))
        with pytest.raises(GetMetaTimeout):  # every committed row is served once: nothing more
            client.get_meta(["x"], 1, partition_id="p", task_name="t", timeout=0.5)
    finally:
        client.close()
        transfer_queue.shutdown()
    # the queue is gone, its units with it: its journal too (a new init with the same journal_dir starts empty)
    assert sorted(os.listdir(tmp_path / "journal")) == []


def test_a_lease_taken_before_the_controller_was_killed_is_acknowledged_after_its_restart(
    ray_session: Any, tmp_path
) -> None:
    """The journal keeps leases: a consumer leases rows, Ray restarts the killed controller, the consumer acknowledges
    them (no NotLeased) and another consumer is never served them. ``restart_retry_s``: the owner's first call after
    the restart may find its old connection gone (``ServerGone``) and is asked again, as a run's clients do."""
    client = journaled_queue(tmp_path)
    other = None
    try:
        controller = transfer_queue.get_controller()
        client.put({"x": torch.arange(8, dtype=torch.float32).reshape(4, 2)}, partition_id="p")
        client.set_task_options("t", ack="explicit")
        leased = client.get_meta(["x"], 2, partition_id="p", task_name="t")
        ray.kill(controller, no_restart=False)
        other = TransferQueueClient("other", restarted_info(controller))
        rest = other.get_meta(["x"], 2, partition_id="p", task_name="t", timeout=5)
        assert sorted(rest.global_indexes.tolist()) == sorted(set(range(4)) - set(leased.global_indexes.tolist()))
        client.ack(leased)  # the lease survived the restart: its owner acknowledges it
        other.ack(rest)
        with pytest.raises(GetMetaTimeout):  # every row served once: nothing more, the leased ones included
            other.get_meta(["x"], 1, partition_id="p", task_name="t", timeout=0.5)
        assert client.check_consumption_status("t", partition_id="p")  # all 4 rows acknowledged
    finally:
        if other is not None:
            other.close()
        client.close()
        transfer_queue.shutdown()


def test_a_journal_replayed_over_new_storage_units_reports_their_rows_lost(ray_session: Any, tmp_path) -> None:
    journal = str(tmp_path / "journal")
    units = start_storage_units(1)
    controller = TransferQueueController.remote(4, storage_units=units, journal_dir=journal, http_port=-1)
    client = TransferQueueClient("before", ray.get(controller.get_info.remote()))
    meta = client.put({"x": torch.ones(2, 3)}, partition_id="p")
    client.close()
    ray.kill(controller)  # for good (no max_restarts), and its units with it: the journal stays
    for unit in units:
        ray.kill(unit)
    controller = TransferQueueController.remote(
        4, storage_units=start_storage_units(1), journal_dir=journal, http_port=-1
    )
    client = TransferQueueClient("after", ray.get(controller.get_info.remote()))
    try:
        assert client.list_partitions() == ["p"]
        with pytest.raises(RowsLost, match=r"rows \[0, 1\] \(2 of 2\) of partition_id='p' were lost"):
            client.get_data(meta)
        assert client.put({"x": torch.ones(2, 3)}, partition_id="p").global_indexes.tolist() == [2, 3]
    finally:
        client.close()
        ray.get(controller.shutdown.remote())
        ray.kill(controller)


def test_automatic_dp_rounds_go_on_after_the_controller_was_killed(ray_session: Any, tmp_path) -> None:
    """Two DP ranks fetch without a dp_group_id (automatic rounds, counted per connection): rank 0 opens auto-0, Ray
    restarts the killed controller, rank 1 gets its share of auto-0 and rank 0's next call opens auto-1 with other
    rows (before: the numbering began again, and rank 0 was served its auto-0 share a second time)."""
    rank0 = journaled_queue(tmp_path)
    rank1 = None
    try:
        controller = transfer_queue.get_controller()
        rank0.put({"x": torch.arange(16, dtype=torch.float32).reshape(8, 2)}, partition_id="p")
        rank0.set_task_options("t", ack="explicit")

        def share(client: TransferQueueClient, rank: int) -> Any:
            params = {"dp_size": 2, "dp_rank": rank}
            return client.get_meta(["x"], 2, partition_id="p", task_name="t", sampler_params=params, timeout=5)

        first = share(rank0, 0)
        ray.kill(controller, no_restart=False)
        rank1 = TransferQueueClient("rank1", restarted_info(controller))
        peer = share(rank1, 1)
        following = share(rank0, 0)
        assert (first.extra["dp_group_id"], peer.extra["dp_group_id"]) == ("auto-0", "auto-0")
        assert following.extra["dp_group_id"] == "auto-1"
        seen = [set(m.global_indexes.tolist()) for m in (first, peer, following)]
        assert not (seen[0] & seen[1]) and not (seen[2] & (seen[0] | seen[1]))  # nothing served twice
    finally:
        if rank1 is not None:
            rank1.close()
        rank0.close()
        transfer_queue.shutdown()


def test_a_tp_peer_gets_the_round_its_peer_opened_before_the_controller_was_killed(ray_session: Any, tmp_path) -> None:
    """TP peers A and B of dp_rank 0 are separate clients: both fetch auto-0, A fetches auto-1, Ray restarts the
    killed controller, B's next call gets A's share of auto-1 (the same rows) and A's next call opens auto-2 (before:
    B's next call opened auto-2 and B never fetched round 1, so the peers trained on different batches)."""
    a = journaled_queue(tmp_path)
    b = None
    try:
        controller = transfer_queue.get_controller()
        b = TransferQueueClient("b", ray.get(controller.get_info.remote()))
        a.put({"x": torch.arange(16, dtype=torch.float32).reshape(8, 2)}, partition_id="p")
        a.set_task_options("t", ack="explicit")

        def share(client: TransferQueueClient) -> Any:
            params = {"dp_size": 2, "dp_rank": 0}
            return client.get_meta(["x"], 1, partition_id="p", task_name="t", sampler_params=params, timeout=5)

        assert share(a).extra["dp_group_id"] == share(b).extra["dp_group_id"] == "auto-0"
        ahead = share(a)
        assert ahead.extra["dp_group_id"] == "auto-1"
        ray.kill(controller, no_restart=False)
        restarted_info(controller)
        behind = share(b)
        assert behind.extra["dp_group_id"] == "auto-1"
        assert behind.global_indexes.tolist() == ahead.global_indexes.tolist()
        following = share(a)
        assert following.extra["dp_group_id"] == "auto-2"
        assert not set(following.global_indexes.tolist()) & set(ahead.global_indexes.tolist())
    finally:
        if b is not None:
            b.close()
        a.close()
        transfer_queue.shutdown()


def test_threads_of_one_client_a_round_apart_go_on_from_their_own_rounds_after_the_controller_was_killed(
    ray_session: Any, tmp_path
) -> None:
    """Two threads of one client as TP peers of dp_rank 0 (a connection each): both fetch auto-0, the first fetches
    auto-1, Ray restarts the killed controller and the thread ahead asks first: it opens auto-2 and the thread behind
    gets its share of auto-1 (before: the first new connection of the client took over the counter furthest behind,
    so the thread ahead was served its auto-1 rows a second time)."""
    from concurrent.futures import ThreadPoolExecutor

    client = journaled_queue(tmp_path)
    ahead_thread, behind_thread = ThreadPoolExecutor(1), ThreadPoolExecutor(1)  # one lasting thread each
    try:
        controller = transfer_queue.get_controller()
        client.put({"x": torch.arange(16, dtype=torch.float32).reshape(8, 2)}, partition_id="p")
        client.set_task_options("t", ack="explicit")

        def share(thread: ThreadPoolExecutor) -> Any:
            params = {"dp_size": 2, "dp_rank": 0}
            call = thread.submit(
                client.get_meta, ["x"], 1, partition_id="p", task_name="t", sampler_params=params, timeout=5
            )
            return call.result(timeout=60)

        assert share(ahead_thread).extra["dp_group_id"] == share(behind_thread).extra["dp_group_id"] == "auto-0"
        ahead = share(ahead_thread)
        assert ahead.extra["dp_group_id"] == "auto-1"
        ray.kill(controller, no_restart=False)
        restarted_info(controller)
        for thread in (ahead_thread, behind_thread):  # each thread reconnects first, with a call outside any round
            thread.submit(client.get_meta, ["x"], 1, partition_id="p", task_name="look", peek=True).result(60)
        following = share(ahead_thread)
        assert following.extra["dp_group_id"] == "auto-2"
        assert not set(following.global_indexes.tolist()) & set(ahead.global_indexes.tolist())
        behind = share(behind_thread)
        assert behind.extra["dp_group_id"] == "auto-1"
        assert behind.global_indexes.tolist() == ahead.global_indexes.tolist()
    finally:
        ahead_thread.shutdown()
        behind_thread.shutdown()
        client.close()
        transfer_queue.shutdown()


@pytest.mark.slow  # a unit re-replicated, then the controller killed (~20 s loaded): make test's 10-minute budget
@pytest.mark.timeout(240)
def test_a_controller_killed_after_a_unit_was_lost_for_good_comes_back_and_serves_every_row(
    ray_session: Any, tmp_path, wait_until: Any
) -> None:
    """replicas=2 over three units Ray never restarts, journaled: unit 0 is killed for good and its copies moved onto
    the other two; then the controller is killed. Ray restarts it, it replays its journal without unit 0 (before:
    its constructor asked every unit for its session, the dead one's call failed, and the controller could never
    start again), and every row is read back from the copies, none lost."""
    from tests.integration.transfer_queue.test_replicas import check_all_read_back, put_rows

    client = transfer_queue.init(global_batch_size=4, num_storage_units=3, default_timeout=10.0, replicas=2,
                                 storage_unit_max_restarts=0, journal_dir=str(tmp_path / "journal"),
                                 restart_retry_s=60.0)  # fmt: skip
    try:
        controller = transfer_queue.get_controller()
        metas = put_rows(client, 6)
        pids = [u["pid"] for u in ray.get(controller.storage_stats.remote())]
        os.kill(pids[0], 9)
        wait_until(lambda: 0 in client.status()["storage"]["rereplicated"], 60, what="unit 0's copies to be moved")
        ray.kill(controller, no_restart=False)
        restarted_info(controller)
        check_all_read_back(client, metas)
        storage = client.status()["storage"]
        assert 0 in storage["rereplicated"] and storage["blocks_single_copy"] == 0
        meta = client.put({"x": torch.ones(2, 8), "y": torch.zeros(2, dtype=torch.int64)}, partition_id="q")
        assert client.get_data(meta)["x"].shape == (2, 8)
    finally:
        client.close()
        transfer_queue.shutdown()
