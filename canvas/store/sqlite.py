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

`DocStore` is the interface the server uses; `canvas.store.pg.PgStore` implements it in PostgreSQL, and with it
`SharedStore` (cross-process locks, change stamps, notifications) for several server processes serving the same
documents; the two share their reads and common writes through `_SqlStore`. `open_store` picks one from a path
or a `postgresql://` URL. A SQLite file is served by one process.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

SCHEMA_VERSION = 2

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


class DuplicateProposal(StoreError, ValueError):
    def __init__(self, gen: str) -> None:
        super().__init__(f"generation {gen!r} already has a proposal")
        self.gen = gen


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
    change: Any = None  # what the edit changed, as saved with it (None: nothing was saved)


@dataclass(frozen=True, slots=True)
class ProposalRecord:
    """A finished generation's proposal: `body` as saved (None once resolved), its range `[start, end)` in the
    document's current text, whether a later change overlapped it, and its outcome (None while pending)."""

    gen: str
    doc_id: str
    owner: str
    body: Any
    start: int
    end: int
    stale: bool
    outcome: str | None


# gen -> (start, end, stale): where a pending proposal now lies, after the change being saved.
Positions = Mapping[str, tuple[int, int, bool]]


_PROPOSAL_COLUMNS = 'gen, doc_id, owner, body, start, "end", stale, outcome'
# A settled proposal keeps its row (so a late request about it gets a precise answer) but not its body.
_SETTLE = "UPDATE proposals SET outcome=?, body=NULL, updated=? WHERE gen=? AND doc_id=? AND outcome IS NULL"


def _proposal(row: tuple[Any, ...]) -> ProposalRecord:
    gen, doc_id, owner, body, start, end, stale, outcome = row
    return ProposalRecord(gen, doc_id, owner, None if body is None else json.loads(body), start, end, bool(stale),
                          outcome)  # fmt: skip


def _doc_record(row: tuple[Any, ...]) -> DocRecord:
    return DocRecord(row[0], row[1], int(row[2]), int(row[3]), float(row[4]), float(row[5]))


