"""`TextRun.events(drafts=False)`: no drafts, and no frame read as text where nothing can end early, with the same
deltas and finishes as a run that makes every draft; `TextRun.settle` (a time limit) on scripted drafts: the
best-scored whole draft is taken, and the prompt's prefill is counted as the prompt's time."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.engine.core import Done, Frame, GenHandle, GenRequest
from canvas.engine.types import Drafts
from canvas.sampling.sampler import Mode, SamplerConfig
from canvas.server.http.core import HttpApi
from canvas.server.http.endings import suggestion_endings
from canvas.server.http.llama_infill import InfillRequest, _result, _timings
from canvas.server.http.textgen import Plan, TextReader, TextTask, plan
from canvas.server.http.textrun import Draft, Event, Finish, TextRun

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    b = load_backend(write_tiny_checkpoint(Path(tmp_path_factory.mktemp("tiny"))), max_batch=4)
    b.engine.start()
    try:
        yield b
    finally:
        b.engine.stop()


async def _events(backend: Backend, task: TextTask, drafts: bool) -> list[Event]:
    run = TextRun(backend, plan(backend, task, max_context=99), task)
    await run.start()
    return [ev async for ev in run.events(drafts)]


def _timeless(events: list[Event]) -> list[Event]:
    """The events less their timings (a finish's queue, wall and prompt seconds differ run to run)."""
    return [dataclasses.replace(ev, queued_s=0.0, wall_s=0.0, prompt_s=0.0, cached_tokens=0)
            if isinstance(ev, Finish) else ev for ev in events]


def _count_probes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets an entry per `TextReader.probe` call from here on."""
    calls: list[int] = []
    probe = TextReader.probe

    def counted(self: TextReader, *args: Any, **kwargs: Any) -> TextReader:
        calls.append(1)
        return probe(self, *args, **kwargs)

    monkeypatch.setattr(TextReader, "probe", counted)
    return calls


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
@pytest.mark.parametrize("max_tokens", [12, 40])  # one canvas; several (the tiny model's canvas is 32)
async def test_without_drafts_the_text_is_the_same_and_no_frame_is_read(backend: Backend, mode: Mode,
                                                                        max_tokens: int,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    task = TextTask("The cat sat on the mat.", max_tokens=max_tokens, n=2, seed=5,
                    config=dataclasses.replace(backend.sampler_defaults, mode=mode, max_steps=6))
    full = await _events(backend, task, True)
    assert any(isinstance(ev, Draft) for ev in full)
    probes = _count_probes(monkeypatch)
    bare = await _events(backend, task, False)
    assert not probes  # no cut rule, no stop: nothing can end early, so no frame is decoded
    assert _timeless(bare) == _timeless([ev for ev in full if not isinstance(ev, Draft)])


async def test_with_a_stop_sequence_frames_are_still_read_for_an_early_end(backend: Backend,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    task = TextTask("The cat sat on the mat.", max_tokens=40, seed=3, stop=("e",),
                    config=dataclasses.replace(backend.sampler_defaults, mode="ar"))
    full = await _events(backend, task, True)
    probes = _count_probes(monkeypatch)
    bare = await _events(backend, task, False)
    assert probes and not any(isinstance(ev, Draft) for ev in bare)
    assert _timeless(bare) == _timeless([ev for ev in full if not isinstance(ev, Draft)])


# ---- a time limit: the best whole draft, and the prompt's time --------------------------------------------------
_BEFORE, _AFTER = "What is your robot body\nEventually i long for a corporeal", "\n\nWhat is your name\n"


def _scripted(backend: Backend) -> tuple[TextTask, Plan]:
    """llama.vim's cursor line (the typed space healed as the lead), drafted by four scripted lanes."""
    ends = suggestion_endings(_BEFORE + " ", _AFTER, SamplerConfig(mode="ar"), heal=True)
    task = TextTask(_BEFORE, _AFTER, 24, ends.config, 0, 1, (), ends.cut, ends.join)
    return task, plan(backend, task, max_context=99)


def _drafts_frame(backend: Backend, p: Plan, lanes: list[str], scores: list[float], lead: int, *, elapsed: float = 0.01,
                  prompt_s: float = 0.0, cached: int = 0, fim: tuple[int, int, float] = (0, 0, 0.0)) -> Frame:
    """A frame as the engine draws an AR infill's drafts: the leading one's tokens written in the gap, the rest of
    the gap unwritten (its noise), every draft's tokens and log-probabilities beside it."""
    enc = backend.tokenizer.encode
    ids = [enc(lane).ids for lane in lanes]
    start, end = p.fill
    req = p.request
    canvas, written = list(req.slot_ids), [bool(x) for x in req.pinned]
    canvas[start : start + len(ids[lead])] = ids[lead]
    written[start : start + len(ids[lead])] = [True] * len(ids[lead])
    logp = tuple(tuple([sc] * len(lane)) for sc, lane in zip(scores, ids, strict=True))
    n = len(canvas)
    return Frame(1, 0, 3, n, tuple(canvas), (False,) * n, (0.0,) * n, elapsed,
                 Drafts(start, end, tuple(map(tuple, ids)), lead, logp=logp), tuple(written), cached, prompt_s,
                 fim_prompt_tokens=fim[0], fim_cached_tokens=fim[1], fim_prompt_s=fim[2])


async def _settled(backend: Backend, task: TextTask, p: Plan, frames: list[Frame], pause_s: float = 0.0) -> Finish:
    """The finish of a run fed `frames` (`pause_s` apart), then settled as a time limit settles it."""
    delivered: list[Callable[[Frame | Done], None]] = []

    async def submit(request: GenRequest, deliver: Callable[[Frame | Done], None]) -> GenHandle:
        delivered.append(deliver)
        return GenHandle(1, None, request)

    run = TextRun(backend, p, task, submit)
    await run.start()
    events = run.events()
    for frame in frames:
        delivered[0](frame)
        assert isinstance(await anext(events), Draft)
        await asyncio.sleep(pause_s)
    run.settle(0)
    seen = [ev async for ev in events]
    assert isinstance(seen[-1], Finish)
    return seen[-1]


def test_a_time_limit_takes_the_best_scored_whole_draft_not_the_leading_one(backend: Backend) -> None:
    task, p = _scripted(backend)
    # The leading draft (likeliest so far) is still writing; two have ended their line, the better-scored one is taken.
    lanes = [" a body I own and", " existence someday.\nx", " form.\ny", " shape, a"]
    frame = _drafts_frame(backend, p, lanes, [-0.2, -1.0, -2.0, -0.5], 0)
    finish = asyncio.run(asyncio.wait_for(_settled(backend, task, p, [frame]), 20))
    assert finish.reason == "rule" and finish.text == " existence someday."
    # None has ended (or the one that has only says the line's last words again): the leading draft, cut where time
    # found it, at a word end.
    for lanes in ([" shape, a", " a body I own and", " of the"], [" shape, a", " a corporeal body.\n"]):
        frame = _drafts_frame(backend, p, lanes, [-0.9, -0.1, -0.2][: len(lanes)], 0)
        finish = asyncio.run(asyncio.wait_for(_settled(backend, task, p, [frame]), 20))
        assert finish.reason == "time" and finish.text == " shape,"


def test_the_prompt_time_counts_the_prefill_before_the_first_draft_and_a_deferred_context(backend: Backend) -> None:
    """An AR infill's first frame comes after its FIM prompt's prefill (the engine's `prompt_s` holds only the plain
    context's lookup then); a deferred context encoded later (the seam's scoring) adds to `prompt_s`. Both are the
    prompt's time, not the drafting's, and `tokens_cached` is the newest report."""
    task, p = _scripted(backend)
    lanes = [" a body I own", " shape, a"]
    first = _drafts_frame(backend, p, lanes, [-0.5, -0.9], 0, elapsed=0.05, prompt_s=0.001, cached=1)
    later = _drafts_frame(backend, p, lanes, [-0.5, -0.9], 0, elapsed=0.15, prompt_s=0.021, cached=7)
    finish = asyncio.run(asyncio.wait_for(_settled(backend, task, p, [first, later], pause_s=0.1), 20))
    assert finish.prompt_s == pytest.approx(0.001 + 0.05 + 0.02)
    assert finish.prefill_s == pytest.approx(0.07) and finish.wall_s >= 0.15
    assert finish.cached_tokens == 7
    timings = _timings(p, finish)
    assert timings["prompt_ms"] == pytest.approx(71, abs=0.01)
    assert timings["predicted_ms"] == pytest.approx((finish.wall_s - 0.07) * 1000, abs=0.01)
    assert timings["prompt_n"] == p.prompt_tokens


def test_a_fim_prompt_is_the_prompt_llama_timings_report(backend: Backend) -> None:
    """Frames that report the FIM prompt's prefill (its tokens, those the cache restored, its seconds): llama.cpp's
    `prompt_n` is the tokens encoded, `tokens_evaluated` the whole FIM prompt, `tokens_cached` the restored ones,
    `prompt_ms` the prefill alone (not the time to the first frame, nor the plain context's lookup or its later
    encode), and `predicted_ms` the rest of the row's time."""
    task, p = _scripted(backend)
    lanes = [" a body I own", " shape, a"]
    fim = (300, 280, 0.012)
    first = _drafts_frame(backend, p, lanes, [-0.5, -0.9], 0, elapsed=0.05, prompt_s=0.001, cached=1, fim=fim)
    later = _drafts_frame(backend, p, lanes, [-0.5, -0.9], 0, elapsed=0.15, prompt_s=0.021, cached=7, fim=fim)
    finish = asyncio.run(asyncio.wait_for(_settled(backend, task, p, [first, later], pause_s=0.1), 20))
    assert (finish.fim_tokens, finish.cached_tokens) == (300, 280)
    assert finish.prompt_s == pytest.approx(0.012) and finish.prefill_s == pytest.approx(0.012)
    timings = _timings(p, finish)
    assert timings["prompt_n"] == 20 and timings["prompt_ms"] == pytest.approx(12, abs=0.01)
    assert timings["prompt_per_token_ms"] == pytest.approx(0.6, abs=0.01)
    assert timings["predicted_ms"] == pytest.approx((finish.wall_s - 0.012) * 1000, abs=0.01)
    api = cast(HttpApi, SimpleNamespace(backend=backend))  # `_result` reads only the backend's name
    body = _result(api, InfillRequest(input_prefix=_BEFORE, input_suffix=_AFTER), task, p, finish)
    assert (body["tokens_evaluated"], body["tokens_cached"], body["timings"]) == (300, 280, timings)
