"""The dcanvas/1 server through Starlette's TestClient, with a real tiny model: every message type, versions and
rebasing, broadcasts, generations (progress, cancel, supersede, stale), proposals, persistence, and hostile input.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from canvas.engine.backend import Backend
from canvas.protocol import ServerLimits
from canvas.sampling.modes import LABELS
from canvas.sampling.sampler import SamplerConfig
from canvas.server.app import create_app
from canvas.server.config import ServerConfig
from canvas.store.sqlite import Store
from tests.canvas.wsconn import TEXT, Conn, Factory
from tests.canvas.wsconn import edit as _edit
from tests.canvas.wsconn import generate as _generate
from tests.canvas.wsconn import open_doc as _open

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def conn(serve: Factory) -> Iterator[Conn]:
    client = serve()
    with client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        assert c.rpc({"type": "hello", "protocol": "dcanvas/1"})["type"] == "welcome"
        yield c


# -- handshake -------------------------------------------------------------------------------------------------


def test_hello_welcome_and_handshake_rules(serve: Factory, backend: Backend) -> None:
    client = serve()
    with client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        early = c.rpc({"type": "doc.list"})
        assert (early["type"], early["code"]) == ("error", "unauthorized")
        welcome = c.rpc({"type": "hello", "protocol": "dcanvas/1", "client": {"name": "pytest"}})
        assert welcome["protocol"] == "dcanvas/1" and welcome["session"].startswith("s-")
        defaults = {"max_steps": 48, "entropy_bound": 0.1, "t_max": 0.8, "t_min": 0.4}
        assert welcome["model"] == {"name": backend.name, "canvas_length": 32, "modes": ["diffusion", "ar"],
                                    "defaults": defaults,
                                    "default_modes": {"infill": "diffusion", "continuation": "diffusion"},
                                    "labels": LABELS}  # fmt: skip
        assert welcome["limits"] == dataclasses.asdict(ServerLimits())
        assert c.rpc({"type": "hello", "protocol": "dcanvas/1"})["code"] == "conflict"
        assert c.rpc({"type": "ping"})["type"] == "pong"
    with client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        err = c.rpc({"type": "hello", "protocol": "dcanvas/2"})
        assert err["code"] == "unsupported_protocol"
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_json()
        assert info.value.code == 4409


def test_token_is_checked_at_hello(serve: Factory) -> None:
    client = serve(token="correct-horse-battery")
    for token in (None, "wrong-token-wrong-token"):
        with client.websocket_connect("/ws") as ws:
            c = Conn(ws)
            hello: dict[str, Any] = {"type": "hello", "protocol": "dcanvas/1"}
            err = c.rpc(hello if token is None else {**hello, "token": token})
            assert (err["code"], err["retryable"]) == ("unauthorized", False)
            with pytest.raises(WebSocketDisconnect) as info:
                ws.receive_json()
            assert info.value.code == 1008
    with client.websocket_connect("/ws", subprotocols=["dcanvas.v1"]) as ws:
        assert ws.accepted_subprotocol == "dcanvas.v1"
        c = Conn(ws)
        assert c.rpc({"type": "hello", "protocol": "dcanvas/1", "token": "correct-horse-battery"})["type"] == "welcome"


def test_origin_allow_list_is_checked_before_accept(serve: Factory) -> None:
    client = serve(origins=("https://editor.example",))
    for bad in ("https://evil.example", "null", "http://127.0.0.1:9999"):
        with pytest.raises(WebSocketDisconnect):
            with client.websocket_connect("/ws", headers={"origin": bad}):
                pass
    for good in ("http://127.0.0.1:8765", "http://localhost:8765", "https://editor.example"):
        with client.websocket_connect("/ws", headers={"origin": good}) as ws:
            assert Conn(ws).rpc({"type": "hello", "protocol": "dcanvas/1"})["type"] == "welcome"


def test_session_limit(serve: Factory) -> None:
    client = serve(limits=ServerLimits(max_sessions=2))
    with client.websocket_connect("/ws") as a, client.websocket_connect("/ws") as b:
        for ws in (a, b):
            assert Conn(ws).rpc({"type": "hello", "protocol": "dcanvas/1"})["type"] == "welcome"
        with pytest.raises(WebSocketDisconnect):
            with client.websocket_connect("/ws"):
                pass
    deadline = time.monotonic() + 10
    while client.get("/health").json()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.01)  # the server notices the closes asynchronously
    with client.websocket_connect("/ws") as ws:  # a place is free again
        assert Conn(ws).rpc({"type": "ping"})["code"] == "unauthorized"


# -- documents -------------------------------------------------------------------------------------------------


def test_open_state_list_close(conn: Conn) -> None:
    state = _open(conn)
    assert state["text"] == TEXT and state["v"] == 0 and state["name"] == "t"
    assert state["window"] == {"start": 0, "end": len(TEXT)}
    assert state["spans"][0]["kind"] == "pinned" and state["can_undo"] is False
    again = conn.rpc({"type": "doc.open", "doc_id": state["doc_id"]})
    assert again["text"] == TEXT and again["v"] == 0
    empty = conn.rpc({"type": "doc.open"})
    assert empty["text"] == "" and [s["kind"] for s in empty["spans"]] == ["free"]  # all free: continue from nothing
    listing = conn.rpc({"type": "doc.list"})
    assert {d["doc_id"] for d in listing["docs"]} == {state["doc_id"], empty["doc_id"]}
    assert {d["doc_id"]: d["chars"] for d in listing["docs"]} == {state["doc_id"]: len(TEXT), empty["doc_id"]: 0}
    assert conn.rpc({"type": "doc.close", "doc_id": state["doc_id"]})["type"] == "ack"
    missing = conn.rpc({"type": "doc.open", "doc_id": "nope"})
    assert (missing["code"], missing["retryable"]) == ("not_found", False)


def test_every_edit_op(conn: Conn) -> None:
    s = _open(conn)
    s = _edit(conn, s, {"op": "mask", "start": 4, "end": 7})
    assert s["v"] == 1 and any(sp["kind"] == "free" for sp in s["spans"])
    s = _edit(conn, s, {"op": "unmask", "start": 4, "end": 7})
    assert [sp["kind"] for sp in s["spans"]][0] == "pinned"
    s = _edit(conn, s, {"op": "unpin", "start": 8, "end": 11}, {"op": "pin", "start": 8, "end": 11})
    s = _edit(conn, s, {"op": "insert_gap", "at": 24, "n_tokens": 3})
    gap = [sp for sp in s["spans"] if sp["start"] == sp["end"] and sp["kind"] == "free"]
    assert gap and gap[0]["slots"] == 3
    s = _edit(conn, s, {"op": "replace", "start": 0, "end": 3, "text": "A"})
    assert s["text"] == "A" + TEXT[3:]
    s = _edit(conn, s, {"op": "move_window", "start": 0})
    assert s["can_undo"] is True
    v = s["v"]
    undone = conn.rpc({"type": "history.undo", "doc_id": s["doc_id"]})
    assert undone["text"] == TEXT and undone["v"] == v + 1 and undone["can_redo"] is True
    redone = conn.rpc({"type": "history.redo", "doc_id": s["doc_id"]})
    assert redone["text"] == "A" + TEXT[3:] and redone["v"] == v + 2


def test_bad_edits_are_typed_and_change_nothing(conn: Conn) -> None:
    s = _open(conn)
    cases = [
        ({"op": "mask", "start": 0, "end": 999}, "invalid_params"),  # past the end of the text
        ({"op": "mask", "start": 3, "end": 3}, "invalid_params"),  # empty mask
        ({"op": "insert_gap", "at": 0, "n_tokens": 100}, "too_large"),  # more slots than the canvas has
        ({"op": "mask", "start": 2, "end": 1}, "invalid_params"),  # caught by the parser
    ]
    for op, code in cases:
        err = _edit(conn, s, op)
        assert err["type"] == "error" and err["code"] == code, (op, err)
    # all-or-nothing: a good op followed by a bad one applies neither
    err = _edit(conn, s, {"op": "replace", "start": 0, "end": 3, "text": "X"}, {"op": "mask", "start": 0, "end": 999})
    assert err["type"] == "error"
    assert conn.rpc({"type": "doc.open", "doc_id": s["doc_id"]})["text"] == TEXT
    assert conn.rpc({"type": "history.undo", "doc_id": s["doc_id"]})["code"] == "conflict"  # nothing to undo
    future = _edit(conn, s, {"op": "pin", "start": 0, "end": 1}, base_v=5)
    assert future["code"] == "invalid_params" and "newer" in future["message"]


def test_old_versions_are_rebased_or_refused(conn: Conn) -> None:
    s0 = _open(conn)
    s1 = _edit(conn, s0, {"op": "replace", "start": 0, "end": 0, "text": ">> "})  # someone typed at the start
    # An edit made against v0 at the end of the text is moved by 3 characters.
    s2 = _edit(conn, s0, {"op": "replace", "start": len(TEXT) - 1, "end": len(TEXT), "text": "!"})
    assert s2["v"] == 2 and s2["text"] == ">> " + TEXT[:-1] + "!"
    # Ones that overlap what changed since v0 are refused with the current version: a second insertion at the
    # same offset (which goes first is ambiguous), a range sharing characters with a later change.
    for op in ({"op": "replace", "start": 0, "end": 0, "text": "A "}, {"op": "mask", "start": 38, "end": 42}):
        err = _edit(conn, s0, op)
        assert (err["code"], err["retryable"], err["data"]) == ("stale_version", True, {"current_v": 2})
    # Against v1 the first change is already known: only the second one is rebased over.
    s3 = _edit(conn, s1, {"op": "replace", "start": 0, "end": 0, "text": "A "})
    assert s3["text"] == "A >> " + TEXT[:-1] + "!"


def test_changes_are_broadcast_to_every_session_that_opened_the_document(serve: Factory) -> None:
    client = serve()
    with client.websocket_connect("/ws") as wa, client.websocket_connect("/ws") as wb:
        a, b = Conn(wa), Conn(wb)
        for c in (a, b):
            c.rpc({"type": "hello", "protocol": "dcanvas/1"})
        s = _open(a)
        b.rpc({"type": "doc.open", "doc_id": s["doc_id"]})
        mine = _edit(a, s, {"op": "mask", "start": 4, "end": 7})
        theirs = b.until("doc.state")
        assert "re" not in theirs and theirs["v"] == mine["v"] == 1 and theirs["spans"] == mine["spans"]
        assert b.rpc({"type": "doc.close", "doc_id": s["doc_id"]})["type"] == "ack"
        _edit(a, mine, {"op": "unmask", "start": 4, "end": 7})
        assert b.rpc({"type": "ping"})["type"] == "pong"
        assert [e for e in b.events if e["type"] == "doc.state"] == []  # closed: no more broadcasts


# -- generation ------------------------------------------------------------------------------------------------


def test_generate_accept_undo(conn: Conn) -> None:
    s = _edit(conn, _open(conn), {"op": "mask", "start": 4, "end": 7})
    accepted, frames, done = _generate(conn, s, max_steps=8, seed=3)
    assert accepted["params"]["seed"] == 3 and accepted["base_v"] == s["v"]
    assert done["status"] == "completed" and done["re"] == accepted["re"]
    assert [f["seq"] for f in frames] == list(range(1, len(frames) + 1)) and frames
    for f in frames:
        assert f["free"] >= 1 and all(0 <= sl["i"] < 32 for sl in f["slots"])
    p = done["proposal"]
    assert p["base_v"] == s["v"] and TEXT[p["start"] : p["end"]] == " cat"
    stats = done["stats"]
    assert stats["steps"] >= 1 and stats["wall_s"] > 0
    new = conn.rpc({"type": "proposal.accept", "gen": accepted["gen"], "base_v": s["v"]})
    assert new["text"] == TEXT[: p["start"]] + p["text"] + TEXT[p["end"] :] and new["v"] == s["v"] + 1
    assert all(sp["kind"] == "pinned" for sp in new["spans"] if sp["start"] < sp["end"])
    again = conn.rpc({"type": "proposal.accept", "gen": accepted["gen"], "base_v": new["v"]})
    assert again["code"] == "conflict"  # already accepted
    back = conn.rpc({"type": "history.undo", "doc_id": s["doc_id"]})  # one undo takes the whole proposal back
    assert back["text"] == TEXT and any(sp["kind"] == "free" for sp in back["spans"])


def test_left_out_params_take_the_model_defaults(backend: Backend, tmp_path: Path) -> None:
    """A model's generation_config.json sets what a gen.start leaves out; gen.accepted echoes what was used."""
    tuned = dataclasses.replace(backend, sampler_defaults=SamplerConfig(max_steps=5, entropy_bound=0.7, t_max=0.6))
    config = ServerConfig(db=":memory:", port=8765, hosts=("testserver",), web_dir=str(tmp_path))
    with TestClient(create_app(config, backend=tuned)) as client, client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        welcome = c.rpc({"type": "hello", "protocol": "dcanvas/1"})
        assert welcome["model"]["defaults"] == {"max_steps": 5, "entropy_bound": 0.7, "t_max": 0.6, "t_min": 0.4}
        s = _edit(c, _open(c), {"op": "mask", "start": 4, "end": 7})
        accepted, frames, done = _generate(c, s, seed=1)
        p = accepted["params"]
        assert (p["max_steps"], p["entropy_bound"], p["t_max"], p["t_min"]) == (5, 0.7, 0.6, 0.4)
        assert all(f["max_steps"] == 5 for f in frames) and done["stats"]["steps"] <= 5
        accepted, _, _ = _generate(c, s, seed=1, max_steps=3, t_min=0.1)  # given fields win
        assert (accepted["params"]["max_steps"], accepted["params"]["t_min"]) == (3, 0.1)
        bad = c.rpc({"type": "gen.start", "doc_id": s["doc_id"], "base_v": s["v"], "params": {"t_min": 0.65}})
        assert bad["code"] == "invalid_params" and "t_max (0.6) must be >= t_min (0.65)" in bad["message"]


