"""Durable storage of documents: SQLite in WAL mode, one row per document plus an append-only log of edits.

Owns the database file and its schema. A document is stored as an opaque JSON state blob (what
`canvas.document.Document.to_dict()` returns, undo history included) with its version `v`; every accepted
edit is appended to `edits` (doc_id, v, ops as JSON, time) in the same transaction as the new state.

Invariants:
- Durability: `synchronous=FULL` in WAL mode, so once `save` has returned the write survives `kill -9` of the
  process (and a power cut, as far as the disk honours fsync). The server acknowledges an edit only after `save`.
- Versions of a document only grow: `save` with `v` below the stored version raises `VersionRegression`;
  the same `v` again is allowed only without ops (re-saving a state, e.g. a new name).
- Thread safety: one connection, opened with `check_same_thread=False` and guarded by a `threading.Lock`. Every
  call is one short transaction (well under a millisecond plus one fsync), so the asyncio server may call it
  directly or through `asyncio.to_thread`; a connection per thread would buy nothing with SQLite's single writer.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS documents (
    doc_id  TEXT PRIMARY KEY,
    name    TEXT NOT NULL DEFAULT '',
    v       INTEGER NOT NULL,
    state   TEXT NOT NULL,
    chars   INTEGER NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS edits (
    seq    INTEGER PRIMARY KEY AUTOINCREMENT,
    doc_id TEXT NOT NULL REFERENCES documents(doc_id) ON DELETE CASCADE,
    v      INTEGER NOT NULL,
    ops    TEXT NOT NULL,
    time   REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS edits_by_doc ON edits (doc_id, v);
"""


class StoreError(Exception):
    """Base class of the store's errors."""


class DocumentNotFound(StoreError, KeyError):
    def __init__(self, doc_id: str) -> None:
        super().__init__(doc_id)
        self.doc_id = doc_id

    def __str__(self) -> str:
        return f"no document {self.doc_id!r}"


class VersionRegression(StoreError, ValueError):
    def __init__(self, doc_id: str, v: int, stored: int) -> None:
        super().__init__(f"document {doc_id!r} is at version {stored}; cannot save version {v}")
        self.doc_id, self.v, self.stored = doc_id, v, stored


@dataclass(frozen=True, slots=True)
class DocRecord:
    doc_id: str
    name: str
    v: int
    chars: int  # length of state["text"] when the state has a text, else 0
    created: float
    updated: float


@dataclass(frozen=True, slots=True)
class EditRecord:
    doc_id: str
    v: int
    ops: list[Any]
    time: float


def _encode(what: str, value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not JSON-serialisable: {e}") from None


class Store:
    """A document store in one SQLite file (`":memory:"` for a throwaway store)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions; each method opens its own with BEGIN IMMEDIATE.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise StoreError(f"{self.path}: schema version {row[0]}, this code reads {SCHEMA_VERSION}")

    # -- writing ---------------------------------------------------------------------------------------------

    def save(
        self,
        doc_id: str,
        v: int,
        state: dict[str, Any],
        ops: list[Any] | None = None,
        *,
        name: str | None = None,
        chars: int | None = None,
    ) -> None:
        """Store `state` as version `v` of `doc_id` and, when `ops` is given, log them as the edit that made `v`.

        Atomic and durable when it returns. `name` (for listings) is kept from the previous save when None;
        `chars` (for listings) defaults to the length of `state["text"]` when the state has one.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, not {type(state).__name__}")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"version must be a non-negative int (got {v!r})")
        blob = _encode("state", state)
        ops_blob = None if ops is None else _encode("ops", ops)
        if chars is None:
            text = state.get("text")
            chars = len(text) if isinstance(text, str) else 0
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT v FROM documents WHERE doc_id=?", (doc_id,)).fetchone()
                if row is None:
                    self._db.execute(
                        "INSERT INTO documents (doc_id, name, v, state, chars, created, updated) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (doc_id, name or "", v, blob, chars, now, now),
                    )
                else:
                    if v < row[0] or (v == row[0] and ops is not None):
                        raise VersionRegression(doc_id, v, row[0])
                    self._db.execute(
                        "UPDATE documents SET v=?, state=?, chars=?, updated=?, name=COALESCE(?, name) WHERE doc_id=?",
                        (v, blob, chars, now, name, doc_id),
                    )
                if ops_blob is not None:
                    self._db.execute(
                        "INSERT INTO edits (doc_id, v, ops, time) VALUES (?, ?, ?, ?)", (doc_id, v, ops_blob, now)
                    )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def delete(self, doc_id: str) -> bool:
        """Remove a document and its edit log. Returns whether it existed."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM edits WHERE doc_id=?", (doc_id,))
                gone = self._db.execute("DELETE FROM documents WHERE doc_id=?", (doc_id,)).rowcount > 0
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return gone

    # -- reading ---------------------------------------------------------------------------------------------

    def load(self, doc_id: str) -> tuple[int, dict[str, Any]]:
        """The latest `(v, state)` of a document; raises `DocumentNotFound`."""
        with self._lock:
            row = self._db.execute("SELECT v, state FROM documents WHERE doc_id=?", (doc_id,)).fetchone()
        if row is None:
            raise DocumentNotFound(doc_id)
        return int(row[0]), json.loads(row[1])

    def exists(self, doc_id: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM documents WHERE doc_id=?", (doc_id,)).fetchone() is not None

    def info(self, doc_id: str) -> DocRecord:
        """A document's record (name, version, size, times); raises `DocumentNotFound`."""
        with self._lock:
            row = self._db.execute(
                "SELECT doc_id, name, v, chars, created, updated FROM documents WHERE doc_id=?", (doc_id,)
            ).fetchone()
        if row is None:
            raise DocumentNotFound(doc_id)
        return DocRecord(*row)

    def list_docs(self) -> list[DocRecord]:
        """Every document, most recently updated first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT doc_id, name, v, chars, created, updated FROM documents ORDER BY updated DESC, doc_id"
            ).fetchall()
        return [DocRecord(*row) for row in rows]

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM documents").fetchone()[0])

    def edits(self, doc_id: str, since_v: int = 0) -> list[EditRecord]:
        """The logged edits of a document with version > `since_v`, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT doc_id, v, ops, time FROM edits WHERE doc_id=? AND v>? ORDER BY seq", (doc_id, since_v)
            ).fetchall()
        return [EditRecord(r[0], int(r[1]), json.loads(r[2]), float(r[3])) for r in rows]

    # -- lifetime --------------------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
