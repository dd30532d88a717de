"""workers/api_key.py: fresh keys."""

from __future__ import annotations

import argparse

import pytest

from workers import api_key


def test_a_fresh_key_is_never_read_as_an_option(monkeypatch: pytest.MonkeyPatch) -> None:
    # a URL-safe token starts with "-" one time in 64: as SGLang's "--api-key KEY" it was refused by argparse
    # ("argument --api-key: expected one argument"), a fake server's start failed that way in a test run
    monkeypatch.setattr(api_key.secrets, "token_urlsafe", lambda n: "-" + "a" * (n - 1))
    key = api_key.new_api_key()
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key")
    assert parser.parse_args(["--api-key", key]).api_key == key
    assert key.startswith("tq-") and len(key) > 32


def test_fresh_keys_differ() -> None:
    assert api_key.new_api_key() != api_key.new_api_key()