def test_reject_and_partial_accept(conn: Conn) -> None:
    s = _edit(conn, _open(conn), {"op": "mask", "start": 4, "end": 7}, {"op": "mask", "start": 19, "end": 22})
    accepted, _, done = _generate(conn, s, max_steps=4, seed=1)
    assert conn.rpc({"type": "proposal.reject", "gen": accepted["gen"]})["type"] == "ack"
    assert conn.rpc({"type": "proposal.accept", "gen": accepted["gen"], "base_v": s["v"]})["code"] == "conflict"
    assert conn.rpc({"type": "proposal.reject", "gen": "g-unknown"})["code"] == "not_found"
    accepted, _, done = _generate(conn, s, max_steps=4, seed=2)
    diff = done["proposal"]["diff"]
    n_hunks = sum(1 for i, d in enumerate(diff) if d["op"] != "equal" and (i == 0 or diff[i - 1]["op"] == "equal"))
    assert n_hunks >= 1
    bad = conn.rpc({"type": "proposal.accept", "gen": accepted["gen"], "base_v": s["v"], "hunks": [n_hunks]})
    assert bad["code"] == "invalid_params"
    new = conn.rpc({"type": "proposal.accept", "gen": accepted["gen"], "base_v": s["v"], "hunks": []})
    assert new["text"] == TEXT  # no hunk chosen: the old text stays, now pinned


