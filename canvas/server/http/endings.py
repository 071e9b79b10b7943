"""Where an editor's suggestion ends: the line-level endings of `/infill`, and the early end of an AR row whose drafts
have all reached theirs.

llama.cpp's server (tools/server, `process_token`, read at ggml-org/llama.cpp 001d906) ends an `/infill` generation at
an end-of-generation token ("eos": a FIM model ends its middle itself), a stop string ("word"), `n_predict`, `n_indent`
(once the text holds a newline, a later line indented by fewer spaces and tabs than `n_indent` ends it, cut before
that line's first other character) and `t_max_predict_ms` (past that time, the next token holding a newline ends it),
the last three as "limit". It has no line rule of its own: Qwen2.5-Coder, the model llama.vim recommends, ends the
middle of a half-typed line at the line's end by itself, and llama.vim (autoload/llama.vim, `s:fim_render`) appends
the rest of the cursor line to the suggestion's last line and drops a suggestion that only repeats what follows. Our
FIM adapters seldom end a middle there yet, so the server ends it where such a model would (`CursorLine`):
- the cursor line has text before the cursor: the suggestion is the rest of that line and ends at its first newline
  (`line_rule`); where the line goes on after the cursor, a suggestion whose line ends with the start of that rest is
  cut before the repeat (at word boundaries; kept where the line's brackets balance with it and not without it);
  a middle that ended on its own gets the same cut (`join_rule`);
- a blank cursor line keeps multi-line suggestions (a block), ended by `n_indent` as llama.cpp ends them;
- the first token never breaks the line, except at the start of a line with text after the cursor (inserting lines
  above it): `CursorLine.first_newline`, the engine's `SamplerConfig.ar_first_newline`.
`n_indent` and `t_max_predict_ms` keep llama.cpp's meaning (`llama_infill.indent_rule`, `llama_fields.Deadline`).

An AR infill's K drafts grow side by side (`canvas.engine.ar`; frames carry them all): `early_end` ends the row as
soon as every draft has reached its end (a cut rule, a stop string, or its `<|fim_end|>`), with the draft most of
them agree on, else the leading one, so a single-line suggestion costs its line, not the token budget. A draft's text
is read from its tokens' own texts to check (cheap, each step), and the one chosen is read exactly before it ends the
choice.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from canvas.engine.core import Frame
from canvas.sampling.sampler import SamplerConfig
from canvas.server.http.textgen import CutRule, TextReader, TextTask, stop_cut

_OPEN, _CLOSE = "([{", {")": "(", "]": "[", "}": "{"}
# Why a probe of a draft ended where it did for the draft to count as ended: never "time" or "length" (cut short).
_ENDED = ("rule", "word", "eos")


@dataclass(frozen=True, slots=True)
class CursorLine:
    """The cursor's line around a gap: `before` the cursor (the text before the gap after its last newline) and `after`
    it (the text after the gap up to its first newline; "" at the line's end)."""

    before: str
    after: str

    @classmethod
    def around(cls, before_gap: str, after_gap: str) -> CursorLine:
        return cls(before_gap.rsplit("\n", 1)[-1], after_gap.split("\n", 1)[0])

    @property
    def has_text(self) -> bool:
        """Text before the cursor on its line: the suggestion is the rest of this line."""
        return bool(self.before.strip())

    @property
    def first_newline(self) -> bool:
        """Whether the suggestion may open with a line break: only at the start of a line with text after the cursor
        (a line break then inserts lines above it). A line with text before the cursor, and a blank one (the writer
        opened it to write on it), want text first."""
        return not self.has_text and bool(self.after.strip())


def _word(c: str) -> bool:
    return c.isalnum() or c == "_"


def _boundary(s: str, i: int) -> bool:
    return i <= 0 or i >= len(s) or not (_word(s[i - 1]) and _word(s[i]))


def repeat(line: str, rest: str) -> int:
    """The length of the longest start of `rest` that `line` ends with, both ends of it at word boundaries (so "bathe"
    does not end with the "the" of "the end"); 0 when none."""
    for k in range(min(len(line), len(rest)), 0, -1):
        if line.endswith(rest[:k]) and _boundary(line, len(line) - k) and _boundary(rest, k):
            return k
    return 0


def unbalanced(text: str) -> int:
    """Brackets of `text` that close nothing or are never closed."""
    stack: list[str] = []
    bad = 0
    for ch in text:
        if ch in _OPEN:
            stack.append(ch)
        elif ch in _CLOSE:
            if stack and stack[-1] == _CLOSE[ch]:
                stack.pop()
            else:
                bad += 1
    return bad + len(stack)


def join_at(cursor: CursorLine, line: str) -> int:
    """Where a suggestion's (whole) line `line` ends before the rest of the cursor line: before its repeat of that
    rest's start, unless the repeat balances the line's brackets and its removal does not ("f(a)" before ")" in
    "print(" is a call, not a repeat); with whitespace before the rest, the suggestion's own trailing whitespace goes
    too."""
    rest = cursor.after
    body = line.rstrip()
    k = repeat(body, rest.strip()) if rest.strip() else 0
    if not k:
        return len(line)
    keep = body[: len(body) - k]
    if unbalanced(cursor.before + keep + rest) > unbalanced(cursor.before + line + rest):
        return len(line)
    if rest[:1].isspace():
        keep = keep.rstrip()
    return len(keep)


def line_rule(cursor: CursorLine) -> CutRule | None:
    """The cut rule of a suggestion at a cursor line with text: it ends at its first newline, before a repeat of the
    rest of the line (`join_at`); None on a blank line."""
    if not cursor.has_text:
        return None

    def cut(text: str) -> int | None:
        nl = text.find("\n")
        return None if nl < 0 else join_at(cursor, text[:nl])

    return cut


def join_rule(cursor: CursorLine) -> CutRule | None:
    """For a suggestion that ended on its own before any newline: the cut before a repeat of the rest of the line;
    None where the line has nothing after the cursor or nothing before it."""
    if not cursor.has_text or not cursor.after.strip():
        return None
    return lambda text: None if "\n" in text else join_at(cursor, text)


def indent_rule(n_indent: int) -> CutRule:
    """llama.cpp's `n_indent`: after the first newline, the text ends at the first line whose indentation (spaces
    and tabs) is narrower than `n_indent`, just before that line's first other character."""

    def cut(text: str) -> int | None:
        nl = text.find("\n")
        while nl >= 0:
            k = nl + 1
            while k < len(text) and text[k] in " \t":
                k += 1
            if k < len(text) and k - (nl + 1) < n_indent:
                return k
            nl = text.find("\n", nl + 1)
        return None

    return cut


def combine(*rules: CutRule | None) -> CutRule | None:
    """One rule: the earliest end any of `rules` gives."""
    present = [r for r in rules if r is not None]
    if len(present) <= 1:
        return present[0] if present else None

    def cut(text: str) -> int | None:
        ends = [at for r in present if (at := r(text)) is not None]
        return min(ends) if ends else None

    return cut


@dataclass(frozen=True, slots=True)
class Endings:
    """Where a suggestion ends (`TextTask.cut`, `TextTask.join`) and the sampler settings that draft it."""

    cut: CutRule | None
    join: CutRule | None
    config: SamplerConfig


def suggestion_endings(before: str, after: str, config: SamplerConfig, *, n_indent: int = 0,
                       one_gap: bool = True) -> Endings:
    """The endings of an editor's suggestion between `before` and `after` (the whole texts around the gap): llama.cpp's
    `n_indent` and the cursor line's rules (`line_rule`, `join_rule`), drafted from `config` with the first token
    never breaking the line where the cursor line wants text first (`CursorLine.first_newline`; only for a request
    of `one_gap`: the setting holds for every gap), and, for the rest of a line, with `<|fim_end|>` allowed from the
    first token on (`ar_min_fill` 0: the budget is a ceiling, and a line is short)."""
    cursor = CursorLine.around(before, after)
    if not cursor.first_newline and one_gap:
        config = dataclasses.replace(config, ar_first_newline=False)
    if cursor.has_text:
        config = dataclasses.replace(config, ar_min_fill=0.0)
    cut = combine(indent_rule(n_indent) if n_indent > 0 else None, line_rule(cursor))
    return Endings(cut, join_rule(cursor), config)


# ---- ending an AR row early --------------------------------------------------------------------------------------
EarlyEnd = tuple[list[int], tuple[bool, ...], bool]  # (canvas, written mask, settled) to commit as the last canvas


def _lane_end(task: TextTask, text: str, ended: bool) -> str | None:
    """A draft's text as it would end (`ended`: the draft ended on its own there): None while it goes on."""
    ends = [found[0]] if (found := stop_cut(text, task.stop)) is not None else []
    if task.cut is not None and (at := task.cut(text)) is not None:
        ends.append(at)
    if ends:
        return text[: min(ends)]
    if not ended:
        return None
    at = task.join(text) if task.join is not None else None
    return text if at is None else text[:at]


def early_end(reader: TextReader, task: TextTask, frame: Frame, lead: TextReader, *, fim_end: int | None,
              null_id: int | None, token_text: Callable[[int], str]) -> EarlyEnd | None:
    """What to commit when every draft of the AR canvas `frame` shows has reached where its text ends, else None.
    `reader`: the choice's reader (the frame's canvas is its next); `lead`: its probe of the frame's canvas as drawn
    (the leading draft). A frame without side-by-side drafts ends when the leading draft's written text has reached
    a cut rule or a stop string. With drafts, each draft ends at a cut rule, a stop string or its `<|fim_end|>`
    (`fim_end`; the rest of its gap becomes `<null>`, `null_id`); the one taken is the ending most drafts share (ties:
    the leading draft's, else the first), and it ends the choice only if its exact reading ends there too."""
    if frame.written is None or (task.cut is None and not task.stop):
        return None  # a diffusion row's slots are not final; without a rule nothing ends a draft early
    drafts = frame.drafts
    if drafts is None or drafts.chosen is not None:
        return (list(frame.draft), frame.written, True) if lead.reason in ("rule", "word") else None
    endings: list[tuple[str, tuple[int, ...], bool]] = []
    for tokens in drafts.tokens:
        cut = tokens.index(fim_end) if fim_end is not None and fim_end in tokens else None
        own = tokens if cut is None else tokens[:cut]
        text = _lane_end(task, "".join(token_text(t) for t in own), cut is not None)
        if text is None:
            return None  # this draft goes on
        endings.append((text, own, cut is not None))
    counts = Counter(text for text, _, _ in endings)
    top = max(counts.values())
    order = [drafts.lead, *range(len(endings))]
    k = next(i for i in order if i < len(endings) and counts[endings[i][0]] == top)
    _, own, natural = endings[k]
    if natural and null_id is None:
        return None
    canvas = list(frame.draft)
    written = list(frame.written)
    canvas[drafts.start : drafts.start + len(own)] = own
    if natural:  # the rest of the gap is null, as the engine leaves a draft that ended: the model ended the text
        canvas[drafts.start + len(own) : drafts.end] = [null_id or 0] * (drafts.end - drafts.start - len(own))
        written[drafts.start : drafts.end] = [True] * (drafts.end - drafts.start)
    else:  # the draft goes on past its end: only its tokens so far are written
        written[drafts.start : drafts.end] = [i < len(own) for i in range(drafts.end - drafts.start)]
    settled = not natural
    probe = reader.probe(canvas, written, settled=settled)
    return (canvas, tuple(written), settled) if probe.reason in _ENDED else None


def fim_end_id(token_id: Callable[[str], int | None]) -> int | None:
    """The `<|fim_end|>` id of a tokenizer (`HFTokenizer.token_id`), None without one."""
    from canvas.convert.vocab import FIM_END

    return token_id(FIM_END)
