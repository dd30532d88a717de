"""Fixtures of the ledger tests: every test that takes ``ledger_url`` runs on SQLite and on a real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ledger.pg import PostgresServer, postgres_bin

NO_POSTGRES = "PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin (apt-get install -y postgresql)"


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
