"""Commit -> wake latency (issue 29): how soon a commit wakes a consumer whose get_meta is parked waiting for it.

A consumer process (spawned once) parks ``get_meta(["x"], 1, partition_id=P, task_name="wake")`` on a partition with
no ready row; the producer (this process, the bench's client, spin 0) waits until the controller reports the
get_meta parked (``status()["waiting_get_meta"]``, outside the timed window), then puts one row of one int64 into P.
Three instants are taken on the producer's side and one on the consumer's, all with ``time.perf_counter_ns``: on
Linux that is ``CLOCK_MONOTONIC``, one clock for every process of the host, so instants taken in two processes can be
subtracted.

- ``put_start``: before ``put`` is called (the put then reserves, writes to a storage unit, commits);
- ``commit_sent``: when the put's last controller round trip (the commit) starts, taken inside the client's
  transport (``call_many``): from here the path is producer -> controller (apply the commit, retry the parked
  get_meta, answer both) -> consumer;
- ``put_return``: when ``put`` returns (the commit is acknowledged);
- ``wake``: when the consumer's ``get_meta`` returns (its reply decoded into a BatchMeta); and ``reply_arrived``, when
  the consumer's transport handed the reply's frames back, before the client decoded them (row
  ``wake.commit_sent.reply_arrived``: the path without the consumer's decoding).

``wake - commit_sent`` is the figure the issue's goal is about (p50 <= 0.2 ms, p99 <= 1 ms); ``wake - put_return``
can be negative (the controller answers the commit and the parked get_meta in the same pass, and either process may
be scheduled first); ``wake - put_start`` includes the whole put.

Baselines, same pattern, same run: a raw ZeroMQ one-way message over ``ipc://`` (a PUSH in this process, a PULL in
the consumer process blocked in ``recv``: send -> wake), and the same over a plain Unix-domain socket (the transport
the queue's same-host clients use). The queue's path is two such hops (producer -> controller -> consumer) plus the
controller's work, so the floor for it is about twice the one-way baseline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
import uuid
from typing import Any

import numpy as np

WAKES = 200  # per repetition
FIELD = "x"


# ---- the consumer process ------------------------------------------------------------------------------------
def _consumer(conn: Any) -> None:
    """Serves jobs from ``conn``: each one is a loop of ``n`` waits, each preceded by a "parking" notice and followed
    by the wake instant (perf_counter_ns)."""
    import zmq

    client = None
    ctx: Any = zmq.Context.instance()
    while True:
        job = conn.recv()
        if job is None:
            break
        kind, args, n = job
        try:
            if kind == "queue":
                info, pid = args
                if client is None:
                    import transfer_queue as tq

                    client = tq.TransferQueueClient("bench-wake-consumer", info)
                    arrivals = _arrival_clock(client)
                for i in range(n):
                    conn.send(("parking", i))
                    meta = client.get_meta([FIELD], 1, partition_id=pid, task_name="wake", timeout=60)
                    t = time.perf_counter_ns()
                    assert len(meta) == 1, len(meta)
                    conn.send(("woke", i, t, arrivals[-1]))
            elif kind == "zmq":
                sock = ctx.socket(zmq.PULL)
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(args)
                conn.send(("bound", 0))
                for i in range(n):
                    conn.send(("parking", i))
                    sock.recv(copy=False)
                    t = time.perf_counter_ns()
                    conn.send(("woke", i, t))
                sock.close(linger=0)
            elif kind == "uds":
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                listener.bind(args)
                listener.listen(1)
                conn.send(("bound", 0))
                peer, _ = listener.accept()
                for i in range(n):
                    conn.send(("parking", i))
                    got = peer.recv(64)
                    t = time.perf_counter_ns()
                    assert got, "the producer closed the socket"
                    conn.send(("woke", i, t))
                peer.close()
                listener.close()
                os.unlink(args)
            conn.send(("done", 0))
        except Exception as exc:  # report, and keep the process usable
            conn.send(("error", repr(exc)))
    if client is not None:
        client.close()


def _arrival_clock(client: Any) -> list[int]:
    """Wraps the client's transport for good: appends the instant each round trip's reply has arrived (before the
    client decodes it into a BatchMeta) to the list it returns."""
    transport = client._client._transport
    inner = transport.call_many
    arrivals: list[int] = []

    async def call_many(calls: Any, timeout: float, into: Any = None) -> Any:
        out = await inner(calls, timeout, into)
        arrivals.append(time.perf_counter_ns())
        return out

    transport.call_many = call_many
    return arrivals


class Consumer:
    """The consumer process and the pipe to it."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_consumer, args=(child,), daemon=True)
        self.proc.start()

    def recv(self, expect: str, timeout: float = 120.0) -> tuple:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the consumer process sent nothing for {timeout} s (expected {expect!r})")
        msg = self.conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"the consumer process failed: {msg[1]}")
        assert msg[0] == expect, (msg, expect)
        return msg

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


