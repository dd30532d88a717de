"""Same-host payloads through shared memory (``QueueConfig.shared_memory``), without Ray: a ControllerServer and
StorageServers in this process (or a unit in a child process, to SIGKILL it), a sync client over their Unix sockets.

Puts and gets through shared memory give the same rows as the sockets (dense, jagged, strings, numpy object arrays,
reads across puts and out of order); a killed unit or client leaves no segment mapped anywhere and nothing in
/dev/shm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from transfer_queue.client import TransferQueueClient
from transfer_queue.config import QueueConfig
from transfer_queue.controller.server import ControllerServer
from transfer_queue.errors import StorageUnitDown
from transfer_queue.metadata import BatchMeta
from transfer_queue.state.queue_state import QueueState
from transfer_queue.storage.unit import BlockStore, StorageServer
from transfer_queue.wire import protocol as p
from transfer_queue.wire import shm as shm_wire
from transfer_queue.wire.shm import MIN_SHM_BYTES

SESSION = "f" * 32
SECRET = b"s" * 32
POOL = 64 << 20
CONFIG = QueueConfig(global_batch_size=4, num_storage_units=2, default_timeout=5.0, shared_memory=True,
                     shared_memory_pool_bytes=POOL)  # fmt: skip


@dataclass
class LocalQueue:
    controller: ControllerServer
    units: list[StorageServer]
    info: p.ControllerInfo

    def client(self, name: str, shared_memory: bool = True, force_tcp: bool = False) -> TransferQueueClient:
        config = {**self.info.config, "shared_memory": shared_memory}
        info = p.ControllerInfo(p.PROTOCOL_VERSION, SESSION, self.info.controller, self.info.storage_units, config,
                                SECRET)  # fmt: skip
        return TransferQueueClient(name, info, force_tcp=force_tcp)


@pytest.fixture
def queue() -> Iterator[LocalQueue]:
    units = [
        StorageServer(BlockStore(u, 2, SECRET), "127.0.0.1", SESSION, SECRET, 1 << 30, None, POOL) for u in range(2)
    ]
    controller = ControllerServer(QueueState(CONFIG, None), SESSION, [u.endpoint for u in units], "127.0.0.1", SECRET)
    info = p.ControllerInfo(
        p.PROTOCOL_VERSION, SESSION, controller.endpoint, [u.endpoint for u in units], CONFIG.to_dict(), SECRET
    )
    yield LocalQueue(controller, units, info)
    controller.stop()
    for unit in units:
        unit.stop()


def batch(rows: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(rows, 512, generator=g),  # 2 KiB a row: large reads and puts go through segments
        "b": torch.randn(rows, 64, generator=g).to(torch.bfloat16),
        "ids": torch.nested.nested_tensor(
            [torch.randint(0, 1000, (1 + (seed + i) % 300,), generator=g) for i in range(rows)], layout=torch.jagged
        ),
        "s": [f"row {seed}-{i}" for i in range(rows)],
        "o": np.array([f"{seed}:{i}" for i in range(rows)], dtype=object),
    }


def same(got, want: dict, rows: list[int]) -> None:
    assert torch.equal(got["x"], want["x"][rows]) and torch.equal(got["b"], want["b"][rows])
    ids = want["ids"].unbind()
    assert [t.tolist() for t in got["ids"].unbind()] == [ids[r].tolist() for r in rows]
    assert list(got["s"]) == [want["s"][r] for r in rows]
    assert list(got["o"]) == [want["o"][r] for r in rows]


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_puts_and_gets_through_shared_memory_give_the_sockets_rows(
    queue: LocalQueue, copy_threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 3: every copy through a segment (the client's out of a get and into a grant) is split over three threads
    monkeypatch.setattr(shm_wire, "COPY_THREADS", copy_threads)
    monkeypatch.setattr(shm_wire, "PARALLEL_COPY_BYTES", MIN_SHM_BYTES)
    shm, plain, tcp = queue.client("shm"), queue.client("plain", False), queue.client("tcp", False, True)
    parts = [batch(128, seed) for seed in range(3)]
    whole = {k: (torch.cat([p[k] for p in parts]) if k in ("x", "b") else None) for k in parts[0]}
    whole["ids"] = torch.nested.nested_tensor([t for p in parts for t in p["ids"].unbind()], layout=torch.jagged)
    whole["s"] = [s for p in parts for s in p["s"]]
    whole["o"] = np.concatenate([p["o"] for p in parts])
    metas = [shm.put(part, partition_id="a") for part in parts]  # the first in-band, the others in a grant
    metas.append(plain.put(parts[0], partition_id="b"))
    everything = BatchMeta.concat(metas[:3])
    for client in (shm, plain, tcp):
        same(client.get_data(everything), whole, list(range(384)))  # each unit's blocks end to end: one frame
        picked = everything.select_samples([300, 5, 130, 6, 7, 250])  # out of order: gathered by the unit
        same(client.get_data(picked), whole, [300, 5, 130, 6, 7, 250])
        same(client.get_data(metas[3]), parts[0], list(range(128)))
    transport = shm._client._transport
    maps = [sock.shm for sock in transport._local.__dict__["unix"].values() if sock.shm.maps]
    assert len(maps) == 2, "the shared-memory client did not map both units' segments"
    adopted = [unit.stats()["shm"] for unit in queue.units]
    assert all(s["segments"] >= 2 for s in adopted)
    for client in (shm, plain, tcp):
        client.close()


def test_a_get_is_copied_out_before_the_unit_may_reuse_the_block(queue: LocalQueue) -> None:
    """The rows a get returns are the client's own: clearing them and putting others into the same (pooled)
    segments leaves them as they were."""
    client = queue.client("reuse")
    first = {"x": torch.full((64, 1024), 1.0)}
    got = client.get_data(client.put(first, partition_id="r1"))
    client.clear(partition_id="r1")
    wait_for(lambda: all(unit.stats()["bytes"] == 0 for unit in queue.units))  # the units dropped the blocks
    for value in (2.0, 3.0):  # into the freed segments (the pool reuses them)
        client.put({"x": torch.full((64, 1024), value)}, partition_id=f"r{value}")
    assert torch.equal(got["x"], first["x"])
    assert sum(unit.stats()["shm"]["reused"] for unit in queue.units) > 0
    held = queue.units[0].stats()["shm"]["segment_bytes"]
    assert f'transfer_queue_storage_shm_bytes{{unit="0"}} {float(held)}' in queue.units[0].prometheus_text().decode()
    client.close()


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        time.sleep(0.02)


UNIT = textwrap.dedent(
    """
    import sys, time
    from transfer_queue.storage.unit import BlockStore, StorageServer
    from transfer_queue.wire import protocol as p
    unit = StorageServer(BlockStore({unit}, 2, {secret!r}), "127.0.0.1", {session!r}, {secret!r}, 1 << 30, None, {pool})
    sys.stdout.write(p.encode(unit.endpoint).hex() + "\\n")
    sys.stdout.flush()
    time.sleep(600)
    """
)

CLIENT = textwrap.dedent(
    """
    import sys, time, torch
    from transfer_queue.client import TransferQueueClient
    from transfer_queue.wire import protocol as p
    info = p.decode_as(bytes.fromhex(sys.argv[1]), p.ControllerInfo)
    client = TransferQueueClient("doomed", info)
    meta = client.put({"x": torch.ones(256, 1024)}, partition_id="doomed")
    client.put({"x": torch.ones(256, 1024)}, partition_id="doomed")  # staged in a grant
    client.get_data(meta)
    sys.stdout.write("ready\\n")
    sys.stdout.flush()
    time.sleep(600)
    """
)


def dev_shm(*pids: int) -> set[str]:
    """The /dev/shm entries this test's processes could have made: named after one of ``pids`` (this process's and
    the child's; torch's ``torch_<pid>_*``, the weight channels' ``tq-weights-<pid>-*``) or ``tq-shm``. Other
    processes' entries (tests running beside this one) come and go on their own."""
    if not os.path.isdir("/dev/shm"):
        return set()
    marks = [str(pid) for pid in (os.getpid(), *pids)]
    return {
        name for name in os.listdir("/dev/shm")
        if name.startswith("tq-shm") or any(mark in name.replace("-", "_").split("_") for mark in marks)
    }  # fmt: skip


