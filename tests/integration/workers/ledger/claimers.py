"""Worker processes of the contention and fault tests (module level, so that ``spawn`` can import them)."""

from __future__ import annotations

import json
import os
import threading
import time

from workers.ledger import ClaimLost, Ledger, Record
from workers.ledger.retry import with_retry


def claim_all(url: str, split: str, owner: str, start, out_path: str, work_s: float = 0.0, lease_s: float = 30.0):
    """Claim, record and complete tasks of ``split`` until none is left; write what was claimed and how many
    retries the database's absence cost to ``out_path``. Every ledger call is retried with backoff."""
    retries = []
    ledger = with_retry(lambda: Ledger(url), on_retry=retries.append)
    claimed = []
    start.wait()
    while True:
        got = with_retry(lambda: ledger.claim(split, owner=owner, lease_s=lease_s), on_retry=retries.append)
        if got is None:
            counts = with_retry(lambda: ledger.task_counts(split), on_retry=retries.append)
            if counts.get("running", 0) == 0 and counts.get("pending", 0) == 0:
                break
            time.sleep(0.05)  # a claim whose reply was lost: its lease must run out first
            continue
        claim, task = got
        claimed.append([claim.task_key, task.id, task.epoch, claim.attempt])
        if work_s:
            time.sleep(work_s)
        record = Record(task_key=claim.task_key, task_id=task.id, split=split, epoch=task.epoch, claim_id=claim.id)
        with_retry(lambda r=record: ledger.write_record(r), on_retry=retries.append)
        try:
            with_retry(lambda c=claim.id: ledger.complete(c), on_retry=retries.append)
        except ClaimLost:
            pass  # the completion committed but its reply was lost with the connection
    with open(out_path, "w") as f:
        json.dump(
            {"claimed": claimed, "retries": len(retries), "errors": sorted({type(e).__name__ for e in retries})}, f
        )
    ledger.close()


def claim_and_hang(url: str, split: str, out_path: str, lease_s: float, heartbeat_s: float) -> None:
    """Claim one task, write its sample 0, keep the lease alive with heartbeats, then hang (to be SIGKILLed)."""
    ledger = Ledger(url)
    claim, task = ledger.claim(split, owner=f"doomed-{os.getpid()}", lease_s=lease_s)
    ledger.write_record(Record(task_key=claim.task_key, task_id=task.id, split=split, epoch=task.epoch, score=0.5))

    def beat() -> None:
        while True:
            ledger.heartbeat(claim.id, lease_s=lease_s)
            time.sleep(heartbeat_s)

    threading.Thread(target=beat, daemon=True).start()
    with open(out_path, "w") as f:
        json.dump({"claim_id": claim.id, "task_key": claim.task_key}, f)
    time.sleep(600)


def claim_batches(url: str, split: str, owner: str, batch: int, start, out_path: str) -> None:
    """Claim tasks of ``split`` ``batch`` at a time (``Ledger.claim_many``; ``batch`` 1: ``Ledger.claim``) until none
    is left, completing none (leases far longer than the run); write the task keys claimed to ``out_path``."""
    ledger = Ledger(url)
    keys = []
    start.wait()
    while True:
        if batch == 1:
            one = ledger.claim(split, owner=owner, lease_s=3600)
            got = [] if one is None else [one]
        else:
            got = ledger.claim_many(split, owner, batch, lease_s=3600)
        if not got:
            break
        keys += [claim.task_key for claim, _ in got]
    with open(out_path, "w") as f:
        json.dump({"keys": keys}, f)
    ledger.close()
