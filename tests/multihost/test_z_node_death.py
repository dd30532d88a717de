"""A storage unit's node dies (every process of host C killed): the first read of its rows fails at once with a typed
error naming the unit and the rows, new puts go to the live unit, a clear does not wait for it, and Ray's view of the
dead node or actor marks it down for good (scripts/node_death.py). Runs last in the tier: host C stays dead."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.multihost.conftest import TIMINGS

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(600)]  # the first test also builds the hosts


def test_a_dead_node_fails_reads_at_once_and_puts_go_elsewhere(cluster: Any) -> None:
    out = cluster.steered("a", "node_death.py", on={"KILL_C": lambda: cluster.kill_host("c")}, timeout=300)
    rows = re.escape(str(out["rows_on_c"]))
    for read in (out["first_read"], out["second_read"]):
        assert read.get("error") == "StorageUnitDown", read
        assert re.search(rf"storage unit 1 is down \(.*\): it held rows {rows} of partition 'p'", read["msg"]), read
        assert read["s"] < 30.0, read  # never the 60 s timeout: the dead host's sockets were closed by its kernel
    assert out["puts"] == [[0], [0], [0]]
    assert out["clear"].get("ok"), out["clear"]
    assert re.match(r"its Ray (node \w+ died|actor died)", out["ray_reason"]), out
    TIMINGS.append(
        f"node death: first read failed after {out['first_read']['s']:.2f} s, controller knew after "
        f"{out['controller_knew_after_s']:.1f} s, Ray's verdict ({out['ray_reason']}) after "
        f"{out['ray_knew_after_s']:.1f} s"
    )