def mapped_by_anyone(pid: int) -> list[str]:
    """Other processes of this user that still map a memfd segment of process ``pid`` (``tq-shm-*-<pid>-<id>``)."""
    holders = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or entry == str(pid):
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                if any(f"-{pid}-" in line and "/memfd:tq-shm" in line for line in f):
                    holders.append(entry)
        except OSError:
            continue
    return holders


def child(script: str, *args: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, f"the child exited with {proc.wait()}"
    return proc, line


def test_a_storage_unit_killed_leaves_no_segment_mapped_and_nothing_in_dev_shm() -> None:
    before = dev_shm()
    local = StorageServer(BlockStore(0, 2, SECRET), "127.0.0.1", SESSION, SECRET, 1 << 30, None, POOL)
    proc, line = child(UNIT.format(unit=1, secret=SECRET, session=SESSION, pool=POOL))
    endpoints = [local.endpoint, p.decode_as(bytes.fromhex(line), p.Endpoint)]
    controller = ControllerServer(QueueState(CONFIG, None), SESSION, endpoints, "127.0.0.1", SECRET)
    info = p.ControllerInfo(p.PROTOCOL_VERSION, SESSION, controller.endpoint, endpoints, CONFIG.to_dict(), SECRET)
    client = TransferQueueClient("survivor", info)
    try:
        metas = [client.put({"x": torch.full((256, 1024), float(i))}, partition_id="k") for i in range(4)]
        on_dead = [m for m in metas if int(m.blocks[0, 0]) % 2 == 1]
        assert on_dead and client.get_data(on_dead[-1])["x"].shape == (256, 1024)
        assert mapped_by_anyone(proc.pid) == [str(os.getpid())], "the client does not map the unit's segments"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        # a call to the other unit notices that the dead unit's idle connection hung up: closed, its mappings dropped
        on_live = [m for m in metas if int(m.blocks[0, 0]) % 2 == 0]
        assert client.get_data(on_live[0])["x"].shape == (256, 1024)
        assert mapped_by_anyone(proc.pid) == []
        with pytest.raises(StorageUnitDown):
            client.get_data(on_dead[-1])
        assert dev_shm(proc.pid) == before
    finally:
        proc.kill()
        client.close()
        controller.stop()
        local.stop()


def test_a_client_killed_releases_its_grants_and_pins_and_leaves_nothing_in_dev_shm(queue: LocalQueue) -> None:
    before = dev_shm()
    proc, line = child(CLIENT, p.encode(queue.info).hex())
    assert line == "ready"
    assert mapped_by_anyone(os.getpid()) == [str(proc.pid)], "the client maps no segment of the units"
    grants = [sum(c.shm.grant is not None for c in unit.sockets.unix.connections.values()) for unit in queue.units]
    assert sum(grants) >= 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_for(lambda: not any(unit.sockets.unix.connections for unit in queue.units))  # the units saw them close
    assert mapped_by_anyone(os.getpid()) == []
    client = queue.client("after")
    client.clear(partition_id="doomed")
    wait_for(lambda: all(unit.stats()["bytes"] == 0 for unit in queue.units))
    free = [unit.stats()["shm"] for unit in queue.units]
    assert all(s["segment_bytes"] - s["free_bytes"] == 0 for s in free), free  # grants and blocks all back
    assert dev_shm(proc.pid) == before
    client.close()


def test_small_payloads_stay_in_band_and_take_no_segment(queue: LocalQueue) -> None:
    client = queue.client("small")
    data = {"x": torch.randn(16, 256), "s": [str(i) for i in range(16)]}  # 16 KiB: below MIN_SHM_BYTES
    assert data["x"].numel() * 4 < MIN_SHM_BYTES
    for _ in range(3):
        got = client.get_data(client.put(data, partition_id="small"))
        assert torch.equal(got["x"], data["x"]) and list(got["s"]) == data["s"]
    assert [unit.stats()["shm"]["created"] for unit in queue.units] == [0, 0]
    client.close()
