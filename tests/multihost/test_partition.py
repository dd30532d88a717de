"""A network partition that heals (host B's link down for a few seconds, then up): calls during it fail with typed
errors within their timeout, and everything works again after it, with no restart (scripts/partition.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(600)]  # the first test also builds the hosts

CUT_SECONDS = 8.0  # well below Ray's node health-check window (~30 s), so Ray keeps host B's node
SLACK = 20.0  # a loaded 2-core machine: a call may end this long after its timeout


def outcomes(events: list[dict[str, Any]], what: str) -> list[str]:
    return [e.get("error", "ok") for e in events if e["what"] == what]


def test_a_partition_that_heals(cluster: Any) -> None:
    def cut_and_heal() -> None:
        cluster.partition("b", up=False)
        try:
            time.sleep(CUT_SECONDS)
        finally:
            cluster.partition("b", up=True)

    out = cluster.steered("a", "partition.py", on={"PARTITION": cut_and_heal}, timeout=300)
    a, b = out["a"], out["b"]
    for events in (a, b):
        assert all(e["s"] < 2.0 + 5.0 + SLACK for e in events), events  # no call waits past its timeout (+ slack)
    # Host A: reads of unit 1's rows fail typed (StorageUnitDown, a StorageUnavailable) during the cut, then work
    reads = outcomes(a, "get_data(unit 1)")
    assert reads[0] == "ok" and reads[-1] == "ok", reads
    assert set(reads) <= {"ok", "StorageUnitDown"} and "StorageUnitDown" in reads, reads
    # ... while puts keep working, placed on unit 0 alone once the controller knows unit 1 is down (a put placed on
    # unit 1 before that, within the heartbeat timeout, fails typed and leaves nothing behind)
    puts = [e for e in a if e["what"] == "put"]
    assert set(outcomes(a, "put")) <= {"ok", "StorageUnavailable"}, puts
    cut = next(i for i, e in enumerate(a) if "error" in e)
    assert any(e.get("units") == [0] for e in a[cut:]), puts
    down = next(e for e in a if e.get("error") == "StorageUnitDown")
    assert "storage unit 1 is down" in down["msg"] and "it held rows" in down["msg"]
    # Host B: calls to the controller fail typed (no reply within the timeout; or, once its socket was dropped, no
    # route to the controller's host), then work
    calls = outcomes(b, "get_production_status")
    assert calls[0] == "ok" and calls[-1] == "ok", calls
    assert set(calls) <= {"ok", "RequestTimeout", "ServerGone"} and "RequestTimeout" in calls, calls
    assert out["down_after"] == []  # the controller sees unit 1 again
