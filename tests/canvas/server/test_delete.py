"""`doc.delete`: the typed reply, the store row with its history and proposals gone, every other session that had the
document open told, a running generation cancelled, and the refusals (stale base_v, unknown document)."""

from __future__ import annotations

from pathlib import Path

import pytest

from canvas.store.sqlite import Store
from tests.canvas.wsconn import SLOW, Conn, Factory, edit, generate, open_doc

pytestmark = pytest.mark.timeout(120)


def test_delete_removes_everything_and_tells_the_other_sessions(serve: Factory, tmp_path: Path) -> None:
    db = tmp_path / "docs.db"
    client = serve(db=str(db))
    with client.websocket_connect("/ws") as wa, client.websocket_connect("/ws") as wb:
        a, b = Conn(wa), Conn(wb)
        a.hello(), b.hello()
        s = edit(a, open_doc(a), {"op": "mask", "start": 4, "end": 7})
        accepted, _, _ = generate(a, s, max_steps=2, seed=1)  # a pending proposal, stored
        keep = open_doc(a, "Another document.")
        b.rpc({"type": "doc.open", "doc_id": s["doc_id"]})
        store: Store = client.app.state.hub.store  # type: ignore[attr-defined]
        assert store.edits(s["doc_id"]) and store.proposals(s["doc_id"])

        gone = a.rpc({"type": "doc.delete", "doc_id": s["doc_id"]})
        assert gone == {"type": "doc.deleted", "re": gone["re"], "doc_id": s["doc_id"]}
        told = b.until("doc.deleted")
        assert told == {"type": "doc.deleted", "doc_id": s["doc_id"]}  # news, without re
        assert not store.exists(s["doc_id"]) and store.edits(s["doc_id"]) == [] and store.proposals(s["doc_id"]) == []
        assert store.proposal(accepted["gen"]) is None

        for c in (a, b):
            assert c.rpc({"type": "doc.open", "doc_id": s["doc_id"]})["code"] == "not_found"
            assert edit(c, s, {"op": "pin", "start": 0, "end": 1})["code"] == "not_found"
            assert c.rpc({"type": "doc.delete", "doc_id": s["doc_id"]})["code"] == "not_found"
        late = a.rpc({"type": "proposal.accept", "gen": accepted["gen"], "base_v": s["v"]})
        assert late["code"] == "conflict" and "deleted" in late["message"]
        assert [d["doc_id"] for d in a.rpc({"type": "doc.list"})["docs"]] == [keep["doc_id"]]
        assert not [e for e in a.events if e["type"] == "doc.deleted"]  # the deleter got its reply, not the news too
        assert s["doc_id"] not in client.app.state.hub.docs  # type: ignore[attr-defined]
    with Store(db) as again:  # and it stays deleted
        assert not again.exists(s["doc_id"]) and again.exists(keep["doc_id"])


def test_delete_cancels_a_running_generation(serve: Factory) -> None:
    with serve().websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        s = edit(c, open_doc(c), {"op": "mask", "start": 4, "end": 7})
        running = c.rpc({"type": "gen.start", "doc_id": s["doc_id"], "base_v": s["v"], "params": SLOW})
        assert c.rpc({"type": "doc.delete", "doc_id": s["doc_id"], "base_v": s["v"]})["type"] == "doc.deleted"
        done = c.until("gen.done", gen=running["gen"])
        assert done["status"] == "cancelled" and done["message"] == "the document was deleted"
        assert "proposal" not in done
        assert not [e for e in c.events if e["type"] == "doc.state" and e["doc_id"] == s["doc_id"]]
        assert c.rpc({"type": "gen.cancel", "gen": running["gen"]})["type"] == "ack"  # over


def test_delete_refuses_an_old_or_future_version_and_changes_nothing(serve: Factory) -> None:
    with serve().websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        s0 = open_doc(c)
        s1 = edit(c, s0, {"op": "replace", "start": 0, "end": 3, "text": "A"})
        stale = c.rpc({"type": "doc.delete", "doc_id": s0["doc_id"], "base_v": s0["v"]})
        assert (stale["code"], stale["retryable"], stale["data"]) == ("stale_version", True, {"current_v": s1["v"]})
        future = c.rpc({"type": "doc.delete", "doc_id": s0["doc_id"], "base_v": s1["v"] + 1})
        assert future["code"] == "invalid_params" and "newer" in future["message"]
        assert c.rpc({"type": "doc.open", "doc_id": s0["doc_id"]})["text"] == s1["text"]
        assert c.rpc({"type": "doc.delete", "doc_id": "no-such-doc"})["code"] == "not_found"
        bad = c.rpc({"type": "doc.delete"})
        assert bad["code"] == "invalid_params" and "doc_id" in bad["message"]
