"""A save whose COMMIT lost its connection (`CommitUnknown`: PostgreSQL restarting) is answered only once the store,
read back, tells its outcome: made, it is acknowledged as made, never refused as "nothing changed, retry" (a client
that retried an undo would have had it made twice: an undo carries no base version to rebase by); not made, it is
refused and memory keeps nothing of it (a retry makes it once). While the store cannot be read the server waits (up
to `Hub.resolve_s`); past that the client is told the outcome is unknown, and the session's retry of the same
request is acknowledged, not made again, once the store shows it made. A store answer lost (here) is simulated on
SQLite; tests/canvas/server/test_pg_commit.py does it with a real PostgreSQL's connection cut."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from canvas.store.base import CommitUnknown
from canvas.store.sqlite import Store
from tests.canvas.wsconn import Conn, Factory, edit, open_doc

pytestmark = pytest.mark.timeout(120)


class LostAnswers(Store):
    """Saves, then says its COMMIT's answer was lost (`lose` times); `drop` loses the COMMIT itself (nothing saved).
    With `blinding`, each lost answer also makes the store unreadable until `blind` is cleared."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.lose = 0
        self.drop = 0
        self.blind = False
        self.blinding = False

    def _unreadable(self) -> None:
        if self.blind:
            raise sqlite3.OperationalError("unable to open database file")

    def save(self, doc_id: str, v: int, state: dict[str, Any], ops: list[Any] | None = None, **kw: Any) -> None:
        self._unreadable()
        if self.drop:
            self.drop -= 1
            self.blind = self.blinding
            raise CommitUnknown(doc_id, v, time.time(), ops is not None, None, "the connection was lost")
        super().save(doc_id, v, state, ops, **kw)
        if self.lose:
            self.lose -= 1
            self.blind = self.blinding
            if ops is not None:
                at = next(r.time for r in super().edits(doc_id, v - 1) if r.v == v)
            else:
                at = super().info(doc_id).updated
            raise CommitUnknown(doc_id, v, at, ops is not None, None, "the commit's answer was lost")

    def edits(self, doc_id: str, since_v: int = 0) -> Any:
        self._unreadable()
        return super().edits(doc_id, since_v)

    def load(self, doc_id: str) -> Any:
        self._unreadable()
        return super().load(doc_id)

    def committed(self, unknown: CommitUnknown) -> bool:
        self._unreadable()
        return super().committed(unknown)


def _store(tmp_path: Path) -> LostAnswers:
    return LostAnswers(tmp_path / "docs.db")


def _undos(store: Store, doc_id: str) -> int:
    return sum(1 for r in store.edits(doc_id) if r.ops == [{"op": "undo"}])


def test_a_save_that_landed_is_acknowledged_although_the_store_said_it_failed(
    serve: Factory, tmp_path: Path
) -> None:
    store = _store(tmp_path)
    with serve(store=store).websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        s0 = open_doc(c, "one two three")
        s1 = edit(c, s0, {"op": "replace", "start": 3, "end": 3, "text": " and"})
        store.lose = 1
        s2 = edit(c, s1, {"op": "replace", "start": 0, "end": 0, "text": "zero "})
        assert s2["type"] == "doc.state" and s2["v"] == s1["v"] + 1 and s2["text"] == "zero one and two three", s2
        store.lose = 1
        s3 = c.rpc({"type": "history.undo", "doc_id": s0["doc_id"]})
        assert s3["type"] == "doc.state" and s3["v"] == s2["v"] + 1 and s3["text"] == s1["text"], s3
        assert store.load(s0["doc_id"])[0] == s3["v"] and _undos(store, s0["doc_id"]) == 1


