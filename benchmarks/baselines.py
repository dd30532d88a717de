"""Baselines measured in the same run as the queue: raw ZeroMQ, the Ray object store, memcpy.

- Raw Unix-domain socket: the same request/reply without ZeroMQ (what a same-host transport could reach).
- Raw ZeroMQ: a DEALER client and a ROUTER server in another process (a plain Python loop, like the queue's
  servers), zero-copy frames, over the same transport the queue uses on one host (``ipc://``) and over
  loopback TCP. ``rtt`` is a request/reply of given sizes (the get_meta baseline); ``send`` moves buffers one
  way and waits for a tiny ack (the put baseline); ``fetch`` asks with a tiny request and receives the buffers
  (the get_data baseline).
- Ray object store: ``ray.put`` in this process and ``ray.get`` in an actor (put direction); an actor returns
  the tensors and this process ``ray.get``s them (get direction). Torch tensors and numpy arrays both.
- memcpy: a numpy copy of the same bytes (one thread), and ``tensor.clone()`` (torch's intra-op threads).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import tempfile
import threading
import time
import uuid
from typing import Any

import numpy as np
import zmq

# ---- raw ZeroMQ server (runs in its own process) -------------------------------------------------------------


def _serve_uds(listener: socket.socket) -> None:
    """Raw Unix-domain-socket echo (no ZeroMQ, no I/O threads): 8-byte header (request, reply sizes) + request."""
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        replies: dict[int, bytes] = {}
        try:
            while True:
                header = _recv_exact(conn, 8)
                if header is None:
                    break
                req, rep = struct.unpack("<II", header)
                if req and _recv_exact(conn, req) is None:
                    break
                reply = replies.get(rep)
                if reply is None:
                    reply = replies[rep] = b"y" * rep
                conn.sendall(reply)
        finally:
            conn.close()


def _recv_exact(conn: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if not k:
            return None
        got += k
    return buf


def _serve(ready: Any, ipc_path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(ipc_path + ".uds")
    listener.listen(8)
    threading.Thread(target=_serve_uds, args=(listener,), daemon=True).start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.bind(f"ipc://{ipc_path}")
    ready.put({"tcp": f"tcp://127.0.0.1:{port}", "ipc": f"ipc://{ipc_path}", "uds": ipc_path + ".uds"})
    cache: dict[bytes, list[Any]] = {}
    while True:
        frames = sock.recv_multipart(copy=False)
        identity, op = frames[0], frames[1].bytes
        if op == b"stop":
            sock.send_multipart([identity, b"bye"])
            break
        if op.startswith(b"echo:") or op.startswith(b"source:"):
            reply = cache.get(op)
            if reply is None:
                sizes = [int(s) for s in op.split(b":", 1)[1].split(b",")]
                reply = cache[op] = [np.ones(s, dtype=np.uint8) for s in sizes]
            sock.send_multipart([identity, *reply], copy=False)
        elif op == b"drop":
            cache.clear()
            sock.send_multipart([identity, b"ok"])
        else:  # sink: the payload frames are received (and dropped); ack
            sock.send_multipart([identity, b"ok"])
    sock.close(linger=0)
    ctx.term()
    os.unlink(ipc_path)
    os.unlink(ipc_path + ".uds")


class RawZmq:
    """A raw ZeroMQ server process and a client socket per address."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        self._ipc_path = os.path.join(tempfile.gettempdir(), f"tq-bench-{uuid.uuid4().hex[:12]}.sock")
        self._proc = ctx.Process(target=_serve, args=(ready, self._ipc_path), daemon=True)
        self._proc.start()
        self.addresses: dict[str, str] = ready.get(timeout=60)
        self._ctx = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket] = {}

    def _sock(self, transport: str) -> zmq.Socket:
        sock = self._socks.get(transport)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.addresses[transport])
            self._socks[transport] = sock
        return sock

    @staticmethod
    def _wait(sock: zmq.Socket, spin: float) -> list[zmq.Frame]:
        if spin > 0:
            until = time.perf_counter() + spin
            while time.perf_counter() < until:
                if sock.poll(0, zmq.POLLIN):
                    break
        if not sock.poll(60_000, zmq.POLLIN):
            raise TimeoutError("raw zmq server did not answer")
        return sock.recv_multipart(copy=False)

    def rtt(self, req_bytes: int, rep_bytes: int, n: int, transport: str = "ipc", spin: float = 0.0) -> list[float]:
        """Seconds per request/reply of ``req_bytes`` out and ``rep_bytes`` back, ``n`` times."""
        sock = self._sock(transport)
        op, pad = f"echo:{rep_bytes}".encode(), b"x" * max(0, req_bytes - 8)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            sock.send_multipart([op, pad], copy=False)
            self._wait(sock, spin)
            out.append(time.perf_counter() - t0)
        return out

    def uds_rtt(self, req_bytes: int, rep_bytes: int, n: int) -> list[float]:
        """Seconds per request/reply over a plain Unix-domain socket (the floor without ZeroMQ's I/O threads)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.addresses["uds"])
        message = struct.pack("<II", req_bytes, rep_bytes) + b"x" * req_bytes
        out = []
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                conn.sendall(message)
                _recv_exact(conn, rep_bytes)
                out.append(time.perf_counter() - t0)
        finally:
            conn.close()
        return out

    def send(self, buffers: list[Any], transport: str = "ipc") -> float:
        """Seconds to move ``buffers`` one way (zero-copy) and get a tiny ack."""
        sock = self._sock(transport)
        t0 = time.perf_counter()
        sock.send_multipart([b"sink", *buffers], copy=False)
        self._wait(sock, 0.0)
        return time.perf_counter() - t0

    def fetch(self, sizes: list[int], transport: str = "ipc") -> float:
        """Seconds to ask for buffers of ``sizes`` bytes and receive them (zero-copy both sides)."""
        sock = self._sock(transport)
        op = ("source:" + ",".join(str(s) for s in sizes)).encode()
        t0 = time.perf_counter()
        sock.send_multipart([op], copy=False)
        frames = self._wait(sock, 0.0)
        views = [np.frombuffer(f.buffer, dtype=np.uint8) for f in frames]  # what a receiver would build on
        elapsed = time.perf_counter() - t0
        assert [v.nbytes for v in views] == sizes
        return elapsed

    def drop_cache(self) -> None:
        sock = self._sock("ipc")
        sock.send_multipart([b"drop"])
        self._wait(sock, 0.0)

    def close(self) -> None:
        try:
            sock = self._sock("ipc")
            sock.send_multipart([b"stop"])
            self._wait(sock, 0.0)
        except Exception:
            pass
        for sock in self._socks.values():
            sock.close(linger=0)
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()


# ---- Ray object store -----------------------------------------------------------------------------------------


def ray_actor_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class RayPeer:
        """The other end of the Ray baseline: fetches what the driver put, or returns what it holds."""

        def __init__(self) -> None:
            self.held: Any = None

        def fetch(self, refs: list[Any]) -> int:
            value = ray.get(refs[0])
            return sum(_nbytes(v) for v in value.values())

        def hold(self, value: dict[str, Any]) -> int:
            self.held = {k: v.copy() if isinstance(v, np.ndarray) else v.clone() for k, v in value.items()}
            return sum(_nbytes(v) for v in self.held.values())

        def give(self) -> dict[str, Any]:
            return self.held

        def drop(self) -> None:
            self.held = None

    return RayPeer


def _nbytes(v: Any) -> int:
    return int(v.nbytes) if isinstance(v, np.ndarray) else v.numel() * v.element_size()


def ray_put_get(peer: Any, value: dict[str, Any]) -> float:
    """Seconds for ``ray.put`` here plus ``ray.get`` in the peer actor (which touches nothing but sizes)."""
    import ray

    t0 = time.perf_counter()
    ref = ray.put(value)
    ray.get(peer.fetch.remote([ref]))
    elapsed = time.perf_counter() - t0
    del ref
    return elapsed


def ray_get_from_actor(peer: Any) -> tuple[float, Any]:
    """Seconds for ``ray.get`` of the value the peer actor holds (it returns it from a method)."""
    import ray

    t0 = time.perf_counter()
    value = ray.get(peer.give.remote())
    return time.perf_counter() - t0, value


def memcpy(tensors: dict[str, Any]) -> float:
    """Seconds to copy the tensors' bytes into fresh memory with numpy (one thread: the plain memcpy limit)."""
    import torch

    views = [v.reshape(-1).view(torch.uint8).numpy() for v in tensors.values()]
    t0 = time.perf_counter()
    copies = [v.copy() for v in views]
    elapsed = time.perf_counter() - t0
    del copies
    return elapsed


def torch_clone(tensors: dict[str, Any]) -> float:
    """Seconds for ``tensor.clone()`` of each tensor (torch's intra-op threads, as a client would copy)."""
    t0 = time.perf_counter()
    copies = {k: v.clone() for k, v in tensors.items()}
    elapsed = time.perf_counter() - t0
    del copies
    return elapsed