def test_cancel_supersede_and_stale(conn: Conn) -> None:
    s = _edit(conn, _open(conn), {"op": "mask", "start": 4, "end": 7})
    slow = {"max_steps": 256, "entropy_bound": 1e-6, "seed": 1}  # accepts ~1 slot a step: runs long
    first = conn.rpc({"type": "gen.start", "doc_id": s["doc_id"], "base_v": s["v"], "params": slow})
    assert conn.rpc({"type": "gen.cancel", "gen": first["gen"]})["type"] == "ack"
    done = conn.until("gen.done", gen=first["gen"])
    assert done["status"] == "cancelled" and "proposal" not in done
    assert conn.rpc({"type": "gen.cancel", "gen": first["gen"]})["type"] == "ack"  # idempotent once over
    assert conn.rpc({"type": "gen.cancel", "gen": "g-nope"})["code"] == "not_found"

    second = conn.rpc({"type": "gen.start", "doc_id": s["doc_id"], "base_v": s["v"], "params": slow})
    third = conn.rpc({"type": "gen.start", "doc_id": s["doc_id"], "base_v": s["v"], "params": slow})
    assert conn.until("gen.done", gen=second["gen"])["status"] == "superseded"
    # An edit overlapping the region being generated makes it stale; a disjoint one would not.
    _edit(conn, s, {"op": "replace", "start": 5, "end": 6, "text": "o"})
    stale = conn.until("gen.done", gen=third["gen"])
    assert stale["status"] == "stale" and stale["message"]


