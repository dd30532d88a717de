"""``replicas=2`` across hosts: a storage unit's node dies (every process of host B killed) and nothing is lost. Each
row's second copy is on another host's unit, so every read after the death comes back whole (from the live copy, at
once), the queue reports 0 rows lost, new puts go to the live units, and a consumer is served every row
(scripts/replicated_node_death.py). Runs before test_z_node_death (which kills host C); host B stays dead."""

from __future__ import annotations

from typing import Any

import pytest

from tests.multihost.conftest import TIMINGS

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(600)]


def test_a_dead_node_loses_no_row_with_two_copies(cluster: Any) -> None:
    out = cluster.steered("a", "replicated_node_death.py", on={"KILL_B": lambda: cluster.kill_host("b")}, timeout=300)
    replica_of = out["replica_of"]
    assert sorted(replica_of) == [0, 1, 2] and all(partner != unit for unit, partner in enumerate(replica_of))
    holders = [{u, replica_of[u]} for units in out["units_per_put"] for u in units]  # a block's primary, its copy
    assert sum(1 in both for both in holders) >= 4, out  # host B held copies of most puts
    assert all(read["ok"] for read in out["reads"]), out
    assert all(read["s"] < 30.0 for read in out["reads"]), out  # never the 60 s timeout
    assert out["lost_rows"] == [] and out["rows_lost"] == 0, out
    for put in out["fresh_puts"]:  # both copies on the live units
        assert put["ok"] and all(u != 1 and replica_of[u] != 1 for u in put["units"]), out
    assert out["rows_single_copy"] > 0  # the dead unit's partners hold one copy of what it shared with them
    assert out["served_rows"] == 18 and out["served_ok"] == 18
    TIMINGS.append(
        f"node death with replicas=2: 0 of 18 rows lost, first read after the kill "
        f"{out['first_read_after_kill_s']:.2f} s, "
        f"controller knew after {out['controller_knew_after_s']:.1f} s"
    )
