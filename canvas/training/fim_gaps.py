"""Gaps as editors make them, chosen in the text of a window of a document: where a FIM middle starts and ends.

An editor's gap is rarely a random run of words. In code (llama.vim, llama.vscode) it is the rest of the line after
the cursor, a whole line, a few lines, or the body under a `def`/`if`/`{` line; the middle ends at a line end (the
newline belongs to the text after the gap) and the model must stop there with `<|fim_end|>`. In prose it is the rest
of the sentence or of the line (a paragraph is one line in the corpus), ending at the full stop or the line end.
`code_gap` and `prose_gap` return such a gap (`TextGap`, character offsets into the window's text) or None where the
window has no place for the shape drawn (the caller then cuts a token span instead: `canvas.training.fim`).

Invariants: `text[:cut] + text[cut:end] + text[end:]` is the text (nothing is added, dropped or re-indented); a middle
never holds a newline in the "rest"/"line"/"sentence" shapes and never starts or ends with one in any shape; it ends
where a line ends (the next character is "\\n") or, for "sentence", after a full stop, question or exclamation mark
(with its closing quotes) that a space or a line end follows; `line_start <= cut` is the start of the cursor's line,
so `text[line_start:cut]` is what llama.vim sends as `prompt` (the cursor line before the cursor); `mid_word` marks a
cut inside an identifier or word (only the layout with the cursor line after `<|fim_middle|>` may use it: there the
model reads the partial word as text, as the engine's token healing puts it). Lines cut by the window's edges are
never part of a middle. Every choice is drawn from the `rng` passed in, so a gap is a function of its seed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

# Shapes and their shares; "span" is the caller's token span (a word to a paragraph, cut at word boundaries).
CODE_SHAPES = (("rest", 0.35), ("line", 0.2), ("block", 0.15), ("body", 0.1), ("span", 0.2))
PROSE_SHAPES = (("rest", 0.2), ("sentence", 0.25), ("span", 0.55))
MAX_BLOCK_LINES = 8
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=[ \n])")


@dataclass(frozen=True, slots=True)
class TextGap:
    shape: str
    cut: int  # the middle is text[cut:end]
    end: int
    line_start: int  # start of the cursor's line
    mid_word: bool = False  # the cut splits a word or identifier


def draw_shape(rng: np.random.Generator, shapes: tuple[tuple[str, float], ...]) -> str:
    r, acc = rng.random(), 0.0
    for name, share in shapes:
        acc += share
        if r < acc:
            return name
    return shapes[-1][0]


def _lines(text: str, first_whole: bool) -> list[tuple[int, int, bool]]:
    """(start, end, whole) of every line: end is the index of its "\\n" (or len(text)); a line is whole when the
    window holds its start (not the first line of a window cut inside a document) and its newline."""
    out, start = [], 0
    for i, line in enumerate(text.split("\n")):
        end = start + len(line)
        out.append((start, end, (i > 0 or first_whole) and end < len(text)))
        start = end + 1
    return out


def _indent(text: str, start: int, end: int) -> int:
    line = text[start:end]
    return len(line) - len(line.lstrip(" \t"))


def _word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def code_gap(text: str, rng: np.random.Generator, *, first_whole: bool, max_chars: int) -> TextGap | None:
    """A code gap of a drawn shape ("rest", "line", "block", "body"), or None ("span" drawn, or no room for it)."""
    shape = draw_shape(rng, CODE_SHAPES)
    if shape == "span":
        return None
    lines = _lines(text, first_whole)
    full = [i for i, (s, e, whole) in enumerate(lines) if whole and text[s:e].strip()]
    if not full:
        return None
    if shape == "body":
        return _body_gap(text, lines, rng, max_chars)
    i = full[int(rng.integers(0, len(full)))]
    s, e, _ = lines[i]
    ind = _indent(text, s, e)
    if shape == "rest":
        p = int(rng.integers(s + ind, e))  # the cursor: after the indentation, before the line's last character
        if not text[p:e].strip():
            return None
        mid = p > s + ind and _word(text[p - 1]) and _word(text[p])
        return TextGap("rest", p, e, s, mid) if e - p <= max_chars else None
    start = s + ind if rng.random() < 0.5 else s  # the cursor at the indentation (auto-indent) or at column 0
    if shape == "line":
        return TextGap("line", start, e, s) if e - start <= max_chars else None
    # block: this line and up to MAX_BLOCK_LINES - 1 more whole lines, ending on a non-blank one
    last = i
    for j in range(i + 1, min(len(lines), i + int(rng.integers(2, MAX_BLOCK_LINES + 1)))):
        if not lines[j][2]:
            break
        if text[lines[j][0] : lines[j][1]].strip() and lines[j][1] - start <= max_chars:
            last = j
    return TextGap("block", start, lines[last][1], s) if last > i else None


def _body_gap(text: str, lines: list[tuple[int, int, bool]], rng: np.random.Generator,
              max_chars: int) -> TextGap | None:
    """The lines indented under a header line (`def f():`, `if x {`), as far as they fit in `max_chars`."""
    bodies: list[tuple[int, int]] = []  # (first, last) line of each body
    for h, (s, e, whole) in enumerate(lines):
        if not whole or not text[s:e].strip():
            continue
        head = _indent(text, s, e)
        first = last = -1
        for j in range(h + 1, len(lines)):
            js, je, jwhole = lines[j]
            if not jwhole:
                break
            if not text[js:je].strip():
                continue
            if _indent(text, js, je) <= head:
                break
            first = j if first < 0 else first
            if je - lines[first][0] > max_chars:
                break
            last = j
        if first >= 0 and last >= first:
            bodies.append((first, last))
    if not bodies:
        return None
    first, last = bodies[int(rng.integers(0, len(bodies)))]
    s, e, _ = lines[first]
    start = s + _indent(text, s, e) if rng.random() < 0.5 else s
    return TextGap("body", start, lines[last][1], s)


def prose_gap(text: str, rng: np.random.Generator, *, max_chars: int) -> TextGap | None:
    """A prose gap: the rest of the line (the paragraph) or of the sentence after a cursor that sits between two
    words, the middle starting with the space before the next word; None ("span" drawn, or no room)."""
    shape = draw_shape(rng, PROSE_SHAPES)
    if shape == "span":
        return None
    last_nl = text.rfind("\n")  # a middle must end before a line end the window holds (the doc's end is not one)
    cursors = [m.start() for m in re.finditer(r"(?<=\S) (?=\S)", text[:last_nl])] if last_nl > 0 else []
    if not cursors:
        return None
    p = cursors[int(rng.integers(0, len(cursors)))]
    line_end = text.index("\n", p)
    end = line_end
    if shape == "sentence":
        found = _SENTENCE_END.search(text, p + 1, line_end + 1)
        if found is None:
            return None
        end = found.end()
    if not text[p:end].strip() or end - p > max_chars:
        return None
    return TextGap(shape, p, end, text.rfind("\n", 0, p) + 1)
