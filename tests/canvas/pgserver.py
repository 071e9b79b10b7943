"""The throwaway PostgreSQL server of the store tests (not a test module): `canvas.store.pgserver`, which
`dcanvas bench soak --db postgresql` also starts, re-exported under the name the fixtures import."""

from __future__ import annotations

from canvas.store.pgserver import PgServer, find_bindir

__all__ = ["PgServer", "find_bindir"]
