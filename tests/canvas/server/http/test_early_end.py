"""However a generation ends early, no slot the model has not written reaches a client as text.

AR mode writes a canvas left to right; the slots it has not reached still hold the canvas's initial noise. Every
request here runs in AR mode on the tiny random model, its engine's `submit` recorded, so what a client got is
checked against the engine's own frames: every text (a result, a streamed delta, a draft) must be a prefix, cut at
a token boundary, of what the model had written by some frame of that generation (`Frame.written`), and a text cut
where it goes on must end at a word boundary. The model's newline logit is raised (about one token in five is a
newline) so that drafts hold line ends when `t_max_predict_ms` (the first draft after the limit) ends them.
Paths: the time limit (/infill, /v1/completions, chat; streamed and not), the token budget, a stop sequence, a client
that goes away mid-stream, a closed run, and the websocket's `gen.progress` slots.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from starlette.testclient import TestClient

from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.engine.core import Done, Event, Frame, GenHandle, GenRequest
from canvas.protocol import SlotUpdate
from canvas.sampling.modes import ModeDefaults
from canvas.server.embedded import EmbeddedServer
from canvas.server.http.textgen import TextTask, plan
from canvas.server.http.textrun import Delta, Finish, TextRun
from tests.canvas.wsconn import Conn, Factory, edit, generate, open_doc, served

pytestmark = pytest.mark.timeout(300)
NEWLINE_BIAS = 4.5  # added to the newline token's logit: ~20% of AR tokens become newlines (356-token vocabulary)
PREFIX = "The cat sat on the mat and watched the rain.\n"
SUFFIX = "\nOnce upon a time there was a small house by a river.\n"


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    b = load_backend(write_tiny_checkpoint(Path(tmp_path_factory.mktemp("tiny"))), max_batch=4)
    model = b.engine.model
    newline = next(i for i in range(model.config.vocab_size) if b.token_text(i) == "\n")
    logits = model.logits

    def biased(h: torch.Tensor, quant: bool = False) -> torch.Tensor:
        out = logits(h, quant)
        out[..., newline] += NEWLINE_BIAS
        return out

    model.logits = biased  # type: ignore[method-assign]
    defaults = dataclasses.replace(b.sampler_defaults, ar_temperature=1.0, ar_drafts=4)
    yield dataclasses.replace(b, sampler_defaults=defaults, mode_defaults=ModeDefaults("ar", "ar"))
    del model.logits  # back to the class's method


@dataclass
class Gen:
    request: GenRequest
    events: list[Event] = field(default_factory=list)


@pytest.fixture
def gens(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> list[Gen]:
    """Every generation submitted to the engine while the test runs, with every event it was sent."""
    out: list[Gen] = []
    submit = backend.engine.submit

    def spy(req: GenRequest, on_event: Callable[[Event], None] | None = None, **kwargs: Any) -> GenHandle:
        gen = Gen(req)
        out.append(gen)

        def record(ev: Event) -> None:
            gen.events.append(ev)
            if on_event is not None:
                on_event(ev)

        return submit(req, record, **kwargs)

    monkeypatch.setattr(backend.engine, "submit", spy)
    return out


@pytest.fixture
def client(backend: Backend, tmp_path: Path) -> Iterator[TestClient]:
    with served(backend, tmp_path) as make:
        yield make()


@pytest.fixture
def serve(backend: Backend, tmp_path: Path) -> Iterator[Factory]:
    with served(backend, tmp_path) as make:
        yield make


# -- what the model wrote, from the engine's own frames ------------------------------------------------------------


def _canvas_ids(backend: Backend, req: GenRequest, canvas: int, draft: tuple[int, ...],
                written: tuple[bool, ...] | None) -> tuple[list[int], bool]:
    """The ids the model had written in a canvas's generated slots, in order (nulls dropped), and whether EOS ended
    them."""
    L = backend.canvas_length
    free = [k for k in range(len(req.slot_ids) or L) if canvas > 0 or not (req.pinned and req.pinned[k])]
    ids: list[int] = []
    for k in free:
        if written is not None and not written[k]:
            break
        if draft[k] == backend.eos_id:
            return ids, True
        if draft[k] != backend.null_id:
            ids.append(draft[k])
    return ids, False


def _lane_views(f: Frame) -> list[tuple[tuple[int, ...], tuple[bool, ...] | None]]:
    """A frame's canvas as drawn, and, where it carries an AR infill's drafts side by side, the canvas with each
    draft's tokens written in the gap instead (a time limit may take any of them: `draft_ends.deadline_end`)."""
    views = [(f.draft, f.written)]
    d = f.drafts
    if d is None or d.chosen is not None or f.written is None:
        return views
    for lane in d.tokens:
        canvas, written = list(f.draft), list(f.written)
        canvas[d.start : d.start + len(lane)] = lane
        written[d.start : d.end] = [i < len(lane) for i in range(d.end - d.start)]
        views.append((tuple(canvas), tuple(written)))
    return views


