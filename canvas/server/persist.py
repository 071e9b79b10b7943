"""What the server keeps in the store beside each document, and how a `LiveDoc` is rebuilt from it.

Owns the stored forms of a change (`[start, end, new_end]`, `[]` for a version bump that changed nothing
measurable) and of a pending proposal (`canvas.document.proposal_to_json`), and `load_live`, which reads a
document back with its recent change log and its pending proposals. So a restarted server rebases a request made
against an old version, and accepts a proposal made before the restart, exactly as the server that made them would.

Invariant: everything stored here is written in the same transaction as the document version it belongs to
(`Hub.mutate`), or on its own when no version changes (a proposal added, rejected or expired).

A write the store could not make (an I/O error, a full disk: `write_failed`) is told to the client as `busy` with
`data.unavailable` (retryable, `retry_after_s`), never `internal`: the store rolled the transaction back and the
server keeps nothing of the change in memory either (`Hub.mutate` reloads the document), so a retry applies it once.
A write whose COMMIT lost its connection (`canvas.store.base.CommitUnknown`) is told only once its outcome is known
(`Hub.mutate` reads the store back for up to `RESOLVE_S`): made, it is acknowledged; not made, it is `busy` as
above; still unknown, the client is told so (`outcome_unknown`: `busy` with `data.outcome = "unknown"`), never
"nothing changed".
"""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Sequence
from typing import Any

from canvas.document import Document, StateError, TextTokenizer, proposal_from_json
from canvas.protocol import ErrorCode, ProtocolError
from canvas.server.rebase import Change, ChangeLog
from canvas.server.state import LiveDoc, PendingProposal, snapshot
from canvas.store.base import CommitUnknown, DocStore, EditRecord, Positions

LOG_LENGTH = 256  # changes a document remembers for rebasing (docs/protocol.md says 256)
_STORAGE_ERRNOS = frozenset({errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EROFS})
RETRY_AFTER_S = 1.0  # what a client told that the store could not write waits before it retries
# How long a change whose COMMIT lost its connection waits for the store to answer whether it was made. Past it the
# client is told the outcome is unknown. Longer than a database restart (seconds), shorter than a client's patience.
RESOLVE_S = 30.0


def write_failed(exc: BaseException) -> bool:
    """Whether `exc` is the store failing to write (I/O error, full disk, locked or unreachable database), as
    opposed to a bug or a bad request. psycopg's errors are matched by module so that SQLite needs no psycopg."""
    if isinstance(exc, (sqlite3.DatabaseError, CommitUnknown)):
        return True
    if isinstance(exc, OSError):  # not every OSError: a lost connection to an engine replica is no store failure
        return exc.errno in _STORAGE_ERRNOS
    return any(c.__module__.startswith("psycopg") and c.__name__ == "OperationalError" for c in type(exc).__mro__)


def unavailable(exc: BaseException, re: str | int | None = None) -> ProtocolError:
    """The typed, retryable error for a write the store could not make (`write_failed`): nothing changed."""
    reason = str(exc).strip()[:120] or type(exc).__name__
    return ProtocolError(
        ErrorCode.BUSY, f"the document store could not save the change ({reason}); nothing changed, retry", re,
        data={"retry_after_s": RETRY_AFTER_S, "unavailable": reason},
    )  # fmt: skip


def outcome_unknown(exc: BaseException, re: str | int | None = None) -> ProtocolError:
    """The typed, retryable error for a change whose COMMIT lost its connection and whose outcome the store could not
    be read to tell within `RESOLVE_S`: it may have been made. The session's retry of the same request is checked
    against the store first (`Hub._repeat`), so it is acknowledged, not made twice, if it was."""
    reason = str(exc).strip()[:120] or type(exc).__name__
    return ProtocolError(
        ErrorCode.BUSY, "the document store lost its connection while saving the change and cannot yet tell whether "
        "it was saved: re-read the document (or retry the same request on this connection)", re,
        data={"retry_after_s": RETRY_AFTER_S, "unavailable": reason, "outcome": "unknown"},
    )  # fmt: skip


def encode_change(change: Change | None) -> list[int]:
    return [] if change is None else [change.start, change.end, change.new_end]


def decode_change(value: Any) -> Change | None:
    if value == []:
        return None
    if isinstance(value, list) and len(value) == 3 and all(type(x) is int and x >= 0 for x in value):
        return Change(value[0], value[1], value[2])
    raise StateError(f"a stored change is [start, end, new_end] or [], not {value!r:.60}")


def change_log(version: int, records: Sequence[EditRecord]) -> ChangeLog:
    """The change log of a document at `version` from its last logged edits (oldest first)."""
    entries: list[tuple[int, Change | None]] = []
    for r in records:
        if r.change is None:
            entries.clear()  # saved without its change (a version 1 store): nothing before it can be rebased over
        else:
            entries.append((r.v, decode_change(r.change)))
    return ChangeLog.restore(version, entries, LOG_LENGTH)


def positions(live: LiveDoc) -> Positions:
    return {gen: (p.start, p.end, p.stale) for gen, p in live.proposals.items()}


def load_live(store: DocStore, doc_id: str, tokenizer: TextTokenizer) -> LiveDoc:
    """Read a document, its change log and its pending proposals (blocking: run it in a thread).
    Raises `DocumentNotFound`, or `StateError` for a corrupt row."""
    _, state = store.load(doc_id)
    doc = Document.from_dict(state, tokenizer)
    record = store.info(doc_id)
    log = change_log(doc.version, store.edits(doc_id, since_v=max(0, doc.version - LOG_LENGTH)))
    live = LiveDoc(doc, record.name, snapshot(doc), log)
    for p in store.proposals(doc_id):
        live.proposals[p.gen] = PendingProposal(p.gen, p.owner, proposal_from_json(p.body), p.start, p.end, p.stale)
    return live
