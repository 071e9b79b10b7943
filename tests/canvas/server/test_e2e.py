"""End to end: a real `dcanvas serve` process on loopback, driven by `canvas.protocol.client` over real websockets.

hello -> open -> mask -> gen.start -> >= 3 progress frames -> done -> accept -> undo; then `kill -9` the server in
the middle of a stream of edits and check that a restarted server has every acknowledged one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from canvas.engine.backend import write_tiny_checkpoint
from canvas.protocol import GenDone, GenProgress, MaskOp, ProtocolError, ReplaceOp
from canvas.protocol.client import ConnectionLost, DcanvasClient

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # a server process starts in ~10 s, ~25 s in all
TEXT = "The cat sat on the mat. It was a warm day."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, model: Path, db: Path) -> None:
        self.port = _free_port()
        self.url = f"ws://127.0.0.1:{self.port}/ws"
        cmd = [sys.executable, "-m", "canvas.cli", "serve", "--port", str(self.port), "--model", str(model),
               "--db", str(db), "--log-level", "warning"]  # fmt: skip
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dcanvas serve exited: {self.proc.stdout.read() if self.proc.stdout else ''}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                    self.health = json.loads(r.read())
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise TimeoutError("dcanvas serve did not come up")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def server(model_dir: Path, tmp_path: Path) -> Iterator[Server]:
    s = Server(model_dir, tmp_path / "docs.db")
    yield s
    s.stop()


def test_edit_generate_accept_undo_over_real_websockets(server: Server) -> None:
    assert server.health["status"] == "ok" and server.health["protocol"] == "dcanvas/1"

    async def session() -> None:
        broadcasts = []
        async with DcanvasClient.connect(server.url) as c:
            assert c.welcome is not None and c.welcome.model.canvas_length == 32
            async with DcanvasClient.connect(server.url, on_state=broadcasts.append) as watcher:
                doc = await c.open(text=TEXT)
                await watcher.open(doc.doc_id)
                doc = await c.edit(doc.doc_id, doc.v, [MaskOp(start=4, end=7)])
                gen = c.generate(doc.doc_id, doc.v, max_steps=48, seed=5)
                events = [ev async for ev in gen]
                progress = [e for e in events if isinstance(e, GenProgress)]
                assert len(progress) >= 3, len(progress)
                assert [p.seq for p in progress] == list(range(1, len(progress) + 1))
                done = events[-1]
                assert isinstance(done, GenDone) and done.status == "completed" and done.proposal is not None
                p = done.proposal
                accepted = await c.accept(gen.gen, doc.v)
                assert accepted.text == TEXT[: p.start] + p.text + TEXT[p.end :]
                undone = await c.undo(doc.doc_id)
                assert undone.text == TEXT and undone.v == accepted.v + 1
                await asyncio.sleep(0.2)
                assert [s.v for s in broadcasts if s.re is None][-1] == undone.v  # the watcher saw every change
                with pytest.raises(ProtocolError) as info:
                    await c.edit(doc.doc_id, 0, [ReplaceOp(start=4, end=7, text="dog")])
                assert info.value.code == "stale_version" and info.value.data == {"current_v": undone.v}

    asyncio.run(session())


def test_kill_9_loses_no_acknowledged_edit(model_dir: Path, tmp_path: Path) -> None:
    db = tmp_path / "docs.db"
    first = Server(model_dir, db)
    acked: list[tuple[str, int, str]] = []

    async def type_until_killed() -> None:
        async with DcanvasClient.connect(first.url) as c:
            doc = await c.open(text="")
            killer = asyncio.get_running_loop().call_later(1.0, os.kill, first.proc.pid, signal.SIGKILL)
            try:
                for i in range(100_000):
                    doc = await c.edit(doc.doc_id, doc.v, [ReplaceOp(start=len(doc.text), end=len(doc.text),
                                                                     text=f"{i % 10}")])  # fmt: skip
                    acked.append((doc.doc_id, doc.v, doc.text))
            except ConnectionLost:
                pass
            finally:
                killer.cancel()

    asyncio.run(type_until_killed())
    first.stop()
    assert first.proc.returncode == -signal.SIGKILL and len(acked) >= 10
    second = Server(model_dir, db)
    try:

        async def check() -> None:
            async with DcanvasClient.connect(second.url) as c:
                doc_id, v, text = acked[-1]
                back = await c.open(doc_id)
                assert back.v >= v and back.text.startswith(text)  # the last acknowledged edit (or one more)

        asyncio.run(check())
    finally:
        second.stop()
