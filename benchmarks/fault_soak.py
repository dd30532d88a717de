"""Fault-injection soak (issue 8, section 5): many producers and two consumer tasks while a storage unit and a consumer
are killed (SIGKILL / ``ray.kill``) and restarted mid-run.

    python benchmarks/fault_soak.py [--clients 64] [--puts 10000] [--consumers-per-task 2] [--rotate 1000] ...

``clients`` producer clients (threads spread over ``--producer-processes`` Ray actors, one client each) put
``puts`` one-row puts each into string partitions ``soak-0``, ``soak-1``, ... (a client's put ``k`` goes to partition
``k // rotate``). Two tasks (``task_a``, ``task_b``) consume every row with explicit acks, ``consumers_per_task``
consumer actors each, journalling every batch they acknowledged to a file. The driver closes a partition once every
producer passed it, audits it once both tasks are done (the queue's counts, its lost rows) and clears it. At
``kill_unit_at`` of the puts it kills storage unit 0's process (Ray restarts it empty), at ``kill_consumer_at`` one
consumer of ``task_a`` (its leases go back after the disconnect grace; a new consumer takes its place).

Reported (a JSON line, then a table):

- ``lost_silently``: rows whose put returned but that are neither in their partition nor reported lost, plus rows a
  task never acknowledged (target 0);
- ``lost_reported``: rows the dead unit held, reported by ``lost_rows`` (expected: every row on the unit whose
  partition was live when it died); ``dead_unit_rows_unreported`` and ``reported_not_on_dead_unit`` (target 0);
- ``double_acknowledged``: rows a task acknowledged twice, from the consumers' journals (target 0);
- ``errors_typed`` / ``errors_untyped`` by type (target: 0 untyped), ``hangs`` (calls that outlived their timeout by
  30 s, and workers not done at the deadline; target 0);
- ``unit_recover_s`` (kill to the restarted unit attached), ``unit_puts_again_s`` (kill to the first put stored on
  it again), ``consumer_recover_s`` (kill to the replacement's first ack), puts/s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray
from tqdm import tqdm

from benchmarks.soak_actors import Consumer, Producers, partition_name
from transfer_queue import TransferQueueClient, TransferQueueController

TASKS = ("task_a", "task_b")


@dataclass
class SoakConfig:
    clients: int = 64
    puts: int = 10_000
    consumers_per_task: int = 2
    producer_processes: int = 4
    rotate: int = 1000  # a client's puts per partition
    batch: int = 64  # rows a consumer asks for
    kill_unit_at: float = 0.3  # fraction of all puts done
    kill_consumer_at: float = 0.5
    deadline_s: float = 3600.0
    disconnect_grace: float = 2.0


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """Run the soak on the current Ray cluster; returns the report (see the module docstring)."""
    partitions = -(-cfg.puts // cfg.rotate)
    controller = TransferQueueController.options(num_cpus=0).remote(
        1, num_storage_units=2, default_timeout=30.0, disconnect_grace=cfg.disconnect_grace,
        storage_unit_max_restarts=3, lease_s=60.0,
    )  # fmt: skip
    info = ray.get(controller.get_info.remote())
    client = TransferQueueClient("soak-driver", info)
    for task in TASKS:
        client.set_task_options(task, ack="explicit")
    journal_dir = Path(tempfile.mkdtemp(prefix="tq-soak-"))
    per = -(-cfg.clients // cfg.producer_processes)
    producers = [
        Producers.options(num_cpus=0, max_concurrency=4).remote(info, first, min(per, cfg.clients - first),
                                                                 cfg.puts, cfg.rotate)
        for first in range(0, cfg.clients, per)
    ]  # fmt: skip

    def consumer(task: str, k: int) -> Any:
        path = str(journal_dir / f"{task}-{k}.log")
        return Consumer.options(num_cpus=0, max_concurrency=4).remote(info, task, path, partitions, cfg.batch)

    consumers = {(task, k): consumer(task, k) for task in TASKS for k in range(cfg.consumers_per_task)}
    ray.get([p.start.remote() for p in producers] + [c.start.remote() for c in consumers.values()])
    started = time.time()
    total = cfg.clients * cfg.puts
    closed: set[int] = set()
    crash = ""
    audits: dict[int, dict[str, Any]] = {}
    events: dict[str, float] = {}
    unit_pid = ray.get(controller.storage_stats.remote())[0]["pid"]
    replacement: Any = None
    bar = tqdm(total=total, desc="fault soak", unit="put", dynamic_ncols=True, file=sys.stderr)
    while len(audits) < partitions and time.time() - started < cfg.deadline_s:
        try:
            progress = ray.get([p.progress.remote() for p in producers])
        except ray.exceptions.RayActorError as exc:  # a producer process crashed: the soak cannot finish
            events["worker_crashed"] = time.time()
            crash = f"{type(exc).__name__}: {str(exc)[:300]}"
            break
        done_puts, slowest = sum(x[0] for x in progress), min(x[1] for x in progress)
        bar.update(done_puts - bar.n)
        bar.set_postfix(audited=f"{len(audits)}/{partitions}", events=",".join(events) or "-", refresh=False)
        for j in range(partitions):
            if j not in closed and (slowest >= min(cfg.puts, (j + 1) * cfg.rotate)):
                client.close_partition(partition_id=partition_name(j))
                closed.add(j)
        for j in sorted(closed - set(audits)):
            audit = _audit_if_done(client, j)
            if audit is not None:
                audit["cleared_at"] = time.time()
                audits[j] = audit
        if "unit_killed" not in events and done_puts >= cfg.kill_unit_at * total:
            os.kill(unit_pid, signal.SIGKILL)
            events["unit_killed"] = time.time()
        restarting = "unit_killed" in events and "unit_restarted" not in events
        if restarting and ray.get(controller.server_stats.remote())["storage_units_restarted"].get(0):
            events["unit_restarted"] = time.time()
        if "consumer_killed" not in events and done_puts >= cfg.kill_consumer_at * total:
            ray.kill(consumers[("task_a", 0)], no_restart=True)
            events["consumer_killed"] = time.time()
            replacement = consumers[("task_a", "replacement")] = consumer("task_a", cfg.consumers_per_task)
            ray.get(replacement.start.remote())
        time.sleep(0.2)
    bar.close()
    wall = time.time() - started
    alive = [c for key, c in consumers.items() if key != ("task_a", 0)]
    produced, consumed = _results(producers), _results(alive)
    for actor in [*producers, *alive]:
        ray.kill(actor)
    ray.get(controller.shutdown.remote(), timeout=60)
    ray.kill(controller)
    client.close()
    report = _report(cfg, produced, consumed, audits, events, journal_dir, partitions, wall)
    report["replacement_first_ack_s"] = consumed[-1].get("first_ack_at", 0) - events.get("consumer_killed", 0)
    report["worker_crashes"] = sum(1 for r in [*produced, *consumed] if r.get("crashed"))
    if "worker_crashed" in events:
        report["worker_crash"] = crash
    return report


def _results(actors: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for actor in actors:
        try:
            out.append(ray.get(actor.result.remote(), timeout=120))
        except Exception as exc:  # a crashed worker: counted, its figures are gone
            empty = {"rows": [], "failed": 0, "errors_typed": {}, "errors_untyped": {}, "hangs": 0}
            out.append({**empty, "crashed": f"{type(exc).__name__}: {str(exc)[:200]}"})
    return out


def _audit_if_done(client: TransferQueueClient, j: int) -> dict[str, Any] | None:
    """A closed partition both tasks finished: its counts and lost rows, then it is cleared; None if not done."""
    name = partition_name(j)
    production = client.get_production_status(partition_id=name)
    if production["rows_in_flight"]:
        return None
    tasks = client.get_consumption_status(partition_id=name)["tasks"]
    for task in TASKS:
        counts = tasks.get(task)
        if counts is None or counts["ready"] or counts["leased"]:
            return None
    lost = client.lost_rows(partition_id=name)
    client.clear(partition_id=name)
    return {
        "rows": production["rows"],
        "rows_lost": production["rows_lost"],
        "tasks": {task: tasks[task] for task in TASKS},
        "lost": [row["global_index"] for row in lost],
    }


def _report(
    cfg: SoakConfig,
    produced: list[dict[str, Any]],
    consumed: list[dict[str, Any]],
    audits: dict[int, dict[str, Any]],
    events: dict[str, float],
    journal_dir: Path,
    partitions: int,
    wall: float,
) -> dict[str, Any]:
    rows = [row for p in produced for row in p["rows"]]  # (partition, global index, unit, done at)
    put_ok = Counter(j for j, _, _, _ in rows)
    unit_of = {(j, g): u for j, g, u, _ in rows}
    killed, restarted = events.get("unit_killed", float("inf")), events.get("unit_restarted", float("inf"))
    silent = unreported = not_on_unit = 0
    detail = {}
    for j, audit in audits.items():
        missing = put_ok[j] - audit["rows"] - audit["rows_lost"]
        unacked = {t: audit["rows"] - audit["tasks"][t]["acknowledged"] for t in TASKS}
        silent += missing + sum(unacked.values())
        if missing or any(unacked.values()):
            detail[j] = {"put_ok": put_ok[j], "missing": missing, **audit, "lost": len(audit["lost"])}
        lost = set(audit["lost"])
        not_on_unit += sum(1 for g in lost if unit_of.get((j, g)) != 0)
        if audit["cleared_at"] > killed:  # live when the unit died: every row it held then must be reported
            unreported += sum(1 for jj, g, u, t in rows if jj == j and u == 0 and t < killed and g not in lost)
    acked: dict[str, Counter] = {task: Counter() for task in TASKS}
    for path in journal_dir.glob("*.log"):
        task = path.name.rsplit("-", 1)[0]
        for line in path.read_text().splitlines():
            j, *indexes = line.split()
            acked[task].update((int(j), int(g)) for g in indexes)
    double = sum(c - 1 for task in TASKS for c in acked[task].values() if c > 1)
    errors_typed: Counter = Counter()
    errors_untyped: Counter = Counter()
    for part in [*produced, *consumed]:
        errors_typed.update(part["errors_typed"])
        errors_untyped.update(part["errors_untyped"])
    puts_again = min((t for _, _, u, t in rows if u == 0 and t > restarted), default=float("nan"))
    return {
        "type": "fault_soak",
        "config": asdict(cfg),
        "puts": len(rows),
        "puts_failed": sum(p["failed"] for p in produced),
        "partitions_audited": len(audits),
        "partitions": partitions,
        "lost_silently": silent,
        "lost_silently_detail": detail,
        "corrupt_rows": sum(c.get("corrupt", 0) for c in consumed),
        "lost_reported": sum(a["rows_lost"] for a in audits.values()),
        "dead_unit_rows_unreported": unreported,
        "reported_not_on_dead_unit": not_on_unit,
        "double_acknowledged": double,
        "acks_journalled": {task: sum(acked[task].values()) for task in TASKS},
        "errors_typed": dict(errors_typed),
        "errors_untyped": dict(errors_untyped),
        "hangs": sum(p["hangs"] for p in [*produced, *consumed]) + (partitions - len(audits)),
        "unit_recover_s": restarted - killed,
        "unit_puts_again_s": puts_again - killed,
        "consumer_killed": "consumer_killed" in events,
        "wall_s": wall,
        "puts_per_s": len(rows) / wall if wall else 0.0,
    }


def print_table(report: dict[str, Any]) -> None:
    keys = ["puts", "puts_failed", "lost_silently", "corrupt_rows", "lost_reported", "dead_unit_rows_unreported",
            "reported_not_on_dead_unit", "double_acknowledged", "errors_typed", "errors_untyped", "hangs",
            "worker_crashes",
            "unit_recover_s", "unit_puts_again_s", "replacement_first_ack_s", "wall_s", "puts_per_s"]  # fmt: skip
    width = max(map(len, keys))
    for key in keys:
        value = report.get(key)
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in asdict(SoakConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    cfg = SoakConfig(**vars(parser.parse_args(argv)))
    root = str(Path(__file__).resolve().parents[1])  # the actors' module, in every Ray worker
    ray.init(
        num_cpus=max(8, os.cpu_count() or 1),
        include_dashboard=False,
        logging_level="ERROR",
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}},
    )
    report = run_soak(cfg)
    print(json.dumps(report), flush=True)
    print_table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