def test_disjoint_edit_during_generation_is_rebased_into_the_proposal(conn: Conn) -> None:
    s = _edit(conn, _open(conn), {"op": "mask", "start": 4, "end": 7})
    # A tiny entropy bound accepts ~1 slot a step, so the run lasts all its steps: the edit lands while it runs.
    params = {"max_steps": 24, "entropy_bound": 1e-6}
    rid = conn.send({"type": "gen.start", "doc_id": s["doc_id"], "base_v": s["v"], "params": params})
    accepted = conn.reply(rid)
    typed = _edit(conn, s, {"op": "replace", "start": len(TEXT), "end": len(TEXT), "text": " Yes."})
    done = conn.until("gen.done", gen=accepted["gen"])
    assert done["status"] == "completed"
    p = done["proposal"]
    assert p["base_v"] == typed["v"] and typed["text"][p["start"] : p["end"]] == " cat"
    new = conn.rpc({"type": "proposal.accept", "gen": accepted["gen"], "base_v": typed["v"]})
    assert new["text"] == typed["text"][: p["start"]] + p["text"] + typed["text"][p["end"] :]
    assert new["text"].endswith(" Yes.")


def test_generation_guards(serve: Factory) -> None:
    client = serve(limits=ServerLimits(max_gens_per_session=1))
    with client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.rpc({"type": "hello", "protocol": "dcanvas/1"})
        s = _open(c)
        stale = c.rpc({"type": "gen.start", "doc_id": s["doc_id"], "base_v": s["v"] + 1})
        assert stale["code"] == "stale_version" and stale["data"] == {"current_v": 0}
        s = _edit(c, s, {"op": "mask", "start": 4, "end": 7})
        other = _edit(c, _open(c, "Another one."), {"op": "mask", "start": 0, "end": 7})
        slow = {"max_steps": 256, "entropy_bound": 1e-6}
        first = c.rpc({"type": "gen.start", "doc_id": s["doc_id"], "base_v": s["v"], "params": slow})
        busy = c.rpc({"type": "gen.start", "doc_id": other["doc_id"], "base_v": other["v"]})
        assert (busy["code"], busy["retryable"]) == ("busy", True)
        c.rpc({"type": "gen.cancel", "gen": first["gen"]})
        c.until("gen.done", gen=first["gen"])
        long = _open(c, "word " * 60)  # more tokens than the 32-slot window, all pinned: nothing is free
        nothing = c.rpc({"type": "gen.start", "doc_id": long["doc_id"], "base_v": long["v"]})
        assert nothing["code"] == "conflict" and "nothing to generate" in nothing["message"]


