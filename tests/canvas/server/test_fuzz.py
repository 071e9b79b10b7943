"""Fuzz the server with generated and mutated frames: every frame gets exactly one typed reply, no reply is
`internal`, the connection survives, a rejected request leaves the document exactly as it was, and what the store
holds is what the server holds (the document, its pending proposals and where they lie), so a restart would lose
nothing. 1,000 frames in the default suite (a few seconds), 10,000 in the slow one (`DCANVAS_FUZZ_EXAMPLES`
overrides that number)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from canvas.engine.backend import load_backend, write_tiny_checkpoint
from canvas.protocol import SERVER_MESSAGES, ServerLimits
from canvas.server.app import create_app
from canvas.server.config import ServerConfig

pytestmark = pytest.mark.timeout(1800)
TEXT = "The cat sat on the mat. It was a warm day. Ünïcödé ✓ too."
EVENTS = ("gen.progress", "gen.done", "doc.state", "doc.deleted")
REPLY_EVENTS = ("doc.state", "doc.deleted")  # event types that are also direct replies (with `re`)
CURRENT, LAST = "<current version>", "<last gen>"  # placeholders `_one_frame` fills in


class Harness:
    def __init__(self, client: TestClient, ws: Any) -> None:
        self.client, self.ws = client, ws
        self.hub = client.app.state.hub  # type: ignore[attr-defined]
        self.ids = iter(range(1, 1 << 40))
        self.replies = 0
        self.codes: dict[str, int] = {}
        self.deleted = 0
        self.last_gen = "g-000000000000"
        self.pending = 0  # the most pending proposals seen at once
        self.checked = 0  # frames after which the store was compared with the server
        self.done: dict[str, int] = {}  # gen.done statuses
        ws.send_text(json.dumps({"type": "hello", "protocol": "dcanvas/1", "id": 0}))
        assert ws.receive_json()["type"] == "welcome"
        self.doc_id = self.request({"type": "doc.open", "text": TEXT})["doc_id"]

    def request(self, msg: dict[str, Any] | str | bytes) -> dict[str, Any]:
        """Send one frame and return its one direct reply (events for earlier requests are skipped)."""
        rid: Any = None
        if isinstance(msg, dict):
            rid = next(self.ids)
            msg = json.dumps({**msg, "id": rid})
        if isinstance(msg, bytes):
            self.ws.send_bytes(msg)
        else:
            self.ws.send_text(msg)
        while True:
            reply = self.ws.receive_json()
            assert reply["type"] in SERVER_MESSAGES
            is_reply = rid is not None and reply.get("re") == rid and reply["type"] != "gen.progress"
            if reply["type"] == "gen.done":
                self.done[reply["status"]] = self.done.get(reply["status"], 0) + 1
            if reply["type"] in EVENTS and not (is_reply and reply["type"] in REPLY_EVENTS):
                continue  # a broadcast or a generation event, not the reply
            if rid is not None:
                assert reply.get("re") == rid, reply
            self.replies += 1
            if reply["type"] == "error":
                self.codes[reply["code"]] = self.codes.get(reply["code"], 0) + 1
            return reply

    def document(self) -> tuple[int, str, tuple[Any, ...]]:
        live = self.hub.docs[self.doc_id]
        return live.doc.version, live.doc.text, tuple(live.doc.spans())

    def check_stored(self) -> bool:
        """The store has the document as the server has it, and its pending proposals where the server has them.
        Checked when nothing is in flight (our request was answered, no generation runs: a finishing one adds its
        proposal on its own), so both are settled; returns whether it could check."""
        live = self.hub.docs[self.doc_id]
        if live.run is not None or live.lock.locked():
            return False
        assert self.hub.store.load(self.doc_id) == (live.doc.version, live.doc.to_dict())
        stored = {p.gen: (p.start, p.end, p.stale) for p in self.hub.store.proposals(self.doc_id)}
        assert stored == {g: (p.start, p.end, p.stale) for g, p in live.proposals.items()}
        self.pending = max(self.pending, len(stored))
        self.checked += 1
        return True


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    backend = load_backend(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model")), max_batch=4)
    limits = ServerLimits(rate_per_s=1e6, rate_burst=1_000_000, max_gens_per_session=2)
    config = ServerConfig(db=":memory:", hosts=("testserver",), web_dir=str(Path(__file__).parent), limits=limits)
    with TestClient(create_app(config, backend=backend)) as client, client.websocket_connect("/ws") as ws:
        h = Harness(client, ws)
        yield h
        assert h.request({"type": "ping"})["type"] == "pong"  # still alive after everything
        errors = sum(h.codes.values())
        print(f"\nfuzz: {h.replies} replies, {h.replies - errors} accepted ({h.deleted} deletes, up to {h.pending} "
              f"proposals pending, generations {h.done}, store checked {h.checked} times); "
              f"errors: {dict(sorted(h.codes.items()))}")


_json: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)  # fmt: skip
_offset = st.integers(-3, len(TEXT) + 5)
_op = st.fixed_dictionaries(
    {"op": st.sampled_from(["replace", "pin", "unpin", "mask", "unmask", "insert_gap", "move_window", "zap"])},
    optional={"start": _offset, "end": _offset, "at": _offset, "n_tokens": st.integers(-1, 40),
              "text": st.text(max_size=8)},
)  # fmt: skip


@st.composite
def _good_op(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed op (clamped to the text by `_fit`; the document may still refuse it: window, canvas size)."""
    start = draw(st.integers(0, 80))
    end = start + draw(st.integers(0, 12))
    kind = draw(st.sampled_from(["replace", "pin", "unpin", "mask", "unmask", "insert_gap", "move_window"]))
    if kind == "replace":
        return {"op": kind, "start": start, "end": end, "text": draw(st.text(max_size=6))}
    if kind == "insert_gap":
        return {"op": kind, "at": start, "n_tokens": draw(st.integers(1, 6))}
    if kind == "move_window":
        return {"op": kind, "start": draw(st.integers(0, 20))}
    return {"op": kind, "start": start, "end": end}


