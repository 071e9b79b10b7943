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
from canvas.server.http.draft_ends import LaneEnd, _score, choose, early_end
from canvas.server.http.endings import (
    CursorLine,
    LeadCut,
    combine,
    copies_after,
    cut_line_echo,
    drop_lead,
    echoes,
    function_words_only,
    indent_rule,
    join_at,
    line_echo,
    line_rule,
    repeat,
    repeats_before,
    sensible,
    suggestion_endings,
    trim_tail,
    typed_lead,
    unbalanced,
)
from canvas.server.http.llama_fields import Deadline
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
    assert ends.config.ar_min_fill == 0.0  # the budget is a ceiling: one line of code may end the block
    several_gaps = suggestion_endings("def f(x):\n", "\n\nprint(f(1))\n", SamplerConfig(mode="ar"), one_gap=False)
    assert several_gaps.config.ar_min_fill == SamplerConfig().ar_min_fill  # a websocket-like layout keeps its own
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


def test_the_lead_is_the_partial_word_after_one_space() -> None:
    assert typed_lead("that it would n") == " n"
    assert typed_lead("The company had applie") == " applie"
    assert typed_lead("a corporeal ") == " "  # the space typed after a word: the next word starts with it
    assert typed_lead("end.  ") == "" and typed_lead("x\n  ") == "" and typed_lead("foo(ba") == ""
    assert typed_lead("I don'") == "" and typed_lead("") == "" and typed_lead("word") == ""
    assert typed_lead("see " + "x" * 40) == ""  # a long run is code or a URL: healed by the engine as before


def test_the_lead_leaves_the_prompt_and_the_answer() -> None:
    ar = SamplerConfig(mode="ar")
    ends = suggestion_endings("It rained.\nThe cat would n", "\nNext line.\n", ar, heal=True)
    assert ends.lead == " n" and ends.config.ar_lead == " n"
    assert ends.cut is not None and ends.cut(" never go out.\nMore") == len(" never go out.")
    assert suggestion_endings("The cat would n", "\n", ar).lead == ""  # heal=False: as before
    assert suggestion_endings("The cat would n", "\n", SamplerConfig(), heal=True).lead == ""  # diffusion
    assert suggestion_endings("The cat would n", "\n", ar, heal=True, one_gap=False).lead == ""
    assert drop_lead(" never go out.", " n") == "ever go out."
    assert drop_lead(" ", " ") == "" and drop_lead(" ap", " applie") == ""  # cut before the lead was whole
    cut = LeadCut(" applie")
    assert [cut(p) for p in (" app", "lied", " for it", "")] == ["", "d", " for it", ""]


def test_a_text_cut_by_time_ends_on_a_word_it_can_end_on() -> None:
    assert trim_tail(" or") == "" and trim_tail(" of the") == ""  # nothing whole: dropped
    assert trim_tail(" worth $2.1 million, and the") == " worth $2.1 million"
    assert trim_tail(" in the car, ") == " in the car"
    assert trim_tail(" the police said.") == " the police said." and trim_tail(" f(x)") == " f(x)"
    assert trim_tail(" I love you") == " I love you" and trim_tail("") == ""
    assert trim_tail(" so they were all the same. He") == " so they were all the same."  # a sentence begun: goes
    assert trim_tail('I said "yes." Then') == 'I said "yes."' and trim_tail(' end."') == ' end."'
    assert trim_tail(" and to the 1.5.0 (2019-06-28") == " and to the 1.5.0"  # a bracket never closed
    assert trim_tail(" for (const def in line") == "" and trim_tail(" f(a, g(b)") == " f"


def test_a_copy_of_a_line_that_follows_is_known() -> None:
    after = "\n\nWhat is your age\nI am still young by your standards.\n"
    assert copies_after(" I am still young by your standards.", after)
    assert not copies_after(" as self-employed.", after)
    assert not copies_after(" age", after)  # too short to call a copy
    assert not copies_after(" I am still young.\nMore", after)  # every line must be a copy


