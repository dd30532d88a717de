"""Per-run API keys for the HTTP servers a run starts: the task server, the OpenAI-compatible endpoint and the engine
servers (vLLM, SGLang) all refuse a request without ``Authorization: Bearer <key>`` (401).

The key is drawn fresh for each run (:func:`new_api_key`) unless the user gives one, reaches a server started as a
process through its environment (:data:`API_KEY_ENV`, never its command line where that can be helped) and its
clients through Ray or their constructor, and is never logged: :func:`redact` takes it out of a command line before
that is written anywhere. Every check compares in constant time (``hmac.compare_digest``).

    key = new_api_key()
    app.add_middleware(BearerAuth, api_key=key, open_paths=("/health",))   # any ASGI app (FastAPI, Starlette)
    httpx.get(url, headers=bearer_headers(key))

The queue's own secret (``transfer_queue/wire/auth.py``) is raw bytes proven over ZeroMQ / Unix sockets, not a
header: its helpers do not fit an HTTP bearer token, so this module draws a text token of the same strength.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any

#: the environment variable a server started as a process reads its key from (and clients fall back on)
API_KEY_ENV = "TQ_API_KEY"
#: what a logged command line shows instead of the key
REDACTED = "<redacted>"
#: an argv item a launcher (``EngineServer``) replaces by the key, for servers that take it only as a flag (SGLang)
KEY_PLACEHOLDER = "<api-key>"
KEY_BYTES = 32  # 256 bits, as the queue's secret

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def new_api_key() -> str:
    """A fresh random key (URL-safe text, 256 bits). It starts with ``tq-``: a key that began with ``-`` (one in 64
    of URL-safe tokens) would be read as an option where a server takes it as a flag (SGLang's ``--api-key KEY``)."""
    return "tq-" + secrets.token_urlsafe(KEY_BYTES)


def key_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """The key in :data:`API_KEY_ENV` (None when unset or empty)."""
    value = (os.environ if env is None else env).get(API_KEY_ENV, "")
    return value or None


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <key>"}``, or no header without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def redact(text: str, api_key: str | None) -> str:
    """``text`` (a command line, a log line) with every occurrence of the key replaced by :data:`REDACTED`."""
    return text.replace(api_key, REDACTED) if api_key else text


def key_matches(authorization: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>`` (constant-time comparison)."""
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(presented.strip().encode(), api_key.encode())


class BearerAuth:
    """ASGI middleware: every HTTP (and WebSocket) request needs ``Authorization: Bearer <api_key>``; others get a
    401 with a JSON body ``{"detail": ..., "error": {"message", "type", "code"}}`` (both FastAPI's and OpenAI's error
    shape) and ``WWW-Authenticate: Bearer``. Paths in ``open_paths`` (exact) stay open, and so do CORS preflights.

    Args:
        app: the ASGI app behind it.
        api_key: the key; None reads :data:`API_KEY_ENV` (how vLLM's ``--middleware`` builds it: no arguments).
        open_paths: paths answered without a key (health probes).

    Raises:
        ValueError: without a key (given or in the environment): a server meant to be protected must not start open.
    """

    def __init__(self, app: ASGIApp, api_key: str | None = None, open_paths: Iterable[str] = ()) -> None:
        key = api_key if api_key is not None else key_from_env()
        if not key:
            raise ValueError(f"BearerAuth needs an API key: expected api_key=... or {API_KEY_ENV} set, got neither")
        self.app, self._key, self.open_paths = app, key, frozenset(open_paths)

    def __repr__(self) -> str:  # never the key
        return f"BearerAuth(open_paths={sorted(self.open_paths)})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await _refuse(send)

    def _allowed(self, scope: Scope) -> bool:
        if scope.get("method") == "OPTIONS" or scope.get("path") in self.open_paths:
            return True
        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization")
        return key_matches(authorization.decode("latin-1") if authorization else None, self._key)


UNAUTHORIZED = "missing or wrong API key: expected the header 'Authorization: Bearer <key>' with this run's key"


async def _refuse(send: Send) -> None:
    body = json.dumps(
        {"detail": UNAUTHORIZED, "error": {"message": UNAUTHORIZED, "type": "authentication_error", "code": 401}}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
