"""kill -9 mid-generation and mid-accept: a real server process over real websockets dies, and a restarted server on
the same file has every acknowledged change, rebases old versions as before, and settles the proposal that was
being accepted exactly once.

The short test (default suite) makes the server kill itself at a chosen point of `proposal.accept` (its store is
wrapped by the child script below): `in-commit` dies inside the transaction, just before COMMIT (nothing of the
accept may survive: the proposal is still pending and accepts once after the restart); `after-commit` dies right
after it, before the reply (all of it survives: the text has the proposal once, and a retry is told it was
accepted). Another document is generating at that moment. The long test (slow) kills the server at random times
under a random stream of requests, over and over.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.protocol import GenDone, MaskOp, ProtocolError, ReplaceOp
from canvas.protocol.client import ConnectionLost, DcanvasClient
from canvas.server.app import create_app
from canvas.server.config import ServerConfig
from tests.canvas.wsconn import SLOW, TEXT, Conn

pytestmark = pytest.mark.timeout(180)

# The server, in a child process; argv: model dir, db file, port, where to die ("never", "in-commit" or
# "after-commit" of the first save that settles a proposal, i.e. an accept).
_SERVER = textwrap.dedent(
    """
    import os, signal, sys
    import uvicorn
    from canvas.server.app import create_app
    from canvas.engine.backend import load_backend
    from canvas.server.config import ServerConfig
    from canvas.server.embedded import uvicorn_options
    from canvas.store.sqlite import Store

    model, db, port, die = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

    def kill_9(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    class DyingStore(Store):
        def save(self, *args, **kwargs):
            accepting = bool(kwargs.get("resolved"))
            if accepting and die == "in-commit":  # the statements ran; COMMIT never does
                self._db.set_trace_callback(lambda sql: sql.startswith("COMMIT") and kill_9())
            super().save(*args, **kwargs)
            if accepting and die == "after-commit":  # durable, but nobody was told
                kill_9()

    config = ServerConfig(port=port, db=db, model_dir=model)
    app = create_app(config, backend=load_backend(model, max_batch=4), store=DyingStore(db))
    print("serving", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", **uvicorn_options(config))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Child:
    """The server process. `url` is its websocket; `wait_killed` asserts that it died of SIGKILL."""

    def __init__(self, model: Path, db: Path, die: str) -> None:
        self.port = _free_port()
        self.url = f"ws://127.0.0.1:{self.port}/ws"
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        args = [sys.executable, "-c", _SERVER, str(model), str(db), str(self.port), die]
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    async def ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.close()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                await asyncio.sleep(0.05)
        raise TimeoutError("the server did not come up")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)

    def wait_killed(self) -> None:
        self.proc.wait(timeout=30)
        output = self.close()
        assert self.proc.returncode == -signal.SIGKILL, output

    def close(self) -> str:
        """Kill (if need be) and reap the process; its output."""
        self.kill()
        self.proc.wait(timeout=30)
        if self.proc.stdout is None or self.proc.stdout.closed:
            return ""
        with self.proc.stdout:
            return self.proc.stdout.read()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> Backend:
    return load_backend(model_dir, max_batch=4)


DIES = ["in-commit", "after-commit"]


@pytest.fixture(scope="module")
def dying(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Child, Path]]]:
    """The servers of the short test, started together (most of the test's time is their start-up)."""
    where = tmp_path_factory.mktemp("dying")
    children = {die: (Child(model_dir, where / f"{die}.db", die), where / f"{die}.db") for die in DIES}
    yield children
    for child, _ in children.values():
        child.close()


@contextmanager
def restarted(backend: Backend, db: Path, tmp_path: Path) -> Iterator[Conn]:
    """The restarted server (in this process, same store file) and a greeted connection to it."""
    config = ServerConfig(db=str(db), port=8765, hosts=("testserver",), web_dir=str(tmp_path))
    with TestClient(create_app(config, backend=backend)) as client, client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        yield c


def _integrity(db: Path) -> None:
    con = sqlite3.connect(db)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        con.close()


