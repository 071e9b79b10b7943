"""The text layer under the HTTP dialects: canvas layouts of continuations and infills (`plan`), reading generated
ids back as text (`TextReader`: nulls, EOS, budgets, stop sequences, cut rules, characters split over canvases),
and `TextRun` on the real engine (deltas join to the final text, drafts stream, settle and close cancel)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.sampling.sampler import SamplerConfig
from canvas.server.http.llama_infill import indent_rule, project
from canvas.server.http.textgen import TextReader, TextTask, held_back, max_gap, plan, sampler_config, stop_cut
from canvas.server.http.textrun import Delta, Draft, Finish, TextRun

pytestmark = pytest.mark.timeout(120)
PROMPT = "The cat sat on the mat and watched the rain. A dog ran past the open door."
SUFFIX = " Once upon a time there was a small house by a river."


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    b = load_backend(write_tiny_checkpoint(Path(tmp_path_factory.mktemp("tiny"))), max_batch=4)
    b.engine.start()
    yield b
    b.engine.stop()


def ids(backend: Backend, text: str) -> list[int]:
    return list(backend.tokenizer.encode(text).ids)


# -- layouts --------------------------------------------------------------------------------------------------------


def test_a_short_continuation_is_one_canvas_of_exactly_the_budget(backend: Backend) -> None:
    p = plan(backend, TextTask(PROMPT, max_tokens=10), max_context=2048)
    assert p.request.context_ids == (backend.bos_id, *ids(backend, PROMPT))
    assert len(p.request.slot_ids) == 10 and not any(p.request.pinned) and p.request.n_canvases == 1
    assert p.fill == (0, 10) and not p.infill and not p.truncated
    assert p.prompt_tokens == len(p.request.context_ids)


def test_a_long_continuation_takes_whole_canvases(backend: Backend) -> None:
    p = plan(backend, TextTask(PROMPT, max_tokens=70), max_context=2048)
    assert p.request.slot_ids == () and p.request.n_canvases == 3  # 32 + 32 + 6 of 32
    assert p.fill == (0, 32)


def test_an_infill_pins_the_prefix_tail_and_the_suffix_head_around_its_gap(backend: Backend) -> None:
    pre, suf = ids(backend, PROMPT), ids(backend, SUFFIX)
    p = plan(backend, TextTask(PROMPT, SUFFIX, max_tokens=10), max_context=2048)
    r = p.request
    a, b = p.fill
    assert b - a == 10 and len(r.slot_ids) == backend.canvas_length  # both sides are long: the canvas is full
    assert r.pinned == (True,) * a + (False,) * 10 + (True,) * (len(r.slot_ids) - b)
    assert r.context_ids + r.slot_ids[:a] == (backend.bos_id, *pre)  # no prefix token lost or repeated
    assert list(r.slot_ids[b:]) == suf[: len(r.slot_ids) - b]
    assert set(r.slot_ids[a:b]) == {backend.tokenizer.placeholder_id}
    assert r.config.gap_min_fill <= 0.125 and p.infill


def test_an_infill_gap_is_the_budget_up_to_the_largest_trained_gap(backend: Backend) -> None:
    p = plan(backend, TextTask("a", " b", max_tokens=500), max_context=2048)
    assert p.fill[1] - p.fill[0] == max_gap(backend.canvas_length) == 24
    short = plan(backend, TextTask(PROMPT, " x", max_tokens=4), max_context=2048)
    assert short.request.pinned[-1] and short.request.pinned.count(False) == 4  # the suffix closes the gap


def test_the_model_gap_fill_is_turned_down_but_a_smaller_one_kept(backend: Backend) -> None:
    strict = dataclasses.replace(SamplerConfig(), gap_min_fill=0.75)
    loose = dataclasses.replace(SamplerConfig(), gap_min_fill=0.05)
    assert plan(backend, TextTask("a", " b", 8, strict), max_context=99).request.config.gap_min_fill == 0.125
    assert plan(backend, TextTask("a", " b", 8, loose), max_context=99).request.config.gap_min_fill == 0.05


def test_a_long_context_keeps_its_newest_tokens_after_bos(backend: Backend) -> None:
    p = plan(backend, TextTask(PROMPT, max_tokens=4), max_context=5)
    assert p.request.context_ids == (backend.bos_id, *ids(backend, PROMPT)[-4:]) and p.truncated


def test_a_growing_prompt_keeps_the_start_of_its_cut_context(backend: Backend) -> None:
    """The cut moves in steps (an eighth of the context here), so typing at the end leaves the context's start as
    it was (its cached encoding stays usable) until the prompt has grown a step; the newest tokens always stay."""
    text = " ".join(f"word{i}" for i in range(200))
    starts = []
    for extra in ("", " a", " a b", " a b c"):
        p = plan(backend, TextTask(text + extra, max_tokens=4), max_context=65)
        ctx = p.request.context_ids
        assert p.truncated and ctx[0] == backend.bos_id and 57 <= len(ctx) <= 65
        assert ctx[1:] == tuple(ids(backend, text + extra)[-(len(ctx) - 1) :])
        starts.append(ctx[1:4])
    assert len(set(starts)) < len(starts)


def test_an_empty_prompt_needs_a_bos(backend: Backend) -> None:
    assert plan(backend, TextTask("", max_tokens=4), max_context=8).request.context_ids == (backend.bos_id,)
    with pytest.raises(ValueError, match="BOS"):
        plan(dataclasses.replace(backend, bos_id=None), TextTask("", max_tokens=4), max_context=8)


def test_temperature_sets_the_start_of_the_schedule_and_keeps_its_shape() -> None:
    d = SamplerConfig(t_max=0.8, t_min=0.4)
    hot = sampler_config(d, temperature=1.6)
    assert (hot.t_max, hot.t_min) == pytest.approx((1.6, 0.8))
    cold = sampler_config(d, temperature=0)
    assert 0 < cold.t_min <= cold.t_max <= 0.01
    assert sampler_config(d) is d
    assert sampler_config(d, max_steps=7, entropy_bound=2.0).max_steps == 7
    with pytest.raises(ValueError):
        sampler_config(d, max_steps=0)


# -- reading ids back -----------------------------------------------------------------------------------------------


def canvas(backend: Backend, text_ids: list[int], length: int | None = None) -> list[int]:
    n = backend.canvas_length if length is None else length
    assert backend.null_id is not None
    return text_ids + [backend.null_id] * (n - len(text_ids))


def test_nulls_are_dropped_and_eos_ends_the_text(backend: Backend) -> None:
    task = TextTask(PROMPT, max_tokens=64)
    r = TextReader(backend, plan(backend, task, max_context=99), task)
    assert backend.eos_id is not None and backend.null_id is not None
    r.feed([*ids(backend, " The cat"), backend.null_id, *ids(backend, " sat"), backend.eos_id,
            *ids(backend, " gone")] + [backend.null_id] * 20, last=False)
    assert (r.text, r.reason, r.tokens, r.safe) == (" The cat sat", "eos", 3, len(" The cat sat"))


def test_the_budget_ends_a_continuation(backend: Backend) -> None:
    task = TextTask(PROMPT, max_tokens=40)
    r = TextReader(backend, plan(backend, task, max_context=99), task)
    word = ids(backend, " sat")
    r.feed(word * 32, last=False)
    assert r.reason is None and r.tokens == 32
    r.feed(word * 32, last=True)
    # The text goes on past the budget: its last word may be cut, so it ends at the word boundary before it.
    assert (r.reason, r.tokens, r.text) == ("length", 39, " sat" * 39)
    r = TextReader(backend, plan(backend, task, max_context=99), task)
    r.feed((word + ids(backend, ".")) * 16, last=False)
    r.feed((word + ids(backend, ".")) * 16, last=True)  # the budget ends after a full stop: a boundary
    assert (r.reason, r.tokens, r.text) == ("length", 40, " sat." * 20)


def test_an_infill_that_left_slots_null_ended_on_its_own(backend: Backend) -> None:
    task = TextTask(PROMPT, SUFFIX, max_tokens=6)
    p = plan(backend, task, max_context=99)
    a, b = p.fill
    full = list(p.request.slot_ids)
    full[a:b] = ids(backend, " sat") * 6
    r = TextReader(backend, p, task)
    r.feed(full, last=True)
    assert (r.reason, r.text) == ("length", " sat" * 6)  # every slot was text: the budget may have cut it
    assert backend.null_id is not None
    full[a + 2 : b] = [backend.null_id] * 4
    r = TextReader(backend, p, task)
    r.feed(full, last=True)
    assert (r.reason, r.text, r.tokens) == ("eos", " sat sat", 2)


def test_a_fill_is_decoded_in_place(backend: Backend) -> None:
    """The first generated token keeps its leading space: it is decoded after the prompt's last tokens."""
    task = TextTask("The cat", " on the mat.", max_tokens=1)
    p = plan(backend, task, max_context=99)
    full = list(p.request.slot_ids)
    full[p.fill[0]] = ids(backend, " sat")[0]
    r = TextReader(backend, p, task)
    r.feed(full, last=True)
    assert "The cat" + r.text + " on the mat." == "The cat sat on the mat."