def test_a_lost_commit_that_did_not_land_is_refused_and_its_retry_made_once(serve: Factory, tmp_path: Path) -> None:
    store = _store(tmp_path)
    with serve(store=store).websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        s0 = open_doc(c, "one two three")
        store.drop = 1
        refused = edit(c, s0, {"op": "replace", "start": 0, "end": 0, "text": "zero "})
        assert refused["type"] == "error" and refused["code"] == "busy", refused
        assert "outcome" not in (refused.get("data") or {}), refused  # known: not made
        assert store.load(s0["doc_id"])[0] == s0["v"]
        again = edit(c, s0, {"op": "replace", "start": 0, "end": 0, "text": "zero "})
        assert again["type"] == "doc.state" and again["v"] == s0["v"] + 1, again
        assert again["text"] == "zero one two three", again


def test_the_answer_waits_for_the_store_to_tell_the_outcome(serve: Factory, tmp_path: Path) -> None:
    """The store is unreadable for a while after the lost COMMIT: the client's answer waits, then tells the truth."""
    store = _store(tmp_path)
    client = serve(store=store)
    with client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        s0 = open_doc(c, "one two three")
        store.lose, store.blinding = 1, True
        threading.Timer(1.0, lambda: setattr(store, "blind", False)).start()  # the database is back after 1 s
        t = time.monotonic()
        s1 = edit(c, s0, {"op": "replace", "start": 0, "end": 0, "text": "zero "})
        assert time.monotonic() - t >= 0.9
        assert s1["type"] == "doc.state" and s1["v"] == s0["v"] + 1 and s1["text"] == "zero one two three", s1


@pytest.mark.parametrize("request_kind", ["undo", "edit"])
def test_a_retry_after_an_unreadable_store_is_not_made_twice(
    serve: Factory, tmp_path: Path, request_kind: str
) -> None:
    store = _store(tmp_path)
    client = serve(store=store)
    client.app.state.hub.resolve_s = 0.3  # type: ignore[attr-defined]
    with client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        s0 = open_doc(c, "one two three")
        s1 = edit(c, s0, {"op": "replace", "start": 3, "end": 3, "text": " and"})
        s2 = edit(c, s1, {"op": "replace", "start": 17, "end": 17, "text": " four"})
        if request_kind == "undo":
            request: dict[str, Any] = {"type": "history.undo", "doc_id": s0["doc_id"]}
        else:
            request = {"type": "doc.edit", "doc_id": s0["doc_id"], "base_v": s2["v"],
                       "ops": [{"op": "replace", "start": 0, "end": 0, "text": "zero "}]}  # fmt: skip
        store.lose, store.blinding = 1, True
        unknown = c.rpc(request)
        assert unknown["type"] == "error" and unknown["code"] == "busy" and unknown["retryable"], unknown
        assert unknown["data"]["outcome"] == "unknown", unknown  # never "nothing changed" while it cannot be told
        store.blind = False  # the store is back: it holds the change
        saved_v = store.load(s0["doc_id"])[0]
        assert saved_v == s2["v"] + 1
        again = c.rpc(request)
        assert again["type"] == "doc.state" and again["v"] == saved_v, again
        assert store.load(s0["doc_id"])[0] == saved_v
        if request_kind == "undo":
            assert _undos(store, s0["doc_id"]) == 1 and again["text"] == s1["text"]  # " four" undone, once
        else:
            assert again["text"].count("zero") == 1, again
        # The next request is made as usual.
        after = edit(c, again, {"op": "replace", "start": 0, "end": 0, "text": "A "})
        assert after["type"] == "doc.state" and after["v"] == saved_v + 1 and after["text"].startswith("A "), after


def test_a_change_refused_while_the_store_is_unreadable_is_not_kept_in_memory(serve: Factory, tmp_path: Path) -> None:
    """A plain write failure (nothing saved) whose roll-back cannot read the store: the next request (another
    session's read included) sees the store's version, not the refused change."""
    store = _store(tmp_path)
    with serve(store=store).websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        s0 = open_doc(c, "one two three")
        store.blind = True
        refused = edit(c, s0, {"op": "replace", "start": 0, "end": 0, "text": "zero "})
        assert refused["type"] == "error" and refused["code"] == "busy", refused
        store.blind = False
        read = c.rpc({"type": "doc.open", "doc_id": s0["doc_id"]})
        assert read["type"] == "doc.state" and read["v"] == s0["v"] and read["text"] == s0["text"], read
