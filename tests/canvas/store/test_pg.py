"""PostgreSQL for several server processes: the store's cross-process parts (stamps, advisory locks, notifications)
and servers sharing documents through it (two hubs in this process, each with its own connection, as two ingress
replicas would be; and two `dcanvas serve` processes). The data methods are tested for both stores in
test_store.py. Needs Debian's `postgresql` (installed by .ci/run) and the `pg` extra."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.store import open_store
from canvas.store.base import StoreError
from tests.canvas.wsconn import SLOW, TEXT, Conn, Factory, served
from tests.canvas.wsconn import edit as _edit
from tests.canvas.wsconn import open_doc as _open

pytestmark = pytest.mark.timeout(120)
psycopg = pytest.importorskip("psycopg", reason="the pg extra (psycopg) is not installed")

from canvas.store.pg import PgStore  # noqa: E402


def _state(text: str, v: int = 0) -> dict[str, Any]:
    return {"text": text, "v": v}


def _wait(cond: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


# -- the store's cross-process parts ---------------------------------------------------------------------------


def test_stamps_tell_a_process_what_another_wrote(pg_url: str) -> None:
    with PgStore(pg_url) as a, PgStore(pg_url) as b:
        a.save("d", 0, _state("x"))
        b.load("d")
        assert not b.changed("d") and not a.changed("d")  # each has seen the latest
        a.save("d", 1, _state("xy"), [{"op": "r"}])
        assert b.changed("d") and not a.changed("d")
        b.load("d")
        assert not b.changed("d")
        a.add_proposal("d", "g-1", "s", {}, 0, 1)  # proposals count as writes: another server must reload them
        assert b.changed("d")
        b.load("d")
        a.resolve_proposal("d", "g-1", "rejected")
        assert b.changed("d")
        b.load("d")
        a.delete("d")
        assert b.changed("d")  # gone counts as changed


def test_a_document_lock_is_held_by_one_process_at_a_time(pg_url: str) -> None:
    with PgStore(pg_url) as a, PgStore(pg_url) as b:
        assert a.try_lock("d")
        assert not b.try_lock("d")
        assert b.try_lock("other")  # locks are per document
        a.unlock("d")
        assert b.try_lock("d")
        b.close()  # a process that dies (its connection closes) releases what it held (once its backend exits)
        assert _wait(lambda: a.try_lock("d"))


def test_notifications_reach_other_processes_not_the_writer(pg_url: str) -> None:
    with PgStore(pg_url) as a, PgStore(pg_url) as b:
        heard_a: list[str] = []
        heard_b: list[str] = []
        a.listen(heard_a.append)
        b.listen(heard_b.append)
        time.sleep(0.3)  # the listeners connect
        a.save("d1", 0, _state("x"))
        a.save("d1", 1, _state("y"), [])
        b.save("d2", 0, _state("z"))
        assert _wait(lambda: heard_b == ["d1", "d1"] and heard_a == ["d2"]), (heard_a, heard_b)


def test_versions_stay_monotonic_under_concurrent_saves(pg_url: str) -> None:
    """Two processes racing to save the same next version: exactly one wins, the other gets VersionRegression."""
    from canvas.store.base import VersionRegression

    with PgStore(pg_url) as a, PgStore(pg_url) as b:
        a.save("d", 0, _state(""))
        outcomes: list[str] = []

        def race(store: PgStore, tag: str) -> None:
            for v in range(1, 41):
                try:
                    store.save("d", v, _state(f"{tag}{v}"), [tag])
                    outcomes.append(tag)
                except VersionRegression:
                    pass

        threads = [threading.Thread(target=race, args=(s, t)) for s, t in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [e.v for e in a.edits("d")] == list(range(1, 41))  # one edit per version, none lost or doubled
        assert len(outcomes) == 40


def test_a_bad_url_is_a_clear_error() -> None:
    with pytest.raises(StoreError, match=r"cannot connect to postgresql://nobody:\*\*\*@127.0.0.1:1/x"):
        open_store("postgresql://nobody:secret@127.0.0.1:1/x")


# -- two servers sharing documents -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Backend:
    return load_backend(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model")), max_batch=4)


@pytest.fixture
def two(backend: Backend, tmp_path: Path, pg_url: str) -> Iterator[tuple[Factory, str]]:
    stores: list[PgStore] = []

    with served(backend, tmp_path) as make:

        def server(**kw: Any) -> Any:
            store = PgStore(pg_url)
            stores.append(store)
            return make(store=store, **kw)

        yield server, pg_url
    for s in stores:
        s.close()


@contextmanager
def _a_client_on_each(make: Factory) -> Iterator[tuple[Conn, Conn, dict[str, Any]]]:
    """Two servers, a greeted client on each, and a document opened through the first: (its client, the other's,
    the document's state)."""
    a, b = make(), make()
    with a.websocket_connect("/ws") as wa, b.websocket_connect("/ws") as wb:
        ca, cb = Conn(wa), Conn(wb)
        ca.hello()
        cb.hello()
        yield ca, cb, _open(ca)


def test_two_servers_serve_one_document(two: tuple[Factory, str]) -> None:
    make, url = two
    with _a_client_on_each(make) as (ca, cb, s0):
        doc = s0["doc_id"]
        sb = cb.rpc({"type": "doc.open", "doc_id": doc})
        assert (sb["text"], sb["v"]) == (s0["text"], s0["v"])
        # An edit through A reaches B's client without B asking (NOTIFY), and B's copy is up to date.
        s1 = _edit(ca, s0, {"op": "replace", "start": 0, "end": 3, "text": "A"})
        pushed = cb.until("doc.state", v=s1["v"])
        assert pushed["text"] == s1["text"] == "A" + TEXT[3:]
        # An edit through B against the version before A's is rebased over it, exactly as on one server.
        s2 = _edit(cb, sb, {"op": "replace", "start": len(TEXT) - 1, "end": len(TEXT), "text": "!"})
        assert (s2["v"], s2["text"]) == (s1["v"] + 1, "A" + TEXT[3:-1] + "!")
        assert ca.until("doc.state", v=s2["v"])["text"] == s2["text"]
        # One that overlaps A's change is refused as stale, with the current version.
        err = _edit(cb, sb, {"op": "replace", "start": 1, "end": 2, "text": "x"})
        assert (err["code"], err["data"]["current_v"]) == ("stale_version", s2["v"])
        # Undo through A undoes the last change, made through B: the history is the document's, not a server's.
        s3 = ca.rpc({"type": "history.undo", "doc_id": doc})
        assert s3["text"] == s1["text"] and s3["v"] == s2["v"] + 1
        # Deleting through B tells A's client.
        assert cb.rpc({"type": "doc.delete", "doc_id": doc})["type"] == "doc.deleted"
        assert ca.until("doc.deleted", doc_id=doc)
        assert ca.rpc({"type": "doc.open", "doc_id": doc})["code"] == "not_found"
    with PgStore(url) as check:
        assert not check.exists(doc)


def test_concurrent_edits_through_two_servers_are_serialised(two: tuple[Factory, str]) -> None:
    """Four clients, two on each server, insert markers into one document at once (retrying when refused as stale):
    every acknowledged edit is in the final text once, and the edit log has one entry per version, none skipped."""
    make, url = two
    servers = [make(), make()]
    with servers[0].websocket_connect("/ws") as w:
        c = Conn(w)
        c.hello()
        doc = _open(c, "|")["doc_id"]
    per_client, errors = 6, []
    acked: dict[str, list[int]] = {}

    def writer(k: int) -> None:
        try:
            with servers[k % 2].websocket_connect("/ws") as ws:
                conn = Conn(ws)
                conn.hello()
                state = conn.rpc({"type": "doc.open", "doc_id": doc})
                versions = acked.setdefault(f"c{k}", [])
                for i in range(per_client):
                    while True:
                        end = len(state["text"])
                        reply = _edit(conn, state, {"op": "replace", "start": end, "end": end, "text": f"<{k}.{i}>"})
                        if reply["type"] == "doc.state":
                            versions.append(reply["v"])
                            state = reply
                            break
                        assert reply["code"] == "stale_version", reply
                        state = conn.rpc({"type": "doc.open", "doc_id": doc})  # read the latest and try again
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    with PgStore(url) as check:
        v, _ = check.load(doc)
        log = [e.v for e in check.edits(doc)]
    assert v == 4 * per_client and log == list(range(1, v + 1))
    for server in servers:  # both read the same final text
        with server.websocket_connect("/ws") as w:
            c = Conn(w)
            c.hello()
            final = c.rpc({"type": "doc.open", "doc_id": doc})
        assert final["v"] == v
        for k in range(4):
            for i in range(per_client):
                assert final["text"].count(f"<{k}.{i}>") == 1
        assert acked[f"c{k}"] == sorted(acked[f"c{k}"])


def test_a_generation_moves_over_an_edit_made_through_the_other_server(two: tuple[Factory, str]) -> None:
    with _a_client_on_each(two[0]) as (ca, cb, s0):
        doc, tail = s0["doc_id"], TEXT.index("warm")
        s1 = _edit(ca, s0, {"op": "mask", "start": tail, "end": tail + 4})
        sb = cb.rpc({"type": "doc.open", "doc_id": doc})
        rid = ca.send({"type": "gen.start", "doc_id": doc, "base_v": s1["v"], "params": {**SLOW, "seed": 1}})
        gen = ca.reply(rid)["gen"]
        # Through B, before the masked words: the generation's region moves by the three characters added.
        s2 = _edit(cb, sb, {"op": "replace", "start": 0, "end": 0, "text": "So "})
        assert s2["v"] == s1["v"] + 1
        done = ca.until("gen.done", gen=gen)
        assert done["status"] == "completed", done
        p = done["proposal"]
        [masked] = [sp for sp in s1["spans"] if sp["kind"] == "free"]  # the mask, widened to whole tokens
        assert (p["start"], p["end"]) == (masked["start"] + 3, masked["end"] + 3)
        accepted = ca.rpc({"type": "proposal.accept", "gen": gen, "base_v": p["base_v"]})
        assert accepted["type"] == "doc.state" and accepted["text"].startswith("So The cat")
        # A generation whose region an edit through B overlaps stops as stale.
        s3 = ca.rpc({"type": "doc.open", "doc_id": doc})
        s4 = _edit(ca, s3, {"op": "mask", "start": 3, "end": 6})
        rid = ca.send({"type": "gen.start", "doc_id": doc, "base_v": s4["v"], "params": {**SLOW, "seed": 2}})
        gen = ca.reply(rid)["gen"]
        sb = cb.rpc({"type": "doc.open", "doc_id": doc})
        _edit(cb, sb, {"op": "replace", "start": 4, "end": 5, "text": "k"})
        assert ca.until("gen.done", gen=gen)["status"] == "stale"


# -- two server processes (each starts in ~3 s with the tiny model) --------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(model: Path, url: str) -> tuple[subprocess.Popen[str], int]:
    port = _free_port()
    cmd = [sys.executable, "-m", "canvas.cli", "serve", "--port", str(port), "--model", str(model), "--db", url,
           "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), port


@pytest.mark.timeout(240)
def test_two_server_processes_edit_one_document(tmp_path: Path, pg_url: str) -> None:
    from canvas.protocol import ProtocolError, ReplaceOp
    from canvas.protocol.client import DcanvasClient

    model = write_tiny_checkpoint(tmp_path / "model")
    procs = [_serve(model, pg_url) for _ in range(2)]
    try:

        async def main() -> tuple[str, list[list[int]]]:  # (the final text, each writer's acknowledged versions)
            async def connect(port: int) -> DcanvasClient:
                deadline = time.monotonic() + 120
                while True:
                    try:
                        return await DcanvasClient.connect(f"ws://127.0.0.1:{port}/ws")
                    except OSError:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.3)

            clients = [await connect(port) for _, port in procs for _ in range(2)]
            doc = (await clients[0].open(text="|")).doc_id

            async def writer(k: int) -> list[int]:
                c, versions = clients[k], []
                state = await c.open(doc)
                for i in range(8):
                    while True:
                        end = len(state.text)
                        try:
                            state = await c.edit(doc, state.v, [ReplaceOp(start=end, end=end, text=f"<{k}.{i}>")])
                            versions.append(state.v)
                            break
                        except ProtocolError as e:
                            assert e.code == "stale_version", e
                            state = await c.open(doc)
                return versions

            acked = await asyncio.gather(*(writer(k) for k in range(4)))
            texts = [(await c.open(doc)).text for c in (clients[0], clients[-1])]  # one client on each server
            for c in clients:
                await c.close()
            assert texts[0] == texts[1]
            return texts[0], list(acked)

        text, acked = asyncio.run(main())
        with PgStore(pg_url) as check:
            [record] = check.list_docs()
            assert [e.v for e in check.edits(record.doc_id)] == list(range(1, 33)) and record.v == 32
        for k, versions in enumerate(acked):
            assert versions == sorted(versions) and len(versions) == 8
            for i in range(8):
                assert text.count(f"<{k}.{i}>") == 1
    finally:
        for proc, _ in procs:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
            if proc.stdout is not None:
                proc.stdout.close()
