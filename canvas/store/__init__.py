"""Durable storage of documents: the `DocStore` interface, its two implementations, and `open_store`, which picks one.

Map: `base` (records, errors, `DocStore` / `SharedStore`, the shared SQL), `sqlite` (`Store`: one SQLite file, one
server process), `pg` (`PgStore`: PostgreSQL, several server processes), `pgserver` (a private, throwaway
PostgreSQL from Debian's binaries, for the tests and the soak). The bottom layer with `canvas.protocol` and
`canvas.document`: it imports only the face's settings (`canvas.env`, where `pgserver` finds its binaries; documents
are opaque JSON blobs here); the server (`canvas.server`), the soak and the tests import it.
Imports: `canvas`.
Imported by: `canvas.server` and `canvas.soak`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from canvas.store.base import DocStore


def open_store(target: str | Path) -> DocStore:
    """A SQLite file (a path, `":memory:"`) or a PostgreSQL database (`postgresql://...`)."""
    if isinstance(target, str) and target.startswith(("postgresql://", "postgres://")):
        from canvas.store.pg import PgStore

        return PgStore(target)
    from canvas.store.sqlite import Store

    return Store(target)
