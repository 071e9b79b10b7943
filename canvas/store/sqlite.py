"""Durable storage of documents: SQLite in WAL mode, one row per document, an append-only log of edits, and the
proposals of finished generations.

Owns the database file and its schema. A document is stored as an opaque JSON state blob (what
`canvas.document.Document.to_dict()` returns, undo history included) with its version `v`; every accepted
edit is appended to `edits` (doc_id, v, ops as JSON, what it changed as JSON, time) in the same transaction as the
new state, together with what the edit did to the document's proposals (moved them, made them stale, accepted
one). A proposal row holds an opaque JSON body, its current range in the text, and its outcome (NULL while it
is pending), so a restarted server rebases old versions and accepts old proposals exactly as before.

Invariants:
- Durability: `synchronous=FULL` in WAL mode, so once `save` has returned the write survives `kill -9` of the
  process (and a power cut, as far as the disk honours fsync). The server acknowledges an edit only after `save`.
- Versions of a document only grow: `save` with `v` below the stored version raises `VersionRegression`;
  the same `v` again is allowed only without ops (re-saving a state, e.g. a new name).
- A save is all or nothing: the state, its edit-log row and its proposal updates commit together.
- Schema upgrades run in place when a file is opened (version 1 files gain the `change` column and `proposals`).
- Thread safety: one connection, opened with `check_same_thread=False` and guarded by a `threading.Lock`. Every
  call is one short transaction (well under a millisecond plus one fsync), so the asyncio server may call it
  directly or through `asyncio.to_thread`; a connection per thread would buy nothing with SQLite's single writer.

`Store` implements `canvas.store.base.DocStore`; `canvas.store.pg.PgStore` implements it in PostgreSQL, and with it
`SharedStore` (cross-process locks, change stamps, notifications) for several server processes serving the same
documents; the two share their reads and common writes through `canvas.store.base.SqlStore`. `canvas.store.open_store`
picks one from a path or a `postgresql://` URL. A SQLite file is served by one process.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from canvas.store.base import (
    SCHEMA_VERSION,
    DocumentNotFound,
    DuplicateProposal,
    Positions,
    SqlStore,
    StoreError,
    VersionRegression,
    encode_json,
    save_blobs,
)

_NO_PAGE_CAP = 1073741823  # SQLite's default max_page_count

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
    time   REAL NOT NULL,
    change TEXT
);
CREATE INDEX IF NOT EXISTS edits_by_doc ON edits (doc_id, v);
CREATE TABLE IF NOT EXISTS proposals (
    gen     TEXT PRIMARY KEY,
    doc_id  TEXT NOT NULL REFERENCES documents(doc_id) ON DELETE CASCADE,
    owner   TEXT NOT NULL,
    body    TEXT,
    start   INTEGER NOT NULL,
    "end"   INTEGER NOT NULL,
    stale   INTEGER NOT NULL DEFAULT 0,
    outcome TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS proposals_by_doc ON proposals (doc_id, outcome);
"""




class Store(SqlStore):
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
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            found = SCHEMA_VERSION if row is None else int(row[0])
            if found not in (1, SCHEMA_VERSION):
                raise StoreError(f"{self.path}: schema version {found}, this code reads {SCHEMA_VERSION}")
            with self._transaction():  # one statement at a time: executescript would commit on its own
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        self._db.execute(statement)
                columns = {r[1] for r in self._db.execute("PRAGMA table_info(edits)")}
                if "change" not in columns:  # a version 1 file: its edits predate change tracking (NULL)
                    self._db.execute("ALTER TABLE edits ADD COLUMN change TEXT")
                self._db.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
                )

    def cap_size(self, full: bool) -> None:
        """Cap the database at its present size (`full`), or lift the cap: SQLite itself then finds the disk full.

        For fault injection (`canvas.server.faults`): the cap must hold on the connection that writes, this store's.
        """
        with self._lock:
            pages = int(self._db.execute("PRAGMA page_count").fetchone()[0])
            self._db.execute(f"PRAGMA max_page_count={pages if full else _NO_PAGE_CAP}")

    # -- writing ---------------------------------------------------------------------------------------------

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception (the caller holds `_lock`)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            # SQLite has already rolled back after some errors (a full disk, an I/O error): a second ROLLBACK would
            # raise "no transaction is active" and hide the error that matters.
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    def _writing(self, doc_id: str) -> AbstractContextManager[None]:
        return self._transaction()

    def save(
        self,
        doc_id: str,
        v: int,
        state: dict[str, Any],
        ops: list[Any] | None = None,
        *,
        name: str | None = None,
        chars: int | None = None,
        change: Any = None,
        positions: Positions | None = None,
        resolved: Mapping[str, str] | None = None,
    ) -> None:
        """Store `state` as version `v` of `doc_id` and, when `ops` is given, log them as the edit that made `v`.

        Atomic and durable when it returns. `name` (for listings) is kept from the previous save when None;
        `chars` (for listings) defaults to the length of `state["text"]` when the state has one. With the edit go
        `change` (what it changed, any JSON value, stored beside its ops), `positions` (where the document's pending
        proposals lie after it) and `resolved` (gen -> outcome: proposals it settled, e.g. the one it accepted).
        """
        blob, ops_blob, change_blob, chars = save_blobs(v, state, ops, change, chars)
        now = time.time()
        with self._lock, self._transaction():
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
                    "INSERT INTO edits (doc_id, v, ops, time, change) VALUES (?, ?, ?, ?, ?)",
                    (doc_id, v, ops_blob, now, change_blob),
                )
            self._settle(doc_id, positions or {}, resolved or {}, now)

    def add_proposal(
        self, doc_id: str, gen: str, owner: str, body: Any, start: int, end: int, *, expire: Sequence[str] = ()
    ) -> None:
        """Store a pending proposal of `doc_id` (a finished generation `gen`, started by session `owner`) and, in
        the same transaction, mark the pending proposals in `expire` as `expired`. Raises `DocumentNotFound`, or
        `DuplicateProposal` when `gen` has one already."""
        blob = encode_json("body", body)
        now = time.time()
        with self._lock, self._transaction():
            if self._db.execute("SELECT 1 FROM documents WHERE doc_id=?", (doc_id,)).fetchone() is None:
                raise DocumentNotFound(doc_id)
            try:
                self._db.execute(
                    'INSERT INTO proposals (gen, doc_id, owner, body, start, "end", created, updated) '
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (gen, doc_id, owner, blob, start, end, now, now),
                )
            except sqlite3.IntegrityError:
                raise DuplicateProposal(gen) from None
            self._settle(doc_id, {}, {g: "expired" for g in expire}, now)

    # -- reading ---------------------------------------------------------------------------------------------

    def load(self, doc_id: str) -> tuple[int, dict[str, Any]]:
        """The latest `(v, state)` of a document; raises `DocumentNotFound`."""
        with self._lock:
            row = self._db.execute("SELECT v, state FROM documents WHERE doc_id=?", (doc_id,)).fetchone()
        if row is None:
            raise DocumentNotFound(doc_id)
        return int(row[0]), json.loads(row[1])
