"""What authentication costs on the grpo workload (issue 29: "<= 5%, bench with auth on and off").

A queue started by ``transfer_queue.init`` always authenticates: its controller draws a random secret
(``wire/auth.new_secret``) and there is no setting to turn that off. Its servers take the secret as an argument, and
``b""`` means no authentication (``wire/auth.py``: "a server with no secret accepts every peer"), so this workload
builds two queues without Ray from the same classes the Ray actors run (``ControllerServer`` over ``QueueState``, two
``StorageServer`` s over ``BlockStore`` s), each server in a process of its own as under Ray, one with a secret and
one with ``b""``, and runs the grpo put / get_data on both, interleaved call by call (a put on one queue, a put on
the other, ...; which goes first is swapped every repetition).

What authentication is on each path:

- **Unix socket** (same-host clients, what the ``grpo`` row measures): an HMAC-SHA256 challenge once per connection,
  plus the write token: the controller signs each block a put reserves (HMAC-SHA256 of 32 bytes) and the storage unit
  checks it. Nothing per byte. (The controller signs with the empty key too when the secret is ``b""``; only the
  storage unit's check is skipped.)
- **TCP** (clients on other hosts; ``force_tcp=True`` here, loopback): CURVE, every byte encrypted and authenticated
  by libzmq, on top of the same write tokens.

Rows: ``auth.grpo.{put,get_data}.{uds,tcp}.{on,off}`` (medians over 3x the run's repetitions of each repetition's
p50) and the ratio on / off of each, goal <= 1.05 (the JSONL also has the median of the per-repetition ratios);
``auth.write_token`` is one token's HMAC in process, the per-block share of a put.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from typing import Any

import numpy as np

PER_REP = {"uds": 8, "tcp": 4}
REPS_FACTOR = 3  # 3x the run's repetitions: a 5% difference is within one repetition's noise on a shared machine


# ---- a queue without Ray: each server in a process of its own --------------------------------------------------
def _storage_proc(
    conn: Any, unit: int, num_units: int, session: str, secret: bytes, shared_memory_bytes: int = 0
) -> None:
    from transfer_queue.storage.unit import BlockStore, StorageServer

    block = BlockStore(unit, num_units, secret)
    server = StorageServer(block, "127.0.0.1", session, secret, 1 << 31, None, shared_memory_bytes)
    conn.send(server.endpoint)
    conn.recv()
    server.stop()


def _controller_proc(conn: Any, config: Any, endpoints: list, session: str, secret: bytes) -> None:
    from transfer_queue.controller.server import ControllerServer
    from transfer_queue.state.queue_state import QueueState
    from transfer_queue.wire import protocol as p

    server = ControllerServer(QueueState(config, None), session, endpoints, "127.0.0.1", secret)
    conn.send(p.ControllerInfo(p.PROTOCOL_VERSION, session, server.endpoint, endpoints, config.to_dict(), secret))
    conn.recv()
    server.stop()


class RaylessQueue:
    """A controller and two storage units, each in a spawned process, with ``secret`` (``b""``: no authentication).
    ``shared_memory_bytes`` > 0: the units pool that much shared memory for clients that ask for it."""

    def __init__(self, secret: bytes, num_units: int = 2, shared_memory_bytes: int = 0):
        from transfer_queue.config import QueueConfig

        ctx = mp.get_context("spawn")
        session = uuid.uuid4().hex
        config = QueueConfig(global_batch_size=64, num_n_samples=4, num_storage_units=num_units,
                             storage_unit_bytes=4 << 30)  # fmt: skip
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        endpoints = []
        for unit in range(num_units):
            endpoints.append(self._start(ctx, _storage_proc, unit, num_units, session, secret, shared_memory_bytes))
        self.info = self._start(ctx, _controller_proc, config, endpoints, session, secret)
        self.controller_pid = self._procs[-1].pid

    def _start(self, ctx: Any, target: Any, *args: Any) -> Any:
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        proc.start()
        self._conns.append(conn)
        self._procs.append(proc)
        if not conn.poll(120):
            raise TimeoutError(f"{target.__name__} did not start within 120 s")
        return conn.recv()

    def close(self) -> None:
        for conn, proc in reversed(list(zip(self._conns, self._procs, strict=True))):  # the controller first
            conn.send("stop")
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


# ---- the workload ---------------------------------------------------------------------------------------------
def _put_get(clients: dict[str, Any], td: Any, pids: dict[str, str], n: int) -> dict[tuple[str, str], list[float]]:
    """``n`` puts into ``pids[mode]`` by ``clients[mode]``, then ``n`` get_data of get_meta's metas (the consumer's
    path), the modes alternating call by call (so a busy moment of the machine slows both); seconds each, by
    (op, mode)."""
    out: dict[tuple[str, str], list[float]] = {}
    for _ in range(n):
        for mode, client in clients.items():
            t0 = time.perf_counter()
            client.put(td, partition_id=pids[mode])
            out.setdefault(("put", mode), []).append(time.perf_counter() - t0)
    for _ in range(n):
        for mode, client in clients.items():
            meta = client.get_meta(list(td.keys()), len(td), partition_id=pids[mode], task_name="auth")
            t0 = time.perf_counter()
            client.get_data(meta)
            out.setdefault(("get_data", mode), []).append(time.perf_counter() - t0)
    for mode, client in clients.items():
        client.clear(partition_id=pids[mode])
    return out


def write_token_seconds(n: int = 20_000) -> float:
    from transfer_queue.wire.auth import new_secret, write_token

    secret = new_secret()
    t0 = time.perf_counter()
    for i in range(n):
        write_token(secret, 7, i, 128, 10 << 20)
    return (time.perf_counter() - t0) / n


def bench_auth(bench: Any) -> None:
    import torch
    from bench import grpo_batch
    from common import p50_ms, settle

    import transfer_queue as tq
    from transfer_queue.wire.auth import new_secret

    td = grpo_batch(256)
    queues = {"on": RaylessQueue(new_secret()), "off": RaylessQueue(b"")}
    clients: dict[tuple[str, str], Any] = {}
    try:
        for mode, queue in queues.items():
            for path in ("uds", "tcp"):
                client = tq.TransferQueueClient(f"bench-auth-{mode}-{path}", queue.info, force_tcp=path == "tcp")
                back = client.get_data(client.put(td, partition_id="warm"))  # warm up, and check the round trip
                for k, v in td.items():
                    assert torch.equal(back[k], v), k  # type: ignore[arg-type]
                client.clear(partition_id="warm")
                clients[(mode, path)] = client
        p50s: dict[tuple[str, str, str], list[float]] = {}
        for rep in range(REPS_FACTOR * bench.reps):
            for path in ("uds", "tcp"):
                order = ("on", "off") if rep % 2 == 0 else ("off", "on")
                settle()
                times = _put_get({m: clients[(m, path)] for m in order}, td, {m: bench.fresh("auth") for m in order},
                                 PER_REP[path])  # fmt: skip
                for (op, mode), seconds in times.items():
                    p50s.setdefault((op, path, mode), []).append(p50_ms(seconds))
    finally:
        for client in clients.values():
            client.close()
        for queue in queues.values():
            queue.close()
    what = {"uds": "Unix socket: HMAC handshake per connection + write tokens",
            "tcp": "TCP loopback: CURVE (every byte) + write tokens"}  # fmt: skip
    for path in ("uds", "tcp"):
        for op in ("put", "get_data"):
            off = p50s[(op, path, "off")]
            bench.add(f"auth.grpo.{op}.{path}.off", "auth", "ms", off, extra={"per_rep": PER_REP[path]})
            on = p50s[(op, path, "on")]
            paired = [a / b for a, b in zip(on, off, strict=True)]
            bench.add(
                f"auth.grpo.{op}.{path}.on",
                "auth",
                "ms",
                on,
                baseline="auth off",
                baseline_value=float(np.median(off)),
                target="<= 1.05x off",
                met=float(np.median(on)) / float(np.median(off)) <= 1.05,
                extra={
                    "per_rep": PER_REP[path],
                    "paired_ratio_median": round(float(np.median(paired)), 4),
                    "paired_ratios": [round(r, 3) for r in paired],
                    "auth": what[path],
                },
            )
    token = write_token_seconds()
    put_on = float(np.median(p50s[("put", "uds", "on")]))
    bench.add(
        "auth.write_token",
        "auth",
        "ms",
        [token * 1e3],
        extra={"share_of_grpo_put_per_block": round(2 * token * 1e3 / put_on, 6), "note": "signed + checked per block"},
    )
