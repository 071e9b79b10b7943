"""Admission control through the server: `busy` past the queue's bound (typed, retryable, with the queue's length
and the wait), the queue position in `gen.accepted`, fairness between sessions, cancelled, superseded and
disconnected requests leaving the queue at once, HTTP 429 with Retry-After from the same queue, and a burst of
writers waiting its turn (issue 47: after a tiny request, and on a fresh server) instead of being refused.

The engine has one row, and its denoising step is held on a gate: the first generation takes the row and stays
there, so everything after it waits in the queue for as long as the test wants. A `gen.done` that arrives while the
gate is shut can only come from the queue itself.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.engine.core import Engine, GenHandle
from canvas.engine.scheduling import LoadStats
from canvas.server.admission import AdmissionConfig
from canvas.server.gens import Generations
from tests.canvas.wsconn import Conn, Factory, served
from tests.canvas.wsconn import edit as _edit
from tests.canvas.wsconn import open_doc as _open

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Backend:
    return load_backend(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model")), max_batch=1)


@pytest.fixture
def gate(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Shut: the engine's one row is held at its first denoising step. Opened at the end, so servers can stop."""
    shut = threading.Event()
    engine = backend.engine
    step = engine._diffusion_step

    def held(rows: Any) -> None:
        shut.wait(30)
        step(rows)

    monkeypatch.setattr(engine, "_diffusion_step", held)
    yield shut
    shut.set()


_open_sockets: list[Any] = []  # websockets a test opened; closed before its servers stop


@pytest.fixture
def serve(backend: Backend, gate: threading.Event, tmp_path: Path) -> Iterator[Factory]:
    with served(backend, tmp_path) as make:
        yield make
        gate.set()  # before the servers stop: their engine must finish its held step
        while _open_sockets:
            _open_sockets.pop().__exit__(None, None, None)


def session(client: TestClient) -> Conn:
    connecting = client.websocket_connect("/ws")
    c = Conn(connecting.__enter__())
    _open_sockets.append(connecting)
    c.hello()
    return c


def disconnect(c: Conn) -> None:
    for i, ws in enumerate(_open_sockets):
        if ws is c.ws:
            _open_sockets.pop(i).__exit__(None, None, None)
            return
    raise AssertionError("not an open session")


def masked(c: Conn, text: str = "The cat sat on the mat.") -> dict[str, Any]:
    return _edit(c, _open(c, text), {"op": "mask", "start": 4, "end": 7})


def start(c: Conn, state: dict[str, Any]) -> dict[str, Any]:
    # Two steps: the gate, not the generation's length, keeps the row taken, and the teardown stays quick.
    params = {"max_steps": 2, "seed": 1}
    return c.rpc({"type": "gen.start", "doc_id": state["doc_id"], "base_v": state["v"], "params": params})


def engine_of(client: TestClient) -> Engine:
    engine: Engine = client.app.state.hub.backend.engine  # type: ignore[attr-defined]
    return engine


def handle(client: TestClient, gen: str) -> GenHandle:
    gens: Generations = client.app.state.hub.gens  # type: ignore[attr-defined]
    h = gens.runs[gen].handle
    assert h is not None
    return h


def hold_the_row(client: TestClient) -> Conn:
    """A session whose generation has the engine's one row (held at the gate)."""
    c = session(client)
    assert start(c, masked(c))["queue_position"] == 0
    deadline = time.monotonic() + 10
    while engine_of(client).load().active < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine_of(client).load().active == 1 and engine_of(client).load().queued == 0
    return c


def test_refusal_past_the_bound_is_a_typed_retryable_busy(serve: Factory) -> None:
    client = serve(admission=AdmissionConfig(max_queue=1))
    hold_the_row(client)
    b, c = session(client), session(client)
    waiting = start(b, masked(b))
    assert (waiting["type"], waiting["queue_position"]) == ("gen.accepted", 0)
    busy = start(c, masked(c))
    assert (busy["type"], busy["code"], busy["retryable"]) == ("error", "busy", True)
    data = busy["data"]
    assert (data["queue_length"], data["position"], data["max_queue"]) == (1, 1, 1)
    assert data["retry_after_s"] > 0 and (data["est_wait_s"] is None or data["est_wait_s"] > 0)
    health = client.get("/health").json()["queue"]
    assert (health["queued"], health["active"], health["max_queue"]) == (1, 1, 1) and health["refused"] >= 1


