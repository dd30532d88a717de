"""A server bound to a fixed port (a controller restarted from its journal binds the port its clients know) waits for
the port while the process before it lets go of it, and names the port when it never comes free."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from transfer_queue.errors import PortInUse
from transfer_queue.wire.server_sockets import ServerSockets


def _listener() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def test_a_fixed_port_still_held_by_the_process_before_is_waited_for() -> None:
    holder, port = _listener()  # the dead controller's socket, not closed yet
    let_go = threading.Timer(0.5, holder.close)
    let_go.start()
    try:
        server = ServerSockets(host="127.0.0.1", unix=False, port=port)
    finally:
        let_go.join()
    try:
        assert server.endpoint.tcp.endswith(f":{port}")
    finally:
        server.close()


def test_a_fixed_port_that_stays_taken_is_a_typed_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import transfer_queue.wire.server_sockets as server_sockets

    monkeypatch.setattr(server_sockets, "FIXED_PORT_WAIT_S", 0.3)
    holder, port = _listener()
    try:
        with pytest.raises(PortInUse, match=rf"port {port} of 127\.0\.0\.1 is still taken after 0\.3 s"):
            ServerSockets(host="127.0.0.1", unix=False, port=port)
    finally:
        holder.close()


def test_a_fixed_port_that_stays_taken_leaves_nothing_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """The failed server closes its ZeroMQ context, router and ZAP handler: a process that tries again does not leak
    file descriptors (or ZeroMQ I/O threads) with every try, even while it keeps the errors."""
    import transfer_queue.wire.server_sockets as server_sockets

    monkeypatch.setattr(server_sockets, "FIXED_PORT_WAIT_S", 0.0)
    holder, port = _listener()
    try:
        before = len(os.listdir("/proc/self/fd"))
        threads = threading.active_count()
        kept = []  # the errors and their tracebacks, as a caller that reports them keeps them (Ray does)
        for _ in range(3):
            with pytest.raises(PortInUse, match=f"port {port} ") as failed:
                ServerSockets(host="127.0.0.1", unix=False, secret=b"s" * 32, port=port)
            kept.append(failed.value)
        assert len(os.listdir("/proc/self/fd")) == before
        assert threading.active_count() == threads
    finally:
        holder.close()
