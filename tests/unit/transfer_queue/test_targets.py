"""``python -m transfer_queue targets``' Prometheus entries (no Ray)."""

from __future__ import annotations

from transfer_queue.__main__ import file_sd


def test_a_unit_dead_for_good_gets_no_scrape_target():
    """A controller started again from its journal after a unit was lost for good has no metrics URL for it (None):
    the other units keep their numbers and the dead one is left out (before: urlparse(None) raised)."""
    endpoints = {"controller": "http://127.0.0.1:8000", "storage_units": [None, "http://127.0.0.1:8002"]}
    assert file_sd(endpoints) == [
        {"targets": ["127.0.0.1:8000"], "labels": {"component": "controller"}},
        {"targets": ["127.0.0.1:8002"], "labels": {"component": "storage", "unit": "1"}},
    ]