def written_texts(backend: Backend, gens: list[Gen]) -> list[list[str]]:
    """For each frame of each generation (and each of its drafts): the texts of every token prefix of what the model
    had written by then."""
    out = []
    for gen in gens:
        frames = [e for e in gen.events if isinstance(e, Frame)]
        last = {f.canvas_index: f for f in frames}  # an AR canvas's last frame is the committed, fully written one
        for f in frames:
            ids: list[int] = []
            for c in range(f.canvas_index):
                more, eos = _canvas_ids(backend, gen.request, c, last[c].draft, last[c].written)
                ids += more
            for draft, written in _lane_views(f):
                more, _ = _canvas_ids(backend, gen.request, f.canvas_index, draft, written)
                out.append([backend.tokenizer.decode((ids + more)[:k]) for k in range(len(ids) + len(more) + 1)])
    return out


def _word(c: str) -> bool:
    return c.isalnum() or c == "_"


def check_written(backend: Backend, gens: list[Gen], text: str, *, word_end: bool = False, strip: bool = False,
                  stop: str | None = None) -> None:
    """`text` is a token prefix of what the model had written by some frame (`strip`: less leading whitespace, as a
    chat turn starts; `stop`: the text was cut before this stop sequence, which the model wrote next). `word_end`:
    the text was cut where it goes on, so it ends at a word boundary (or holds none: one word)."""
    for prefixes in written_texts(backend, gens):
        if stop is not None:
            if (prefixes[-1].lstrip() if strip else prefixes[-1]).startswith(text + stop):
                return
            continue
        for k, full in enumerate(prefixes):
            if (full.lstrip() if strip else full) != text:
                continue
            if not word_end or not text or not _word(text[-1]) or all(_word(c) for c in text[1:]):
                return
            after = prefixes[k + 1][len(full) :] if k + 1 < len(prefixes) else ""
            if after and not _word(after[0]):
                return
    raise AssertionError(f"{text!r} is not what the model wrote{' (at a word end)' if word_end else ''}")


def sse(text: str) -> list[dict[str, Any]]:
    return [json.loads(b.removeprefix("data: ")) for b in text.split("\n\n") if b.startswith("data: {")]


def finished(gens: list[Gen], wait_s: float = 10.0) -> list[Done]:
    """The generations' `Done`s, waiting up to `wait_s` for one (a cancelled row's comes from the engine's thread)."""
    deadline = time.monotonic() + wait_s
    while True:
        out = [e for g in gens for e in g.events if isinstance(e, Done)]
        if out or time.monotonic() >= deadline:
            return out
        time.sleep(0.01)


# -- llama.cpp's /infill, as llama.vim sends it --------------------------------------------------------------------


