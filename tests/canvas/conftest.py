"""Fixtures shared by tests/canvas: a PostgreSQL server started once per run, and an empty database per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.canvas.pgserver import PgServer, find_bindir


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/run does it)")
    pytest.importorskip("psycopg", reason="the pg extra (psycopg) is not installed")
    server = PgServer(bindir).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server: PgServer) -> str:
    """The URL of a new, empty database on the session's PostgreSQL server."""
    return pg_server.database()