@pytest.mark.parametrize("die", DIES)
def test_kill_9_mid_generation_and_mid_accept(
    die: str, dying: dict[str, tuple[Child, Path]], backend: Backend, tmp_path: Path
) -> None:
    child, db = dying[die]
    seen: dict[str, Any] = {}

    async def until_killed() -> None:
        await child.ready()
        async with DcanvasClient.connect(child.url) as c:
            a = await c.open(text=TEXT)
            a = await c.edit(a.doc_id, a.v, [MaskOp(start=4, end=7)])
            done = await c.generate(a.doc_id, a.v, max_steps=6, seed=4).result()
            assert isinstance(done, GenDone) and done.status == "completed" and done.proposal is not None
            seen["proposal"], seen["gen"] = done.proposal, done.gen
            # A disjoint edit moves the proposal (the move is stored with the edit).
            a = await c.edit(a.doc_id, a.v, [ReplaceOp(start=0, end=0, text="Yes. ")])
            seen["a"] = a
            # Another document is generating (a long run) when the server dies; it was edited meanwhile.
            b = await c.open(text=TEXT)
            b = await c.edit(b.doc_id, b.v, [MaskOp(start=19, end=22)])
            running = c.generate(b.doc_id, b.v, **SLOW)
            await running.start()
            seen["b0"] = b
            b = await c.edit(b.doc_id, b.v, [ReplaceOp(start=len(TEXT), end=len(TEXT), text=" Yes.")])
            seen["b"], seen["running"] = b, running.gen
            with pytest.raises(ConnectionLost):
                await c.accept(done.gen, a.v)

    try:
        asyncio.run(until_killed())
    finally:
        child.kill()
    child.wait_killed()
    _integrity(db)

    p, gen, a, b, b0 = seen["proposal"], seen["gen"], seen["a"], seen["b"], seen["b0"]
    accepted_text = "Yes. " + TEXT[: p.start] + p.text + TEXT[p.end :]
    with restarted(backend, db, tmp_path) as c:
        back = c.rpc({"type": "doc.open", "doc_id": a.doc_id})
        retry = c.rpc({"type": "proposal.accept", "gen": gen, "base_v": back["v"]})
        if die == "in-commit":  # nothing of the accept survived: the proposal is pending and accepts now, once
            assert (back["v"], back["text"]) == (a.v, a.text)
            assert (retry["type"], retry["text"], retry["v"]) == ("doc.state", accepted_text, a.v + 1), retry
        else:  # all of it survived: applied once, and the retry is told so
            assert (back["v"], back["text"]) == (a.v + 1, accepted_text)
            assert retry["code"] == "conflict" and "accepted" in retry["message"], retry
        again = c.rpc({"type": "proposal.accept", "gen": gen, "base_v": a.v + 1})
        assert again["code"] == "conflict"
        assert c.rpc({"type": "doc.open", "doc_id": a.doc_id})["text"] == accepted_text

        # The document that was generating: its acknowledged edit is there, nothing runs on it, and requests made
        # against its versions before the kill rebase exactly as they would have.
        state = c.rpc({"type": "doc.open", "doc_id": b.doc_id})
        assert (state["v"], state["text"], "gen" in state) == (b.v, b.text, False)
        assert c.rpc({"type": "gen.cancel", "gen": seen["running"]})["code"] == "not_found"
        typed = c.rpc({"type": "doc.edit", "doc_id": b.doc_id, "base_v": b0.v,
                       "ops": [{"op": "replace", "start": 0, "end": 3, "text": "One"}]})  # fmt: skip
        assert typed["type"] == "doc.state" and typed["text"] == "One" + b.text[3:]
        stale = c.rpc({"type": "doc.edit", "doc_id": b.doc_id, "base_v": b0.v,
                       "ops": [{"op": "replace", "start": len(TEXT), "end": len(TEXT), "text": "?"}]})  # fmt: skip
        assert (stale["code"], stale["data"]) == ("stale_version", {"current_v": typed["v"]})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_9_at_random_times_loses_nothing_acknowledged(model_dir: Path, backend: Backend, tmp_path: Path) -> None:
    """Many rounds: a server takes a random stream of edits, generations, accepts and rejects on two documents and
    is killed at a random moment. After each kill: every acknowledged change is there, at most the one request in
    flight went further, and every proposal the client was told of and had not settled is still pending."""
    db = tmp_path / "docs.db"
    rng = random.Random(20)
    docs: dict[str, tuple[int, str]] = {}  # doc_id -> (v, text) last acknowledged
    pending: dict[str, str] = {}  # gen -> doc_id: proposals the client saw and did not settle
    done: Counter[str] = Counter()  # acknowledged requests by kind
    for round_ in range(8):
        child = Child(model_dir, db, "never")
        loop_s = rng.uniform(0.3, 2.5)

        async def workload(child: Child, loop_s: float) -> None:
            await child.ready()
            async with DcanvasClient.connect(child.url) as c:
                while len(docs) < 2:
                    d = await c.open(text=TEXT)
                    docs[d.doc_id] = (d.v, d.text)
                for doc_id in docs:
                    await c.open(doc_id)
                asyncio.get_running_loop().call_later(loop_s, child.kill)
                try:
                    while True:
                        done[await _random_request(c, rng, docs, pending)] += 1
                except (ConnectionLost, OSError):
                    pass

        try:
            asyncio.run(workload(child, loop_s))
        finally:
            child.kill()
        child.wait_killed()
        _integrity(db)
        with restarted(backend, db, tmp_path) as c:
            ahead = 0
            for doc_id, (v, text) in docs.items():
                state = c.rpc({"type": "doc.open", "doc_id": doc_id})
                assert state["v"] in (v, v + 1) and "gen" not in state, (round_, state, v)
                if state["v"] == v:
                    assert state["text"] == text
                ahead += state["v"] == v + 1  # the one request in flight may have been saved
                docs[doc_id] = (state["v"], state["text"])
            assert ahead <= 1
            for gen in list(pending):
                assert c.rpc({"type": "proposal.reject", "gen": gen})["type"] == "ack", (round_, gen)
                del pending[gen]
    print(f"\nkill -9 rounds: {dict(done)}")
    assert done["edit"] >= 20 and done["generate"] >= 5 and done["accept"] >= 2, done


