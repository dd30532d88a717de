"""ZeroMQ sockets shared by the servers and the clients: which address a server binds and advertises, whether a
client talks TCP or the Unix socket (``TRANSFER_QUEUE_TRANSPORT``), and watched sockets (a monitor that sees a peer
go away or fail its handshake)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from transfer_queue.errors import (
    InvalidRequest,
)

T = TypeVar("T")
Frames = list[Any]


TRANSPORT_ENV = "TRANSFER_QUEUE_TRANSPORT"


def force_tcp_default() -> bool:
    """Whether sync clients skip the Unix socket by default: ``TRANSFER_QUEUE_TRANSPORT=tcp`` in the environment
    (``auto``, the default, takes the Unix socket to servers on this host). Tests use it to run the cross-host path
    on one host; ``TransferQueueClient(..., force_tcp=True)`` does the same for one client."""
    value = os.environ.get(TRANSPORT_ENV, "auto").strip().lower()
    if value not in ("auto", "tcp"):
        raise InvalidRequest(f"{TRANSPORT_ENV} must be 'auto' or 'tcp', got {value!r}")
    return value == "tcp"


def node_ip() -> str:
    """The node's address as Ray sees it (127.0.0.1 outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # ray missing or not connected: serve on loopback
        pass
    return "127.0.0.1"


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means "every interface" (it can be bound, never connected to)."""
    return host.strip("[]") in ("0.0.0.0", "::", "*", "")


def tcp_address(host: str, port: int | str) -> str:
    """``tcp://host:port`` with an IPv6 literal in brackets (``tcp://[::1]:5555``)."""
    host = host.strip("[]")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def server_addresses(bind_host: str | None, advertise_host: str | None) -> tuple[str, str]:
    """Where a server binds and the address it tells clients to connect to.

    Default: both are the node's address as Ray sees it. A server bound to every interface (``0.0.0.0``, ``::``)
    advertises the node's address unless told otherwise; an advertised wildcard is refused (clients would connect to
    themselves).

    >>> server_addresses("0.0.0.0", None)
    ('0.0.0.0', '127.0.0.1')
    """
    bind = (bind_host or node_ip()).strip("[]")
    advertise = (advertise_host or (node_ip() if is_wildcard(bind) else bind)).strip("[]")
    if is_wildcard(advertise):
        raise InvalidRequest(
            f"advertise_host={advertise_host!r}: clients cannot connect to a wildcard address; advertise an address "
            "of this node that they can reach (default: the node's address as Ray sees it)"
        )
    return bind, advertise


E = TypeVar("E", bound=Exception)


def with_addresses(exc: E, addresses: Sequence[str]) -> E:
    """``exc`` with the addresses (TCP addresses or Unix socket paths) of the servers it is about, as ``addresses``:
    the client maps them back to storage units."""
    exc.addresses = list(addresses)  # type: ignore[attr-defined]
    return exc


Reply = Callable[[Sequence[Any]], None]
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


# libzmq sends monitor events with a *blocking* send from the context's I/O thread: a monitor whose queue is full,
# or whose reading end was closed while the socket it watches still runs, blocks that thread for good, and with it
# every socket of the context (no connect, no message in or out). The two functions below are the only way this
# package opens and closes a monitored socket.
_monitor_ids = itertools.count(1)
_Socket = TypeVar("_Socket", bound=zmq.Socket)


def watch(sock: _Socket, events: int) -> _Socket:
    """A PAIR socket that receives ``sock``'s ``events`` (ZeroMQ's socket monitor). Close the two with
    :func:`close_watched`, never the monitor alone. Unlike pyzmq's ``get_monitor_socket``:

    - the monitor's queue has no bound (``RCVHWM`` 0 on our end, set before connecting): a monitor nobody reads for a
      while does not fill up (pyzmq's 1,000 events are 100 s of a socket retrying a dead server every 100 ms);
    - each monitor has an address of its own (pyzmq derives it from the socket's file descriptor, which the kernel
      hands out again once the socket is closed).
    """
    address = f"inproc://tq-monitor-{os.getpid()}-{next(_monitor_ids)}"
    sock.monitor(address, events)
    monitor: _Socket = sock.context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.RCVHWM, 0)
    monitor.setsockopt(zmq.LINGER, 0)
    monitor.connect(address)
    sock._monitor_socket = monitor  # where close_watched (and pyzmq's disable_monitor) find it
    return monitor


def monitor_of(sock: zmq.Socket) -> zmq.Socket:
    monitor = sock._monitor_socket
    assert monitor is not None, "a socket opened without watch()"
    return monitor


def close_watched(sock: zmq.Socket) -> None:
    """Close ``sock`` and its monitor (see :func:`watch`) in the one safe order: the monitor is stopped first, at
    once (libzmq does it under the socket's monitor lock), so no event is ever sent to a monitor closed before it."""
    monitor = sock._monitor_socket
    if monitor is not None and not sock.closed:
        sock.disable_monitor()
    sock.close(linger=0)
    if monitor is not None:
        monitor.close(linger=0)
