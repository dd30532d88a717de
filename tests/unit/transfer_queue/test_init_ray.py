"""init_ray: Ray's notice that a local cluster has token authentication (its default) is not printed on every run;
its warning that authentication is disabled still is, and authentication is left to Ray."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from transfer_queue import runtime


def test_the_notice_of_rays_default_is_dropped_and_the_disabled_warning_kept(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[dict[str, Any]] = []
    notice = "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out."
    disabled = "Token authentication is disabled for this Ray cluster. Anyone with network access..."

    def fake_init(**kwargs: Any) -> None:  # what ray.init logs on a local start
        seen.append(kwargs)
        logging.getLogger(runtime.RAY_AUTH_LOGGER).warning(notice)
        logging.getLogger(runtime.RAY_AUTH_LOGGER).warning(disabled)

    monkeypatch.setattr(runtime.ray, "init", fake_init)

    with caplog.at_level(logging.WARNING):
        runtime.init_ray(num_cpus=2)
        runtime.init_ray(num_cpus=2)  # the filter is installed once

    assert [r.getMessage() for r in caplog.records] == [disabled, disabled]
    assert seen == [{"num_cpus": 2}] * 2
    assert logging.getLogger(runtime.RAY_AUTH_LOGGER).filters.count(runtime._not_the_auth_default_notice) == 1
