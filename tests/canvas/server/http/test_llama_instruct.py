"""The screen a rewrite's candidates pass (canvas.server.http.llama_instruct.Screen) and the text the model reads
before the new selection (`edit_prompt`), on llama.vim's request shape (built as `llama#inst_build` builds it, with
`vim_system` from the llama.cpp-fields tests)."""

from __future__ import annotations

from canvas.server.http.llama_instruct import Edit, Screen, edit_prompt, find_edit
from tests.canvas.server.http.test_llama_ext import vim_system

# The fault: line 1 of a three-line file selected, "Rewrite this sentence more formally".
PROSE = ["the meeting got moved to friday cause the boss was out sick all week.",
         "Everyone on the team was told to send their reports by thursday night.",
         "The slides for the quarterly review still need a few more charts."]  # fmt: skip


def prose_edit(instruction: str = "Rewrite this sentence more formally") -> Edit:
    edit = find_edit([("system", vim_system([], PROSE[:1], PROSE[1:])), ("user", f"INSTRUCTION: {instruction}")])
    assert edit is not None
    return edit


def test_the_reported_answer_is_refused_and_a_rewrite_passes() -> None:
    screen = Screen.of(prose_edit())
    # What the fault accepted: two blank lines, then lines 2-3 with one word changed.
    reported = "\n\nThe team was told to send their reports by thursday night.\n" + PROSE[2]
    verdict = screen.check(reported)
    assert verdict.reason is not None and "outside the selection" in verdict.reason
    good = screen.check("\nThe meeting was moved to Friday because the boss was out sick all week.")
    # The blank line before it is dropped (the selection starts with text); nothing else changes.
    assert good == type(good)("The meeting was moved to Friday because the boss was out sick all week.", None)


def test_near_copies_and_re_broken_copies_of_the_text_around_are_refused() -> None:
    screen = Screen.of(prose_edit())
    near = screen.check("Everyone in the team was told to send their reports by thursday night.")
    assert near.reason is not None and near.reason.startswith("copies a line")
    # Two sentences joined on one line: no line equals one outside, but eight words in a row come from below.
    joined = screen.check("The meeting was moved to Friday because the boss was ill, and the slides for the quarterly "
                          "review still need a few more charts")
    assert joined.reason is not None and joined.reason.startswith("repeats 8 words")
    # The instruction is outside the selection too.
    echoed = screen.check("Rewrite this sentence more formally")
    assert echoed.reason is not None and "outside" in echoed.reason


def test_blank_and_overlong_candidates_are_refused_unless_asked_to_grow() -> None:
    screen = Screen.of(prose_edit())
    assert screen.check("").reason == "empty: nothing but whitespace"
    assert screen.check(" \n\t\n").reason == "empty: nothing but whitespace"
    three = "The meeting moved.\nIt is on Friday.\nThe boss was ill."
    assert screen.check(three).reason == "too long: 3 lines for a selection of 1"
    assert screen.check("The meeting moved.\nIt is on Friday.").reason is None  # one line more is allowed
    assert Screen.of(prose_edit("expand this into a paragraph")).check(three).reason is None


def test_lines_the_selection_shares_with_the_text_around_may_stay() -> None:
    # `    return y` is short; `total = total + 1` is substantial and occurs both in the selection and below it.
    edit = find_edit([("system", vim_system(["def f(total):"], ["    total = total + 1", "    y = total * 2"],
                                            ["    total = total + 1", "    return y"])),
                      ("user", "INSTRUCTION: double it")])  # fmt: skip
    assert edit is not None
    screen = Screen.of(edit)
    assert screen.check("    total = total + 1\n    y = total * 4").reason is None
    # A continued edit may go back to the original selection, which is no longer the text being edited.
    more = find_edit([("system", vim_system([], PROSE[:1], PROSE[1:])), ("user", "INSTRUCTION: a"),
                      ("assistant", "The meeting was moved."), ("user", "INSTRUCTION: b")])  # fmt: skip
    assert more is not None and more.earlier == (PROSE[0],)
    assert Screen.of(more).check(PROSE[0]).reason is None


def test_the_model_reads_the_selection_and_the_instruction_right_before_the_gap() -> None:
    edit = prose_edit()
    assert edit_prompt(edit) == ("Instruction: Rewrite this sentence more formally\nOriginal:\n" + PROSE[0]
                                 + "\nRewritten:\n")  # fmt: skip
    code = find_edit([("system", vim_system(["import math", "def area(r):"], ["    y = math.pi * r * r"],
                                            ["    return y"], extra="x = 1")),
                      ("user", "INSTRUCTION: a"), ("assistant", "    y = r\n"),
                      ("user", "INSTRUCTION: b")])  # fmt: skip
    assert code is not None
    assert edit_prompt(code) == ("x = 1\n\nimport math\ndef area(r):\nInstruction: a\nInstruction: b\nOriginal:\n"
                                 "    y = r\nRewritten:\n")  # fmt: skip
