"""Nothing lost across a restart: a restarted server rebases requests made against old versions exactly as the
server that saw the changes would, and pending proposals outlive their connection and the server (stored in the
transaction of each edit that moves them), settled exactly once. In this process, on one backend, file stores."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from canvas.document import Document, StateError, proposal_from_json, proposal_to_json
from canvas.engine.backend import Backend
from canvas.server import proposals as proposals_module
from tests.canvas.wsconn import SLOW, TEXT, Conn, Factory, edit, generate, open_doc

pytestmark = pytest.mark.timeout(120)


@contextmanager
def _session(client: TestClient) -> Iterator[Conn]:
    """A connected, greeted `Conn`; the websocket closes at the end."""
    with client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        yield c


def _restart(serve: Factory, old: TestClient, db: Path) -> TestClient:
    old.__exit__(None, None, None)
    return serve(db=str(db))


def _comparable(reply: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in reply.items() if k not in ("re", "doc_id", "message")}


# Changes of every kind: typing, deleting, slot states, a gap, the window, undo and redo.
HISTORY: list[list[dict[str, Any]] | str] = [
    [{"op": "replace", "start": 0, "end": 0, "text": ">> "}],
    [{"op": "mask", "start": 7, "end": 10}],
    [{"op": "insert_gap", "at": 27, "n_tokens": 2}],
    [{"op": "replace", "start": 30, "end": 33, "text": "cold"}],
    "undo",
    [{"op": "replace", "start": 44, "end": 45, "text": "!"}],
    "undo",
    "redo",
    [{"op": "unmask", "start": 7, "end": 10}, {"op": "pin", "start": 3, "end": 6}],
]
PROBES: list[dict[str, Any]] = [
    {"op": "replace", "start": 0, "end": 0, "text": "A"},
    {"op": "replace", "start": 1, "end": 2, "text": "h"},
    {"op": "mask", "start": 12, "end": 15},
    {"op": "insert_gap", "at": 24, "n_tokens": 1},
    {"op": "replace", "start": 38, "end": 41, "text": "hot"},
    {"op": "pin", "start": 20, "end": 22},
]


def _replay(c: Conn, doc: dict[str, Any]) -> dict[str, Any]:
    for step in HISTORY:
        if isinstance(step, str):
            doc = c.rpc({"type": f"history.{step}", "doc_id": doc["doc_id"]})
        else:
            doc = edit(c, doc, *step)
        assert doc["type"] == "doc.state", (step, doc)
    return doc


def test_old_versions_rebase_after_a_restart_exactly_as_before(serve: Factory, tmp_path: Path) -> None:
    """Two servers see the same changes; one restarts. Every probe, at every old base version, then gets the same
    answer from both (rebased, or stale_version): a restart forgets none of the change log."""
    kept, db = serve(db=str(tmp_path / "kept.db")), tmp_path / "restarted.db"
    restarted = serve(db=str(db))
    with _session(kept) as a, _session(restarted) as b:
        doc_a, doc_b = _replay(a, open_doc(a)), _replay(b, open_doc(b))
    assert _comparable(doc_a) == _comparable(doc_b)
    restarted = _restart(serve, restarted, db)
    outcomes: dict[str, int] = {}
    with _session(kept) as a, _session(restarted) as b:
        b.rpc({"type": "doc.open", "doc_id": doc_b["doc_id"]})
        for base_v in range(doc_a["v"] + 1):
            for probe in PROBES:
                ra = edit(a, doc_a, probe, base_v=base_v)
                rb = edit(b, doc_b, probe, base_v=base_v)
                assert _comparable(ra) == _comparable(rb), (base_v, probe, ra, rb)
                kind = ra.get("code", ra["type"])
                outcomes[kind] = outcomes.get(kind, 0) + 1
    # Both kinds of answer were exercised (a log that forgot everything would answer stale_version throughout).
    assert outcomes.get("doc.state", 0) >= 10 and outcomes.get("stale_version", 0) >= 5, outcomes


def test_a_pending_proposal_survives_a_restart_and_is_accepted_once(serve: Factory, tmp_path: Path) -> None:
    db = tmp_path / "docs.db"
    server = serve(db=str(db))
    with _session(server) as c:
        s = edit(c, open_doc(c), {"op": "mask", "start": 4, "end": 7})
        accepted, _, done = generate(c, s, max_steps=6, seed=4)
        assert done["status"] == "completed"
        p, gen = done["proposal"], accepted["gen"]
        # A disjoint edit after the proposal moves it; the move is stored with the edit.
        typed = edit(c, s, {"op": "replace", "start": 0, "end": 0, "text": "Yes. "})
    assert typed["text"][p["start"] + 5 : p["end"] + 5] == TEXT[p["start"] : p["end"]]
    server = _restart(serve, server, db)
    with _session(server) as c:
        new = c.rpc({"type": "proposal.accept", "gen": gen, "base_v": typed["v"]})
        assert new["type"] == "doc.state", new
        assert new["text"] == "Yes. " + TEXT[: p["start"]] + p["text"] + TEXT[p["end"] :] and new["v"] == typed["v"] + 1
        again = c.rpc({"type": "proposal.accept", "gen": gen, "base_v": new["v"]})
        assert again["code"] == "conflict" and "accepted" in again["message"]
    server = _restart(serve, server, db)
    with _session(server) as c:  # the outcome is stored too: a retry after a restart is told what happened
        again = c.rpc({"type": "proposal.accept", "gen": gen, "base_v": new["v"]})
        assert again["code"] == "conflict" and "accepted" in again["message"]
        assert c.rpc({"type": "gen.cancel", "gen": gen})["type"] == "ack"  # over, so cancelling is a no-op
        assert c.rpc({"type": "doc.open", "doc_id": s["doc_id"]})["text"] == new["text"]


def test_a_stale_proposal_stays_stale_after_a_restart(serve: Factory, tmp_path: Path) -> None:
    db = tmp_path / "docs.db"
    server = serve(db=str(db))
    with _session(server) as c:
        s = edit(c, open_doc(c), {"op": "mask", "start": 4, "end": 7})
        accepted, _, done = generate(c, s, max_steps=4, seed=1)
        rejected, _, _ = generate(c, s, max_steps=4, seed=2)
        assert c.rpc({"type": "proposal.reject", "gen": rejected["gen"]})["type"] == "ack"
        over = edit(c, s, {"op": "replace", "start": 5, "end": 6, "text": "o"})  # inside the proposal's text
    server = _restart(serve, server, db)
    with _session(server) as c:
        err = c.rpc({"type": "proposal.accept", "gen": accepted["gen"], "base_v": over["v"]})
        assert (err["code"], err["data"]) == ("stale_version", {"current_v": over["v"]})
        err = c.rpc({"type": "proposal.accept", "gen": accepted["gen"], "base_v": over["v"]})
        assert err["code"] == "conflict" and "stale" in err["message"]
        err = c.rpc({"type": "proposal.reject", "gen": rejected["gen"]})
        assert err["code"] == "conflict" and "rejected" in err["message"]
        assert c.rpc({"type": "proposal.reject", "gen": "g-000000000000"})["code"] == "not_found"


def test_a_proposal_belongs_to_its_connection_until_that_closes(serve: Factory) -> None:
    server = serve()
    with _session(server) as other:
        with _session(server) as owner:
            s = edit(owner, open_doc(owner), {"op": "mask", "start": 4, "end": 7})
            accepted, _, done = generate(owner, s, max_steps=4, seed=3)
            gen = accepted["gen"]
            for kind in ("proposal.accept", "proposal.reject"):
                refused = other.rpc({"type": kind, "gen": gen, "base_v": s["v"]})
                assert refused["code"] == "not_found", refused
        # The owner's connection is gone (as after a restart): its proposal may be settled by anyone now.
        new = other.rpc({"type": "proposal.accept", "gen": gen, "base_v": s["v"]})
        p = done["proposal"]
        assert new["text"] == TEXT[: p["start"]] + p["text"] + TEXT[p["end"] :]
        assert s["doc_id"] not in server.app.state.hub.docs  # type: ignore[attr-defined]  # nobody has it open


def test_a_document_keeps_a_bounded_number_of_proposals(serve: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proposals_module, "MAX_PENDING", 2)
    with _session(serve()) as c:
        s = edit(c, open_doc(c), {"op": "mask", "start": 4, "end": 7})
        gens = [generate(c, s, max_steps=2, seed=k)[0]["gen"] for k in range(3)]
        expired = c.rpc({"type": "proposal.accept", "gen": gens[0], "base_v": s["v"]})
        assert expired["code"] == "conflict" and "expired" in expired["message"]
        assert c.rpc({"type": "proposal.reject", "gen": gens[1]})["type"] == "ack"
        assert c.rpc({"type": "proposal.accept", "gen": gens[2], "base_v": s["v"]})["type"] == "doc.state"


def test_an_interrupted_generation_leaves_the_document_usable(serve: Factory, tmp_path: Path) -> None:
    """A server that stops mid-generation (here cleanly; test_server_kill does it with kill -9): after the
    restart no generation runs on the document, and it generates again."""
    db = tmp_path / "docs.db"
    server = serve(db=str(db))
    with _session(server) as c:
        s = edit(c, open_doc(c), {"op": "mask", "start": 4, "end": 7})
        running = c.rpc({"type": "gen.start", "doc_id": s["doc_id"], "base_v": s["v"], "params": SLOW})
    server = _restart(serve, server, db)
    with _session(server) as c:
        back = c.rpc({"type": "doc.open", "doc_id": s["doc_id"]})
        assert "gen" not in back and back["v"] == s["v"]
        assert c.rpc({"type": "gen.cancel", "gen": running["gen"]})["code"] == "not_found"
        _, _, done = generate(c, back, max_steps=2, seed=1)
        assert done["status"] == "completed"


def test_proposal_json_round_trip(backend: Backend) -> None:
    doc = Document(backend.tokenizer, TEXT, config=backend.document_config())
    doc.mask(4, 7)
    doc.insert_gap(23, 2)
    view = doc.canvas_view()
    ids = [t if pinned else 5 + k for k, (t, pinned) in enumerate(zip(view.slot_ids, view.pinned, strict=True))]
    made = doc.make_proposal(ids)
    assert proposal_from_json(proposal_to_json(made)) == made
    bad = proposal_to_json(made)
    bad["regions"][0][4] = [["x"], "", "p"]
    with pytest.raises(StateError, match="atoms\[0\]"):
        proposal_from_json(bad)
    with pytest.raises(StateError):
        proposal_from_json({"doc_id": "d"})
