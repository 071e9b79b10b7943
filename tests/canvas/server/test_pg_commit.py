"""The server over a PostgreSQL whose connection is cut around a save (issue 47: the scale-out soak's duplicated
edits and edits "from nowhere" right after `pg_restart_fast` / `pg_restart_immediate`). A client that, like the
soak's writers, retries a `busy` with the same request must never have a change made twice, nor see a version
appear that it was never told of:

- cut after the save's COMMIT, before the document's cross-process lock is released: the save was made, so the
  client is told so (before, the failing unlock turned the reply into `busy`, "nothing changed", and the retry,
  rebased over the change in memory, made it a second time);
- cut at COMMIT after it landed (its answer lost): the server reads the outcome back and acknowledges the change;
- cut at COMMIT before it landed: refused, nothing changed, the retry makes it once;
- the database going down at COMMIT and coming back seconds later: the answer waits for the store to tell."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from canvas.engine.backend import Backend
from canvas.server.app import create_app
from canvas.server.config import ServerConfig
from canvas.store.pgserver import PgServer, find_bindir
from tests.canvas.wsconn import Conn, edit, open_doc

pytestmark = pytest.mark.timeout(120)
psycopg = pytest.importorskip("psycopg", reason="the pg extra (psycopg) is not installed")

from canvas.store.pg import PgStore  # noqa: E402
from tests.canvas.store.test_pg_lost_connection import CutCommit, cut  # noqa: E402


class CutAfterSave(CutCommit):
    """Also cuts its connection right after a save returned (`after_save`), before anything else is asked of it."""

    after_save = False

    def save(self, *args: Any, **kwargs: Any) -> None:
        super().save(*args, **kwargs)
        if self.after_save:
            self.after_save = False
            cut(self.url, self)


def _client(backend: Backend, store: PgStore, tmp_path: Any) -> TestClient:
    config = ServerConfig(db=":memory:", port=8765, hosts=("testserver",), web_dir=str(tmp_path))
    return TestClient(create_app(config, backend=backend, store=store))


def _retry_until_answered(c: Conn, state: dict[str, Any], op: dict[str, Any]) -> list[dict[str, Any]]:
    """The soak writer's way: the same request again while the answer is a retryable `busy`."""
    answers = []
    for _ in range(20):
        answers.append(edit(c, state, op))
        if answers[-1]["type"] != "error" or answers[-1]["code"] != "busy":
            return answers
        time.sleep(0.1)
    return answers


@pytest.mark.parametrize("cut_at", ["after_save", "after_commit", "before_commit"])
def test_a_cut_connection_never_makes_a_change_twice(backend: Backend, tmp_path: Any, pg_url: str,
                                                     cut_at: str) -> None:  # fmt: skip
    store = CutAfterSave(pg_url)
    try:
        with _client(backend, store, tmp_path) as client, client.websocket_connect("/ws") as ws:
            c = Conn(ws)
            c.hello()
            s0 = open_doc(c, "one two three")
            if cut_at == "after_save":
                store.after_save = True
            else:
                store.cut = "after" if cut_at == "after_commit" else "before"
            answers = _retry_until_answered(c, s0, {"op": "replace", "start": 0, "end": 0, "text": "#m1# "})
            last = answers[-1]
            assert last["type"] == "doc.state" and last["v"] == s0["v"] + 1, answers
            assert last["text"].count("#m1#") == 1, answers
            refused = answers[:-1]
            if cut_at == "before_commit":  # refused once as not made (truthfully), then made by the retry
                assert len(refused) == 1 and "outcome" not in (refused[0].get("data") or {}), answers
            else:  # made: told so at once
                assert not refused, answers
            reader = PgStore(pg_url)
            try:
                assert reader.load(s0["doc_id"])[0] == s0["v"] + 1
                assert [e.v for e in reader.edits(s0["doc_id"])] == [s0["v"] + 1]
            finally:
                reader.close()
            after = edit(c, last, {"op": "replace", "start": 0, "end": 0, "text": "A "})  # the next one as usual
            assert after["type"] == "doc.state" and after["v"] == last["v"] + 1, after
    finally:
        store.close()


@pytest.fixture
def pg() -> Iterator[PgServer]:
    """A PostgreSQL of this test's own: it is stopped and started again, which the shared one must not be."""
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/run does it)")
    server = PgServer(bindir).start()
    try:
        yield server
    finally:
        server.remove()


class DownAtCommit(PgStore):
    """Commits, then the database goes down (a fast stop) before the answer is read; `pg.resume()` brings it back."""

    def __init__(self, url: str, pg: PgServer) -> None:
        super().__init__(url)
        self.pg = pg
        self.down = False

    def _commit(self, db: Any) -> None:
        super()._commit(db)
        if self.down:
            self.down = False
            self.pg.halt()
            db.execute("SELECT 1")  # the connection was ended by the stop


def test_the_answer_waits_for_a_database_that_comes_back(backend: Backend, tmp_path: Any, pg: PgServer) -> None:
    url = pg.database()
    store = DownAtCommit(url, pg)
    try:
        with _client(backend, store, tmp_path) as client, client.websocket_connect("/ws") as ws:
            c = Conn(ws)
            c.hello()
            s0 = open_doc(c, "one two three")
            store.down = True
            back = threading.Timer(2.0, pg.resume)
            back.start()
            t = time.monotonic()
            s1 = edit(c, s0, {"op": "replace", "start": 0, "end": 0, "text": "#m1# "})
            back.join()
            assert time.monotonic() - t >= 1.5  # the answer waited for the database
            assert s1["type"] == "doc.state" and s1["v"] == s0["v"] + 1, s1
            assert s1["text"].count("#m1#") == 1
            assert [e.v for e in store.edits(s0["doc_id"])] == [s0["v"] + 1]
    finally:
        store.close()
