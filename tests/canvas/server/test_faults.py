"""A store that cannot write (an I/O error, a full disk) costs the client a retryable `busy` and nothing else: the
refused change is nowhere (not in memory, not in the store), a retry applies it once, and a generation whose
proposal cannot be stored ends `unavailable`. Found by `dcanvas bench soak`: before, the change stayed in memory
after a failed save (`internal`), so a client that retried applied it twice. Also the fault-injecting store itself
(`canvas.server.faults`) and the event-loop lag gauge on /health (`canvas.server.lag`)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from canvas.env import STORE_FAULTS
from canvas.server.faults import FaultySharedStore, FaultyStore, from_env, write_control
from canvas.server.lag import LagConfig, LoopLag
from canvas.server.persist import write_failed
from canvas.store.base import SharedStore
from canvas.store.sqlite import Store
from tests.canvas.wsconn import SLOW, TEXT, Conn, Factory, edit, generate, open_doc

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[tuple[FaultyStore, Path]]:
    control = tmp_path / "faults.json"
    store = FaultyStore(Store(tmp_path / "docs.db"), control)
    yield store, control
    store.close()


def _busy_unavailable(reply: dict[str, Any]) -> None:
    assert reply["type"] == "error", reply
    assert reply["code"] == "busy" and reply["retryable"] is True, reply
    assert reply["data"]["unavailable"] and reply["data"]["retry_after_s"] > 0, reply


# -- the fault-injecting store ------------------------------------------------------------------------------------


def test_faulty_store_fails_writes_as_told_and_keeps_reads(faulty: tuple[FaultyStore, Path]) -> None:
    store, control = faulty
    store.save("d", 0, {"text": "a"})
    write_control(control, "error", p=1.0)
    with pytest.raises(sqlite3.OperationalError, match="I/O"):
        store.save("d", 1, {"text": "ab"}, [{"op": "x"}])
    with pytest.raises(sqlite3.OperationalError):
        store.resolve_proposal("d", "g", "rejected")
    assert store.load("d") == (0, {"text": "a"}) and store.edits("d") == []  # reads go through, nothing written
    assert store.injected == 2
    write_control(control, "off")
    store.save("d", 1, {"text": "ab"}, [{"op": "x"}])
    assert store.load("d")[0] == 1


def test_faulty_store_error_rate_follows_its_seed(faulty: tuple[FaultyStore, Path]) -> None:
    store, control = faulty
    store.save("d", 0, {"text": ""})
    write_control(control, "error", p=0.5, seed=3)
    failed = []
    for v in range(1, 41):
        try:
            store.save("d", v, {"text": str(v)}, [v])
            failed.append(False)
        except sqlite3.OperationalError:
            failed.append(True)
    assert 5 < sum(failed) < 35 and store.injected == sum(failed)


def test_a_full_disk_is_sqlite_refusing_to_grow_the_file(faulty: tuple[FaultyStore, Path]) -> None:
    store, control = faulty
    store.save("d", 0, {"text": "a"})
    write_control(control, "full")
    big = {"text": "x" * 200_000}  # needs new pages
    with pytest.raises(sqlite3.OperationalError, match="full"):
        store.save("d", 1, big, [1])
    assert store.load("d") == (0, {"text": "a"})
    assert store.injected == 0  # SQLite refused it, not the wrapper
    write_control(control, "off")
    store.save("d", 1, big, [1])
    assert store.load("d")[0] == 1


def test_from_env_wraps_only_when_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    inner = Store(":memory:")
    monkeypatch.delenv(STORE_FAULTS.name, raising=False)
    assert from_env(inner) is inner
    monkeypatch.setenv(STORE_FAULTS.name, str(tmp_path / "c.json"))
    wrapped = from_env(inner)
    assert isinstance(wrapped, FaultyStore) and wrapped.inner is inner
    with pytest.raises(ValueError, match="p must be"):
        write_control(tmp_path / "c.json", "error", p=2.0)
    inner.close()


def test_a_postgresql_store_keeps_its_locks_and_fails_as_psycopg(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pg_url: str
) -> None:
    """A shared store is wrapped too (before, `from_env` refused it, so no soak could run on PostgreSQL): its
    cross-process lock still works through the wrapper, and its injected faults are psycopg's store errors (which
    the server answers with a retryable `busy`), the refused write nowhere."""
    from psycopg import errors

    from canvas.store.pg import PgStore

    control = tmp_path / "c.json"
    monkeypatch.setenv(STORE_FAULTS.name, str(control))
    other = PgStore(pg_url)
    store = from_env(PgStore(pg_url))
    try:
        assert isinstance(store, FaultySharedStore) and isinstance(store, SharedStore)
        store.save("d", 0, {"text": "a"})
        assert store.try_lock("d") and not other.try_lock("d")  # the lock is the inner store's own
        store.unlock("d")
        assert other.try_lock("d")
        other.unlock("d")
        for mode, error in (("error", errors.IoError), ("full", errors.DiskFull)):
            write_control(control, mode, p=1.0)
            with pytest.raises(error) as caught:
                store.save("d", 1, {"text": "ab"}, [{"op": "x"}])
            assert write_failed(caught.value)
            assert store.load("d") == (0, {"text": "a"}) and store.edits("d") == []
        assert store.injected == 2
        write_control(control, "off")
        store.save("d", 1, {"text": "ab"}, [{"op": "x"}])
        assert other.load("d")[0] == 1
    finally:
        store.close()
        other.close()


# -- the server: a refused write changes nothing ------------------------------------------------------------------


def test_an_edit_the_store_refuses_is_busy_and_a_retry_applies_it_once(
    serve: Factory, faulty: tuple[FaultyStore, Path]
) -> None:
    store, control = faulty
    client = serve(store=store)
    with client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        doc = open_doc(c)
        insert = {"op": "replace", "start": 0, "end": 0, "text": "[once] "}
        write_control(control, "error", p=1.0)
        _busy_unavailable(edit(c, doc, insert))
        _busy_unavailable(c.rpc({"type": "doc.edit", "doc_id": doc["doc_id"], "base_v": doc["v"],
                                 "ops": [{"op": "mask", "start": 4, "end": 7}]}))  # fmt: skip
        again = c.rpc({"type": "doc.open", "doc_id": doc["doc_id"]})
        assert (again["v"], again["text"], again["spans"]) == (doc["v"], doc["text"], doc["spans"])
        write_control(control, "off")
        after = edit(c, doc, insert)
        assert after["type"] == "doc.state" and after["v"] == doc["v"] + 1
        assert after["text"].count("[once]") == 1
        # undo refused by a full store: can_undo / can_redo and the text stay as they were
        write_control(control, "error", p=1.0)
        _busy_unavailable(c.rpc({"type": "history.undo", "doc_id": doc["doc_id"]}))
        write_control(control, "off")
        undone = c.rpc({"type": "history.undo", "doc_id": doc["doc_id"]})
        assert undone["text"] == TEXT and undone["v"] == after["v"] + 1 and undone["can_redo"] is True
    versions = [e.v for e in store.edits(doc["doc_id"])]
    assert versions == list(range(1, undone["v"] + 1))  # each acknowledged change logged once, none refused
    assert store.info(doc["doc_id"]).v == undone["v"] and store.info(doc["doc_id"]).chars == len(TEXT)


def test_an_accept_the_store_refuses_leaves_the_proposal_pending(
    serve: Factory, faulty: tuple[FaultyStore, Path]
) -> None:
    store, control = faulty
    client = serve(store=store)
    with client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        doc = edit(c, open_doc(c), {"op": "mask", "start": 4, "end": 7})
        _, _, done = generate(c, doc, max_steps=8, seed=1)
        assert done["status"] == "completed", done
        write_control(control, "error", p=1.0)
        _busy_unavailable(c.rpc({"type": "proposal.accept", "gen": done["gen"], "base_v": doc["v"]}))
        assert store.proposal(done["gen"]).outcome is None  # type: ignore[union-attr]
        write_control(control, "off")
        accepted = c.rpc({"type": "proposal.accept", "gen": done["gen"], "base_v": doc["v"]})
        assert accepted["type"] == "doc.state" and accepted["v"] == doc["v"] + 1, accepted
        twice = c.rpc({"type": "proposal.accept", "gen": done["gen"], "base_v": accepted["v"]})
        assert twice["code"] == "conflict" and "accepted" in twice["message"]
    assert store.proposal(done["gen"]).outcome == "accepted"  # type: ignore[union-attr]
    assert [e.v for e in store.edits(doc["doc_id"])] == [1, 2]


def test_a_proposal_the_store_cannot_keep_ends_unavailable(serve: Factory, faulty: tuple[FaultyStore, Path]) -> None:
    store, control = faulty
    client = serve(store=store)
    with client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        doc = edit(c, open_doc(c), {"op": "mask", "start": 4, "end": 7})
        write_control(control, "error", p=1.0)
        _, _, done = generate(c, doc, max_steps=8, seed=1)
        assert done["status"] == "unavailable" and "store" in done["message"], done
        assert "proposal" not in done or done["proposal"] is None
        write_control(control, "off")
        _, _, done = generate(c, doc, max_steps=8, seed=1)  # the same version: retryable as it is
        assert done["status"] == "completed"
    assert store.proposal(done["gen"]) is not None


def test_a_refused_change_stops_the_generation_it_would_have_moved(
    serve: Factory, faulty: tuple[FaultyStore, Path]
) -> None:
    store, control = faulty
    client = serve(store=store)
    with client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        doc = edit(c, open_doc(c), {"op": "mask", "start": 4, "end": 7})
        rid = c.send({"type": "gen.start", "doc_id": doc["doc_id"], "base_v": doc["v"], "params": SLOW})
        started = c.reply(rid)
        assert started["type"] == "gen.accepted", started
        write_control(control, "error", p=1.0)
        # Disjoint from the region being generated: saved, it would move the generation; refused, it stops it.
        _busy_unavailable(edit(c, doc, {"op": "replace", "start": 0, "end": 0, "text": ">> "}))
        done = c.until("gen.done", gen=started["gen"])
        assert done["status"] == "unavailable" and "store" in done["message"], done
        write_control(control, "off")
        again = c.rpc({"type": "doc.open", "doc_id": doc["doc_id"]})
        assert (again["v"], again["text"], again["spans"]) == (doc["v"], doc["text"], doc["spans"])
        _, _, retry = generate(c, doc, max_steps=8, seed=2)  # the same version generates again
        assert retry["status"] == "completed", retry


# -- the event loop's lag -----------------------------------------------------------------------------------------


def test_loop_lag_reports_a_blocked_loop() -> None:
    lag = LoopLag(LagConfig(interval_s=0.01, window_s=1.0))
    assert lag.stats()["p99"] is None

    async def main() -> None:
        task = asyncio.create_task(lag.run())
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # blocks the loop
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(main())
    stats = lag.stats()
    assert stats["max"] is not None and stats["max"] >= 150, stats
    assert stats["max_ever"] == stats["max"] and 0 < stats["samples"] <= 100  # type: ignore[operator]
    with pytest.raises(ValueError):
        LagConfig(interval_s=0)


def test_health_shows_the_loop_lag(serve: Factory) -> None:
    client = serve()
    deadline = time.monotonic() + 5
    while True:
        lag = client.get("/health").json()["loop_lag_ms"]
        if lag["samples"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert lag["samples"] > 0 and lag["p99"] >= 0 and lag["window_s"] == 60.0
