"""Who may talk to a queue: one secret per queue, proven on every connection before any frame is processed.

The controller draws a random secret when it starts and hands it out only through Ray (the trusted channel):
to its storage units when they attach, and to clients inside :class:`~transfer_queue.wire.protocol.ControllerInfo`.
Nothing sent over a socket ever carries it, nor the session id.

- **TCP (ZeroMQ): CURVE.** Server and client key pairs are derived from the secret; the server accepts a
  connection only if its client proves the client key (ZAP, :class:`ZapHandler`), and then everything on it is
  encrypted and authenticated by libzmq. CURVE, not an HMAC of ours, because ZeroMQ hides connections: a DEALER
  reconnects by itself, so a handshake made by our code could not be tied to the connection that later carries the
  frames, while CURVE's handshake runs inside libzmq on every (re)connection. Its encryption also protects the
  bytes on a network we do not own. It costs CPU per byte, which is why same-host traffic does not take it:
- **Unix socket: an HMAC challenge.** On accept the server sends a fresh random nonce; the client answers with
  ``HMAC-SHA256(secret, label + nonce)``; the server answers one byte, or closes the connection on a wrong or late
  proof, before any frame is read (so a client with a stale secret fails at connect time, typed). A server that
  says nothing within the client's timeout is hung, not a refusal: RequestTimeout, as over TCP.
  A fresh nonce per connection makes a recorded answer worthless (no replay). The socket is a real connection we
  own, on one host, in a 0600 file: proving the secret once is enough, and the payload moves at memcpy speed.

A server with no secret (``b""``) accepts every peer (unit tests of the framing; never a queue).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

import zmq
from zmq.utils import z85

from transfer_queue.errors import AuthenticationFailed, RequestTimeout

SECRET_BYTES = 32
NONCE_BYTES = 32
PROOF_BYTES = 32
ACCEPTED = b"\x01"  # the server's one-byte answer to a good proof
REFUSED = b"\x00"  # its answer to a bad one, before it closes the connection (a close alone: the server is gone)
HANDSHAKE_TIMEOUT = 10.0
_UNIX_LABEL = b"transfer_queue unix v1 "
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, label, hashlib.sha256).digest()


def curve_keys(secret: bytes, role: str) -> tuple[bytes, bytes]:
    """The (public, secret) CURVE key pair, Z85-encoded, of ``role`` ("server" or "client") for this secret."""
    private = z85.encode(_derive(secret, b"transfer_queue curve " + role.encode()))
    return zmq.curve_public(private), private


def unix_proof(secret: bytes, nonce: bytes) -> bytes:
    return _derive(secret, _UNIX_LABEL + nonce)


def write_token(secret: bytes, partition_uid: int, block_id: int, num_rows: int, max_bytes: int) -> bytes:
    """The controller's word that a put reserved ``max_bytes`` for block ``block_id`` of ``num_rows`` rows: a storage
    unit refuses a write without it, or carrying more bytes (the budget never trusts a client's declared size)."""
    fields = struct.pack("<qqqq", partition_uid, block_id, num_rows, max_bytes)
    return _derive(secret, b"transfer_queue write " + fields)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def check_unix_proof(secret: bytes, nonce: bytes, proof: bytes) -> bool:
    return hmac.compare_digest(unix_proof(secret, nonce), proof)


def answer_unix_challenge(sock: socket.socket, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Client side of the Unix-socket handshake on a fresh blocking connection: read the nonce, send the proof.

    Raises AuthenticationFailed if the server refuses the proof; RequestTimeout if it sends no challenge, or no
    answer to the proof, within ``timeout`` (it is alive but hung, e.g. stopped: a timeout, not a wrong secret)."""
    deadline = time.monotonic() + timeout
    nonce = b""
    while len(nonce) < NONCE_BYTES:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            chunk = sock.recv(NONCE_BYTES - len(nonce))
        except TimeoutError:
            raise RequestTimeout(f"the server sent no challenge within {timeout:.1f} s (it is hung)") from None
        except OSError:
            chunk = b""
        if not chunk:  # a live server sends its challenge first, whatever the client: this one died (or closes)
            raise ConnectionResetError("the server closed the connection before its challenge (the server is gone)")
        nonce += chunk
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(unix_proof(secret, nonce))
    try:
        answer = sock.recv(1)
    except TimeoutError:
        raise RequestTimeout(f"the server did not answer the proof within {timeout:.1f} s (it is hung)") from None
    except OSError:
        answer = b""
    if not answer:  # no answer: the server died (or closed) between the challenge and the answer, e.g. SIGKILLed
        raise ConnectionResetError("the server closed the connection before answering the proof (the server is gone)")
    if answer != ACCEPTED:
        raise AuthenticationFailed(
            "the server refused this queue's secret: the controller_info is from another queue (fetch a fresh one)"
        )
    sock.settimeout(None)


def secure_client(sock: zmq.Socket, secret: bytes) -> None:
    """Make a DEALER a CURVE client of the queue's servers (before it connects)."""
    if secret:
        public, private = curve_keys(secret, "client")
        sock.curve_serverkey = curve_keys(secret, "server")[0]
        sock.curve_publickey = public
        sock.curve_secretkey = private


def secure_server(sock: zmq.Socket, secret: bytes) -> None:
    """Make a ROUTER a CURVE server of the queue (before it binds); pair it with a :class:`ZapHandler`."""
    if secret:
        sock.curve_server = True
        sock.curve_secretkey = curve_keys(secret, "server")[1]
        sock.zap_domain = b"transfer_queue"


class ZapHandler:
    """libzmq's authentication hook (ZAP, RFC 27) for one context: accepts a CURVE connection only if its client key
    is the one derived from the queue's secret. Served from the server's own poll loop (:meth:`serve`)."""

    def __init__(self, ctx: zmq.Context, secret: bytes):
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(_ZAP_ENDPOINT)
        self._client_key = z85.decode(curve_keys(secret, "client")[0])
        self.refused = 0

    def serve(self) -> None:
        while True:
            try:
                request = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            version, request_id, mechanism = request[0], request[1], request[5] if len(request) > 5 else b""
            key = request[6] if len(request) > 6 else b""
            ok = mechanism == b"CURVE" and hmac.compare_digest(key, self._client_key)
            if not ok:
                self.refused += 1
            status = (b"200", b"OK") if ok else (b"400", b"not a client of this queue")
            self.sock.send_multipart([version, request_id, *status, b"", b""])

    def close(self) -> None:
        self.sock.close(linger=0)