def test_a_closed_connection_cancels_its_generations_and_frees_its_documents(serve: Factory) -> None:
    client = serve()
    with client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.rpc({"type": "hello", "protocol": "dcanvas/1"})
        s = _edit(c, _open(c), {"op": "mask", "start": 4, "end": 7})
        slow = {"max_steps": 256, "entropy_bound": 1e-6}
        assert c.rpc({"type": "gen.start", "doc_id": s["doc_id"], "base_v": s["v"], "params": slow})["gen"]
        assert client.get("/health").json()["generations_running"] == 1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = client.get("/health").json()
        if (health["sessions"], health["documents_open"], health["generations_running"]) == (0, 0, 0):
            break
        time.sleep(0.02)
    assert (health["sessions"], health["documents_open"], health["generations_running"]) == (0, 0, 0)


# -- persistence -----------------------------------------------------------------------------------------------


def test_restart_restores_documents_versions_and_history(serve: Factory, tmp_path: Path) -> None:
    db = str(tmp_path / "docs.db")
    first = serve(db=db)
    with first.websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.rpc({"type": "hello", "protocol": "dcanvas/1"})
        s = _edit(c, _open(c), {"op": "replace", "start": 0, "end": 3, "text": "One"})
        s = _edit(c, s, {"op": "mask", "start": 4, "end": 7})
    first.__exit__(None, None, None)
    second = serve(db=db)
    with second.websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.rpc({"type": "hello", "protocol": "dcanvas/1"})
        back = c.rpc({"type": "doc.open", "doc_id": s["doc_id"]})
        assert (back["text"], back["v"], back["spans"], back["name"]) == (s["text"], s["v"], s["spans"], "t")
        assert c.rpc({"type": "history.undo", "doc_id": s["doc_id"]})["spans"] != s["spans"]
        assert c.rpc({"type": "history.undo", "doc_id": s["doc_id"]})["text"] == TEXT
    log = Store(db).edits(s["doc_id"])
    assert [e.v for e in log] == [1, 2, 3, 4] and log[0].ops[0]["op"] == "replace" and log[3].ops == [{"op": "undo"}]


