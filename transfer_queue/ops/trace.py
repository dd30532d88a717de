"""A trace of the controller's requests, viewable in Perfetto (https://ui.perfetto.dev) or chrome://tracing.

Each request the controller answers becomes one span, from its arrival to its answer, so a get_meta that was
parked shows how long it waited: ``put.reserve`` and ``put.commit`` (the rows become visible, their fields ready),
``get_meta`` (rows leased to a task), ``ack`` (rows acknowledged), ``release``, ``extend_lease``, ``clear``, and the
rest by their request name. The thread of a span is its client (the ``owner`` a request names; ``storage and
others`` where none); its arguments name the partition, the task, the number of rows and their global indexes (the
first :data:`MAX_INDEXES` of a batch, then a count), so one row's life (put, ready, leased, read, acknowledged, per
task) is found by its index.

Off by default; while off it costs the controller one attribute test per request. On (``controller.trace_start``,
``python -m transfer_queue trace``, or an RL recipe's ``trace=true``) it keeps the newest ``max_events`` spans in
memory (a ring: the oldest go first). :func:`chrome_trace` writes the JSON object format of Chrome's trace events,
with spans of other processes (an RL driver's stages) added beside the controller's.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from transfer_queue.metadata import BatchMeta, describe_partition

MAX_INDEXES = 64  # global indexes listed per span; a larger batch lists these and counts the rest
DEFAULT_MAX_EVENTS = 200_000
CONTROLLER_PROCESS = "transfer_queue controller"
_NO_OWNER = "storage and others"

Respond = Callable[[Any, BaseException | None], None]

# request type name -> span name (the others: the type name in snake case)
_NAMES = {"Reserve": "put.reserve", "Commit": "put.commit", "Abort": "put.abort", "GetMeta": "get_meta"}


def _span_name(kind: str) -> str:
    return _NAMES.get(kind) or "".join(f"_{c.lower()}" if c.isupper() else c for c in kind).lstrip("_")


def _indexes(values: np.ndarray) -> dict[str, Any]:
    head = values[:MAX_INDEXES].tolist()
    out: dict[str, Any] = {"rows": len(values), "global_indexes": head}
    if len(values) > MAX_INDEXES:
        out["more_indexes"] = int(len(values) - MAX_INDEXES)
    return out


class RequestTrace:
    """The newest ``max_events`` request spans of the controller (see the module docstring)."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS, clock: Callable[[], float] = time.time):
        if not isinstance(max_events, int) or isinstance(max_events, bool) or max_events < 1:
            raise ValueError(f"max_events: expected an int >= 1, got {max_events!r}")
        self.clock = clock
        self.spans: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.started_at = clock()
        self.dropped = 0  # spans pushed out of the ring by newer ones

    def wrap(self, request: Any, respond: Respond) -> Respond:
        """``respond``, recording ``request``'s span when it is called (its answer's rows included)."""
        start = self.clock()

        def traced(value: Any, error: BaseException | None) -> None:
            self._record(request, start, self.clock(), value, error)
            respond(value, error)

        return traced

    def _record(self, request: Any, start: float, end: float, value: Any, error: BaseException | None) -> None:
        kind = type(request).__name__
        args: dict[str, Any] = {}
        partition = getattr(request, "partition", None)
        if partition is not None:
            args["partition"] = describe_partition(partition)
        for name in ("task_name", "batch_size", "num_rows", "put_id"):
            if getattr(request, name, None) is not None:
                args[name] = getattr(request, name)
        if isinstance(value, BatchMeta):
            args["partition"] = describe_partition(value.partition_id)
            args.update(_indexes(value.global_indexes))
        elif getattr(request, "global_indexes", None) is not None:
            from transfer_queue.wire.protocol import unpack_indexes  # only when tracing

            args.update(_indexes(unpack_indexes(request.global_indexes)))
        if error is not None:
            args["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        if len(self.spans) == self.spans.maxlen:
            self.dropped += 1
        self.spans.append(
            {
                "name": _span_name(kind),
                "cat": args.get("task_name") or "queue",
                "ph": "X",
                "ts": start * 1e6,
                "dur": max(end - start, 0.0) * 1e6,
                "pid": CONTROLLER_PROCESS,
                "tid": getattr(request, "owner", "") or _NO_OWNER,
                "args": args,
            }
        )

    def events(self) -> list[dict[str, Any]]:
        """The recorded spans, oldest first, as Chrome trace events."""
        return list(self.spans)


def record_for(
    controller: Any,
    seconds: float,
    max_events: int = DEFAULT_MAX_EVENTS,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.time,
) -> list[dict[str, Any]]:
    """The controller's spans of the next ``seconds`` (``python -m transfer_queue trace``); a Ctrl-C ends the wait early
    and keeps what was recorded. A trace this call starts stops with it; one already on (a run's ``trace=true``) goes
    on, and only the spans that ended after this call began are returned."""
    import ray

    started = ray.get(controller.trace_start.remote(max_events))
    began = clock()
    try:
        sleep(seconds)
    except KeyboardInterrupt:
        pass
    if started:
        return list(ray.get(controller.trace_stop.remote()))
    return [e for e in ray.get(controller.trace_events.remote()) if e["ts"] + e["dur"] >= began * 1e6]


def span(name: str, start: float, end: float, process: str, thread: str, **args: Any) -> dict[str, Any]:
    """One complete span (``ph: X``) of another process, e.g. an RL stage: ``start``/``end`` in ``time.time()``
    seconds."""
    return {
        "name": name,
        "cat": thread,
        "ph": "X",
        "ts": start * 1e6,
        "dur": max(end - start, 0.0) * 1e6,
        "pid": process,
        "tid": thread,
        "args": args,
    }


def chrome_trace(path: str | os.PathLike[str], *event_lists: Iterable[dict[str, Any]]) -> Path:
    """Write the events as a Chrome trace JSON file (atomically: a reader never sees half of it); returns its path.

    Process and thread names are strings here; the file gets the numeric ids Chrome's format asks for and a
    ``process_name`` / ``thread_name`` metadata event for each, so Perfetto labels the tracks by name.
    """
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    out: list[dict[str, Any]] = []
    for events in event_lists:
        for event in events:
            process, thread = str(event["pid"]), str(event["tid"])
            if process not in pids:
                pids[process] = len(pids) + 1
                out.append({"name": "process_name", "ph": "M", "pid": pids[process], "args": {"name": process}})
            if (process, thread) not in tids:
                tids[(process, thread)] = len(tids) + 1
                out.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": pids[process],
                        "tid": tids[(process, thread)],
                        "args": {"name": thread},
                    }
                )
            out.append({**event, "pid": pids[process], "tid": tids[(process, thread)]})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))
    os.replace(tmp, path)
    return path
