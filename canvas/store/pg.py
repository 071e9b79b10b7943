"""Durable storage of documents in PostgreSQL, for several server processes (ingress replicas, nodes) sharing them.

Owns the PostgreSQL schema and one connection per process. The data and its methods are those of the SQLite
`canvas.store.sqlite.Store` (same records, same errors, same invariants: versions only grow, a save is all or nothing,
durable once it returns), and the reads and the writes whose SQL is the same live in their shared base,
`canvas.store.base.SqlStore`; this module writes what differs (schema, save, add_proposal, load). What it adds is
what several processes serving the same documents need (`canvas.store.base.SharedStore`):

- A per-document **stamp**, bumped by every write that touches the document (a save, a proposal added or settled).
  A process remembers the stamp of what it last read or wrote (`_seen`); `changed(doc_id)` says whether another
  process has written since, so the server reloads its copy before it acts on it (`canvas.server.hub`).
- A per-document **advisory lock** (`try_lock` / `unlock`, on `hashtextextended(doc_id)`), held by a server while it
  checks, changes and saves a document: edits of one document are serialised across processes, so a save never
  races another process's save of the same version. It is only ever tried, never waited for on the connection
  (the caller polls), so a process waiting for one document's lock does not block its other documents' reads and
  writes, and two processes cannot deadlock on their single connections.
- `NOTIFY dcanvas_docs` with every write (sent at commit), and `listen(callback)`, a thread with its own
  connection that calls `callback(doc_id)` for documents other processes changed, so a server tells its clients
  of an edit made through another server within milliseconds.

Thread safety: one connection in autocommit mode guarded by a `threading.Lock`, reopened by the next call after it
broke (a database restart: `_db`); every call is one short transaction (`synchronous_commit` as the server is
configured: on by default, so durable at return). psycopg is imported when a store is opened, so nothing else needs
it installed (the `pg` extra).

A lost connection, and what it must never cause (the scale-out soak's duplicated and unannounced edits):
- A failure before COMMIT wrote nothing. A failure *at* COMMIT (the connection lost: a restart, a cut) may have
  committed: it raises `CommitUnknown`, and `committed` tells, once the database answers again, whether the write is
  there (its edit's version and time), after making sure the lost session has ended (its backend pid and start
  time gone from `pg_stat_activity`, terminated if need be), so that a COMMIT still under way cannot land later.
- The advisory locks of a lost connection went with it. A write to a document whose lock was taken on a connection
  since lost fails (retryable, before writing anything) instead of writing unlocked on the new connection; and
  `unlock` after a lost connection has nothing to release and never raises (a failing unlock after a save that
  committed would have told the client "nothing changed" of a change that was made).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from canvas.store.base import (
    SCHEMA_VERSION,
    CommitUnknown,
    DocumentNotFound,
    DuplicateProposal,
    Positions,
    SqlStore,
    StoreError,
    VersionRegression,
    describe,
    encode_json,
    save_blobs,
)

CHANNEL = "dcanvas_docs"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS documents (
    doc_id  TEXT PRIMARY KEY,
    name    TEXT NOT NULL DEFAULT '',
    v       BIGINT NOT NULL,
    stamp   BIGINT NOT NULL DEFAULT 1,
    state   TEXT NOT NULL,
    chars   INTEGER NOT NULL,
    created DOUBLE PRECISION NOT NULL,
    updated DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS edits (
    seq    BIGSERIAL PRIMARY KEY,
    doc_id TEXT NOT NULL REFERENCES documents(doc_id) ON DELETE CASCADE,
    v      BIGINT NOT NULL,
    ops    TEXT NOT NULL,
    time   DOUBLE PRECISION NOT NULL,
    change TEXT
);
CREATE INDEX IF NOT EXISTS edits_by_doc ON edits (doc_id, v);
CREATE TABLE IF NOT EXISTS proposals (
    seq     BIGSERIAL,
    gen     TEXT PRIMARY KEY,
    doc_id  TEXT NOT NULL REFERENCES documents(doc_id) ON DELETE CASCADE,
    owner   TEXT NOT NULL,
    body    TEXT,
    start   INTEGER NOT NULL,
    "end"   INTEGER NOT NULL,
    stale   BOOLEAN NOT NULL DEFAULT FALSE,
    outcome TEXT,
    created DOUBLE PRECISION NOT NULL,
    updated DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS proposals_by_doc ON proposals (doc_id, outcome)
"""