# -- hostile and malformed input -------------------------------------------------------------------------------


def test_malformed_frames_get_errors_and_the_connection_stays_open(conn: Conn) -> None:
    junk: list[tuple[str | bytes, str]] = [
        ("{not json", "invalid_message"),
        ("[]", "invalid_message"),
        ('{"type": "rm -rf"}', "unknown_type"),
        ('{"type": "doc.edit", "id": 5}', "invalid_params"),
        ("[" * 50_000, "invalid_message"),
        (b'{"type": "ping", "id": "bin"}', "pong"),
        ('{"type": "doc.open", "text": "' + "x" * 1_100_000 + '"}', "too_large"),
        ('{"type": "doc.open", "text": "\\udc00"}', "invalid_message"),
    ]
    for frame, expected in junk:
        if isinstance(frame, bytes):
            conn.ws.send_bytes(frame)
        else:
            conn.ws.send_text(frame)
        msg = conn.ws.receive_json()
        assert expected in (msg["type"], msg.get("code")), (frame[:40], msg)
        assert "Traceback" not in json.dumps(msg)
    assert conn.rpc({"type": "ping"})["type"] == "pong"


def test_rate_limit(serve: Factory) -> None:
    client = serve(limits=ServerLimits(rate_per_s=1.0, rate_burst=10))
    with client.websocket_connect("/ws") as ws:
        for i in range(30):
            ws.send_text(json.dumps({"type": "ping", "id": i}))
        replies = [ws.receive_json() for _ in range(30)]
        limited = [r for r in replies if r.get("code") == "rate_limited"]
        assert len(limited) >= 15 and all(r["retryable"] for r in limited)
        assert len(replies) - len(limited) <= 12


