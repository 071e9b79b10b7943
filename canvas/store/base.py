"""What the SQLite and PostgreSQL stores share: the records and errors, the `DocStore` interface the server uses (and
`SharedStore`, what several server processes sharing documents need), and `SqlStore`, the reads and common writes
whose SQL is the same in both.

Owns the data model of a stored document (`DocRecord`, `EditRecord`, `ProposalRecord`, the schema version both
schemas follow) and the invariants every store keeps: versions of a document only grow (`VersionRegression`), a
save is all or nothing, durable once it returns, and a failed one wrote nothing unless it raised `CommitUnknown`
(the connection lost at COMMIT), whose outcome `committed` tells once the store can be read. `canvas.store.sqlite`
and `canvas.store.pg` write what differs (schema, save, add_proposal, load); neither imports the other.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

SCHEMA_VERSION = 2


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


class CommitUnknown(StoreError):
    """The connection to the store was lost while a write committed: the write may or may not have been made.

    Raised only for a failure at COMMIT (every failure before it leaves nothing written). It names the write well
    enough for `committed` to say, once the store can be read again, whether it was made: the document, the version
    saved (None for a write that saves no version: a proposal added or settled, a deletion), its time `at` (stored
    with the edit, or as the document's `updated`) and `writer`, the store's own name for the lost session (PostgreSQL:
    its backend pid and start), which `committed` waits out so that a COMMIT still under way cannot land later."""

    def __init__(self, doc_id: str, v: int | None, at: float, ops: bool, writer: Any = None, reason: str = "") -> None:
        # Neutral on the outcome: the server quotes it once it knows (made, not made, or still unknown).
        super().__init__(f"the connection to the store was lost at the COMMIT of a write to document {doc_id!r}"
                         + (f" ({reason})" if reason else ""))  # fmt: skip
        self.doc_id, self.v, self.at, self.ops, self.writer = doc_id, v, at, ops, writer


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


def encode_json(what: str, value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not JSON-serialisable: {e}") from None


def save_blobs(
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
    return (encode_json("state", state), None if ops is None else encode_json("ops", ops),
            None if change is None else encode_json("change", change), chars)  # fmt: skip


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
    def committed(self, unknown: CommitUnknown) -> bool: ...
    def close(self) -> None: ...


@runtime_checkable
class SharedStore(Protocol):
    """A store that several server processes use at once (`canvas.store.pg.PgStore`): a document's writes are
    serialised across them by a lock each takes around check-change-save, and each learns of the others' writes."""

    def try_lock(self, doc_id: str) -> bool: ...  # the document's cross-process lock, if free
    def unlock(self, doc_id: str) -> None: ...
    def changed(self, doc_id: str) -> bool: ...  # another process wrote (or deleted) it since this one read it
    def listen(self, callback: Callable[[str], None]) -> None: ...  # doc ids others change ("*": maybe any)



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


class SqlStore:
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

    def committed(self, unknown: CommitUnknown) -> bool:
        """Whether the save that raised `unknown` was made: its edit (version and time) is in the log, or, for a
        save without an edit (a creation, a rename), the document is at that version with that `updated` time (which
        a later write replaces: such a save then reads as not made). Raises the driver's error while the store cannot
        be read; a write that saved no version cannot be told (False)."""
        if unknown.v is None:
            return False
        with self._lock:
            if unknown.ops:
                sql = "SELECT 1 FROM edits WHERE doc_id=? AND v=? AND time=?"
            else:
                sql = "SELECT 1 FROM documents WHERE doc_id=? AND v=? AND updated=?"
            return self._db.execute(self._q(sql), (unknown.doc_id, unknown.v, unknown.at)).fetchone() is not None

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
