"""`dcanvas serve --ray` for real: a local Ray cluster started by the test, engine replicas of the tiny model on Ray
Serve, and `dcanvas serve --ray --ray-address ...` ingress processes in front of them, driven over websockets.

Quick (default suite): two replicas behind one ingress; several clients run the whole dcanvas/1 flow (open, mask,
gen.start, progress, gen.done, proposal.accept) on several documents, one cancels a long generation (the replica
frees its row), and an HTTP completion with two choices; the per-replica counters on /health show generations on
both replicas. Slow: a replica killed mid-generation
(`ray.kill` of its actor) ends that generation with `unavailable`, the document is as it was, and the next
gen.start is served; an application deployed with one replica scaled to two (`dcanvas cluster scale`) without
restarting its ingress, the new replica taking work; and two ingresses in front of the same replicas sharing their
documents through PostgreSQL (the whole deployment of the README).
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
from typing import Any

import pytest

from canvas.engine.backend import write_tiny_checkpoint
from canvas.protocol import GenDone, GenProgress, MaskOp
from canvas.protocol.client import DcanvasClient
from tests.canvas.wsconn import SLOW, TEXT

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.timeout(240)


def _env() -> dict[str, str]:
    """This process's environment as it is now: after `ray.init`, it says the cluster uses token authentication."""
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Ingress:
    """A `dcanvas serve --ray` process joined to the test's Ray cluster."""

    def __init__(self, model: Path, db: Path | str, address: str, replicas: int, app: str) -> None:
        self.port, self.app = _free_port(), app
        self.url = f"ws://127.0.0.1:{self.port}/ws"
        args = [sys.executable, "-m", "canvas.cli", "serve", "--ray", "--replicas", str(replicas), "--ray-address",
                address, "--ray-app", app, "--model", str(model), "--db", str(db), "--port", str(self.port),
                "--max-batch", "4", "--threads", "1", "--log-level", "warning"]
        self.proc = subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def wait_for(self, what: str, ok: Any, timeout: float = 120) -> dict[str, Any]:
        """/health's queue figures once `ok(queue)` holds."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the ingress exited: {self.close()}")
            try:
                last = self.health()["queue"]
                if ok(last):
                    return last
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{what}: /health queue is {last}")

    def close(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the ingress deletes the application it deployed
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout is None or self.proc.stdout.closed:
            return ""
        with self.proc.stdout:
            return self.proc.stdout.read()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    # Logical CPUs (Ray schedules a replica per CPU); each engine runs one torch thread.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def two(model_dir: Path, ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ingress]:
    ingress = Ingress(model_dir, tmp_path_factory.mktemp("two") / "docs.db", ray_address, 2, "two")
    try:
        ingress.wait_for("two replicas", lambda q: q["replicas_live"] == 2)
        yield ingress
    finally:
        ingress.close()


async def _edit_generate_accept(url: str, n_docs: int, seed: int) -> list[str]:
    """One client: `n_docs` documents, each masked, generated (progress seen) and accepted; their final texts."""
    texts = []
    async with DcanvasClient.connect(url) as c:
        for k in range(n_docs):
            doc = await c.open(text=TEXT)
            doc = await c.edit(doc.doc_id, doc.v, [MaskOp(start=4, end=7)])
            gen = await c.generate(doc.doc_id, doc.v, max_steps=6, seed=seed * 10 + k)
            assert gen.accepted is not None and gen.accepted.doc_id == doc.doc_id
            events = [ev async for ev in gen]
            done = events[-1]
            assert isinstance(done, GenDone) and done.status == "completed", done
            assert any(isinstance(ev, GenProgress) for ev in events[:-1]) and done.proposal is not None
            accepted = await c.accept(done.gen, doc.v)
            assert accepted.v == doc.v + 1 and accepted.text.endswith(TEXT[7:])
            texts.append(accepted.text)
    return texts


async def _cancelled(url: str) -> None:
    """One client cancels a long generation after its first frame: gen.done says cancelled, the text is unchanged."""
    async with DcanvasClient.connect(url) as c:
        doc = await c.open(text=TEXT)
        doc = await c.edit(doc.doc_id, doc.v, [MaskOp(start=4, end=7)])
        gen = await c.generate(doc.doc_id, doc.v, seed=5, **SLOW)
        assert isinstance(await gen.__anext__(), GenProgress)
        await c.cancel(gen.gen)
        done = [ev async for ev in gen][-1]
        assert isinstance(done, GenDone) and done.status == "cancelled"
        assert (await c.open(doc.doc_id)).text == TEXT


def test_clients_on_two_replicas(two: Ingress) -> None:
    before = sum(two.health()["queue"]["generations_by_replica"].values())

    async def clients() -> list[list[str]]:
        runs = await asyncio.gather(*(_edit_generate_accept(two.url, 2, seed) for seed in range(4)),
                                    _cancelled(two.url))
        return [r for r in runs if r is not None]

    texts = asyncio.run(clients())
    assert sum(len(t) for t in texts) == 8
    # The HTTP routes go through the same replicas (no affinity: Serve's router picks).
    body = json.dumps({"prompt": "The cat sat", "max_tokens": 4, "n": 2, "seed": 3}).encode()
    post = urllib.request.Request(f"http://127.0.0.1:{two.port}/v1/completions", body,
                                  {"content-type": "application/json"})
    with urllib.request.urlopen(post, timeout=60) as r:
        assert len(json.loads(r.read())["choices"]) == 2
    # Replicas post their counters every second: wait until all 11 generations are counted and over (a post taken
    # while the last one ran counts it started and still active), then both replicas served some.
    queue = two.wait_for("11 generations counted",
                         lambda q: sum(q["generations_by_replica"].values()) >= before + 11 and q["active"] == 0,
                         timeout=30)
    by_replica = queue["generations_by_replica"]
    assert len(by_replica) == 2 and all(n > 0 for n in by_replica.values()), by_replica
    # The cancelled one: its stream was cancelled, and its replica cancelled the engine's row (counted abandoned).
    assert sum(r.get("abandoned", 0) for r in queue["replicas"]) == 1, queue["replicas"]
    assert queue["ingress_unavailable"] == 0


@pytest.mark.slow
def test_a_replica_killed_mid_generation(two: Ingress) -> None:
    async def scenario() -> str:
        async with DcanvasClient.connect(two.url) as c:
            doc = await c.open(text=TEXT)
            doc = await c.edit(doc.doc_id, doc.v, [MaskOp(start=4, end=7)])
            gen = await c.generate(doc.doc_id, doc.v, seed=1, **SLOW)
            first = await gen.__anext__()
            assert isinstance(first, GenProgress)
            # The replica running it, as the ingress knows it (the generation lasts under a second: kill it now).
            queue = two.health()["queue"]
            (replica,) = queue["running_by_replica"]
            (victim,) = [r for r in queue["replicas"] if r["replica"] == replica]
            ray.kill(ray.get_actor(victim["actor"], namespace="serve"), no_restart=True)
            events = [ev async for ev in gen]
            done = events[-1]
            assert isinstance(done, GenDone) and done.status == "unavailable" and done.proposal is None, done
            assert done.message is not None and victim["replica"] in done.message
            # Nothing in the document was lost: same version, same text, same mask; the next gen.start is served.
            again = await c.open(doc.doc_id)
            assert (again.v, again.text, again.spans) == (doc.v, doc.text, doc.spans)
            retry = await c.generate(doc.doc_id, doc.v, max_steps=6, seed=2).result()
            assert retry.status == "completed" and retry.proposal is not None
            accepted = await c.accept(retry.gen, doc.v)
            assert accepted.v == doc.v + 1
            return str(victim["replica"])

    victim = asyncio.run(scenario())
    # Serve replaces the dead replica (a new id; the dead one's last post goes stale); the ingress serves throughout.
    two.wait_for("the dead replica replaced",
                 lambda q: q["replicas_live"] == 2 and victim not in q["generations_by_replica"], timeout=120)


@pytest.mark.slow
def test_scaling_one_replica_to_two_without_restarting_the_ingress(
    model_dir: Path, ray_address: str, tmp_path: Path
) -> None:
    one = Ingress(model_dir, tmp_path / "docs.db", ray_address, 1, "scaled")
    try:
        queue = one.wait_for("one replica", lambda q: q["replicas_live"] == 1)
        (first,) = queue["generations_by_replica"]
        scale = subprocess.run([sys.executable, "-m", "canvas.cli", "cluster", "scale", "--replicas", "2",
                                "--ray-address", ray_address, "--app", "scaled"],
                               env=_env(), capture_output=True, text=True, timeout=180)
        assert scale.returncode == 0, scale.stdout + scale.stderr
        queue = one.wait_for("two replicas", lambda q: q["replicas_live"] == 2)

        async def clients() -> list[list[str]]:
            return await asyncio.gather(*(_edit_generate_accept(one.url, 2, seed) for seed in range(4)))

        asyncio.run(clients())
        queue = one.wait_for("8 generations counted", lambda q: sum(q["generations_by_replica"].values()) >= 8)
        new = [r for r in queue["generations_by_replica"] if r != first]
        assert len(new) == 1 and queue["generations_by_replica"][new[0]] > 0, queue["generations_by_replica"]
    finally:
        one.close()


@pytest.mark.slow
def test_two_ingresses_share_the_replicas_and_the_documents(model_dir: Path, ray_address: str, pg_url: str) -> None:
    """The README's full deployment: two `dcanvas serve --ray --db postgresql://...` ingresses, the first deploying two
    replicas and the second attaching to them; one client on each edits, generates and accepts on one document."""
    first = Ingress(model_dir, pg_url, ray_address, 2, "shared")
    second: Ingress | None = None
    try:
        first.wait_for("two replicas", lambda q: q["replicas_live"] == 2)
        second = Ingress(model_dir, pg_url, ray_address, 2, "shared")
        second.wait_for("attached to the two replicas", lambda q: q["replicas_live"] == 2)

        async def scenario(a_url: str, b_url: str) -> None:
            seen_by_a: list[int] = []
            async with DcanvasClient.connect(a_url, on_state=lambda s: seen_by_a.append(s.v)) as a, \
                    DcanvasClient.connect(b_url) as b:
                doc = await a.open(text=TEXT)
                masked = await b.edit(doc.doc_id, (await b.open(doc.doc_id)).v, [MaskOp(start=4, end=7)])
                # A's client hears of B's edit (pushed), and generates on the version B made.
                for _ in range(100):
                    if masked.v in seen_by_a:
                        break
                    await asyncio.sleep(0.05)
                assert masked.v in seen_by_a
                done = await a.generate(doc.doc_id, masked.v, max_steps=6, seed=1).result()
                assert done.status == "completed" and done.proposal is not None, done
                # B accepts the proposal A's generation left (any session may settle it once it is stored).
                accepted = await b.accept(done.gen, masked.v)
                assert accepted.v == masked.v + 1 and accepted.text.endswith(TEXT[7:])
                assert (await a.open(doc.doc_id)).text == accepted.text

        asyncio.run(scenario(first.url, second.url))
    finally:
        if second is not None:
            second.close()
        first.close()
