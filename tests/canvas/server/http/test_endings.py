"""Where an editor's suggestion ends: the cursor line's rules on hand-made strings, a run whose scripted drafts all
reach their line end (the row is freed then, with the draft most agree on), and llama.vim's exact `/infill` request
on the tiny model whose likeliest token is a newline (one line, never an empty first one)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient

from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.engine.core import Done, Frame, GenHandle, GenRequest
from canvas.engine.types import Drafts
from canvas.eval.client_shapes import LineSample, fim_body
from canvas.sampling.modes import ModeDefaults
from canvas.sampling.sampler import SamplerConfig
from canvas.server.http.endings import (
    CursorLine,
    combine,
    indent_rule,
    join_at,
    line_rule,
    repeat,
    suggestion_endings,
    unbalanced,
)
from canvas.server.http.textgen import TextReader, TextTask, plan
from canvas.server.http.textrun import Draft, Event, Finish, TextRun
from tests.canvas.wsconn import served

pytestmark = pytest.mark.timeout(300)
NEWLINE_BIAS = 8.0  # added to the newline's logit: the tiny model's likeliest token, first or not


# ---- the rules ----------------------------------------------------------------------------------------------------
def test_the_cursor_line_is_read_around_the_gap() -> None:
    c = CursorLine.around("import math\n\ndef area(r):\n    return ma", "\n\nprint(area(2))\n")
    assert c == CursorLine("    return ma", "") and c.has_text and not c.first_newline
    assert CursorLine.around("x = 1\n", "\ny = 2\n") == CursorLine("", "")  # a blank line: text first
    assert not CursorLine.around("x = 1\n", "\ny = 2\n").first_newline
    assert CursorLine.around("x = 1\n", "y = 2\n").first_newline  # at the start of a line with text: lines above it
    assert CursorLine.around("a\n    ", "\n").before == "    " and not CursorLine("    ", "").has_text


def test_at_the_end_of_a_line_the_suggestion_is_the_rest_of_it() -> None:
    cut = line_rule(CursorLine("    y = math.pi", ""))
    assert cut is not None
    assert cut(" * r * r") is None  # still writing its line
    assert cut(" * r * r\n    return y\n") == len(" * r * r")
    assert cut("\n") == 0


def test_mid_line_the_suggestion_ends_before_what_follows_the_cursor() -> None:
    call = CursorLine("    print(", ")")
    assert join_at(call, "x)") == 1  # the rest of the line, written again: cut
    assert join_at(call, "f(a)") == 4  # a call of its own: "print(f(a))" balances, "print(f(a)" would not
    assert join_at(call, "x") == 1
    prose = CursorLine("The cat ", "on the mat.")
    assert join_at(prose, "sat on the mat.") == len("sat ")
    assert join_at(prose, "sat on") == len("sat ")  # its end is the rest's start: said once
    assert join_at(CursorLine("A ", "the end."), "bathe") == len("bathe")  # not at a word boundary
    assert join_at(CursorLine("f(a,", " b)"), "x b)") == len("x")  # the space before the rest goes too
    cut = line_rule(prose)
    assert cut is not None and cut("sat on the mat.\nThe dog") == len("sat ")
    assert repeat("x):", "):") == 2 and repeat("abc", "d") == 0
    assert unbalanced("print(f(a)") == 1 and unbalanced("f(a))") == 1 and unbalanced("[(x)]") == 0


def test_a_blank_line_keeps_blocks_and_n_indent_as_llama_cpp() -> None:
    ends = suggestion_endings("def f(x):\n", "\n\nprint(f(1))\n", SamplerConfig(mode="ar"), n_indent=4)
    text = "    y = x + 1\n    return y\nprint(1)"
    assert ends.cut is not None and ends.cut(text) == indent_rule(4)(text) == text.index("print")
    assert ends.join is None and ends.config.ar_first_newline is False
    assert ends.config.ar_min_fill == SamplerConfig().ar_min_fill  # a block keeps the model's own
    typed = suggestion_endings("def f(x):\n    y = x", "\n", SamplerConfig(mode="ar"), n_indent=4)
    assert typed.config.ar_first_newline is False and typed.config.ar_min_fill == 0.0
    assert typed.cut is not None and typed.cut(" + 1\n    return y") == len(" + 1")
    above = suggestion_endings("x = 1\n", "y = 2\n", SamplerConfig(mode="ar"))
    assert above.config.ar_first_newline is True and above.cut is None
    several = suggestion_endings("a line", "", SamplerConfig(mode="ar"), one_gap=False)
    assert several.config.ar_first_newline is True  # a continuation of several canvases: every canvas is a gap


def test_combine_takes_the_earliest_end() -> None:
    def at(n: int | None) -> Callable[[str], int | None]:
        return lambda text: n

    assert combine(None, None) is None
    assert combine(at(3), None)("abcdef") == 3  # type: ignore[misc]
    assert combine(at(3), at(1), at(None))("abcdef") == 1  # type: ignore[misc]
    assert combine(at(None), at(None))("abcdef") is None  # type: ignore[misc]


# ---- a run whose drafts all reach their end -----------------------------------------------------------------------
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


def _frame(req: GenRequest, start: int, end: int, lanes: Sequence[Sequence[int]], lead: int, step: int) -> Frame:
    n = len(req.slot_ids)
    written = tuple(bool(p) for p in req.pinned)
    return Frame(1, 0, step, n, tuple(req.slot_ids), (False,) * n, (0.0,) * n, 0.01,
                 Drafts(start, end, tuple(map(tuple, lanes)), lead), written)


def test_a_row_ends_when_every_draft_has_reached_its_line_end(backend: Backend) -> None:
    before, after = "The cat sat by the door.\nprint(", ")\nprint(2)\n"
    ends = suggestion_endings(before, after, SamplerConfig(mode="ar"))
    task = TextTask(before, after, 16, ends.config, 0, 1, (), ends.cut, ends.join)
    p = plan(backend, task, max_context=99)
    start, end = p.fill
    enc = backend.tokenizer.encode
    lane_a, lane_b = enc("cat)\nthe").ids, enc("door").ids  # "cat" repeats the ")" after the cursor, then ends
    handles: list[GenHandle] = []
    delivered: list[Callable[[Frame | Done], None]] = []

    async def submit(request: GenRequest, deliver: Callable[[Frame | Done], None]) -> GenHandle:
        handles.append(GenHandle(1, None, request))
        delivered.append(deliver)
        return handles[-1]

    async def drive() -> list[Event]:
        run = TextRun(backend, p, task, submit)
        await run.start()
        events = run.events()
        seen: list[Event] = []
        delivered[0](_frame(p.request, start, end, [lane_a, lane_b], 1, 1))
        seen.append(await anext(events))  # a draft: "door" goes on
        assert not handles[0].cancelled
        delivered[0](_frame(p.request, start, end, [lane_a + enc("x").ids, enc("door)\n").ids], 1, 2))
        seen += [ev async for ev in events]  # ends without another frame, nor a Done
        return seen

    seen = asyncio.run(asyncio.wait_for(drive(), 20))
    assert isinstance(seen[0], Draft) and not seen[0].ended
    finish = seen[-1]
    assert isinstance(finish, Finish) and finish.reason == "rule"
    assert finish.text == "door" and handles[0].cancelled  # a tie: the leading draft's; the engine row is freed


def test_a_draft_that_ends_on_its_own_is_cut_before_the_repeat(backend: Backend) -> None:
    before, after = "x = 1\nprint(", ")\n"
    ends = suggestion_endings(before, after, SamplerConfig(mode="ar"))
    task = TextTask(before, after, 8, ends.config, 0, 1, (), ends.cut, ends.join)
    p = plan(backend, task, max_context=99)
    a, b = p.fill
    canvas = list(p.request.slot_ids)
    ids = backend.tokenizer.encode("cat)").ids
    assert backend.null_id is not None
    canvas[a:b] = [*ids, *[backend.null_id] * (b - a - len(ids))]  # the engine's choice: a fill, then nulls
    reader = TextReader(backend, p, task)
    reader.feed(canvas, last=True)
    assert reader.reason == "eos" and reader.text == "cat"


# ---- llama.vim's request on the tiny model -------------------------------------------------------------------------
@pytest.fixture
def client(backend: Backend, tmp_path: Path) -> Iterator[TestClient]:
    with served(backend, tmp_path) as make:
        yield make()


SAMPLE = LineSample("doc", ("The cat sat on the mat.", "It watched the rain all day."), "When the sun came ",
                    "out, it went into the garden.", ("Once upon a time there was a house.", ""))


@pytest.fixture
def dones(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> list[Done]:
    """The `Done` of every generation submitted to the engine while the test runs."""
    out: list[Done] = []
    submit = backend.engine.submit

    def spy(req: GenRequest, on_event: Callable[[Frame | Done], None] | None = None, **kwargs: object) -> GenHandle:
        def record(ev: Frame | Done) -> None:
            if isinstance(ev, Done):
                out.append(ev)
            if on_event is not None:
                on_event(ev)

        return submit(req, record, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(backend.engine, "submit", spy)
    return out


@pytest.mark.parametrize("t_max_predict_ms", [250, 1000])
def test_llama_vim_at_a_half_typed_line_gets_one_line_never_an_empty_one(client: TestClient,
                                                                         t_max_predict_ms: int) -> None:
    for seed in range(4):
        r = client.post("/infill", json={**fim_body(SAMPLE, t_max_predict_ms), "seed": seed})
        assert r.status_code == 200, r.text
        content = r.json()["content"]
        assert content.strip() and "\n" not in content, content  # the rest of this line, never an empty first line


def test_the_row_stops_when_every_draft_has_ended_its_line(client: TestClient, backend: Backend,
                                                           dones: list[Done]) -> None:
    gap = 24  # n_predict 128 on the tiny model's 32-slot canvas: its largest gap
    for seed in range(3):
        body = {**fim_body(SAMPLE, 0), "seed": seed}
        del body["response_fields"]
        r = client.post("/infill", json=body).json()
        assert r["dcanvas"]["end"] == "rule" and r["stop_type"] == "limit" and "\n" not in r["content"]
        deadline = time.monotonic() + 10
        while len(dones) <= seed and time.monotonic() < deadline:
            time.sleep(0.01)  # the cancelled row's Done comes from the engine's thread
        assert dones[seed].status == "cancelled" and dones[seed].steps < gap  # freed at the line's end
