"""The whole-queue summary behind ``client.status()``, ``/status.json``, the status page and the status command.

:func:`queue_summary` reads a :class:`~transfer_queue.state.queue_state.QueueState` in one go, under the controller's
lock, so the summary is consistent with itself even while partitions are cleared (a driver stitching ``list_partitions``
and per-partition status calls races a clear and gets ``UnknownPartition``). It costs O(rows x tasks): for people and
scrapers, never the hot path. :func:`format_summary` renders it as the status command's tables.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from transfer_queue.ops.metrics import ROW_STATES, ControllerMetrics
from transfer_queue.state.lost_rows import lost_summary
from transfer_queue.state.partition import PartitionState
from transfer_queue.state.partition_status import row_state_counts
from transfer_queue.state.queue_state import QueueState

RUN_HISTORY = 2000  # RL step rows the controller keeps for the status page's curves


def partition_summary(part: PartitionState, task_names: Sequence[str]) -> dict[str, Any]:
    return {
        "partition_id": part.key,
        "uid": part.uid,
        "capacity": part.capacity,
        "rows": part.num_committed,
        "rows_in_flight": part.num_reserved,
        "rows_lost": part.num_lost,
        "closed": part.sealed,
        "bytes": part.nbytes,
        "fields": {name: part.field_produced[col] for name, col in part.field_col.items()},
        "tasks": {task: row_state_counts(part, task) for task in task_names},
    }


def queue_summary(
    state: QueueState,
    *,
    metrics: ControllerMetrics | None = None,
    clients: int = 0,
    run: list[dict[str, Any]] | None = None,
    endpoints: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything the status page and command show, from one read of ``state`` (hold the controller's lock)."""
    config = state.config
    task_names = sorted({t for part in state.partitions.values() for t in part.tasks} | set(state.samplers))
    partitions = [partition_summary(part, task_names) for part in state.partitions.values()]
    tasks = {task: dict.fromkeys(ROW_STATES, 0) for task in task_names}
    for part in partitions:
        for task, counts in part["tasks"].items():
            for key, value in counts.items():
                tasks[task][key] += value
    units = config.num_storage_units
    unit_bytes = [0] * units
    for state_part in state.partitions.values():
        for block, size in state_part.block_nbytes.items():
            unit_bytes[block % units] += size
    run = run or []
    return {
        "time": time.time(),
        "config": config.to_dict(),
        "partitions_live": len(partitions),
        "partitions_closed": sum(1 for p in partitions if p["closed"]),
        "max_cleared_step": state.max_cleared_step,
        "partitions": partitions,
        "tasks": tasks,
        "rows_committed": sum(p["rows"] for p in partitions),
        "rows_in_flight": sum(p["rows_in_flight"] for p in partitions),
        "rows_lost": sum(p["rows_lost"] for p in partitions),  # in live partitions (lost_rows: since start)
        "lost_rows": lost_summary(state),
        "open_puts": len(state.open_puts),
        "waiting_get_meta": sum(len(waiting) for waiting in state.getters.values()),
        "waiting_puts": len(state.putters),
        "clients": clients,
        "storage": {
            "bytes_held": state.bytes_held,
            "budget": config.storage_unit_bytes * units,
            "units": [
                {
                    "unit": u,
                    "bytes": size,
                    "budget": config.storage_unit_bytes,
                    "up": u not in state.down_units,
                    "restarts": state.lost.restarts.get(u, 0),
                }
                for u, size in enumerate(unit_bytes)
            ],
        },
        "requests": metrics.request_counts() if metrics else {},
        "errors": {
            "by_type": metrics.errors_by_type() if metrics else {},
            "recent": list(metrics.recent_errors) if metrics else [],
        },
        "run": {"last": dict(run[-1]) if run else {}, "history": run},
        "endpoints": endpoints or {},
    }


def numeric_row(row: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of an RL metrics row (what gauges and curves can show)."""
    out = {}
    for key, value in row.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if value == value and abs(value) != float("inf"):
            out[key] = float(value)
    return out


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [headers, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return [lines[0], "  ".join("-" * w for w in widths), *lines[1:]]


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as the status command's plain-text tables."""
    storage = summary["storage"]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(summary["time"]))
    lines = [
        f"transfer_queue status at {stamp}",
        f"partitions: {summary['partitions_live']} live ({summary['partitions_closed']} closed) | rows committed "
        f"{summary['rows_committed']}, in flight {summary['rows_in_flight']} | open puts {summary['open_puts']} | "
        f"waiting: get_meta {summary['waiting_get_meta']}, puts {summary['waiting_puts']} | clients "
        f"{summary['clients']}",
        f"storage: {_bytes(storage['bytes_held'])} held of {_bytes(storage['budget'])}",
    ]
    if summary["endpoints"].get("controller"):
        url = summary["endpoints"]["controller"]
        lines.append(f"status page: {url}/status | metrics: {url}/metrics (+ one per storage unit)")
    lines.append("")
    rows = []
    for part in summary["partitions"]:
        capacity = part["capacity"] if part["capacity"] is not None else "-"
        progress = " ".join(
            f"{task}={c['acknowledged']}/{part['rows']}" + (f"(+{c['leased']} leased)" if c["leased"] else "")
            for task, c in part["tasks"].items()
        )
        rows.append(
            [part["partition_id"], f"{part['rows']}/{capacity}", "yes" if part["closed"] else "no",
             _bytes(part["bytes"]), progress or "-"]
        )  # fmt: skip
    lines += _table(["PARTITION", "ROWS", "CLOSED", "BYTES", "CONSUMED (task=acknowledged/rows)"], rows)
    lines.append("")
    task_rows = [[task, *(c[s] for s in ROW_STATES)] for task, c in summary["tasks"].items()]
    lines += _table(["TASK", "READY", "LEASED", "ACKNOWLEDGED", "DEAD_LETTERED"], task_rows)
    lines.append("")
    unit_rows = [
        [u["unit"], _bytes(u["bytes"]), _bytes(u["budget"]), "up" if u["up"] else "DOWN"] for u in storage["units"]
    ]
    lines += _table(["UNIT", "BYTES", "BUDGET", "HEALTH"], unit_rows)
    last = summary["run"]["last"]
    if last:
        shown = {k: last[k] for k in ("step", "reward", "loss", "kl", "entropy", "step_s") if k in last}
        lines += ["", "RL run: " + " | ".join(f"{k} {v:.4g}" for k, v in shown.items())]
    errors = summary["errors"]
    if errors["by_type"]:
        lines += ["", "errors: " + ", ".join(f"{k} {v}" for k, v in sorted(errors["by_type"].items()))]
        for err in errors["recent"][-5:]:
            when = time.strftime("%H:%M:%S", time.localtime(err["time"]))
            lines.append(f"  {when} {err['kind']}: {err['type']}: {err['message'][:160]}")
    return "\n".join(lines)
