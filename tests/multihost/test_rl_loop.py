"""The demo's RL loop with its trainer ranks, rollout worker and reward worker on different hosts (a short run of a
few GRPO steps; scripts/rl_loop.py)."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from typing import Any

import pytest

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(600)]  # the first test also builds the hosts


def test_the_rl_loop_across_hosts(cluster: Any) -> None:
    out = tempfile.mkdtemp(prefix=f"tqmh{os.getpid()}-rl-", dir="/var/tmp")  # every host sees /var/tmp (not /tmp)
    try:
        result = cluster.driver("a", "rl_loop.py", out, timeout=420)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert result["hosts"] == {
        "trainer": ["tqmh-host-b", "tqmh-host-b"],
        "rollout": ["tqmh-host-c"],
        "reward": ["tqmh-host-a"],
        "storage": ["tqmh-host-b", "tqmh-host-c"],
    }
    assert result["steps"] == [0, 1, 2]
    assert result["versions"] == [1.0, 2.0, 3.0]  # weights published to the engine on host C after every step
    assert all(0.0 <= r <= 1.0 and not math.isnan(r) for r in result["rewards"])
