"""Helpers for the websocket tests of the dcanvas/1 server through Starlette's TestClient (not a test module).

`served` makes servers on one backend (each a TestClient, closed at the end); `Conn` wraps one websocket so that
`rpc` returns a request's one direct reply and keeps everything else (broadcasts, generation events) in `events`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

from canvas.engine.backend import Backend
from canvas.server.app import create_app
from canvas.server.config import ServerConfig
from canvas.store.sqlite import Store

TEXT = "The cat sat on the mat. It was a warm day."
SLOW: dict[str, Any] = {"max_steps": 256, "entropy_bound": 1e-6}  # accepts ~1 slot a step: a generation that runs long

Factory = Callable[..., TestClient]


@contextmanager
def served(backend: Backend, web_dir: Path) -> Iterator[Factory]:
    """A factory of servers: `make(store=None, **ServerConfig fields)` returns a started TestClient."""
    clients: list[TestClient] = []

    def make(store: Store | None = None, **overrides: Any) -> TestClient:
        fields: dict[str, Any] = {"db": ":memory:", "port": 8765, "hosts": ("testserver",), "web_dir": str(web_dir)}
        config = ServerConfig(**{**fields, **overrides})
        client = TestClient(create_app(config, backend=backend, store=store))
        client.__enter__()
        clients.append(client)
        return client

    try:
        yield make
    finally:
        for c in clients:
            c.__exit__(None, None, None)


class Conn:
    """A test websocket: `rpc` sends a request and returns its reply, keeping everything else in `events`."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self._ids = iter(range(1, 1 << 30))

    def send(self, msg: dict[str, Any]) -> int:
        rid = next(self._ids)
        self.ws.send_text(json.dumps({**msg, "id": rid}))
        return rid

    def reply(self, rid: Any) -> dict[str, Any]:
        while True:
            msg = self.ws.receive_json()
            if msg.get("re") == rid and msg["type"] not in ("gen.progress", "gen.done"):
                return msg
            self.events.append(msg)

    def rpc(self, msg: dict[str, Any]) -> dict[str, Any]:
        return self.reply(self.send(msg))

    def hello(self) -> dict[str, Any]:
        welcome = self.rpc({"type": "hello", "protocol": "dcanvas/1"})
        assert welcome["type"] == "welcome", welcome
        return welcome

    def until(self, kind: str, **match: Any) -> dict[str, Any]:
        for i, ev in enumerate(self.events):
            if ev["type"] == kind and all(ev.get(k) == v for k, v in match.items()):
                return self.events.pop(i)
        while True:
            msg = self.ws.receive_json()
            if msg["type"] == kind and all(msg.get(k) == v for k, v in match.items()):
                return msg
            self.events.append(msg)


def open_doc(c: Conn, text: str = TEXT) -> dict[str, Any]:
    state = c.rpc({"type": "doc.open", "text": text, "name": "t"})
    assert state["type"] == "doc.state", state
    return state


def edit(c: Conn, state: dict[str, Any], *ops: dict[str, Any], base_v: int | None = None) -> dict[str, Any]:
    v = state["v"] if base_v is None else base_v
    return c.rpc({"type": "doc.edit", "doc_id": state["doc_id"], "base_v": v, "ops": list(ops)})


def generate(c: Conn, state: dict[str, Any], **params: Any) -> tuple[dict[str, Any], list[dict[str, Any]], dict]:
    """Run a generation to its end: (gen.accepted, the progress frames, gen.done)."""
    rid = c.send({"type": "gen.start", "doc_id": state["doc_id"], "base_v": state["v"], "params": params})
    accepted = c.reply(rid)
    assert accepted["type"] == "gen.accepted", accepted
    frames = []
    while True:
        msg = c.ws.receive_json()
        if msg.get("gen") != accepted["gen"]:
            c.events.append(msg)
        elif msg["type"] == "gen.progress":
            frames.append(msg)
        elif msg["type"] == "gen.done":
            return accepted, frames, msg
