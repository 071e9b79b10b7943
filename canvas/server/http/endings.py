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

The writer's partial word (`typed_lead`: " applie" of "...had applie", or the " " of "...would ", the space typed
before the next word) is token-healed by constraint where the request drafts left to right (`heal=True`): it leaves
the prompt, so the prompt ends where a word ends as every FIM prefix the fine-tune saw did, the engine's drafts must
start by writing it again in their own tokens (`SamplerConfig.ar_lead`), and `drop_lead` takes it off the answer.
Without that, a prompt ending in " app" "lie" or in a lone space token asks for a split the tokenizer never makes,
and the model joins badly ("would n" -> "ounced"). The rules above read the text with the lead at its start.

At a time limit (`llama_fields.Deadline`) an AR infill's answer is the best-scored draft that has reached its end and
is worth showing (`draft_ends.deadline_end`), not the leading draft as the clock finds it; only where no draft has
ended (or none that ended is worth showing) is a draft taken where time ran out, not where the model chose, and then
`trim_tail` takes off the words it cannot end on ("... worth $2.1 million, and the" -> "... worth $2.1 million"; " or"
-> ""), so it ends at a clause end or a content word, or is dropped where nothing whole is left. A suggestion whose
line is a copy of one of the next lines (`copies_after`: the drafts copy what follows when it is likeliest) is
dropped: accepting it would write that line twice.

An AR infill's K drafts grow side by side: which one ends the row, early or at a time limit, is
`canvas.server.http.draft_ends`'s.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from canvas.sampling.sampler import SamplerConfig
from canvas.server.http.textgen import CutRule

_OPEN, _CLOSE = "([{", {")": "(", "]": "[", "}": "{"}
# The cursor line's partial word: one space after text, then word characters up to the cursor (none: the space alone).
_LEAD = re.compile(r"(?<=\S) \w{0,31}\Z")


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


# Words a phrase cannot end on (articles, prepositions, conjunctions, auxiliaries, determiners): a suggestion cut by
# time that ends on one reads as broken off ("with forty free of"); lowercase.
_CLOSED_CLASS = frozenset(
    "a an the of or and but nor to in on at by for from with as into onto upon than that which whose if so because "
    "while when where whether your my our their his her its this these those is are was were be been being has have "
    "had do does did can could will would shall should may might must not no very such".split())
_LAST_WORD = re.compile(r"\w+\Z")
_HANGING = " \t,;:-([{\"'\u201c\u2018"  # what a text cut by time may trail that leaves it hanging


_SENTENCE_END = re.compile(r"[.!?][\"')\]\u201d\u2019]*(?=\s)")  # a sentence's end with more text after it
_FINISHED = re.compile(r"[.!?][\"')\]\u201d\u2019]*\Z")  # a text that ends where a sentence does


def _open_bracket(text: str) -> int:
    """Where the first bracket of `text` that is never closed opens; -1 when every one closes."""
    stack: list[int] = []
    for i, ch in enumerate(text):
        if ch in _OPEN:
            stack.append(i)
        elif ch in _CLOSE and stack and text[stack[-1]] == _CLOSE[ch]:
            stack.pop()
    return stack[0] if stack else -1


def trim_tail(text: str) -> str:
    """A text a time limit ended, less what it cannot end on: a sentence it had begun after a finished one ("... 72
    votes. He" -> "... 72 votes."), what follows a bracket it never closed ("1.5.0 (2019-06-28" -> "1.5.0"), then
    trailing closed-class words and the separators that leave it hanging (spaces, commas, opening brackets and
    quotes), one after another; "" when nothing else is left. A text ending with a full stop, a closing bracket or a
    content word keeps all of it but such separators."""
    out = text.rstrip()
    if not _FINISHED.search(out):  # not at a sentence's end: an unfinished sentence after a finished one goes
        ends = list(_SENTENCE_END.finditer(out))
        out = out[: ends[-1].end()] if ends else out
    if (at := _open_bracket(out)) >= 0:
        out = out[:at]
    if _FINISHED.search(out):
        return out
    while True:
        core = out.rstrip(_HANGING)
        found = _LAST_WORD.search(core)
        if found is None or found.group(0).lower() not in _CLOSED_CLASS:
            return core if core.strip() else ""
        out = core[: found.start()]


# What a copy may add or lose at its end and still be a copy: "I am still young." of "I am still young by your
# standards" (a sentence the suggestion ends where the copied line goes on).
_TRAILING = ".,;:!?\u2026"


def _bare(line: str) -> str:
    """A line as a copy is compared: stripped, lowercased, less its trailing punctuation (`_TRAILING`)."""
    return line.strip().rstrip(_TRAILING).rstrip().lower()


