"""The whole-queue summary behind ``client.status()``, ``/status.json``, the status page and the status command.

:func:`queue_summary` reads a :class:`~transfer_queue.state.queue_state.QueueState` in one go, under the controller's
lock, so the summary is consistent with itself even while partitions are cleared (a driver stitching ``list_partitions``
and per-partition status calls races a clear and gets ``UnknownPartition``). It is bounded: O(rows x the tasks each
partition follows) to count, and at most ``QueueConfig.status_partitions`` partitions detailed (the rest in aggregate),
so its JSON does not grow with the number of live partitions or task names. For people and scrapers, never the hot
path. :func:`format_summary` renders it as the status command's tables.
"""

from __future__ import annotations

import time
from typing import Any

from transfer_queue.ops.metrics import ROW_STATES, ControllerMetrics
from transfer_queue.state.lost_rows import lost_summary, refill_summary, single_copies
from transfer_queue.state.partition import PartitionState
from transfer_queue.state.partition_status import row_state_counts
from transfer_queue.state.queue_state import QueueState

RUN_HISTORY = 2000  # RL step rows the controller keeps for the status page's curves


def partition_summary(part: PartitionState, counts: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """One partition's row of the summary; ``tasks``: only the tasks that follow it (a task absent here has every
    committed row of it ready)."""
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
        "tasks": counts if counts is not None else {task: row_state_counts(part, task) for task in part.tasks},
    }


def _task_totals(state: QueueState) -> tuple[dict[str, dict[str, int]], dict[int, dict[str, dict[str, int]]]]:
    """Rows by delivery state per task over every live partition, and each partition's counts of the tasks that
    follow it (by uid). O(live partitions x the tasks each follows), never x every task name of the queue."""
    per_part: dict[int, dict[str, dict[str, int]]] = {}
    followed: dict[str, dict[str, int]] = {}
    followed_rows: dict[str, int] = {}  # committed rows of the partitions each task follows
    committed = 0
    for part in state.partitions.values():
        committed += part.num_committed
        counts = per_part[part.uid] = {task: row_state_counts(part, task) for task in part.tasks}
        for task, c in counts.items():
            total = followed.setdefault(task, dict.fromkeys(ROW_STATES, 0))
            for key, value in c.items():
                total[key] += value
            followed_rows[task] = followed_rows.get(task, 0) + part.num_committed
    tasks = {}
    for task in sorted(set(followed) | set(state.samplers)):
        total = dict(followed.get(task) or dict.fromkeys(ROW_STATES, 0))
        total["ready"] += committed - followed_rows.get(task, 0)  # partitions it does not follow: all ready
        tasks[task] = total
    return tasks, per_part


def queue_summary(
    state: QueueState,
    *,
    metrics: ControllerMetrics | None = None,
    clients: int = 0,
    run: list[dict[str, Any]] | None = None,
    endpoints: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything the status page and command show, from one read of ``state`` (hold the controller's lock).

    Bounded: ``partitions`` details the ``config.status_partitions`` most recently opened live partitions (each with
    the tasks that follow it); the others are counted in ``partitions_omitted``. ``tasks`` and the totals cover
    every live partition.
    """
    config = state.config
    tasks, per_part = _task_totals(state)
    live = list(state.partitions.values())
    limit = config.status_partitions
    shown, omitted = live[-limit:], live[: max(0, len(live) - limit)]
    partitions = [partition_summary(part, per_part[part.uid]) for part in shown]
    units = config.num_storage_units
    unit_bytes = [0] * units
    for state_part in state.partitions.values():
        for block, size in state_part.block_nbytes.items():
            for holder in state.ledger.holders(block % units):
                unit_bytes[holder] += size
    run = run or []
    return {
        "time": time.time(),
        "config": config.to_dict(),
        "partitions_live": len(live),
        "partitions_closed": sum(1 for p in live if p.sealed),
        "max_cleared_step": state.max_cleared_step,
        "partitions_limit": limit,  # config.status_partitions: at most this many are detailed in "partitions"
        "partitions": partitions,  # the most recently opened live partitions, oldest first
        "partitions_omitted": {  # the older live partitions, counted but not detailed
            "count": len(omitted),
            "closed": sum(1 for p in omitted if p.sealed),
            "rows": sum(p.num_committed for p in omitted),
            "bytes": sum(p.nbytes for p in omitted),
        },
        "tasks": tasks,
        "rows_committed": sum(p.num_committed for p in live),
        "rows_in_flight": sum(p.num_reserved for p in live),
        "rows_lost": sum(p.num_lost for p in live),  # in live partitions (lost_rows: since start)
        "lost_rows": lost_summary(state),
        "open_puts": len(state.open_puts),
        "waiting_get_meta": state.waiting.num_getters,
        "waiting_puts": len(state.putters),
        "clients": clients,
        "storage": {
            "bytes_held": state.bytes_held,
            "budget": config.byte_budget,
            **(
                {"replicas": config.replicas, **single_copies(state), **refill_summary(state)}
                if config.replicas > 1
                else {}
            ),
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
    omitted = summary.get("partitions_omitted") or {}
    if omitted.get("count"):
        lines.append(
            f"... and {omitted['count']} older live partitions not shown ({omitted['closed']} closed, "
            f"{omitted['rows']} rows, {_bytes(omitted['bytes'])}; at most {summary['partitions_limit']} are detailed: "
            "QueueConfig.status_partitions)"
        )
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
