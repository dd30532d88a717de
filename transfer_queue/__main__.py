"""``python -m transfer_queue COMMAND`` (also installed as ``transfer-queue``): look at a running queue.

    python -m transfer_queue status                      # this user's run on this machine: no flags, no environment
    python -m transfer_queue status --run 12345          # one of several runs (the status command lists them)
    python -m transfer_queue status --address 10.0.0.1:6379 --watch
    python -m transfer_queue status --json               # the same summary as client.status(), as JSON
    python -m transfer_queue status --why-stuck          # what each waiting get_meta / put is blocked on, and why
    python -m transfer_queue targets --output tq.json    # Prometheus file_sd targets of every /metrics endpoint
    python -m transfer_queue trace --seconds 30          # the controller's requests as a Perfetto trace file

With no ``--address`` it finds the run by the record ``transfer_queue.init`` wrote for it (transfer_queue/attach.py,
transfer_queue/ops/runs.py) and joins its Ray cluster with what the record says joining takes; with ``--address``
any process that can join the cluster can run it (see docs/operations.md). Either way, a cluster that does not answer
or refuses this process fails within seconds, saying what to pass. It joins as a Ray driver, finds the queue and reads
it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlparse


def _join(args: argparse.Namespace) -> None:
    """Join the cluster of the run ``args`` name (``--address``, ``--run``, else this user's newest run); say which
    run it is on stderr (stdout stays the command's output, e.g. JSON)."""
    from transfer_queue.attach import attach

    target = attach(args.address, args.run_pid)
    if target.run is not None:
        metrics = f" | its metrics: {target.run.run_metrics}" if target.run.run_metrics else ""
        print(f"run: {target.run.describe()} on Ray {target.address}{metrics}", file=sys.stderr)
    for note in target.notes:
        print(note, file=sys.stderr)


def cmd_status(args: argparse.Namespace) -> int:
    _join(args)  # first: it sets Ray's variables before anything imports Ray
    if args.why_stuck:
        return _why_stuck(args)
    from transfer_queue.ops.status import format_summary
    from transfer_queue.runtime import get_client

    client = get_client("transfer-queue-cli")
    return _show(args, client.status, format_summary)


def _show(args: argparse.Namespace, read: Callable[[], Any], render: Callable[[Any], str]) -> int:
    """Print ``read()`` as JSON (``--json``) or as ``render`` draws it; with ``--watch`` again every ``--interval``
    seconds until Ctrl-C."""
    while True:
        value = read()
        if args.json:
            print(json.dumps(value, indent=2, default=str))
        else:
            if args.watch:
                print("\033[2J\033[H", end="")  # clear the terminal, cursor home
            print(render(value), flush=True)
        if not args.watch:
            return 0
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


def _why_stuck(args: argparse.Namespace) -> int:
    """Print what every waiting get_meta and put is blocked on (``--json``: the report as JSON)."""
    import ray

    from transfer_queue.ops.why_stuck import format_why_stuck
    from transfer_queue.runtime import get_controller

    controller = get_controller()
    return _show(args, lambda: ray.get(controller.why_stuck.remote()), format_why_stuck)


def cmd_trace(args: argparse.Namespace) -> int:
    """Record the controller's requests for ``--seconds`` and write them as a Chrome/Perfetto trace."""
    _join(args)  # first: it sets Ray's variables before anything imports Ray
    from transfer_queue.ops.trace import chrome_trace, record_for
    from transfer_queue.runtime import get_controller

    events = record_for(get_controller(), args.seconds, args.max_events)
    path = chrome_trace(args.output, events)
    print(f"{len(events)} spans in {path}: open it in https://ui.perfetto.dev (or chrome://tracing)")
    return 0


def file_sd(endpoints: dict[str, Any]) -> list[dict[str, Any]]:
    """Prometheus ``file_sd_configs`` entries for the controller's and the storage units' ``/metrics``."""
    out = []
    if endpoints.get("controller"):
        out.append({"targets": [urlparse(endpoints["controller"]).netloc], "labels": {"component": "controller"}})
    for unit, url in enumerate(endpoints.get("storage_units", [])):
        if url is None:  # a unit dead for good serves no metrics
            continue
        out.append({"targets": [urlparse(url).netloc], "labels": {"component": "storage", "unit": str(unit)}})
    return out


def cmd_targets(args: argparse.Namespace) -> int:
    _join(args)  # first: it sets Ray's variables before anything imports Ray
    import ray

    from transfer_queue.runtime import get_controller

    endpoints = ray.get(get_controller().http_endpoints.remote())
    if not endpoints:
        print("the queue serves no HTTP endpoints (it was started with http_port=-1)", file=sys.stderr)
        return 1
    text = json.dumps(file_sd(endpoints), indent=2)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m transfer_queue",
        description="Look at the transfer_queue running on a Ray cluster.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    status = commands.add_parser("status", help="the queue's partitions, tasks, storage units and errors, as tables")
    targets = commands.add_parser("targets", help="Prometheus file_sd targets of the queue's /metrics endpoints")
    trace = commands.add_parser(
        "trace", help="record the controller's requests for a while and write a Chrome/Perfetto trace file"
    )
    for sub in (status, targets, trace):
        sub.add_argument(
            "--address",
            help="the Ray cluster (its GCS host:port); default: RAY_ADDRESS, else this user's run on this machine",
        )
        sub.add_argument("--run", dest="run_pid", type=int, metavar="PID", help="this user's run of that pid")
    status.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch")
    status.add_argument("--json", action="store_true", help="print client.status() (or the --why-stuck report) as JSON")
    status.add_argument(
        "--why-stuck",
        action="store_true",
        help="what every waiting get_meta and put is blocked on: client, task, partition, rows, and why",
    )
    status.set_defaults(run=cmd_status)
    targets.add_argument("--output", help="write the targets to this file (default: print them)")
    targets.set_defaults(run=cmd_targets)
    trace.add_argument("--seconds", type=float, default=10.0, help="how long to record (default 10; Ctrl-C ends it)")
    trace.add_argument("--output", default="transfer_queue_trace.json", help="the trace file to write")
    trace.add_argument("--max-events", type=int, default=200_000, help="spans kept in memory, the newest")
    trace.set_defaults(run=cmd_trace)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    from transfer_queue.errors import TransferQueueError

    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except (TransferQueueError, ConnectionError) as exc:  # no cluster, no queue: say so without a traceback
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