def test_a_stop_sequence_split_over_two_canvases_cuts_the_text(backend: Backend) -> None:
    task = TextTask("", max_tokens=64, stop=("on the", "zzz"))
    r = TextReader(backend, plan(backend, task, max_context=99), task)
    r.feed(canvas(backend, ids(backend, "The cat sat o")), last=False)
    assert r.text == "The cat sat o" and r.safe == len("The cat sat ")  # "o" may start "on the"
    r.feed(canvas(backend, ids(backend, "n the mat.")), last=True)
    assert (r.text, r.reason, r.stop_word, r.safe) == ("The cat sat ", "word", "on the", len("The cat sat "))
    assert r.tokens == 4  # "The", " cat", " sat", and " " + "o"... the token that holds the cut counts


def test_a_character_split_over_two_canvases_waits_for_its_last_byte(backend: Backend) -> None:
    task = TextTask("", max_tokens=64)
    r = TextReader(backend, plan(backend, task, max_context=99), task)
    han = ids(backend, "日")
    assert len(han) == 3  # byte-level: three tokens, one character
    r.feed(canvas(backend, ids(backend, "The ") + han[:2]), last=False)
    assert r.text == "The " and "\ufffd" not in r.text
    r.feed(canvas(backend, han[2:] + ids(backend, " cat.")), last=True)  # "." ends a word: no word cut
    assert r.text == "The 日 cat."