def _inside(part: str, line: str) -> bool:
    """Whether `part` occurs in `line` with both of its ends at word boundaries (so "young" is not in "youngster")."""
    at = line.find(part)
    while at >= 0:
        if _boundary(line, at) and _boundary(line, at + len(part)):
            return True
        at = line.find(part, at + 1)
    return False


def copies_after(text: str, after: str, *, lines: int = 64, min_chars: int = 12) -> bool:
    """Whether the suggestion `text` is, line for line, a copy of text in the first `lines` lines of `after` (each
    of its non-blank lines, stripped, at least `min_chars` long in all, found inside one of those lines at word
    boundaries, whatever the case and the line's trailing punctuation: `_bare`). 64 lines: llama.vim's `n_suffix`,
    all the suffix it sends; a copy of a line further down is a copy all the same."""
    mine = [_bare(ln) for ln in text.split("\n") if _bare(ln)]
    if not mine or sum(map(len, mine)) < min_chars:
        return False
    theirs = [ln.strip().lower() for ln in after.split("\n")[: lines + 1] if ln.strip()]
    return all(any(_inside(m, t) for t in theirs) for m in mine)


_WORDS = re.compile(r"\w+")
# A suggestion whose word 4-grams are at least this share (and two or more) of text after the cursor repeats it:
# `dcanvas eval --task clients` counts the same 4-grams as echo (human text: about 4% pooled).
ECHO_SHARE = 0.3


def _grams(text: str) -> list[tuple[str, ...]]:
    words = [w.lower() for w in _WORDS.findall(text)]
    return [tuple(words[i : i + 4]) for i in range(len(words) - 3)]


def repeats_before(text: str, before: str, *, lines: int = 3, min_chars: int = 8) -> bool:
    """Whether the suggestion's first line (stripped, `min_chars` long) is already written in the last `lines` lines
    before the cursor: three words or more found there in a row, whatever the punctuation ("What is your age\nI am
    still young " -> "I am still young."), or two found as they are ("class shlex:\n    \"A lexical analyzer class "
    -> "class shlex"). Accepted, it would say again what was just said."""
    first = text.strip().split("\n", 1)[0].strip()
    words = [w.lower() for w in _WORDS.findall(first)]
    if len(first) < min_chars or len(words) < 2:
        return False
    near = "\n".join(before.rsplit("\n", lines)[-lines:])
    if first in near:
        return True
    theirs = [w.lower() for w in _WORDS.findall(near)]
    n = len(words)
    return n >= 3 and any(theirs[i : i + n] == words for i in range(len(theirs) - n + 1))


def _runs(words: Sequence[str], theirs: Sequence[str]) -> list[tuple[int, int]]:
    """Each (start, length) in `words` of a longest run that also occurs in `theirs`, in order of start."""
    out = []
    for i in range(len(words)):
        best = 0
        for j in range(len(theirs)):
            n = 0
            while i + n < len(words) and j + n < len(theirs) and words[i + n] == theirs[j + n]:
                n += 1
            best = max(best, n)
        out.append((i, best))
    return out


# A suggestion repeats the cursor line when it holds a run of this many of the line's words in a row, or opens with
# the line's first `_RESTART_WORDS` words. Fewer is common wording ("in the", "of the city"), and code ("foo(a, b").
_LINE_RUN_WORDS = 4
_RESTART_WORDS = 3


def line_echo(text: str, before: str) -> int | None:
    """Where the suggestion `text` starts to repeat the cursor line (the text of `before` after its last newline):
    the start of its first line's first run of `_LINE_RUN_WORDS` words in a row (whatever the punctuation) found
    on that line, or its start where it opens with the line's first `_RESTART_WORDS` words (the line begun again:
    "I am still young " -> "I am still young, still young.") or its last two words or more ("still young."); None
    where it does not.
    Code repeats the lines above it by nature, so only the cursor line is read."""
    first = text.split("\n", 1)[0]
    found = list(_WORDS.finditer(first))
    words = [m.group(0).lower() for m in found]
    theirs = [w.lower() for w in _WORDS.findall(before.rsplit("\n", 1)[-1])]
    if any(words[:k] == theirs[-k:] for k in range(2, min(len(words), len(theirs)) + 1)):
        return found[0].start()  # it says the line's last words again ("I am still young " -> "still young.")
    if len(words) >= _RESTART_WORDS and words[:_RESTART_WORDS] == theirs[:_RESTART_WORDS]:
        return found[0].start()  # the line begun again
    for i, n in _runs(words, theirs):
        if n >= _LINE_RUN_WORDS:
            return found[i].start()
    return None


def cut_line_echo(text: str, before: str) -> str:
    """The suggestion less its repeat of the cursor line (`line_echo`) and what follows it, trimmed to what it can
    end on (`trim_tail`): "" where it starts with the repeat; `text` itself where it has none."""
    at = line_echo(text, before)
    return text if at is None else trim_tail(text[:at])


