"""The core cases with storage units on every host and clients on every host (scripts/core.py), and the cross-host
timings (reported in the terminal summary, never asserted)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.multihost.conftest import SUBNET, TIMINGS

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(600)]  # the first test also builds the hosts


def test_core_cases_across_hosts(cluster: Any) -> None:
    # (the fixture already checked that each host's Ray node reports its own hostname)
    out = cluster.driver("a", "core.py", "5", timeout=400)
    assert out["controller"].startswith(f"tcp://{SUBNET}.1:")
    # each unit listens on its own host's address (not the controller's bind_host), with its own hostname and node
    assert [u[0].rsplit(":", 1)[0] for u in out["units"]] == [f"tcp://{SUBNET}.{i}" for i in (1, 2, 3)]
    assert [u[1] for u in out["units"]] == ["tqmh-host-a", "tqmh-host-b", "tqmh-host-c"]
    assert len({u[2] for u in out["units"]}) == 3
    assert out["put"] == {"units": [0, 1, 2], "host": "tqmh-host-b"}  # a 6.4 MB put spread over the three hosts
    assert out["rollout"] == {"prompts_equal": True, "host": "tqmh-host-c"}
    train = out["train"]
    assert train["responses"] == [10 * i for i in train["indexes"]]
    assert train["first_prompt_values"] == [200_000.0 * i for i in train["indexes"]]
    assert sorted(train["groups"]) == [0, 0, 1, 1, 2, 2, 3, 3]
    shares = out["dp"]
    assert [len(s) for s in shares] == [4, 4, 4] and sorted(v for s in shares for v in s) == list(range(12))
    assert out["grpo"] == [[10.0, 11.0], [20.0, 21.0]]
    assert out["kv"] == [[1.0, 1.0], [5.0, 1.0]]
    assert out["async"] is True
    assert [e.rsplit(":", 1)[0] for e in out["ipv6_endpoints"]] == [
        "tcp://[fd03:15::1]",
        "tcp://[fd03:15::1]",
        "tcp://[fd03:15::2]",
    ]
    assert out["ipv6"] is True
    t = out["timings"]
    assert t["byte_exact"] is True
    TIMINGS.append(
        f"cross-host (client on C, units on A and B), medians of {t['reps']}: put of a {t['nbytes'] / 1e6:.1f} MB "
        f"GRPO batch {t['put_ms']:.1f} ms, get_data {t['get_data_ms']:.1f} ms; get_meta (batch 1, 200 calls) "
        f"{t['get_meta_ms']:.2f} ms"
    )
