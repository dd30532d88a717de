"""The controller's read-only web pages: ``/status`` (HTML), ``/status.json``, ``/metrics`` and their static files.

The page is plain HTML and one script (``static/status.js``) that fetches ``/status.json`` every two seconds and draws
the tables, and the RL run's reward and loss curves with uPlot (MIT, vendored in ``static/`` with its license; no
CDN: the page works on a cluster without internet access).
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from importlib import resources
from typing import Any, Protocol

from transfer_queue.ops.metrics import ControllerMetrics, controller_families, render
from transfer_queue.ops.web import PROMETHEUS_TEXT, Route
from transfer_queue.state.queue_state import QueueState


class ServedQueue(Protocol):
    """What the pages read from the controller's server (``ControllerServer``), under its lock."""

    @property
    def lock(self) -> AbstractContextManager[Any]: ...

    @property
    def metrics(self) -> ControllerMetrics: ...

    @property
    def state(self) -> QueueState: ...

    def summary_locked(self, run_history: bool = False) -> dict[str, Any]: ...

    def summary(self, run_history: bool = False) -> dict[str, Any]: ...


STATIC = {
    "/static/uPlot.iife.min.js": ("uPlot.iife.min.js", "application/javascript; charset=utf-8"),
    "/static/uPlot.min.css": ("uPlot.min.css", "text/css; charset=utf-8"),
    "/static/uPlot.LICENSE": ("uPlot.LICENSE", "text/plain; charset=utf-8"),
    "/static/status.js": ("status.js", "application/javascript; charset=utf-8"),
    "/status": ("status.html", "text/html; charset=utf-8"),
}


def _static(name: str, content_type: str) -> Route:
    body = (resources.files("transfer_queue.ops") / "static" / name).read_bytes()
    return lambda: (content_type, body)


def controller_routes(server: ServedQueue) -> dict[str, Route]:
    """Every page the controller serves, read from ``server`` under its lock."""

    def metrics() -> tuple[str, bytes]:
        with server.lock:
            families = list(controller_families(server.summary_locked(), server.metrics, server.state.events))
        return PROMETHEUS_TEXT, render(lambda: families)

    def status_json() -> tuple[str, bytes]:
        return "application/json", json.dumps(server.summary(run_history=True), default=_jsonable).encode()

    routes: dict[str, Route] = {"/metrics": metrics, "/status.json": status_json}
    routes.update({path: _static(name, kind) for path, (name, kind) in STATIC.items()})
    routes["/"] = routes["/status"]
    return routes


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    return str(value)
