"""The simulated hosts themselves: three Ray nodes, each with its own hostname and address."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multihost


def test_three_hosts_with_their_own_hostnames(cluster) -> None:
    nodes = cluster.driver("b", "nodes.py")
    assert nodes["hostnames"] == ["tqmh-host-a", "tqmh-host-b", "tqmh-host-c"]