def test_queue_position_in_gen_accepted(serve: Factory) -> None:
    client = serve(admission=AdmissionConfig(max_queue=8))
    hold_the_row(client)
    conns = [session(client) for _ in range(3)]
    positions = [start(c, masked(c))["queue_position"] for c in conns]
    assert positions == [0, 1, 2]
    assert engine_of(client).load().queued == 3


def test_a_flooding_session_cannot_starve_another(serve: Factory) -> None:
    """The flooder's requests interleave with everyone else's first (round-robin over sessions), and when the queue
    is full its extra requests are the ones refused."""
    client = serve(admission=AdmissionConfig(max_queue=2))
    flooder = hold_the_row(client)  # its first generation has the row
    docs = [masked(flooder, f"Text number {i} is here.") for i in range(3)]
    a2, a3 = (start(flooder, d) for d in docs[:2])
    assert (a2["queue_position"], a3["queue_position"]) == (0, 1)
    refused = start(flooder, docs[2])  # would wait for 3 rows to free up: one more than the bound
    assert refused["code"] == "busy"
    other = session(client)
    b1 = start(other, masked(other))  # ahead of the flooder's third: only its second is before it
    assert (b1["type"], b1["queue_position"]) == ("gen.accepted", 1)
    order = [h.id for h in engine_of(client).queue_order()]
    assert order == [handle(client, g["gen"]).id for g in (a2, b1, a3)]


def test_cancelled_superseded_and_disconnected_requests_leave_the_queue_at_once(serve: Factory) -> None:
    client = serve(admission=AdmissionConfig(max_queue=8))
    hold_the_row(client)
    engine = engine_of(client)
    a = session(client)
    doc = masked(a)
    first = start(a, doc)
    assert engine.load().queued == 1
    # Superseded: a new gen.start on the same document takes the old one's place, at once.
    second = start(a, doc)
    assert second["queue_position"] == 0 and a.until("gen.done", gen=first["gen"])["status"] == "superseded"
    assert engine.queue_order() == [handle(client, second["gen"])]
    # Cancelled: gen.done comes while the engine is still held, so it came from the queue.
    assert a.rpc({"type": "gen.cancel", "gen": second["gen"]})["type"] == "ack"
    assert a.until("gen.done", gen=second["gen"])["status"] == "cancelled"
    assert engine.load().queued == 0
    # Disconnected: a session that goes away takes its queued requests with it.
    gone = session(client)
    start(gone, masked(gone))
    assert engine.load().queued == 1
    disconnect(gone)
    deadline = time.monotonic() + 10
    while engine.load().queued and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.load().queued == 0


def test_a_refused_gen_start_leaves_the_running_generation_alone(serve: Factory, gate: threading.Event) -> None:
    client = serve(admission=AdmissionConfig(max_queue=1))
    holder = session(client)
    doc = masked(holder)
    running = start(holder, doc)
    deadline = time.monotonic() + 10
    while engine_of(client).load().active < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    other = session(client)
    start(other, masked(other))  # the one place in the queue
    again = start(holder, doc)  # would supersede the running one, but cannot queue
    assert again["code"] == "busy"
    assert running["gen"] in client.app.state.hub.gens.runs  # type: ignore[attr-defined]
    gate.set()
    assert holder.until("gen.done", gen=running["gen"])["status"] == "completed"


def test_http_maps_busy_to_429_with_retry_after(serve: Factory) -> None:
    client = serve(admission=AdmissionConfig(max_queue=1))
    hold_the_row(client)
    # n=2 from one client: the first choice would queue, the second would wait for two rows: refused, all or none.
    r = client.post("/v1/completions", json={"prompt": "The cat", "max_tokens": 2, "n": 2})
    assert r.status_code == 429 and r.json()["error"]["code"] == "server_busy"
    assert int(r.headers["retry-after"]) >= 1
    assert engine_of(client).load().queued == 0  # the first choice left the queue with the refusal
    waiting = session(client)
    start(waiting, masked(waiting))  # the queue's one place
    r = client.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 2})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert client.get("/health").json()["http_generations"]["running"] == 0


