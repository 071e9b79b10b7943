"""llama.vim's instruction mode: a chat request that asks to edit a selection, read back as the selection and the text
around it, so that `/v1/chat/completions` can serve it as a rewrite (a gap between the text before and after the
selection) instead of continuing a transcript.

Owns `Edit`, `find_edit` and `edit_prompt` (the text the model reads before the new selection). The shape (llama.vim
autoload/llama.vim, `llama#inst_build`, at commit a1c8e6e40cb45df59b78add5b65d575386832465): a first system message that
holds, after llama.vim's instructions, four sections, each a marker line (`--- CONTEXT`, `--- PREFIX`, `--- SELECTION`,
`--- SUFFIX`, padded with spaces, then dashes) followed by its lines joined by newlines and one newline more; then user
messages whose content is `INSTRUCTION: <text>` (empty in its warm-up request), and, after `inst_continue`, the
assistant's earlier answers between them. Invariant: a request is an edit only if the markers are all there, once each
and in that order, and the last message is a user's; anything else is an ordinary chat.

Also owns `Screen`, the check a rewrite's candidate passes before it is answered. The model is not instruction-tuned: it
fills the selection's place between the text around it, and a fill-in-the-middle model that does not know what to write
there readily writes the text that follows (the lines below, one word changed). Invariants of an accepted candidate: it
is not blank; no non-trivial line of it (`_TRIVIAL_CHARS`+ characters or `_TRIVIAL_WORDS`+ words, whitespace normalised)
equals or nearly equals (`_NEAR` similarity) a line of the text outside the selection that the model was shown (the
lines before and after, the extra context, the instructions) unless the line is also in the selection; it shares no run
of `_RUN_WORDS` words with that text that the selection does not have; it has at most one line more than the selection
unless the instruction asks for more. Blank lines at its edges where the selection has none are dropped first (llama.vim
drops trailing ones itself; leading ones would be inserted).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher

_MARKER = re.compile(r"^--- (CONTEXT|PREFIX|SELECTION|SUFFIX) +-{3,}\n", re.MULTILINE)
_ORDER = ("CONTEXT", "PREFIX", "SELECTION", "SUFFIX")
_INSTRUCTION_TAG = re.compile(r"^INSTRUCTION:\s*")


@dataclass(frozen=True, slots=True)
class Edit:
    instruction: str  # the users' instructions, oldest first, one per line ("" when none was given yet)
    context: str  # extra context from other buffers ("" when none)
    before: str  # the lines before the selection, each ending in a newline
    selection: str  # the text the answer replaces: the selection, or the assistant's latest answer to edit further
    after: str  # the text after the selection, from the newline that ends its last line ("" at the end of a file)
    # A continued edit: the original selection and the assistant's answers before the latest (empty for a first edit);
    # an answer may go back to any of them.
    earlier: tuple[str, ...] = ()


def _sections(system: str) -> dict[str, str] | None:
    marks = list(_MARKER.finditer(system))
    names = [m.group(1) for m in marks]
    if names not in (list(_ORDER), list(_ORDER[1:])):
        return None
    out = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(system)
        out[m.group(1)] = system[m.end() : end]
    return out


def _line_block(section: str) -> str:
    """A section's lines as text: llama.vim writes `join(lines, "\\n") . "\\n"`, so one trailing newline is its own."""
    return section.removesuffix("\n")


def find_edit(messages: Sequence[tuple[str, str]]) -> Edit | None:
    """The edit a chat request (`(role, text)` pairs) asks for, or None when it is not llama.vim's shape."""
    if len(messages) < 2 or messages[0][0] not in ("system", "developer") or messages[-1][0] != "user":
        return None
    sections = _sections(messages[0][1])
    if sections is None:
        return None
    rest = messages[1:]
    instruction = "\n".join(text.strip() for role, text in rest if role == "user" and text.strip())
    answers = [text for role, text in rest if role == "assistant"]
    selection = answers[-1].removesuffix("\n") if answers else _line_block(sections["SELECTION"])
    before = _line_block(sections["PREFIX"])
    suffix = _line_block(sections["SUFFIX"])
    return Edit(
        instruction=instruction,
        context=_line_block(sections.get("CONTEXT", "")).strip("\n"),
        before=before + "\n" if before else "",
        selection=selection,
        after="\n" + suffix if suffix.strip() else "",
        earlier=(_line_block(sections["SELECTION"]), *(a.removesuffix("\n") for a in answers[:-1])) if answers else (),
    )


def edit_prompt(edit: Edit) -> str:
    """The text before the gap: the extra context, the lines before the selection, then the instructions and the
    selection as a before/after pair whose "after" is the gap. The model is not instruction-tuned, but it has read
    such pairs: shown the selection, its fill is a variant of it; not shown it (the instruction alone before the
    gap), it wrote whatever fits before the text that follows, most often that text again."""
    head = edit.context + "\n\n" if edit.context else ""
    asks = "".join(f"Instruction: {_INSTRUCTION_TAG.sub('', line)}\n" for line in edit.instruction.split("\n") if line)
    return f"{head}{edit.before}{asks}Original:\n{edit.selection}\nRewritten:\n"