@st.composite
def _message(draw: st.DrawFn, doc_id: str) -> dict[str, Any] | str | bytes:
    # Hypothesis favours the first choices of sampled_from; a seeded Random keeps every kind in the mix.
    kinds = ["good"] * 6 + ["edit"] * 2 + ["other"] * 2 + ["gen", "mutated", "mutated", "junk", "bytes"]
    rnd = draw(st.randoms(use_true_random=False))
    kind = rnd.choice(kinds)
    if kind == "good":
        ops = draw(st.lists(_good_op(), min_size=1, max_size=2))
        return {"type": "doc.edit", "doc_id": doc_id, "base_v": -draw(st.integers(0, 2)), "ops": ops, "fit": True}
    if kind == "edit":
        return {"type": "doc.edit", "doc_id": doc_id, "base_v": draw(st.integers(-1, 6)),
                "ops": draw(st.lists(_op, min_size=0, max_size=3))}  # fmt: skip
    if kind == "other":
        gen = draw(st.sampled_from(["g-000000000000", "x", ""]))
        others: list[dict[str, Any]] = [
            {"type": "history.undo", "doc_id": doc_id},
            {"type": "history.redo", "doc_id": doc_id},
            {"type": "doc.open", "doc_id": doc_id},
            {"type": "doc.list"},
            {"type": "ping"},
            {"type": "gen.cancel", "gen": gen},
            {"type": "proposal.accept", "gen": gen, "base_v": 0},
            {"type": "proposal.reject", "gen": gen},
            {"type": "gen.start", "doc_id": doc_id, "base_v": 0, "params": {"max_steps": 2}},
            {"type": "hello", "protocol": "dcanvas/1"},
            {"type": "doc.delete", "doc_id": "no-such-doc"},
            {"type": "doc.delete", "doc_id": doc_id, "base_v": 0},  # deletes only an unedited document
        ]
        return draw(st.sampled_from(others))
    if kind == "gen":  # real generations and their proposals (CURRENT: the document's version, LAST: the last gen)
        gap = {"op": "insert_gap", "at": 0, "n_tokens": 2}
        return rnd.choice(
            [{"type": "doc.edit", "doc_id": doc_id, "base_v": CURRENT, "ops": [gap]}]
            + [{"type": "gen.start", "doc_id": doc_id, "base_v": CURRENT, "params": {"max_steps": 1}}] * 3
            + [{"type": "proposal.accept", "gen": LAST, "base_v": CURRENT}] * 3
            + [{"type": "proposal.reject", "gen": LAST}]
            + [{"type": "doc.delete", "doc_id": doc_id}] * (rnd.random() < 0.1)  # with whatever runs or waits on it
        )
    if kind == "mutated":
        base: dict[str, Any] = {
            "type": draw(
                st.sampled_from(["doc.edit", "gen.start", "doc.open", "proposal.accept", "history.undo", "doc.close",
                                 "doc.delete"] if rnd.random() < 0.1 else ["doc.edit", "gen.start", "doc.open",
                                 "proposal.accept", "history.undo", "doc.close"])
            ),
            "doc_id": doc_id,
        }
        for key in draw(
            st.lists(
                st.sampled_from(["doc_id", "base_v", "ops", "params", "gen", "text", "hunks", "name", "type"]),
                max_size=3,
            )
        ):
            base[key] = draw(_json)
        return base
    if kind == "junk":
        return draw(st.text(max_size=40))
    return draw(st.binary(max_size=40))