def test_a_request_right_after_one_cut_early_is_not_refused(serve: Factory, gate: threading.Event,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A response cut before its engine generation ended (here a stop sequence in the first of three canvases) is
    answered while its row is still in the engine, which retires it at its next step. A request sent right after
    that answer must count that row as free, even with no room to queue (max_queue 0, one row): no 429."""
    client = serve(admission=AdmissionConfig(max_queue=0, first_frame_slo=None))
    gate.set()  # this test holds the engine its own way
    engine = engine_of(client)
    body = {"prompt": "The cat", "max_tokens": 3 * engine.L, "seed": 7, "temperature": 0, "dcanvas": {"max_steps": 2}}
    first = client.post("/v1/completions", json=body)
    assert first.status_code == 200, first.text
    text = first.json()["choices"][0]["text"]
    assert len(text) >= 2, text  # the seed is chosen so that the first canvas holds text to stop at
    stop = text[:2]  # found in the first canvas: the response ends there, two canvases early

    answered = threading.Event()
    step = engine._diffusion_step

    def held(rows: Any) -> None:
        step(rows)
        # After the second canvas's first step: its frame tells the server the first canvas is committed, and the
        # engine waits here, before the next step would notice the cancellation and retire the row.
        if any(r.canvases and r.step_in_canvas == 1 for r in rows):
            answered.wait(30)

    monkeypatch.setattr(engine, "_diffusion_step", held)
    try:
        cut = client.post("/v1/completions", json={**body, "stop": [stop]})
        assert cut.status_code == 200 and cut.json()["choices"][0]["finish_reason"] == "stop", cut.text
        assert engine.load().active == 1  # its row is still held in the engine
        again = client.post("/v1/completions", json={**body, "max_tokens": 2})
    finally:
        answered.set()
    assert again.status_code == 200, again.text


def test_a_burst_of_writers_on_a_fresh_server_queues_rather_than_is_refused(serve: Factory) -> None:
    """A fresh server (its engine has measured one generation) whose one row is taken: nine writers asking at once
    all wait their turn under the sized bound (`max_queue` auto). Before issue 47 the bound was the rows freeing up
    within half a first frame, 0 here, and every one of them was refused."""
    client = serve()
    engine = engine_of(client)
    # What a fresh server has measured after one generation: 2 steps of 10 ms, its first frame after one. Set, not
    # measured here: on a test machine shared with other work a step can take seconds, and the bound would say so.
    engine.stats = LoadStats()
    engine.stats.step_s.add(0.01)
    engine.stats.gen_steps.append(2)
    engine.stats.add_first_frame(0.01, 100, alone=True)
    hold_the_row(client)
    writers = [session(client) for _ in range(9)]
    replies = [start(w, masked(w)) for w in writers]
    assert [r["type"] for r in replies] == ["gen.accepted"] * 9, replies
    assert [r["queue_position"] for r in replies] == list(range(9))
    assert all(0 < r["est_wait_s"] <= AdmissionConfig().max_wait_s for r in replies)
    queue = client.get("/health").json()["queue"]
    assert queue["refused"] == 0 and queue["queued"] == 9 and queue["max_queue"] >= 9


@pytest.fixture(scope="module")
def four_rows(tmp_path_factory: pytest.TempPathFactory) -> Backend:
    """Four rows, and three steps a canvas (a random model never settles): fills that end soon."""
    b = load_backend(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model-4")), max_batch=4)
    return dataclasses.replace(b, sampler_defaults=dataclasses.replace(b.sampler_defaults, max_steps=3))


def test_after_a_tiny_request_eight_concurrent_fills_all_succeed(four_rows: Backend, tmp_path: Path) -> None:
    """Issue 47: a request with an empty prefix and suffix had the fastest first frame ever seen; as the baseline it
    made every later fill read as over the SLO, the row cap fell to 1 and the bound to 0, and of 8 concurrent fills
    most got 429. Now the baseline is per token among requests of comparable size and the queue holds a burst.
    The wait allowed is long here: on a test machine shared with other work a step of even this model can take a
    second, and a second's wait (the default, checked with set measurements above) would rightly refuse then."""
    with served(four_rows, tmp_path) as make:
        client = make(admission=AdmissionConfig(max_wait_s=120))
        tiny = client.post("/infill", json={"input_prefix": "", "input_suffix": "", "n_predict": 4})
        assert tiny.status_code == 200, tiny.text
        bodies = [{"input_prefix": f"Note {i}: the cat", "input_suffix": " on the mat.", "n_predict": 8, "seed": i}
                  for i in range(8)]
        with ThreadPoolExecutor(max_workers=8) as pool:
            answers = list(pool.map(lambda body: client.post("/infill", json=body), bodies))
        assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers if r.status_code != 200]
        queue = client.get("/health").json()["queue"]
        assert (queue["admitted"], queue["refused"]) == (9, 0)
