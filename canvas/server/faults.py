"""A document store that fails on purpose, for soak tests (`dcanvas bench soak`): never enabled in normal use.

`dcanvas serve` wraps its store in `FaultyStore` only when the environment variable `DCANVAS_STORE_FAULTS` names a
control file. The file holds one JSON object that the test rewrites (atomically, by rename) while the server runs:

    {"mode": "off"}                          every write goes through
    {"mode": "error", "p": 0.5, "seed": 7}   each write fails with probability p, as SQLite's "disk I/O error"
    {"mode": "full"}                         the disk is full: SQLite itself refuses to grow the database past
                                             its present size (`max_page_count`), with SQLITE_FULL

A PostgreSQL store (`canvas.store.base.SharedStore`) is wrapped in `FaultySharedStore`, which passes its cross-process
locks and notifications through untouched. Its faults are raised as psycopg's own error classes, before the write
reaches the server (PostgreSQL has no per-database size cap to lower): `error` as `IoError` (SQLSTATE 58030),
`full` as `DiskFull` (53100), both `OperationalError`s, which the server takes for a store that could not write.

Invariants: reads always go through; a write that fails here fails before the store sees it (error; full on
PostgreSQL) or inside the store's own transaction, which it rolls back (full on SQLite), so an injected failure
never leaves a partial write. The control file is read again only when its modification time changes (one `stat`
a write).
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from canvas.env import STORE_FAULTS
from canvas.store.base import CommitUnknown, DocRecord, DocStore, EditRecord, Positions, ProposalRecord, SharedStore
from canvas.store.sqlite import Store

MODES = ("off", "error", "full")


def from_env(store: DocStore) -> DocStore:
    """`store` wrapped in a `FaultyStore` when `DCANVAS_STORE_FAULTS` names a control file; else `store`."""
    control = STORE_FAULTS.get()
    if not control:
        return store
    if isinstance(store, SharedStore):  # its cross-process locks must stay visible to the server (peers)
        return FaultySharedStore(store, control)
    return FaultyStore(store, control)


def write_control(path: str | os.PathLike[str], mode: str, p: float = 1.0, seed: int = 0) -> None:
    """Set the faults of the servers that watch `path` (atomically: a server never reads half a file)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], not {p}")
    tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"mode": mode, "p": p, "seed": seed}, f)
    os.replace(tmp, path)


class FaultyStore:
    """A `DocStore` whose writes fail as its control file says; counts the failures it injected (`injected`)."""

    def __init__(self, inner: DocStore, control: str | os.PathLike[str]) -> None:
        self.inner, self.control = inner, os.fspath(control)
        self.injected = 0
        self._mode, self._p = "off", 0.0
        self._rng = random.Random(0)
        self._mtime: float | None = None
        self._capped = False
        self._lock = threading.Lock()  # the store is called from worker threads

    @property
    def path(self) -> str:
        return self.inner.path

    def _refresh(self) -> None:
        try:
            mtime = os.stat(self.control).st_mtime_ns
        except FileNotFoundError:
            mtime = None
        if mtime == self._mtime:
            return
        self._mtime = mtime
        spec: dict[str, Any] = {"mode": "off"}
        if mtime is not None:
            try:
                with open(self.control, encoding="utf-8") as f:
                    spec = json.load(f)
            except (OSError, ValueError):
                spec = {"mode": "off"}
        mode = spec.get("mode") if spec.get("mode") in MODES else "off"
        self._mode, self._p = str(mode), float(spec.get("p", 1.0))
        self._rng = random.Random(int(spec.get("seed", 0)))
        self._cap(self._mode == "full")

    def _cap(self, full: bool) -> None:
        """Cap (or uncap) a SQLite database at its present size, so that SQLite itself finds the disk full."""
        if full == self._capped:
            return
        if isinstance(self.inner, Store):
            self.inner.cap_size(full)
        self._capped = full

    def _before_write(self) -> None:
        with self._lock:
            self._refresh()
            fail = self._mode == "error" and self._rng.random() < self._p
            full = self._mode == "full" and not isinstance(self.inner, Store)  # SQLite: its own cap says so
            if fail or full:
                self.injected += 1
        if fail:
            raise self._io_error()
        if full:
            raise self._full_error()

    def _io_error(self) -> Exception:
        return sqlite3.OperationalError("disk I/O error")

    def _full_error(self) -> Exception:
        return sqlite3.OperationalError("database or disk is full")

    # -- writes: may fail --------------------------------------------------------------------------------------

    def save(self, doc_id: str, v: int, state: dict[str, Any], ops: list[Any] | None = None, *,
             name: str | None = None, chars: int | None = None, change: Any = None,
             positions: Positions | None = None, resolved: Mapping[str, str] | None = None) -> None:
        self._before_write()
        self.inner.save(doc_id, v, state, ops, name=name, chars=chars, change=change, positions=positions,
                        resolved=resolved)  # fmt: skip

    def add_proposal(self, doc_id: str, gen: str, owner: str, body: Any, start: int, end: int, *,
                     expire: Sequence[str] = ()) -> None:
        self._before_write()
        self.inner.add_proposal(doc_id, gen, owner, body, start, end, expire=expire)

    def resolve_proposal(self, doc_id: str, gen: str, outcome: str) -> bool:
        self._before_write()
        return self.inner.resolve_proposal(doc_id, gen, outcome)

    def delete(self, doc_id: str) -> bool:
        self._before_write()
        return self.inner.delete(doc_id)

    # -- reads: always go through ------------------------------------------------------------------------------

    def load(self, doc_id: str) -> tuple[int, dict[str, Any]]:
        return self.inner.load(doc_id)

    def exists(self, doc_id: str) -> bool:
        return self.inner.exists(doc_id)

    def info(self, doc_id: str) -> DocRecord:
        return self.inner.info(doc_id)

    def list_docs(self) -> list[DocRecord]:
        return self.inner.list_docs()

    def count(self) -> int:
        return self.inner.count()

    def edits(self, doc_id: str, since_v: int = 0) -> list[EditRecord]:
        return self.inner.edits(doc_id, since_v)

    def proposals(self, doc_id: str) -> list[ProposalRecord]:
        return self.inner.proposals(doc_id)

    def proposal(self, gen: str) -> ProposalRecord | None:
        return self.inner.proposal(gen)

    def committed(self, unknown: CommitUnknown) -> bool:
        return self.inner.committed(unknown)

    def close(self) -> None:
        self.inner.close()


class FaultySharedStore(FaultyStore):
    """A `FaultyStore` around a store that several server processes share (PostgreSQL): its writes fail with
    psycopg's errors, and its locks and notifications pass through (they are no writes of documents)."""

    inner: Any  # a DocStore that is also a SharedStore

    def _io_error(self) -> Exception:
        from psycopg import errors

        return errors.IoError("could not write to file: Input/output error (injected)")

    def _full_error(self) -> Exception:
        from psycopg import errors

        return errors.DiskFull("could not extend file: No space left on device (disk full, injected)")

    def try_lock(self, doc_id: str) -> bool:
        return bool(self.inner.try_lock(doc_id))

    def unlock(self, doc_id: str) -> None:
        self.inner.unlock(doc_id)

    def changed(self, doc_id: str) -> bool:
        return bool(self.inner.changed(doc_id))

    def listen(self, callback: Callable[[str], None]) -> None:
        self.inner.listen(callback)