def test_a_copy_that_differs_only_by_case_and_trailing_punctuation_is_a_copy() -> None:
    """Real suggestions of the default build at llama.vim's request (`dcanvas eval --task clients`, issue 51): a
    sentence the suggestion ends where the copied line goes on is still that line's copy; common wording is not."""
    after = "\n\nWhat is your age\nI am still young by your standards.\n"
    for text in (" I am still young.", "I AM STILL YOUNG!", " i am still young by your standards"):
        assert copies_after(text, after) and not sensible(text, "Who is your boss\nI like to think of myself ", after)
    forever = "\nYes.\n\nWill you die\nNo, software will live forever.\n\nWill you ever die\nNo, I am immortal."
    assert copies_after(" will live forever.", forever) and copies_after(" Software will live forever!", forever)
    for text in (" as self-employed.",  # the human rest of the line
                 " young at heart.", " by your leave, sir.",  # a word or two in common
                 " still young, by all means.", " I am still youngish.",  # a longer phrase, a longer word
                 " I am still young.\nAnd so are you."):  # one line of two
        assert not copies_after(text, after), text
    council = "\nThe city council met on Monday to vote on the budget.\n"
    for text in (" the city council voted.", " and the council.", " a vote on Monday."):
        assert not copies_after(text, council) and sensible(text, "He said the city would pay for ", council), text


def test_the_deadline_ends_a_choice_at_its_first_draft_past_the_limit() -> None:
    settled: list[int] = []

    class Run:
        def settle(self, index: int) -> None:
            settled.append(index)

    deadline = Deadline(Run(), 50)  # type: ignore[arg-type]
    deadline(Draft(0, " a line", 1, 8, 0))  # the clock starts at a choice's first draft
    deadline(Draft(1, " b", 1, 8, 0))
    deadline(Draft(0, " a line", 2, 8, 0))  # within the limit
    assert not deadline.fired and not settled
    time.sleep(0.06)
    deadline(Draft(0, " a line", 3, 8, 0))  # time is up: no newline is waited for (a single line never has one)
    assert deadline.fired == {0} and settled == [0]
    Deadline(Run(), 0)(Draft(2, " x", 1, 8, 0))  # type: ignore[arg-type]  # 0: no limit
    assert settled == [0]


def test_an_answer_of_function_words_only_says_nothing() -> None:
    for text in ("a", "be.", " can", "of", " in the", "That is", "you", " I"):
        assert function_words_only(text) and not sensible(text, "", ""), text
    for text in ("existence someday.", " the same as killing ME.", "", ")", "x"):
        assert not function_words_only(text), text
    assert sensible(")", "print(f(x)", "\n") and not sensible("  ", "", "")


def test_an_answer_that_repeats_what_was_just_written_is_an_echo() -> None:
    before = "What is your age\nI am still young"
    assert repeats_before(" I am still young", before) and not sensible("I am still young", before, "")
    assert repeats_before("class shlex", 'class shlex:\n    "A lexical analyzer class')
    assert not repeats_before(" by your standards.", before)
    assert not repeats_before(" young", before)  # one word: not a repeat of anything
    assert repeats_before("I am still young.", before)  # three words or more in a row, whatever the punctuation
    assert not repeats_before("your age!", before)  # two words: only as written
    assert not repeats_before("I am still young", "I am still young\na\nb\nc")  # four lines up: too far


