"""Fixtures of the ledger tests: every test that takes ``ledger_url`` runs on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tests.conftest import requirement
from tests.integration.workers.ledger.pg import PostgresServer, postgres_bin

CHARS = "\n abcdefghijklmnopqrstuvwxyz0123456789:+=.,?"
PAD, EOS, BASE = 0, 1, 2


def encode(text: str) -> list[int]:
    return [BASE + CHARS.index(c) for c in text.lower() if c in CHARS]


def decode(ids) -> str:
    return "".join(CHARS[i - BASE] if i >= BASE else "" for i in ids)


NO_POSTGRES = requirement("PostgreSQL server binaries under /usr/lib/postgresql/*/bin", "apt-get install -y postgresql")


def require_postgres() -> str:
    bindir = postgres_bin()
    if bindir is None:
        pytest.skip(NO_POSTGRES)
    return bindir


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session (tests get their own database on it)."""
    server = PostgresServer(require_postgres())
    server.start()
    yield server
    server.destroy()


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/run/ledger.db"
    return request.getfixturevalue("postgres_server").create_database()


ENDPOINT_KEY = "ledger-test-key"


@contextlib.contextmanager
def serve_endpoint(api_key: str | None = None) -> Iterator[str]:
    """The OpenAI-compatible endpoint (workers/agents/openai_api.py) over a tiny random model, on 127.0.0.1: its base
    URL."""
    from workers.agents.openai_api import create_app
    from workers.agents.samplers import BatchingSampler, engine_generate
    from workers.agents.task_server import serve_in_background
    from workers.agents.trajectory import PlainChatFormat
    from workers.engines.hf import HFEngine
    from workers.models import build_tiny_causal_lm

    model = build_tiny_causal_lm(BASE + len(CHARS), max_position_embeddings=128, seed=1)
    engine = HFEngine(model, pad_token_id=PAD, eos_token_id=EOS)
    sampler = BatchingSampler(engine_generate(engine))
    app = create_app(sampler, PlainChatFormat(encode, decode), model="tiny", api_key=api_key)
    with serve_in_background(app) as url:
        yield url + "/v1"


@pytest.fixture(scope="module")
def endpoint_url() -> Iterator[str]:
    with serve_endpoint() as url:
        yield url


@pytest.fixture(scope="module")
def keyed_endpoint_url() -> Iterator[str]:
    """The endpoint requiring ``ENDPOINT_KEY``."""
    with serve_endpoint(ENDPOINT_KEY) as url:
        yield url
