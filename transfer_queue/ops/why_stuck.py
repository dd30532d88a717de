"""``python -m transfer_queue status --why-stuck``: what every waiting consumer and producer is blocked on.

:func:`why_stuck` reads a :class:`~transfer_queue.state.queue_state.QueueState` in one go, under the controller's lock,
and names for each parked ``get_meta`` the client, task, partition and rows it asked for and what they wait for: rows
not yet put, a field not produced yet (on how many rows), rows leased by other clients (who, how many, for how much
longer), storage units that are down and rows lost with them; for each parked put, the step-ring slot or the storage
space it waits for. The same explanation a timeout carries (``GetMetaTimeout``, ``QueueFull``), before the timeout.

Bounded: one pass over the leases, and per explained request O(the rows of its partition) in numpy (well under a second
at 1M rows); at most ``limit`` requests are explained, the others counted.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from transfer_queue.metadata import describe_partition
from transfer_queue.state.queue_state import QueueState

DEFAULT_LIMIT = 50


def why_stuck(state: QueueState, limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
    """``{"waiting": [...], "omitted": n, "down_units": [...]}``: every parked request, oldest first, with
    ``reason`` (what it waits for) and, for a get_meta, ``leased`` (rows of its task and partition held by clients)."""
    now = state.clock()
    # (partition, task) -> owner -> [rows still leased, the earliest lease deadline]
    held: dict[tuple[Any, str], dict[str, list[float]]] = defaultdict(dict)
    for lease in state.delivery.leases.leases.values():
        if lease.remaining:
            entry = held[(lease.key, lease.task_name)].setdefault(lease.owner, [0, lease.deadline])
            entry[0] += lease.remaining
            entry[1] = min(entry[1], lease.deadline)
    getters = [w for line in state.waiting.getters.values() for w in line]
    parked = sorted([*getters, *state.waiting.putters], key=lambda w: w.started)
    down = sorted(state.down_units)
    out = []
    for waiter in parked[:limit]:
        if waiter.key is None:  # a putter: job is (PutRequest, ...)
            request = waiter.job[0]
            reason = str(state.ledger.timeout_error(request, now - waiter.started))  # "put to ... waited ... for"
            out.append(
                {
                    "kind": "put",
                    "partition": describe_partition(request.partition),
                    "rows": request.num_rows,
                    "waited_s": round(now - waiter.started, 3),
                    "times_out_in_s": round(waiter.deadline - now, 3),
                    "reason": reason,
                }
            )
            continue
        job = waiter.job
        leases = held.get((job.partition, job.task_name), {})
        leased = {
            owner: {"rows": int(rows), "lease_ends_in_s": round(deadline - now, 3)}
            for owner, (rows, deadline) in sorted(leases.items())
        }
        reason = state.reader.explain(job)
        if leased:
            reason += "; leased to " + ", ".join(f"{o} ({v['rows']} rows)" for o, v in leased.items())
        part = state.table.partitions.get(job.partition)
        if part is not None and part.num_lost:
            reason += f"; {part.num_lost} rows of it were lost with a storage unit"
        if down:
            reason += f"; storage units down: {down}"
        out.append(
            {
                "kind": "get_meta",
                "client": job.owner or "?",
                "task": job.task_name,
                "partition": describe_partition(job.partition),
                "batch_size": job.batch_size,
                "fields": list(job.fields),
                "waited_s": round(now - waiter.started, 3),
                "times_out_in_s": round(waiter.deadline - now, 3),
                "leased": leased,
                "reason": reason,
            }
        )
    return {"waiting": out, "omitted": max(0, len(parked) - limit), "down_units": down}


def format_why_stuck(report: dict[str, Any]) -> str:
    """The report as the status command prints it: one paragraph per waiting request."""
    if not report["waiting"]:
        down = f" (storage units down: {report['down_units']})" if report["down_units"] else ""
        return f"nothing is waiting: no get_meta or put is parked in the queue{down}"
    lines = []
    for w in report["waiting"]:
        if w["kind"] == "put":
            head = f"put to {w['partition']} ({w['rows']} rows)"
        else:
            head = f"get_meta of client {w['client']!r}: task {w['task']!r}, {w['partition']}, {w['batch_size']} rows"
        lines.append(f"{head}, waiting {w['waited_s']:.1f} s (times out in {max(w['times_out_in_s'], 0):.1f} s)")
        lines.append(f"  why: {w['reason']}")
    if report["omitted"]:
        lines.append(f"... and {report['omitted']} more waiting requests")
    return "\n".join(lines)