async def _random_request(c: DcanvasClient, rng: random.Random, docs: dict[str, tuple[int, str]],
                          pending: dict[str, str]) -> str:  # fmt: skip
    """One random request; returns what was acknowledged ("refused" for a typed error, "" for nothing sent)."""
    doc_id = rng.choice(sorted(docs))
    v, text = docs[doc_id]
    roll = rng.random()
    kind = "edit"
    try:
        if roll < 0.5:
            at = rng.randint(0, len(text))
            op = ReplaceOp(start=at, end=min(len(text), at + 2), text=rng.choice("ab "))
            state = await c.edit(doc_id, v, [op])
        elif roll < 0.7:
            start = rng.randint(0, max(0, min(len(text), 40) - 4))
            state = await c.edit(doc_id, v, [MaskOp(start=start, end=start + 3)])
        elif roll < 0.85:
            done = await c.generate(doc_id, v, max_steps=rng.randint(1, 8), seed=rng.randint(0, 99)).result()
            if done.status == "completed":
                pending[done.gen] = doc_id
            return "generate"
        elif pending:
            gen = rng.choice(sorted(pending))
            doc_id = pending.pop(gen)  # settled whatever the answer; a kill in flight is checked after the restart
            if rng.random() < 0.5:
                await c.reject(gen)
                return "reject"
            state = await c.accept(gen, docs[doc_id][0])
            kind = "accept"
        else:
            return ""
    except ProtocolError as e:
        assert e.code in ("stale_version", "conflict", "too_large", "invalid_params"), e
        return "refused"
    docs[doc_id] = (state.v, state.text)
    return kind