def test_size_limits(serve: Factory) -> None:
    client = serve(limits=ServerLimits.tiny())
    with client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.rpc({"type": "hello", "protocol": "dcanvas/1"})
        assert c.rpc({"type": "doc.open", "text": "x" * 1001})["code"] == "invalid_params"
        s = _open(c, "y" * 900)
        grown = _edit(
            c,
            s,
            {"op": "replace", "start": 0, "end": 0, "text": "z" * 999},
            {"op": "replace", "start": 0, "end": 0, "text": "z" * 200},
        )
        assert grown["code"] == "too_large"
        for _ in range(3):
            _open(c, "doc")
        assert c.rpc({"type": "doc.open", "text": "fifth"})["code"] == "too_large"  # max_open_docs 4


# -- HTTP ------------------------------------------------------------------------------------------------------


def test_health_schema_and_static_files(serve: Factory, tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("<!doctype html><title>canvas</title>")
    (tmp_path / "app.js").write_text("export const ok = 1;")
    (tmp_path.parent / "secret.txt").write_text("do not serve")
    client = serve()
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["protocol"] == "dcanvas/1"
    schema = client.get("/schema").json()
    assert "hello" in schema["$defs"]["ClientMessage"]["discriminator"]["mapping"]
    assert "canvas" in client.get("/").text
    assert client.get("/app.js").text == "export const ok = 1;"
    for path in ("/../secret.txt", "/%2e%2e/secret.txt", "/..%2fsecret.txt", "/app.js/../../secret.txt"):
        r = client.get(path)
        assert r.status_code == 404 and "do not serve" not in r.text, path
    assert client.get("/health", headers={"host": "evil.example"}).status_code == 400  # DNS rebinding


def test_config_refuses_a_public_bind_without_a_token() -> None:
    with pytest.raises(ValueError, match="token"):
        ServerConfig(host="0.0.0.0")
    with pytest.raises(ValueError, match="16 characters"):
        ServerConfig(host="0.0.0.0", token="short")
    assert ServerConfig(host="0.0.0.0", token="a-long-enough-token").allowed_hosts == ["*"]


# -- real websockets (uvicorn in this process) -----------------------------------------------------------------


def test_embedded_server_over_real_websockets(backend: Backend) -> None:
    import asyncio

    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosedError, InvalidStatus

    from canvas.protocol import GenDone, MaskOp, ProtocolError
    from canvas.protocol.client import DcanvasClient
    from canvas.server.embedded import EmbeddedServer

    async def scenario(server: EmbeddedServer) -> None:
        async with DcanvasClient.connect(server.url) as c:
            doc = await c.open(text=TEXT)
            doc = await c.edit(doc.doc_id, doc.v, [MaskOp(start=4, end=7)])
            done = await c.generate(doc.doc_id, doc.v, max_steps=4).result()
            assert isinstance(done, GenDone) and done.status == "completed"
            with pytest.raises(ProtocolError) as info:
                await c.open(text="x" * 2000)  # over tiny max_text_chars, under the frame limit
            assert info.value.code == "invalid_params"
            await c.send_raw("y" * 5000)  # over max_frame_bytes (4096), under uvicorn's 2x: a typed error
            err = await asyncio.wait_for(c.events.get(), 10)
            while err.type == "doc.state":  # type: ignore[attr-defined]  # the broadcast when the generation ended
                err = await asyncio.wait_for(c.events.get(), 10)
            assert getattr(err, "code", None) == "too_large"
            assert await c.ping() > 0
        with pytest.raises(InvalidStatus) as refused:
            async with connect(server.url, origin="https://evil.example"):  # type: ignore[arg-type]
                pass
        assert refused.value.response.status_code == 403
        async with connect(server.url) as ws:
            await ws.send("z" * 10_000)  # over twice the limit: the websocket layer closes with 1009
            with pytest.raises(ConnectionClosedError) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009

    with EmbeddedServer(backend=backend, limits=ServerLimits.tiny()) as server:
        asyncio.run(scenario(server))
