"""A small read-only HTTP endpoint per actor: ``/metrics`` for Prometheus, and on the controller the status page.

Standard library only (``http.server`` on a daemon thread): GET and HEAD, nothing that changes the queue. It binds
to 127.0.0.1 unless told otherwise (``QueueConfig.http_host``) on a free port unless one is given, and advertises the
URL it serves (``0.0.0.0`` is advertised as the node's address, so a Prometheus elsewhere can scrape it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from transfer_queue.wire.sockets import node_ip

logger = logging.getLogger(__name__)
Route = Callable[[], tuple[str, bytes]]  # () -> (content type, body)
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
# how often the serving loop looks for stop(): stop() waits for it (the standard library's 0.5 s made stopping a
# controller and its storage units take most of a second); requests are served as they arrive either way
STOP_POLL_S = 0.05


class HttpEndpoint:
    """Serves ``routes`` (path -> callable returning content type and body) on ``host:port`` (0: a free port).

    >>> web = HttpEndpoint({"/hello": lambda: ("text/plain", b"hi")})
    >>> import urllib.request; urllib.request.urlopen(web.url + "/hello").read()
    b'hi'
    >>> web.stop()
    """

    def __init__(self, routes: dict[str, Route], host: str = "127.0.0.1", port: int = 0):
        self.routes = routes
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                endpoint._serve(self, body=True)

            def do_HEAD(self) -> None:
                endpoint._serve(self, body=False)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a scrape every few seconds would flood the actor's log

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(STOP_POLL_S,), name="tq-http", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "", "::"):
            host = node_ip()
        return f"http://{host}:{self.port}"

    def _serve(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        path = request.path.split("?", 1)[0]
        route = self.routes.get(path)
        if route is None:
            request.send_error(404, f"no such page; there are {sorted(self.routes)}")
            return
        try:
            content_type, payload = route()
        except Exception as exc:  # the page fails, the actor goes on
            logger.exception("HTTP %s failed", path)
            request.send_error(500, f"{type(exc).__name__}: {exc}")
            return
        request.send_response(200)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(payload)))
        request.send_header("Cache-Control", "no-store")
        request.end_headers()
        if body:
            request.wfile.write(payload)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