# ---- the producer side ---------------------------------------------------------------------------------------
class CommitClock:
    """Records when each transport round trip of a client starts (wraps its private transport while active): a
    put's last one is its commit."""

    def __init__(self, client: Any):
        self._transport = client._client._transport
        self.starts: list[int] = []

    def __enter__(self) -> CommitClock:
        inner = self._transport.call_many

        async def call_many(calls: Any, timeout: float, into: Any = None) -> Any:
            self.starts.append(time.perf_counter_ns())
            return await inner(calls, timeout, into)

        self._transport.call_many = call_many
        return self

    def __exit__(self, *exc: Any) -> None:
        del self._transport.call_many  # back to the class's method


def _wait_parked(client: Any, others: int, timeout: float = 60.0) -> int:
    """Polls the controller until more than ``others`` get_metas are parked; returns how many polls it took."""
    deadline = time.monotonic() + timeout
    polls = 0
    while True:
        polls += 1
        if client.status()["waiting_get_meta"] > others:
            return polls
        if time.monotonic() > deadline:
            raise TimeoutError(f"the consumer's get_meta was not parked within {timeout} s")
        time.sleep(0.0002)


def queue_wakes(bench: Any, consumer: Consumer, n: int) -> dict[str, np.ndarray]:
    """``n`` commit -> wake samples (ns) on a fresh partition: put_start, commit_sent and put_return to wake."""
    import torch
    from tensordict import TensorDict

    client = bench.client
    pid = bench.fresh("wake")
    row = TensorDict({FIELD: torch.zeros(1, dtype=torch.int64)}, batch_size=[1])
    others = client.status()["waiting_get_meta"]  # parked by anyone else (none unless a workload left some)
    consumer.conn.send(("queue", (client.controller_info, pid), n))
    out: dict[str, list[int]] = {k: [] for k in ("put_start", "commit_sent", "put_return", "reply_arrived", "polls")}
    for i in range(n):
        consumer.recv("parking")
        out["polls"].append(_wait_parked(client, others))
        with CommitClock(client) as clock:
            t0 = time.perf_counter_ns()
            client.put(row, partition_id=pid, group_ids=[i])  # one row of a group of num_n_samples
            t1 = time.perf_counter_ns()
        assert len(clock.starts) >= 2, clock.starts  # at least reserve (+ writes) + commit
        _, j, wake, arrived = consumer.recv("woke")
        assert j == i
        out["reply_arrived"].append(arrived - clock.starts[-1])
        out["put_start"].append(wake - t0)
        out["commit_sent"].append(wake - clock.starts[-1])
        out["put_return"].append(wake - t1)
    consumer.recv("done")
    client.clear(partition_id=pid)
    return {k: np.asarray(v) for k, v in out.items()}


def raw_wakes(consumer: Consumer, kind: str, n: int) -> np.ndarray:
    """``n`` send -> wake samples (ns) of a raw one-way message (``kind``: "zmq" over ipc://, or "uds")."""
    import zmq

    path = os.path.join(tempfile.gettempdir(), f"tq-wake-{uuid.uuid4().hex[:12]}.sock")
    consumer.conn.send((kind, f"ipc://{path}" if kind == "zmq" else path, n))
    consumer.recv("bound")
    if kind == "zmq":
        sock: Any = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{path}")
        send = lambda: sock.send(b"x" * 16)  # noqa: E731
        close = lambda: sock.close(linger=0)  # noqa: E731
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        send = lambda: s.sendall(b"x" * 16)  # noqa: E731
        close = s.close
    out = []
    try:
        for i in range(n):
            consumer.recv("parking")
            time.sleep(0.001)  # the consumer blocks in recv (the queue's consumer is parked: asleep in its poll)
            t0 = time.perf_counter_ns()
            send()
            _, j, wake = consumer.recv("woke")
            assert j == i
            out.append(wake - t0)
        consumer.recv("done")
    finally:
        close()
        if kind == "zmq" and os.path.exists(path):
            os.unlink(path)
    return np.asarray(out)


