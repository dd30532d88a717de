"""What idle connections cost a server's round trips: a server of the queue's own serving loop
(``transfer_queue.wire.server.Server``, the controller's and the storage units' base) answering a small request at
once, with N other Unix-socket connections open and silent (an RL run's actor threads each hold one to the
controller), and one client making lock-step round trips over its Unix socket.

    PYTHONPATH=. .venv/bin/python benchmarks/idle_connections.py [--idle 0 --idle 1000 --idle 4000] [--calls 2000]
        [--reps 5] [--source DIR ...]

Each ``--source`` is a checkout of this repository (default: this one) whose ``transfer_queue`` is imported by the
server and the client: two of them compare two versions of the loop in one run, their rounds interleaved
(source A, source B, A, B, ...) so a noisy moment of the machine slows both. Baseline, same run: a raw Python
Unix-socket echo (``select.poll`` + ``recv`` + ``send``, no framing) with no idle connection.

Prints, per source and N, the median over ``--reps`` of each round's mean round trip (us) and the server's CPU per
round trip (``/proc``: user + system), and writes JSON lines to ``benchmarks/results/idle-connections-<time>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import select
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SECRET = b"k" * 32


def _import_from(source: str) -> None:
    sys.path.insert(0, source)
    import transfer_queue

    assert Path(transfer_queue.__file__).resolve().is_relative_to(Path(source).resolve()), transfer_queue.__file__


def _echo_server(source: str, conn: Any) -> None:
    _import_from(source)
    from transfer_queue.wire import protocol as p
    from transfer_queue.wire.server import Responder, Server

    class Echo(Server):
        def handle(self, request: Any, buffers: list[Any], responder: Responder) -> None:
            responder.ok(b"r" * 1000)

    server = Echo("echo", lambda raw: p.decode_as(raw, dict), session_id="s", host="127.0.0.1", secret=SECRET)
    server.start()
    conn.send((server.endpoint, os.getpid()))
    conn.recv()
    server.stop()


def _raw_server(path: str, conn: Any) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    conn.send(os.getpid())
    peer, _ = listener.accept()
    poller = select.poll()
    poller.register(peer, select.POLLIN)
    reply = b"r" * 1077
    while True:
        poller.poll(1000)
        data = peer.recv(65536)
        if not data:
            return
        peer.sendall(reply)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client(source: str, idle: int, calls: int, reps: int, conn: Any) -> None:
    """In a process of its own (the source's ``transfer_queue`` imported): start the server, open ``idle`` silent
    connections (each proves the secret, as a client's does), then ``reps`` rounds of ``calls`` round trips."""
    _import_from(source)
    from transfer_queue.wire import protocol as p
    from transfer_queue.wire.transport import BlockingTransport, run_sync
    from transfer_queue.wire.unix_socket import connect

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo_server, args=(source, child), daemon=True)
    proc.start()
    endpoint, server_pid = parent.recv()
    idle_socks = [connect(endpoint.unix, SECRET, 30.0) for _ in range(idle)]
    transport = BlockingTransport(secret=SECRET)
    body = p.encode({"x": "q" * 100})

    def call() -> None:
        request_id = transport.next_request_id()
        frames = [p.encode(p.Envelope(p.PROTOCOL_VERSION, "s", request_id)), body]
        run_sync(transport.call_many([(endpoint, frames, request_id)], 10.0))

    for _ in range(200):
        call()
    rounds = []
    for _ in range(reps):
        cpu0, t0 = _cpu_s(server_pid), time.perf_counter()
        for _ in range(calls):
            call()
        wall, cpu = time.perf_counter() - t0, _cpu_s(server_pid) - cpu0
        rounds.append({"rtt_us": wall / calls * 1e6, "server_cpu_us": cpu / calls * 1e6})
    transport.close()
    for sock in idle_socks:
        sock.close()
    parent.send("stop")
    proc.join(10)
    conn.send(rounds)


def _raw_round(calls: int) -> float:
    ctx = mp.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="tq-idle-")
    path = os.path.join(folder, "raw.sock")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_server, args=(path, child), daemon=True)
    proc.start()
    parent.recv()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    request = b"q" * 158
    t0 = time.perf_counter()
    for _ in range(calls):
        sock.sendall(request)
        got = 0
        while got < 1077:
            got += len(sock.recv(65536))
    rtt = (time.perf_counter() - t0) / calls * 1e6
    sock.close()
    proc.join(10)
    shutil.rmtree(folder, ignore_errors=True)
    return rtt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle", type=int, action="append", default=None, help="idle connections (repeatable)")
    parser.add_argument("--calls", type=int, default=2000, help="round trips per round")
    parser.add_argument("--reps", type=int, default=5, help="rounds per source and N")
    parser.add_argument("--source", action="append", default=None, help="a checkout to import (repeatable)")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    idles = args.idle or [0, 1000, 4000]
    sources = [str(Path(s).resolve()) for s in (args.source or [str(HERE.parent)])]
    ctx = mp.get_context("spawn")
    rows = []
    for idle in idles:
        rounds: dict[str, list[dict[str, float]]] = {s: [] for s in sources}
        for _ in range(args.reps):  # interleaved: one round of each source in turn
            for source in sources:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_client, args=(source, idle, args.calls, 1, child))
                proc.start()
                rounds[source] += parent.recv()
                proc.join(30)
        raw = _raw_round(args.calls)
        for source in sources:
            row = {
                "idle": idle,
                "source": source,
                "rtt_us": statistics.median(r["rtt_us"] for r in rounds[source]),
                "server_cpu_us": statistics.median(r["server_cpu_us"] for r in rounds[source]),
                "rounds": rounds[source],
                "raw_unix_rtt_us": raw,
                "loadavg": os.getloadavg(),
            }
            rows.append(row)
            print(
                f"idle {idle:5d}  {source}: round trip {row['rtt_us']:7.1f} us, server cpu {row['server_cpu_us']:6.1f} "
                f"us a call (raw Unix echo {raw:.1f} us)",
                flush=True,
            )
    os.makedirs(args.out, exist_ok=True)
    out = Path(args.out) / f"idle-connections-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