# -- screening a rewrite's candidates -------------------------------------------------------------------------------

# A line this long (stripped) or with this many words is one a rewrite would not repeat by chance; shorter ones
# (`return y`, `}`, `else:`) may legitimately recur anywhere.
_TRIVIAL_CHARS = 12
_TRIVIAL_WORDS = 3
# Similarity (difflib's ratio) at which a candidate line is a near copy of a line outside the selection: one word
# changed in a line of eight keeps about 0.85.
_NEAR = 0.8
# Words in a row shared with the text outside the selection (and absent from the selection) that make a copy even
# when the lines were re-broken: a sentence of the next paragraph, joined onto the rewrite.
_RUN_WORDS = 8
# Words in an instruction that ask for a longer text: the line limit then does not apply (the budget still does).
_GROW = re.compile(r"\b(expand|elaborate|extend|lengthen|longer|add|more detail|continue|append|insert|write|"
                   r"list|paragraphs?|implement|docstring|comments?)\b", re.IGNORECASE)
_WORD = re.compile(r"\w+")


def _norm(line: str) -> str:
    return " ".join(line.split())


def _substantial(norm: str) -> bool:
    return len(norm) >= _TRIVIAL_CHARS or len(norm.split()) >= _TRIVIAL_WORDS


def _runs(text: str) -> set[tuple[str, ...]]:
    words = [w.lower() for w in _WORD.findall(text)]
    return {tuple(words[i : i + _RUN_WORDS]) for i in range(len(words) - _RUN_WORDS + 1)}


def _lines(texts: Iterable[str]) -> set[str]:
    return {n for t in texts for n in map(_norm, t.split("\n")) if n}


def _trim_blank_edges(candidate: str, selection: str) -> str:
    """The candidate without the blank lines at either edge where the selection has none."""
    lines = candidate.split("\n")
    sel = selection.split("\n")
    if sel[0].strip():
        while len(lines) > 1 and not lines[0].strip():
            lines.pop(0)
    if sel[-1].strip():
        while len(lines) > 1 and not lines[-1].strip():
            lines.pop()
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Verdict:
    text: str  # the candidate as it would be answered (blank edges dropped where the selection has none)
    reason: str | None  # why it may not be the answer; None: it may


@dataclass(frozen=True, slots=True)
class Screen:
    """What a candidate for `edit` is checked against (built once per request by `Screen.of`)."""

    selection: str
    inside: frozenset[str]  # normalised lines of the selection (and of what a continued edit started from)
    inside_runs: frozenset[tuple[str, ...]]
    outside: tuple[str, ...]  # normalised substantial lines shown to the model outside the selection, not inside
    outside_runs: frozenset[tuple[str, ...]]
    max_lines: int | None  # None: the instruction asks for more text

    @classmethod
    def of(cls, edit: Edit) -> Screen:
        asked = edit.instruction.split("\n")
        shown = (edit.before, edit.after, edit.context, *asked, *(_INSTRUCTION_TAG.sub("", line) for line in asked))
        inside_texts = (edit.selection, *edit.earlier)
        inside = _lines(inside_texts)
        outside = tuple(sorted(n for n in _lines(shown) if _substantial(n) and n not in inside))
        inside_runs = set().union(*map(_runs, inside_texts))
        outside_runs = set().union(*map(_runs, shown)) - inside_runs
        grows = _GROW.search(edit.instruction) is not None
        return cls(edit.selection, frozenset(inside), frozenset(inside_runs), outside, frozenset(outside_runs),
                   None if grows else edit.selection.count("\n") + 2)

    def check(self, candidate: str) -> Verdict:
        text = _trim_blank_edges(candidate, self.selection)
        if not text.strip():
            return Verdict(text, "empty: nothing but whitespace")
        lines = text.split("\n")
        if self.max_lines is not None and len(lines) > self.max_lines:
            return Verdict(text, f"too long: {len(lines)} lines for a selection of {self.max_lines - 1}")
        for line in lines:
            n = _norm(line)
            if not _substantial(n) or n in self.inside:
                continue
            copied = self._copy_of(n)
            if copied is not None:
                return Verdict(text, f"copies a line from outside the selection: {copied!r}")
        shared = _runs(text) & self.outside_runs
        if shared:
            return Verdict(text, f"repeats {_RUN_WORDS} words in a row from outside the selection: "
                                 f"{' '.join(min(shared))!r}")
        return Verdict(text, None)

    def _copy_of(self, n: str) -> str | None:
        """The outside line that `n` copies or nearly copies (and is closer to than to any selection line)."""
        best, best_ratio = None, _NEAR
        for out in self.outside:
            if out == n:
                return out
            m = SequenceMatcher(None, n, out, autojunk=False)
            if m.real_quick_ratio() >= best_ratio and m.quick_ratio() >= best_ratio and m.ratio() >= best_ratio:
                best, best_ratio = out, m.ratio()
        if best is None:
            return None
        own = max((SequenceMatcher(None, n, s, autojunk=False).ratio() for s in self.inside), default=0.0)
        return best if best_ratio > own else None