_SCHEMA_LOCK = 0x64636E76  # "dcnv": one process at a time creates the schema (CREATE IF NOT EXISTS races otherwise)
class PgStore(SqlStore):
    """A document store in a PostgreSQL database (`url`: a libpq URL, `postgresql://user@host:port/db`)."""

    shared = True  # several processes may serve the same documents (canvas.store.base.SharedStore)
    _PARAM = "%s"
    _PROPOSAL_ORDER = "seq"

    def __init__(self, url: str, *, connect_timeout: float = 10.0) -> None:
        try:
            import psycopg
        except ImportError:
            raise StoreError("a postgresql:// store needs psycopg: pip install 'dcanvas[pg]'") from None
        self.url = url
        self.instance = f"{os.getpid()}-{secrets.token_hex(4)}"  # names this process's own notifications
        self._connect_timeout = max(1, int(connect_timeout))
        try:
            self._conn = psycopg.connect(url, autocommit=True, connect_timeout=self._connect_timeout)
        except psycopg.OperationalError as e:
            raise StoreError(f"cannot connect to {describe(url)}: {str(e).strip()}") from None
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}  # doc_id -> the stamp this process last read or wrote
        self._listener: _Listener | None = None
        self._epoch = 0  # connections opened so far, less one: which connection a lock was taken on
        self._held: dict[str, int] = {}  # doc_id -> the epoch of the connection that holds its advisory lock
        self._backend = self._whoami()
        with self._lock, self._db.transaction():
            self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self._db.execute(statement)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is not None and int(row[0]) != SCHEMA_VERSION:
                raise StoreError(f"{describe(url)}: schema version {row[0]}, this code reads {SCHEMA_VERSION}")
            self._db.execute(
                "INSERT INTO meta VALUES ('schema_version', %s) ON CONFLICT (key) DO NOTHING", (str(SCHEMA_VERSION),)
            )

    @property
    def path(self) -> str:  # what the server prints as where documents live
        return describe(self.url)

    @property
    def _db(self) -> Any:
        """The connection (the caller holds `_lock`), opened again if the last one broke: after a database restart
        the call that met the broken connection failed (psycopg's `OperationalError`, which the server tells its
        client as a retryable `busy`), and the next call reconnects instead of failing on the dead connection for
        ever. A failed reconnect raises `OperationalError` too. Session state is lost with the connection: the
        advisory locks it held were released by the server, and `_seen` stays right (stamps are stored)."""
        if self._conn.closed or self._conn.broken:
            import psycopg

            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=self._connect_timeout)
            self._epoch += 1
            self._backend = self._whoami()
        return self._conn

    def _whoami(self) -> tuple[int, Any]:
        """This connection's backend: (pid, start time), which names its session even after the pid is reused."""
        row = self._conn.execute(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        ).fetchone()
        return (int(row[0]), row[1]) if row is not None else (int(self._conn.info.backend_pid), None)

    # -- writing ---------------------------------------------------------------------------------------------

    @contextmanager
    def _writing(self, doc_id: str, v: int | None = None, at: float = 0.0, ops: bool = False) -> Iterator[Any]:
        """One transaction (the caller holds `_lock`) whose commit notifies the other processes of `doc_id`. A lost
        connection at COMMIT raises `CommitUnknown` (`v`, `at`, `ops`: what `committed` looks for); any failure
        before it wrote nothing."""
        import psycopg

        db = self._db
        held = self._held.get(doc_id)
        if held is not None and held != self._epoch:
            raise psycopg.OperationalError(
                f"the connection that held document {doc_id!r}'s lock was lost; nothing was written, retry"
            )
        db.execute("BEGIN")
        try:
            yield db
            db.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"{self.instance} {doc_id}"))
        except BaseException:
            if not (db.closed or db.broken):
                with contextlib.suppress(psycopg.Error):  # failing, it breaks the connection: nothing to roll back
                    db.execute("ROLLBACK")
            raise
        writer = self._backend
        try:
            self._commit(db)
        except psycopg.Error as e:
            if not (db.closed or db.broken):  # the database answered: the transaction did not commit
                raise
            raise CommitUnknown(doc_id, v, at, ops, writer, str(e).strip()[:120]) from e

    def _commit(self, db: Any) -> None:
        db.execute("COMMIT")

    def _touched(self, doc_id: str) -> None:
        """Bump the document's stamp and remember it as this process's own write (forget a deleted document)."""
        row = self._db.execute(
            "UPDATE documents SET stamp = stamp + 1 WHERE doc_id=%s RETURNING stamp", (doc_id,)
        ).fetchone()
        if row is None:
            self._seen.pop(doc_id, None)
        else:
            self._seen[doc_id] = int(row[0])

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
        """As `canvas.store.sqlite.Store.save`: state `v` of `doc_id` with the edit that made it, atomic and durable."""
        blob, ops_blob, change_blob, chars = save_blobs(v, state, ops, change, chars)
        now = time.time()
        with self._lock, self._writing(doc_id, v, now, ops_blob is not None) as db:
            row = db.execute("SELECT v FROM documents WHERE doc_id=%s FOR UPDATE", (doc_id,)).fetchone()
            if row is None:
                inserted = db.execute(
                    "INSERT INTO documents (doc_id, name, v, state, chars, created, updated) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (doc_id) DO NOTHING RETURNING v",
                    (doc_id, name or "", v, blob, chars, now, now),
                ).fetchone()
                if inserted is None:  # another process created it between the two statements
                    stored = db.execute("SELECT v FROM documents WHERE doc_id=%s", (doc_id,)).fetchone()
                    raise VersionRegression(doc_id, v, int(stored[0]) if stored else v)
            else:
                if v < row[0] or (v == row[0] and ops is not None):
                    raise VersionRegression(doc_id, v, int(row[0]))
                db.execute(
                    "UPDATE documents SET v=%s, state=%s, chars=%s, updated=%s, name=COALESCE(%s, name) "
                    "WHERE doc_id=%s",
                    (v, blob, chars, now, name, doc_id),
                )
            if ops_blob is not None:
                db.execute(
                    "INSERT INTO edits (doc_id, v, ops, time, change) VALUES (%s, %s, %s, %s, %s)",
                    (doc_id, v, ops_blob, now, change_blob),
                )
            self._settle(doc_id, positions or {}, resolved or {}, now)
            self._touched(doc_id)

    def add_proposal(
        self, doc_id: str, gen: str, owner: str, body: Any, start: int, end: int, *, expire: Sequence[str] = ()
    ) -> None:
        """As `canvas.store.sqlite.Store.add_proposal`. Raises `DocumentNotFound`."""
        blob = encode_json("body", body)
        now = time.time()
        with self._lock, self._writing(doc_id) as db:
            if db.execute("SELECT 1 FROM documents WHERE doc_id=%s FOR UPDATE", (doc_id,)).fetchone() is None:
                raise DocumentNotFound(doc_id)
            added = db.execute(
                'INSERT INTO proposals (gen, doc_id, owner, body, start, "end", created, updated) '
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (gen) DO NOTHING RETURNING gen",
                (gen, doc_id, owner, blob, start, end, now, now),
            ).fetchone()
            if added is None:
                raise DuplicateProposal(gen)
            self._settle(doc_id, {}, {g: "expired" for g in expire}, now)
            self._touched(doc_id)

    # -- reading ---------------------------------------------------------------------------------------------

    def load(self, doc_id: str) -> tuple[int, dict[str, Any]]:
        """The latest `(v, state)` of a document; raises `DocumentNotFound`. Remembers its stamp (`changed`)."""
        with self._lock:
            row = self._db.execute("SELECT v, state, stamp FROM documents WHERE doc_id=%s", (doc_id,)).fetchone()
            if row is None:
                raise DocumentNotFound(doc_id)
            self._seen[doc_id] = int(row[2])
        return int(row[0]), json.loads(row[1])

    # -- several processes -----------------------------------------------------------------------------------

    def try_lock(self, doc_id: str) -> bool:
        """Take the document's cross-process lock if it is free (re-entrant within this process's connection)."""
        with self._lock:
            row = self._db.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (doc_id,)).fetchone()
            taken = row is not None and bool(row[0])
            if taken:
                self._held[doc_id] = self._epoch
        return taken

    def unlock(self, doc_id: str) -> None:
        """Release the document's lock. Never fails for a lost connection: its locks went with it (one lost now is
        closed, so that none can outlive this call)."""
        import psycopg

        with self._lock:
            held = self._held.pop(doc_id, None)
            conn = self._conn
            if held != self._epoch or conn.closed or conn.broken:
                return  # taken on a connection since lost (or never): nothing holds it
            try:
                conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", (doc_id,))
            except psycopg.Error:
                with contextlib.suppress(Exception):
                    conn.close()  # ends the session, and every lock it held; the next call reconnects

    def committed(self, unknown: CommitUnknown) -> bool:
        """As `SqlStore.committed`, once the session that lost its COMMIT has ended (terminated if it lingers): a
        COMMIT still under way in it could otherwise land after this said it had not."""
        with self._lock:
            db = self._db  # reconnected first: the lost session is never this one
            pid, start = unknown.writer if unknown.writer is not None else (None, None)
            if pid is not None and (pid, start) != self._backend:
                import psycopg

                lingering = f"the session of the lost COMMIT (pid {pid}) has not ended yet"
                try:
                    row = db.execute(
                        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
                        "WHERE pid=%s AND backend_start IS NOT DISTINCT FROM %s",
                        (pid, start),
                    ).fetchone()
                except psycopg.errors.InsufficientPrivilege:  # not ours to end: wait for it to end by itself
                    raise psycopg.OperationalError(lingering) from None
                if row is not None and not row[0]:
                    raise psycopg.OperationalError(lingering)
        return super().committed(unknown)

    def changed(self, doc_id: str) -> bool:
        """Whether another process wrote the document (or deleted it) since this one last read or wrote it."""
        with self._lock:
            row = self._db.execute("SELECT stamp FROM documents WHERE doc_id=%s", (doc_id,)).fetchone()
            return row is None or int(row[0]) != self._seen.get(doc_id)

    def listen(self, callback: Callable[[str], None]) -> None:
        """Call `callback(doc_id)` (on a thread of its own) whenever another process changes a document."""
        if self._listener is None:
            self._listener = _Listener(self.url, self.instance, callback)
            self._listener.start()

    # -- lifetime --------------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._listener is not None:
            self._listener.stop()
        with self._lock:
            self._conn.close()  # not `_db`: closing must not reconnect


class _Listener(threading.Thread):
    """LISTEN on its own connection; hands other processes' document ids to the callback. Reconnects when the
    connection drops (a database restart), after which every document is reported changed once ("*")."""

    def __init__(self, url: str, instance: str, callback: Callable[[str], None]) -> None:
        super().__init__(name="dcanvas-pg-listen", daemon=True)
        self.url, self.instance, self.callback = url, instance, callback
        self._halt = threading.Event()

    def run(self) -> None:
        import psycopg

        lost = False
        while not self._halt.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    if lost:  # notifications may have been missed while disconnected
                        self.callback("*")
                    while not self._halt.is_set():
                        for note in conn.notifies(timeout=0.5):
                            sender, _, doc_id = note.payload.partition(" ")
                            if sender != self.instance and doc_id:
                                self.callback(doc_id)
            except psycopg.OperationalError:
                lost = True
                self._halt.wait(1.0)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=3)