def _p(samples_ns: np.ndarray, q: float) -> float:
    return float(np.percentile(samples_ns, q)) / 1e6


def bench_wake(bench: Any) -> None:
    n = 100 if bench.quick else WAKES
    consumer = Consumer()
    try:
        raw_wakes(consumer, "zmq", 20)  # warm up: the process's imports, the sockets
        queue_wakes(bench, consumer, 20)
        keys = ("put_start", "commit_sent", "put_return", "reply_arrived")
        series: dict[str, list[np.ndarray]] = {k: [] for k in ("zmq", "uds", *keys)}
        polls: list[float] = []
        for _ in range(bench.reps):  # interleaved: each repetition measures the baselines and the queue back to back
            series["zmq"].append(raw_wakes(consumer, "zmq", n))
            series["uds"].append(raw_wakes(consumer, "uds", n))
            q = queue_wakes(bench, consumer, n)
            for k in keys:
                series[k].append(q[k])
            polls.append(float(np.mean(q["polls"])))
    finally:
        consumer.close()

    Baseline = tuple[str, float, float]  # name, p50, p99

    def rows(name: str, key: str, baseline: Baseline | None = None, goals: bool = False, **kw: Any) -> None:
        reps = series[key]
        pooled = np.concatenate(reps)
        extra = {
            "wakes_per_rep": n,
            "p99_ms_per_rep": [round(_p(r, 99), 4) for r in reps],
            "pooled_p50_ms": round(_p(pooled, 50), 4),
            "pooled_p99_ms": round(_p(pooled, 99), 4),
            "pooled_max_ms": round(float(pooled.max()) / 1e6, 4),
            "pooled_min_ms": round(float(pooled.min()) / 1e6, 4),
            **kw,
        }
        base = {} if baseline is None else {"baseline": baseline[0], "baseline_value": baseline[1]}
        p50s = [_p(r, 50) for r in reps]
        goal50 = {"target": "p50 <= 0.2 ms", "met": float(np.median(p50s)) <= 0.2} if goals else {}
        bench.add(f"{name}.p50", "wake", "ms", p50s, extra=extra, **base, **goal50)
        p99s = [_p(r, 99) for r in reps]
        goal99 = {"target": "p99 <= 1 ms", "met": float(np.median(p99s)) <= 1.0} if goals else {}
        base99 = {} if baseline is None else {"baseline": baseline[0] + " p99", "baseline_value": baseline[2]}
        bench.add(f"{name}.p99", "wake", "ms", p99s, **base99, **goal99)

    rows("raw_zmq.one_way.ipc", "zmq")
    rows("raw_uds.one_way", "uds")
    zmq_p50 = bench.results.value("raw_zmq.one_way.ipc.p50")
    zmq_p99 = bench.results.value("raw_zmq.one_way.ipc.p99")
    base = ("raw zmq one-way", zmq_p50, zmq_p99)
    rows("wake.commit_sent", "commit_sent", base, goals=True, status_polls_per_wake=round(float(np.mean(polls)), 2))
    rows("wake.commit_sent.reply_arrived", "reply_arrived", base)
    rows("wake.put_return", "put_return", base)
    rows("wake.put_start", "put_start", base)


def main() -> None:
    """Without Ray: the wake loop against a queue of :class:`auth_cost.RaylessQueue` (a controller and two storage
    units, each its own process), for profiling its controller (``py-spy record -p PID``, the pid printed first)."""
    import argparse
    import itertools
    import sys
    from types import SimpleNamespace

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from auth_cost import RaylessQueue

    import transfer_queue as tq
    from transfer_queue.wire.auth import new_secret

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--wakes", type=int, default=200, help="wakes per repetition")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    queue = RaylessQueue(new_secret())
    print(f"controller pid {queue.controller_pid}", flush=True)
    client = tq.TransferQueueClient("bench-wake-producer", queue.info)
    names = itertools.count()
    bench = SimpleNamespace(client=client, fresh=lambda prefix: f"{prefix}-{next(names)}")
    consumer = Consumer()
    try:
        queue_wakes(bench, consumer, 20)
        for _ in range(args.reps):
            q = queue_wakes(bench, consumer, args.wakes)
            keys = ("commit_sent", "put_return")
            print("  ".join(f"{k} p50 {_p(q[k], 50):.3f} p99 {_p(q[k], 99):.3f} ms" for k in keys), flush=True)
    finally:
        consumer.close()
        client.close()
        queue.close()


if __name__ == "__main__":
    main()
