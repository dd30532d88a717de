"""init_ray: Ray's notice that a local cluster has token authentication (its default) is not printed on every run;
its warning that authentication is disabled still is, and authentication is left to Ray."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from transfer_queue import runtime


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_notice_of_rays_default_is_dropped_and_the_disabled_warning_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []
    notice = "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out."
    disabled = "Token authentication is disabled for this Ray cluster. Anyone with network access..."

    def fake_init(**kwargs: Any) -> None:  # what ray.init logs on a local start
        seen.append(kwargs)
        logging.getLogger(runtime.RAY_AUTH_LOGGER).warning(notice)
        logging.getLogger(runtime.RAY_AUTH_LOGGER).warning(disabled)

    monkeypatch.setattr(runtime.ray, "init", fake_init)

    # on Ray's own logger, at WARNING: an earlier ray.init in this process stops Ray's loggers propagating to the root
    # and may have set the "ray" logger's level above WARNING
    kept = Kept()
    auth_log = logging.getLogger(runtime.RAY_AUTH_LOGGER)
    level = auth_log.level
    auth_log.addHandler(kept)
    auth_log.setLevel(logging.WARNING)
    try:
        runtime.init_ray(num_cpus=2)
        runtime.init_ray(num_cpus=2)  # the filter is installed once
    finally:
        auth_log.removeHandler(kept)
        auth_log.setLevel(level)

    assert kept.messages == [disabled, disabled]
    assert seen == [{"num_cpus": 2}] * 2
    assert logging.getLogger(runtime.RAY_AUTH_LOGGER).filters.count(runtime._not_the_auth_default_notice) == 1