def test_an_answer_that_repeats_a_run_of_the_cursor_line_is_cut_there() -> None:
    """Real suggestions of the default build at llama.vim's request (`dcanvas eval --task clients`, issue 51)."""
    age = "What is your age\nI am still young "
    assert line_echo("I am still young, still young.", age) == 0 and not sensible("I am still young, still young.",
                                                                                  age, "\n")
    assert cut_line_echo("still young.", age) == "" and not sensible(" still young.", age, "")  # its last words
    assert cut_line_echo("by your standards, I am still young and", age) == "by your standards"  # the rest goes
    shares = "Shares of StageGate fell 4% in early tra"
    assert cut_line_echo("ding, shares of StageGate fell 4% again.", shares) == "ding"
    # Kept: the human rests of these lines, and suggestions that share only common wording with the line.
    for before, text in [(age, "by your standards."), (shares, "de of the 2023"), (shares, "ding on Monday."),
                         ("a shortfall of 2.4 trillion tenge by ", '2035," she told lawmakers.'),
                         ("He said the city would pay for the ", "city council to take action."),
                         ("The more you practice, the more ", "you learn, and the more you grow."),
                         ("    y = foo(a, b, c) + ", "foo(a, b, d)"),
                         ("for i in range(len(x)):\n    y = ", "[x[i] for i in range(len(x))]"),  # a line above
                         ("I am not young ", "I am old.")]:
        assert line_echo(text, before) is None and cut_line_echo(text, before) == text, (before, text)
        assert sensible(text, before, ""), (before, text)


def test_an_answer_that_copies_text_far_down_the_suffix_is_an_echo() -> None:
    below = "\n".join(f"x{i} = {i}" for i in range(20)) + "\n    return sum(values) / len(values)\n"
    assert copies_after("return sum(values) / len(values)", below)  # 21 lines down: still a copy
    after = "\n\nWhat are your interests\nI am interested in a wide variety of things, and I find that I'm quite fond"
    assert echoes(" I find that I'm quite fond of the number 23.", "", after)  # 4 of its 8 4-grams follow
    assert not echoes(" computer science, and natural language processing.", "", after)
    assert not echoes(" of many things, a wide variety of foods.", "", after)  # one 4-gram of five: not an echo


def _lane(text: str, score: float, whole: bool = True) -> LaneEnd:
    return LaneEnd(text, (), False, score, whole)


def test_the_draft_taken_is_the_best_scored_whole_one_not_the_shared_short_one() -> None:
    ends = [_lane(" a", -0.5, False), _lane(" a", -0.5, False), _lane(" existence someday.", -1.2),
            _lane(" body.", -0.9), _lane(" I am still young", -0.2, False)]
    assert choose(ends, 0) == 3  # the two "a" agree, but say nothing; the echo scores best, but is one
    assert choose([_lane(" x.", -1.0), _lane(" y.", -1.0), _lane(" y.", -1.0)], 0) == 1  # ties: most shared
    assert choose([_lane(" x.", -1.0), _lane(" y.", -1.0)], 1) == 1  # then the leading draft
    # None whole: the ending most share (the answer's checks then drop it), ties to the leading draft.
    assert choose([_lane(" a", 0, False), _lane(" of", 0, False), _lane(" of", 0, False)], 0) == 1
    assert choose([_lane(" a", 0, False), _lane(" of", 0, False)], 1) == 1


def test_a_draft_is_scored_up_to_the_token_that_ends_it() -> None:
    logp = [-1.0, -2.0, -3.0, -10.0]
    assert _score(logp, [" ab", "c", "\nd", "e"], " abc", False) == -2.0  # the newline's token counts
    assert _score(logp, [" ab", "c"], " abc", True) == -2.0  # a natural end: its <|fim_end|> counts
    assert _score(None, [" ab"], " ab", True) == 0.0 and _score([], [], "", False) == 0.0