def test_infill_time_limit_returns_only_what_was_written(client: TestClient, backend: Backend,
                                                         gens: list[Gen]) -> None:
    """llama.vim's FIM request (t_max_predict_ms 1000, 250 on follow-ups: here 1 ms): the suggestion ends at the
    first draft after the limit, with what the model had written, never the noise after it."""
    ended = []
    for seed in range(4):
        gens.clear()
        body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 24, "seed": seed, "t_max_predict_ms": 1}
        r = client.post("/infill", json=body).json()
        check_written(backend, gens, r["content"], word_end=r["dcanvas"]["end"] == "time")
        assert r["tokens_predicted"] == r["timings"]["predicted_n"] <= 24
        if r["dcanvas"]["end"] == "time":
            assert r["stop_type"] == "limit"
            ended.append(seed)
    assert ended, "the time limit never ended an infill"


def test_infill_stream_time_limit_drafts_and_deltas(client: TestClient, backend: Backend, gens: list[Gen]) -> None:
    body = {"input_prefix": PREFIX, "input_suffix": "", "n_predict": 64, "seed": 3, "t_max_predict_ms": 1,
            "stream": True}
    chunks = sse(client.post("/infill", json=body).text)
    final = chunks[-1]
    end = final["dcanvas"]["end"]
    assert final["stop"] is True and final["stop_type"] == {"time": "limit", "length": "limit", "eos": "eos"}[end]
    streamed = "".join(c["content"] for c in chunks)
    check_written(backend, gens, streamed, word_end=end != "eos")
    drafts = [c["dcanvas"]["draft"] for c in chunks[:-1] if "dcanvas" in c]
    assert drafts
    for d in drafts:
        check_written(backend, gens, d)
    if end == "time":
        assert finished(gens)[0].status == "cancelled"  # the time limit freed its engine row


def test_infill_budget_and_stop_word(client: TestClient, backend: Backend, gens: list[Gen]) -> None:
    r = client.post("/infill", json={"input_prefix": PREFIX, "n_predict": 12, "seed": 4}).json()
    assert r["dcanvas"]["end"] in ("length", "eos") and r["tokens_predicted"] <= 12  # EOS: the model may write it
    check_written(backend, gens, r["content"], word_end=r["dcanvas"]["end"] == "length")
    gens.clear()
    r = client.post("/infill", json={"input_prefix": PREFIX, "n_predict": 40, "seed": 4, "stop": ["\n"]}).json()
    assert r["stop_type"] == "word" and r["stopping_word"] == "\n" and "\n" not in r["content"]
    check_written(backend, gens, r["content"], stop="\n")
    assert r["tokens_cached"] == len(gens[0].request.context_ids)  # the same context as the request before


# -- the OpenAI routes ---------------------------------------------------------------------------------------------


def test_completions_time_limit_streamed_and_not(client: TestClient, backend: Backend, gens: list[Gen]) -> None:
    body = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 24, "seed": 5, "t_max_predict_ms": 1, "n": 2}
    r = client.post("/v1/completions", json=body).json()
    for choice in r["choices"]:
        check_written(backend, gens, choice["text"])
        assert choice["finish_reason"] in ("stop", "length")
    gens.clear()
    chunks = sse(client.post("/v1/completions", json={**body, "suffix": None, "max_tokens": 64, "stream": True}).text)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        check_written(backend, gens, "".join(c["text"] for c in mine), word_end=mine[-1]["finish_reason"] == "length")
        for c in mine:
            if "dcanvas" in c:
                check_written(backend, gens, c["dcanvas"]["draft"])
        assert mine[-1]["finish_reason"] in ("stop", "length")


def test_completion_budget_and_stop(client: TestClient, backend: Backend, gens: list[Gen]) -> None:
    r = client.post("/v1/completions", json={"prompt": PREFIX, "max_tokens": 10, "seed": 6}).json()
    (choice,) = r["choices"]
    assert r["usage"]["completion_tokens"] <= 10
    check_written(backend, gens, choice["text"], word_end=choice["finish_reason"] == "length")
    gens.clear()
    r = client.post("/v1/completions", json={"prompt": PREFIX, "max_tokens": 40, "seed": 6, "stop": "\n"}).json()
    (choice,) = r["choices"]
    assert choice["finish_reason"] == "stop" and "\n" not in choice["text"]
    check_written(backend, gens, choice["text"], stop="\n")