def _encode(what: str, value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not JSON-serialisable: {e}") from None


def _save_blobs(
    v: int, state: dict[str, Any], ops: list[Any] | None, change: Any, chars: int | None
) -> tuple[str, str | None, str | None, int]:
    """`save`'s arguments checked and encoded, before any lock is taken: (state, ops, change, chars)."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, not {type(state).__name__}")
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"version must be a non-negative int (got {v!r})")
    if chars is None:
        text = state.get("text")
        chars = len(text) if isinstance(text, str) else 0
    return (_encode("state", state), None if ops is None else _encode("ops", ops),
            None if change is None else _encode("change", change), chars)  # fmt: skip


class DocStore(Protocol):
    """What the server needs of a document store (`Store`: SQLite; `canvas.store.pg.PgStore`: PostgreSQL)."""

    @property
    def path(self) -> str: ...
    def save(self, doc_id: str, v: int, state: dict[str, Any], ops: list[Any] | None = None, *,
             name: str | None = None, chars: int | None = None, change: Any = None,
             positions: Positions | None = None, resolved: Mapping[str, str] | None = None) -> None: ...
    def add_proposal(self, doc_id: str, gen: str, owner: str, body: Any, start: int, end: int, *,
                     expire: Sequence[str] = ()) -> None: ...
    def resolve_proposal(self, doc_id: str, gen: str, outcome: str) -> bool: ...
    def delete(self, doc_id: str) -> bool: ...
    def load(self, doc_id: str) -> tuple[int, dict[str, Any]]: ...
    def exists(self, doc_id: str) -> bool: ...
    def info(self, doc_id: str) -> DocRecord: ...
    def list_docs(self) -> list[DocRecord]: ...
    def count(self) -> int: ...
    def edits(self, doc_id: str, since_v: int = 0) -> list[EditRecord]: ...
    def proposals(self, doc_id: str) -> list[ProposalRecord]: ...
    def proposal(self, gen: str) -> ProposalRecord | None: ...
    def close(self) -> None: ...


@runtime_checkable
class SharedStore(Protocol):
    """A store that several server processes use at once (`canvas.store.pg.PgStore`): a document's writes are
    serialised across them by a lock each takes around check-change-save, and each learns of the others' writes."""

    def try_lock(self, doc_id: str) -> bool: ...  # the document's cross-process lock, if free
    def unlock(self, doc_id: str) -> None: ...
    def changed(self, doc_id: str) -> bool: ...  # another process wrote (or deleted) it since this one read it
    def listen(self, callback: Callable[[str], None]) -> None: ...  # doc ids others change ("*": maybe any)


def open_store(target: str | Path) -> DocStore:
    """A SQLite file (a path, `":memory:"`) or a PostgreSQL database (`postgresql://...`)."""
    if isinstance(target, str) and target.startswith(("postgresql://", "postgres://")):
        from canvas.store.pg import PgStore

        return PgStore(target)
    return Store(target)


def describe(target: str | Path) -> str:
    """Where documents live, for messages (a database URL without its password)."""
    text = str(target)
    if not text.startswith(("postgresql://", "postgres://")):
        return text
    scheme, _, rest = text.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at or ":" not in creds:
        return text
    return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"


class _SqlStore:
    """What the SQLite and PostgreSQL stores share: one connection (`_db`) guarded by one lock (`_lock`), the reads,
    and the writes whose SQL is the same in both. Queries are written with `?` parameters; `_PARAM` is the driver's
    own (psycopg's `%s`), swapped in by `_q` (no query here holds a literal `?`). Subclasses provide `_writing`
    (one write transaction) and may hook `_touched` (a write to a document committed with that transaction)."""

    _PARAM = "?"
    _PROPOSAL_ORDER = "rowid"  # the proposals column that orders them as they were added
    _db: Any
    _lock: threading.Lock

    def _q(self, sql: str) -> str:
        return sql if self._PARAM == "?" else sql.replace("?", self._PARAM)

    def _writing(self, doc_id: str) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def _touched(self, doc_id: str) -> None:
        """Called inside a write transaction that changed `doc_id` (or deleted it)."""

    # -- writing ---------------------------------------------------------------------------------------------

    def _settle(self, doc_id: str, positions: Positions, resolved: Mapping[str, str], now: float) -> None:
        cur = self._db.cursor()
        if positions:
            cur.executemany(
                self._q('UPDATE proposals SET start=?, "end"=?, stale=?, updated=? '
                        "WHERE gen=? AND doc_id=? AND outcome IS NULL"),
                [(s, e, bool(stale), now, gen, doc_id) for gen, (s, e, stale) in positions.items()],
            )  # fmt: skip
        if resolved:
            cur.executemany(self._q(_SETTLE), [(outcome, now, gen, doc_id) for gen, outcome in resolved.items()])

    def resolve_proposal(self, doc_id: str, gen: str, outcome: str) -> bool:
        """Settle a pending proposal without an edit (rejected, or found stale). Returns whether it was pending."""
        with self._lock, self._writing(doc_id):
            cur = self._db.execute(self._q(_SETTLE), (outcome, time.time(), gen, doc_id))
            if cur.rowcount > 0:
                self._touched(doc_id)
            return bool(cur.rowcount > 0)

    def delete(self, doc_id: str) -> bool:
        """Remove a document, its edit log and its proposals. Returns whether it existed."""
        with self._lock, self._writing(doc_id):
            self._db.execute(self._q("DELETE FROM edits WHERE doc_id=?"), (doc_id,))
            self._db.execute(self._q("DELETE FROM proposals WHERE doc_id=?"), (doc_id,))
            gone = self._db.execute(self._q("DELETE FROM documents WHERE doc_id=?"), (doc_id,)).rowcount > 0
            self._touched(doc_id)
            return bool(gone)

    # -- reading ---------------------------------------------------------------------------------------------

    def exists(self, doc_id: str) -> bool:
        with self._lock:
            return self._db.execute(self._q("SELECT 1 FROM documents WHERE doc_id=?"), (doc_id,)).fetchone() is not None

    def info(self, doc_id: str) -> DocRecord:
        """A document's record (name, version, size, times); raises `DocumentNotFound`."""
        with self._lock:
            row = self._db.execute(
                self._q("SELECT doc_id, name, v, chars, created, updated FROM documents WHERE doc_id=?"), (doc_id,)
            ).fetchone()
        if row is None:
            raise DocumentNotFound(doc_id)
        return _doc_record(row)

    def list_docs(self) -> list[DocRecord]:
        """Every document, most recently updated first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT doc_id, name, v, chars, created, updated FROM documents ORDER BY updated DESC, doc_id"
            ).fetchall()
        return [_doc_record(row) for row in rows]

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM documents").fetchone()[0])

    def edits(self, doc_id: str, since_v: int = 0) -> list[EditRecord]:
        """The logged edits of a document with version > `since_v`, oldest first."""
        with self._lock:
            rows = self._db.execute(
                self._q("SELECT doc_id, v, ops, time, change FROM edits WHERE doc_id=? AND v>? ORDER BY seq"),
                (doc_id, since_v),
            ).fetchall()
        return [
            EditRecord(r[0], int(r[1]), json.loads(r[2]), float(r[3]), None if r[4] is None else json.loads(r[4]))
            for r in rows
        ]

    def proposals(self, doc_id: str) -> list[ProposalRecord]:
        """The pending proposals of a document, oldest first."""
        with self._lock:
            rows = self._db.execute(
                self._q(f"SELECT {_PROPOSAL_COLUMNS} FROM proposals WHERE doc_id=? AND outcome IS NULL "
                        f"ORDER BY {self._PROPOSAL_ORDER}"),
                (doc_id,),
            ).fetchall()  # fmt: skip
        return [_proposal(r) for r in rows]

    def proposal(self, gen: str) -> ProposalRecord | None:
        """Generation `gen`'s proposal, pending or settled; None if it has none (or its document was deleted)."""
        with self._lock:
            row = self._db.execute(self._q(f"SELECT {_PROPOSAL_COLUMNS} FROM proposals WHERE gen=?"), (gen,)).fetchone()
        return None if row is None else _proposal(row)

    # -- lifetime --------------------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Store(_SqlStore):
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
        blob, ops_blob, change_blob, chars = _save_blobs(v, state, ops, change, chars)
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
        blob = _encode("body", body)
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