def test_the_infill_answer_drops_the_lead_trims_a_timed_out_tail_and_drops_a_copy() -> None:
    from types import SimpleNamespace

    from canvas.server.http.llama_infill import InfillRequest, _result

    api = SimpleNamespace(backend=SimpleNamespace(name="m"))
    task = SimpleNamespace(max_tokens=32, config=SamplerConfig(mode="ar"), seed=1, stop=())
    plan_ = SimpleNamespace(request=SimpleNamespace(config=SamplerConfig()), truncated=False, prompt_tokens=3)
    req = InfillRequest(prompt="It would n", input_suffix="\nIt was not a good day for it.\n")

    def answer(text: str, reason: str = "rule", *, timed_out: bool = False) -> str:
        f = Finish(0, reason, text, 3, None, 2, 0.0, 0.1)  # type: ignore[arg-type]
        out = _result(api, req, task, plan_, f, " n", timed_out=timed_out)  # type: ignore[arg-type]
        return str(out["content"])

    assert answer(" never go out, and the") == "ever go out, and the"  # the model ended it: kept
    assert answer(" never go out, and the", timed_out=True) == "ever go out, and the"  # a whole draft at the limit
    assert answer(" never go out, and the", "time", timed_out=True) == "ever go out"  # cut where time found it
    assert answer(" never", "eos", timed_out=True) == "ever"
    assert answer(" n", "time", timed_out=True) == "" and answer(" ", "time", timed_out=True) == ""
    assert answer(" It was") == ""  # not started with its lead: nothing of it follows the cursor
    assert answer(" n of", "eos") == "" and answer(" nor be.", "eos") == ""  # function words only, ended or not
    age = InfillRequest(input_prefix="What is your age\n", prompt="I am still young ", input_suffix="\n\nWho\n")
    f = Finish(0, "eos", " I am still young.", 3, None, 2, 0.0, 0.1)
    assert _result(api, age, task, plan_, f, " ")["content"] == ""  # type: ignore[arg-type]  # what was just said
    f = Finish(0, "eos", " by your standards.", 3, None, 2, 0.0, 0.1)
    assert _result(api, age, task, plan_, f, " ")["content"] == "by your standards."  # type: ignore[arg-type]
    assert answer(" not a good day for it.") == ""  # "ot a good day for it." is inside the next line: a copy


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


def test_the_row_ends_with_the_best_scored_whole_draft_not_the_shared_function_word(backend: Backend) -> None:
    before, after = "What is your robot body\nEventually i long for a corporeal ", "\n\nWhat is your name\n"
    ends = suggestion_endings(before, after, SamplerConfig(mode="ar"), heal=True)
    assert ends.lead == " "
    task = TextTask(before[: -len(ends.lead)], after, 16, ends.config, 0, 1, (), ends.cut, ends.join)
    p = plan(backend, task, max_context=99)
    start, end = p.fill
    enc = backend.tokenizer.encode
    lanes = [enc(" a\nx").ids, enc(" a\ny").ids, enc(" existence someday.\n").ids, enc(" form.\n").ids]
    scores = [-0.1, -0.1, -1.0, -2.0]  # the two "a" are likeliest and agree: the old vote took them
    logp = tuple(tuple([sc] * len(lane)) for sc, lane in zip(scores, lanes, strict=True))
    frame = _frame(p.request, start, end, lanes, 0, 3)
    assert frame.drafts is not None
    frame = dataclasses.replace(frame, drafts=dataclasses.replace(frame.drafts, logp=logp))
    reader = TextReader(backend, p, task)
    probe = reader.probe(frame.draft, frame.written)
    out = early_end(reader, task, frame, probe, fim_end=None, null_id=backend.null_id, token_text=backend.token_text)
    assert out is not None
    canvas, written, settled = out
    reader.feed(canvas, last=True, settled=settled, written=written)
    assert reader.text == " existence someday."


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


def test_a_typed_space_is_written_again_by_the_model_not_twice(client: TestClient, backend: Backend,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """SAMPLE's cursor line ends with a space: the prompt the engine gets ends before it (its last token is a word,
    not a lone space), and the suggestion never starts with whitespace (the first token wrote the space)."""
    seen: list[GenRequest] = []
    submit = backend.engine.submit

    def spy(req: GenRequest, *a: object, **kw: object) -> GenHandle:
        seen.append(req)
        return submit(req, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(backend.engine, "submit", spy)
    for seed in range(4):
        r = client.post("/infill", json={**fim_body(SAMPLE, 1000), "seed": seed})
        assert r.status_code == 200, r.text
        content = r.json()["content"]
        assert content and not content[0].isspace(), content
    assert len(seen) == 4
    for req in seen:
        assert req.config.ar_lead == " "
        left = [*req.context_ids, *req.slot_ids[: req.pinned.index(False)]]
        assert backend.tokenizer.decode(left[-8:]).endswith("sun came")


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
