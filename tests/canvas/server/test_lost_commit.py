"""A save whose COMMIT landed although the store reported a failure (the connection lost during COMMIT: PostgreSQL
restarting) is acknowledged as made, never refused as "nothing changed, retry": a client that retried an undo would
have had it made twice (an undo carries no base version to rebase by). When the store cannot even be read right
after, the client is told to retry, and the session's retry of the same request is acknowledged, not made again."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from canvas.store.sqlite import Store
from tests.canvas.wsconn import Conn, Factory, edit, open_doc

pytestmark = pytest.mark.timeout(120)


class LostAnswers(Store):
    """Saves, then says it failed (`lose` times); with `blind`, it also cannot be read until `blind` is cleared."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.lose = 0
        self.blind = False
        self.blinding = False  # each lost answer also blinds the store

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.blind:
            raise sqlite3.OperationalError("unable to open database file")
        super().save(*args, **kwargs)
        if self.lose:
            self.lose -= 1
            self.blind = self.blinding
            raise sqlite3.OperationalError("disk I/O error (the commit's answer was lost)")

    def edits(self, doc_id: str, since_v: int = 0) -> Any:
        if self.blind:
            raise sqlite3.OperationalError("unable to open database file")
        return super().edits(doc_id, since_v)

    def load(self, doc_id: str) -> Any:
        if self.blind:
            raise sqlite3.OperationalError("unable to open database file")
        return super().load(doc_id)


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


@pytest.mark.parametrize("request_kind", ["undo", "edit"])
def test_a_retry_after_an_unreadable_store_is_not_made_twice(
    serve: Factory, tmp_path: Path, request_kind: str
) -> None:
    store = _store(tmp_path)
    with serve(store=store).websocket_connect("/ws") as ws:
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
        refused = c.rpc(request)
        assert refused["type"] == "error" and refused["code"] == "busy" and refused["retryable"], refused
        store.blind = False  # the store is back: it holds the change the client was told to retry
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