def test_stop_helpers() -> None:
    assert stop_cut("a bc bd", ("bd", "b")) == (2, "b")
    assert stop_cut("abc", ("x",)) is None
    assert held_back("the cat s", ("sat", "cat")) == 1
    assert held_back("the ca", ("cat",)) == 2
    assert held_back("the cat", ("cat",)) == 0  # a whole stop is cut, not held back
    assert held_back("abc", ()) == 0


def test_indent_rule_cuts_like_llama_cpp() -> None:
    cut = indent_rule(4)
    assert cut("x = 1") is None  # the first line is never checked
    assert cut("x\n    a\n    b") is None
    text = "x\n    a\n  b = 2\n"
    assert text[: cut(text)] == "x\n    a\n  "  # the line is cut after its indentation, as llama.cpp does
    assert cut("x\n\n    y") == 2  # an empty line is narrower too
    assert cut("x\n   ") is None  # nothing after the whitespace yet


def test_response_fields_flatten_paths() -> None:
    result = {"content": "x", "timings": {"prompt_n": 3, "predicted_n": 1}, "truncated": False}
    fields = ["content", "timings/prompt_n", "nope", "timings/zzz", "truncated"]
    assert project(result, fields) == {"content": "x", "timings/prompt_n": 3, "truncated": False}


