"""``python -m workers.ledger status --db sqlite:///output/run/ledger.db``: tasks by status, claims, records and
inference services of a ledger (AgentRL's debugging checklist in one screen)."""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

from workers.ledger.errors import LedgerError
from workers.ledger.store import Ledger

STATUSES = ("pending", "running", "done", "failed")


def render_status(ledger: Ledger) -> str:
    summary = ledger.summary()
    lines = [f"ledger {ledger._redacted()} ({ledger.backend})", "", "tasks"]
    table: dict[tuple[str, int], dict[str, int]] = defaultdict(dict)
    for split, epoch, status, n in summary["tasks"]:
        table[(split, epoch)][status] = n
    lines.append(f"  {'split':<12}{'epoch':>6}" + "".join(f"{s:>9}" for s in STATUSES) + f"{'total':>9}")
    for (split, epoch), counts in sorted(table.items()):
        cells = "".join(f"{counts.get(s, 0):>9}" for s in STATUSES)
        lines.append(f"  {split:<12}{epoch:>6}{cells}{sum(counts.values()):>9}")
    if not table:
        lines.append("  (none)")
    claims = summary["claims"]
    lines += ["", "claims  " + (", ".join(f"{k} {v}" for k, v in claims.items()) if claims else "(none)")]
    lines.append(f"records {summary['records']} ({summary['records_trained']} trained)")
    lines += ["", "inference services"]
    now = time.time()
    for s in summary["services"]:
        where = s.url or s.actor or "-"
        lines.append(
            f"  {s.name:<16} {s.status:<5} model={s.model} v{s.policy_version} load={s.load:g} "
            f"heartbeat {now - s.last_heartbeat:.0f} s ago  {where}"
        )
    if not summary["services"]:
        lines.append("  (none)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.ledger", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="tasks by status, claims, records, services")
    status.add_argument("--db", required=True, help="the db_connection_string (sqlite:///PATH or postgresql://...)")
    args = parser.parse_args(argv)
    try:
        ledger = Ledger(args.db, create=False)
        try:
            print(render_status(ledger))
        finally:
            ledger.close()
    except LedgerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
