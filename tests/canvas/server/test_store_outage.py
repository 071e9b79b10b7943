"""A generation that ends while its shared store (PostgreSQL) is down still gets its one `gen.done`, typed: before,
the document's cross-process lock raised psycopg's error out of the run's end and the client was told `failed`
("internal server error"); the scale-out soak (`dcanvas bench soak --ray --db postgresql`) found it. The engine's
`Done` is held back (a wrapper around the real admission) until the database is down, so the run's end meets the
outage every time; after the database is back, the next generation completes and its proposal is stored."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from canvas.engine.backend import Backend
from canvas.engine.types import Done, Event, GenHandle, GenRequest
from canvas.server.admission import Admission, Admitted
from canvas.server.app import create_app
from canvas.server.config import ServerConfig
from canvas.store.pgserver import PgServer, find_bindir
from tests.canvas.wsconn import Conn, edit, open_doc

pytestmark = pytest.mark.timeout(120)
ANSWER_S = 30.0  # every generation is answered within this of its fault's end (issue 47)


class HeldDone:
    """The real admission, with each generation's `Done` held until `release` (its frames pass at once)."""

    def __init__(self, inner: Admission) -> None:
        self.inner = inner
        self.ended = threading.Event()  # a Done is being held
        self._held: list[tuple[Callable[[Event], None], Done]] = []
        self._open = threading.Event()

    async def submit_async(self, request: GenRequest, on_event: Callable[[Event], None] | None, *, owner: Hashable,
                           replacing: GenHandle | None = None, affinity: str | None = None) -> Admitted:
        assert on_event is not None

        def deliver(ev: Event) -> None:  # on the engine's thread
            if isinstance(ev, Done) and not self._open.is_set():
                self._held.append((on_event, ev))
                self.ended.set()
            else:
                on_event(ev)

        return self.inner.submit(request, deliver, owner=owner, replacing=replacing)

    def release(self) -> None:
        self._open.set()
        held, self._held = self._held, []
        for on_event, ev in held:
            on_event(ev)

    async def stats_async(self) -> dict[str, Any]:
        return self.inner.stats()

    async def aclose(self) -> None:
        self.release()


@pytest.fixture
def pg() -> Iterator[PgServer]:
    """A PostgreSQL of this test's own: it is stopped and started again, which the shared one must not be."""
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/run does it)")
    pytest.importorskip("psycopg", reason="the pg extra (psycopg) is not installed")
    server = PgServer(bindir).start()
    try:
        yield server
    finally:
        server.remove()


def _done(c: Conn, gen: str) -> dict[str, Any]:
    return c.until("gen.done", gen=gen)


def test_a_generation_ending_while_postgresql_is_down_is_answered_typed(
    backend: Backend, tmp_path: Path, pg: PgServer
) -> None:
    from canvas.store.pg import PgStore

    url = pg.database()
    store = PgStore(url)
    held = HeldDone(Admission(backend.engine))
    config = ServerConfig(db=":memory:", port=8765, hosts=("testserver",), web_dir=str(tmp_path))
    backend.engine.start()  # with an admission of its own the app starts no engine
    try:
        with TestClient(create_app(config, backend=backend, store=store, admission=held)) as client, \
                client.websocket_connect("/ws") as ws:  # fmt: skip
            c = Conn(ws)
            c.hello()
            state = edit(c, open_doc(c), {"op": "mask", "start": 4, "end": 7})
            params = {"max_steps": 4}
            rid = c.send({"type": "gen.start", "doc_id": state["doc_id"], "base_v": state["v"], "params": params})
            gen = c.reply(rid)["gen"]
            assert held.ended.wait(60), "the engine did not finish the generation"
            pg.halt()
            down = time.monotonic()
            held.release()  # the run ends now, with the database down
            done = _done(c, gen)
            assert time.monotonic() - down < ANSWER_S
            assert done["status"] == "unavailable", done
            assert "store" in done["message"] and done.get("proposal") is None, done

            # An edit meanwhile: a typed, retryable refusal, nothing changed.
            refused = edit(c, state, {"op": "replace", "start": 0, "end": 0, "text": "x"})
            assert refused["type"] == "error" and refused["code"] == "busy" and refused["retryable"], refused
            pg.resume()

            # Back: nothing of the ended run was stored, and the next generation completes with its proposal kept.
            again = _retry_gen(c, state, params)
            assert again["status"] == "completed" and again["proposal"] is not None, again
            reader = PgStore(url)
            try:
                assert reader.proposal(gen) is None and reader.proposal(again["gen"]) is not None
                assert reader.load(state["doc_id"])[0] == state["v"]  # the refused edit is nowhere
            finally:
                reader.close()
    finally:
        backend.engine.stop()
        store.close()


def _retry_gen(c: Conn, state: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """gen.start until the server takes it (the first call after the restart may meet the broken connection)."""
    for _ in range(20):
        rid = c.send({"type": "gen.start", "doc_id": state["doc_id"], "base_v": state["v"], "params": params})
        reply = c.reply(rid)
        if reply["type"] == "gen.accepted":
            return _done(c, reply["gen"])
        assert reply["code"] == "busy" and reply["retryable"], reply
        time.sleep(0.2)
    raise AssertionError("the server kept refusing after the database came back")