# -- TextRun on the engine ------------------------------------------------------------------------------------------


async def events_of(run: TextRun) -> list[Delta | Draft | Finish]:
    return [ev async for ev in run.events()]


async def test_streamed_deltas_join_to_the_final_text(backend: Backend) -> None:
    cfg = dataclasses.replace(backend.sampler_defaults, max_steps=3)
    task = TextTask(PROMPT, max_tokens=40, config=cfg, seed=11, n=2)
    run = TextRun(backend, plan(backend, task, max_context=99), task)
    await run.start()
    evs = await asyncio.wait_for(events_of(run), 60)
    finishes = {e.index: e for e in evs if isinstance(e, Finish)}
    assert sorted(finishes) == [0, 1]
    for i, f in finishes.items():
        assert "".join(e.text for e in evs if isinstance(e, Delta) and e.index == i) == f.text
        assert any(isinstance(e, Draft) and e.index == i for e in evs)
        first_finish = evs.index(f)
        assert all(e.index != i for e in evs[first_finish + 1 :])  # nothing of a choice after its Finish
    # The same seed gives the same text, whatever it was batched with.
    again = TextRun(backend, plan(backend, task, max_context=99), dataclasses.replace(task, n=1))
    await again.start()
    (solo,) = [e for e in await asyncio.wait_for(events_of(again), 60) if isinstance(e, Finish)]
    assert solo.text == finishes[0].text


async def test_settle_takes_the_draft_and_frees_the_engine_row(backend: Backend) -> None:
    cfg = dataclasses.replace(backend.sampler_defaults, max_steps=1024, entropy_bound=1e-9)
    task = TextTask(PROMPT, SUFFIX, max_tokens=8, config=cfg, seed=3)
    run = TextRun(backend, plan(backend, task, max_context=99), task)
    await run.start()
    drafts: list[Draft] = []
    async for ev in run.events():
        if isinstance(ev, Draft):
            drafts.append(ev)
            run.settle(ev.index)
        if isinstance(ev, Finish):
            assert ev.reason == "time" and ev.text == drafts[-1].text and drafts[-1].step < 1024
    handle = run.choices[0].handle
    assert handle is not None
    assert (await asyncio.to_thread(handle.wait, 30)).status == "cancelled"


async def test_closing_a_run_cancels_its_generations(backend: Backend) -> None:
    cfg = dataclasses.replace(backend.sampler_defaults, max_steps=1024, entropy_bound=1e-9)
    task = TextTask(PROMPT, max_tokens=64, config=cfg, n=2)
    run = TextRun(backend, plan(backend, task, max_context=99), task)
    await run.start()
    stream = run.events()
    await anext(stream)
    await stream.aclose()  # what a client that goes away causes
    for c in run.choices:
        assert c.handle is not None
        assert (await asyncio.to_thread(c.handle.wait, 30)).status == "cancelled"


def test_sampler_config_maps_temperature_and_truncation_by_mode() -> None:
    from canvas.sampling.sampler import SamplerConfig
    from canvas.server.http.textgen import sampler_config

    base = SamplerConfig(ar_temperature=0.7)
    ar = sampler_config(base, temperature=0.3, mode="ar", top_k=40, top_p=0.9, min_p=0.05)
    assert (ar.ar_temperature, ar.ar_top_k, ar.ar_top_p, ar.ar_min_p, ar.t_max) == (0.3, 40, 0.9, 0.05, base.t_max)
    diffusion = sampler_config(base, temperature=0.3, mode="diffusion")
    assert diffusion.t_max == 0.3 and diffusion.ar_temperature == 0.7
    off = sampler_config(base, mode="ar", top_k=-1, top_p=0.0)  # llama.cpp's "off" values
    assert (off.ar_top_k, off.ar_top_p) == (0, 1.0)