def _fit(msg: dict[str, Any], v: int, length: int) -> dict[str, Any]:
    """Aim a well-formed edit at the current document: offsets inside the text, base_v a recent version."""
    ops = [{k: min(val, length) if k in ("start", "end", "at") else val for k, val in op.items()} for op in msg["ops"]]
    return {**msg, "base_v": max(0, v + msg["base_v"]), "ops": ops}


def _one_frame(harness: Harness, data: st.DataObject) -> None:
    msg = data.draw(_message(harness.doc_id))
    before = harness.document()
    if isinstance(msg, dict) and msg.pop("fit", False):
        msg = _fit(msg, before[0], len(before[1]))
    if isinstance(msg, dict):
        msg = {k: {CURRENT: before[0], LAST: harness.last_gen}.get(v, v) if isinstance(v, str) else v
               for k, v in msg.items()}  # fmt: skip
    reply = harness.request(msg)
    if reply["type"] == "gen.accepted":
        harness.last_gen = reply["gen"]
    assert reply.get("code") != "internal", (msg, reply)
    if reply["type"] == "error":
        assert harness.document() == before, (msg, reply)
    if reply["type"] == "doc.deleted":  # the fuzz goes on on a new document
        harness.deleted += 1
        harness.doc_id = harness.request({"type": "doc.open", "text": TEXT})["doc_id"]
    if isinstance(msg, dict) and msg.get("type") == "doc.close" and reply["type"] == "ack":
        harness.request({"type": "doc.open", "doc_id": harness.doc_id})  # keep receiving our document
    harness.check_stored()


_SETTINGS = {"deadline": None, "suppress_health_check": list(HealthCheck), "database": None}


@settings(max_examples=1000, **_SETTINGS)  # type: ignore[arg-type]
@given(data=st.data())
def test_1000_fuzzed_frames(harness: Harness, data: st.DataObject) -> None:
    _one_frame(harness, data)


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("DCANVAS_FUZZ_EXAMPLES", "10000")), **_SETTINGS)  # type: ignore[arg-type]
@given(data=st.data())
def test_10000_fuzzed_frames(harness: Harness, data: st.DataObject) -> None:
    _one_frame(harness, data)