def test_chat_time_limit_streamed_and_not(client: TestClient, backend: Backend, gens: list[Gen]) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me about the cat."}], "max_tokens": 64, "seed": 8,
            "t_max_predict_ms": 1}
    r = client.post("/v1/chat/completions", json=body).json()
    check_written(backend, gens, r["choices"][0]["message"]["content"], strip=True)
    gens.clear()
    chunks = sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    check_written(backend, gens, text, strip=True)
    for c in chunks:
        if c["choices"] and "dcanvas" in c["choices"][0]:
            check_written(backend, gens, c["choices"][0]["dcanvas"]["draft"], strip=True)


# -- cancellation: a closed run, a client that goes away ----------------------------------------------------------


async def test_a_closed_run_sent_only_written_text(backend: Backend, gens: list[Gen]) -> None:
    task = TextTask(PREFIX, max_tokens=96, config=dataclasses.replace(backend.sampler_defaults, mode="ar"), seed=9)
    run = TextRun(backend, plan(backend, task, max_context=99), task)  # straight into the engine: no server
    backend.engine.start()
    try:
        await run.start()
        sent = ""
        stream = run.events()
        async for ev in stream:
            assert not isinstance(ev, Finish)
            if isinstance(ev, Delta):
                sent += ev.text
                break  # a canvas was committed: then the client goes away
        await stream.aclose()
        assert (await _wait(run)).status == "cancelled"
    finally:
        backend.engine.stop()
    check_written(backend, gens, sent)
    assert sent


async def _wait(run: TextRun) -> Done:
    handle = run.choices[0].handle
    assert handle is not None
    return await asyncio.to_thread(handle.wait, 30)


def test_a_client_gone_mid_stream_was_sent_only_written_text(backend: Backend, gens: list[Gen]) -> None:
    with EmbeddedServer(backend=backend) as server, httpx.Client(base_url=server.http_url, timeout=60) as http:
        body = {"prompt": PREFIX, "max_tokens": 128, "seed": 10, "stream": True}
        got: list[dict[str, Any]] = []
        with http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got.append(json.loads(line.removeprefix("data: ")))
                if any(c["choices"][0]["text"] for c in got):
                    break  # text has arrived: the client goes away
        assert gens and gens[0].events
        assert next(iter(finished(gens)), None) is None or finished(gens)[0].status == "cancelled"
    check_written(backend, gens, "".join(c["choices"][0]["text"] for c in got))
    for c in got:
        if "dcanvas" in c["choices"][0]:
            check_written(backend, gens, c["choices"][0]["dcanvas"]["draft"])


# -- the websocket ------------------------------------------------------------------------------------------------


def test_websocket_frames_never_show_unwritten_slots(serve: Factory, backend: Backend, gens: list[Gen]) -> None:
    with serve().websocket_connect("/ws") as ws:
        c = Conn(ws)
        c.hello()
        state = open_doc(c)
        state = edit(c, state, {"op": "insert_gap", "at": 8, "n_tokens": 12})
        _, frames, done = generate(c, state, mode="ar", seed=3)
    assert done["status"] == "completed"
    slots = [SlotUpdate.model_validate(s) for f in frames for s in f["slots"]]
    unwritten = [s for s in slots if not s.written]
    assert unwritten, "an AR infill's first frames have slots it has not reached"
    assert all((s.token, s.text, s.accepted, s.entropy) == (-1, "", False, None) for s in unwritten)
    (gen,) = gens
    engine_frames = [e for e in gen.events if isinstance(e, Frame)]
    for s in slots:  # a written slot shows a token the model wrote there; the noise never goes out
        if s.written:
            assert s.text == backend.token_text(s.token)
            assert any(f.written and f.written[s.i] and f.draft[s.i] == s.token for f in engine_frames)