def echoes(text: str, before: str, after: str) -> bool:
    """Whether the suggestion `text` repeats its surroundings rather than adding to them: a copy of lines that
    follow (`copies_after`), `ECHO_SHARE` of its word 4-grams (two or more) found after the cursor, or its first line
    a copy of what was just written before it (`repeats_before`)."""
    if copies_after(text, after) or repeats_before(text, before):
        return True
    grams = _grams(text)
    if len(grams) < 2:
        return False
    seen = set(_grams(after))
    hits = sum(g in seen for g in grams)
    return hits >= 2 and hits >= ECHO_SHARE * len(grams)


# Personal pronouns: closed-class too, but a phrase may end on one ("I love you"), so `trim_tail` keeps them.
_PRONOUNS = frozenset("i you he she it we they me him us them".split())


def function_words_only(text: str) -> bool:
    """Whether `text` has words and every one is closed-class (`_CLOSED_CLASS` or a personal pronoun: "a", "be.",
    "can", "of the", "you"): such an answer says nothing a reader could take, whatever ended it."""
    words = _WORDS.findall(text)
    return bool(words) and all(w.lower() in _CLOSED_CLASS or w.lower() in _PRONOUNS for w in words)


def sensible(text: str, before: str, after: str) -> bool:
    """Whether a suggestion is worth showing once its repeat of the cursor line is cut (`cut_line_echo`): blank,
    function words only (`function_words_only`) or an echo (`echoes`) is not."""
    text = cut_line_echo(text, before)
    return bool(text.strip()) and not function_words_only(text) and not echoes(text, before, after)


def typed_lead(before: str) -> str:
    """The writer's partial word at the end of `before`: a space after text and the word characters after it (at most
    31: a longer run is code or a URL), or that space alone; "" where `before` ends otherwise (at a line start, after
    two spaces, inside punctuation)."""
    found = _LEAD.search(before)
    return found.group(0) if found else ""


def drop_lead(text: str, lead: str) -> str:
    """The suggestion a client gets from a text drafted to start with `lead` (`typed_lead`): the text after it; ""
    when the text ended before the lead was written whole (a time limit: nothing of the suggestion is left)."""
    return text[len(lead) :] if text.startswith(lead) else ""


class LeadCut:
    """`drop_lead` over a stream: fed the text's pieces in order, returns each piece less what of the lead it holds."""

    def __init__(self, lead: str) -> None:
        self.lead, self.seen = lead, 0

    def __call__(self, piece: str) -> str:
        start, self.seen = self.seen, self.seen + len(piece)
        return piece[max(0, len(self.lead) - start) :]


@dataclass(frozen=True, slots=True)
class Endings:
    """Where a suggestion ends (`TextTask.cut`, `TextTask.join`), the sampler settings that draft it, and the lead
    it is drafted to start with (`typed_lead`; the prompt is `before` less it, the answer `drop_lead`'s)."""

    cut: CutRule | None
    join: CutRule | None
    config: SamplerConfig
    lead: str = ""


def suggestion_endings(before: str, after: str, config: SamplerConfig, *, n_indent: int = 0,
                       one_gap: bool = True, heal: bool = False) -> Endings:
    """The endings of an editor's suggestion between `before` and `after` (the whole texts around the gap): llama.cpp's
    `n_indent` and the cursor line's rules (`line_rule`, `join_rule`), drafted from `config` with the first token
    never breaking the line where the cursor line wants text first (`CursorLine.first_newline`; only for a request
    of `one_gap`: the setting holds for every gap), and with `<|fim_end|>` allowed from the first token on
    (`ar_min_fill` 0: llama.cpp's budget is a ceiling; a line is short, and so is a code line at an emptied line,
    which a minimum fill would make run on into the lines after it; the engine still ends no draft while it is
    blank). With `heal`, in AR mode and for
    one gap, the cursor line's partial word is the lead (`typed_lead`, `SamplerConfig.ar_lead`): the caller sends
    `before` less `Endings.lead` and gives the client `drop_lead` of the text."""
    lead = typed_lead(before) if heal and one_gap and config.mode == "ar" else ""
    if lead:
        before = before[: len(before) - len(lead)]
        config = dataclasses.replace(config, ar_lead=lead)
    cursor = CursorLine.around(before, after)
    if not cursor.first_newline and one_gap:
        config = dataclasses.replace(config, ar_first_newline=False)
    if cursor.has_text or one_gap:  # llama.cpp's budget is a ceiling: a line, a block, may end well short of it
        config = dataclasses.replace(config, ar_min_fill=0.0)
    cut = combine(indent_rule(n_indent) if n_indent > 0 else None, line_rule(cursor))
    return Endings(cut, join_rule(cursor), config, lead)
