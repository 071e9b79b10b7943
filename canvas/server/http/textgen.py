"""Text in, engine request out, text back: the canvas layout of one HTTP text generation and the reading of its
generated ids (for the OpenAI-compatible and llama.cpp dialects, which speak text and token budgets, not canvases).

Owns `TextTask` (what a dialect asks for), `plan` (the engine request for it) and `TextReader` (generated ids ->
text, cut where the text must end). Two layouts:
- continuation (no suffix): the prompt is the encoder's context; `max_tokens` free slots, as one canvas of that
  many slots or, past one canvas, as many whole canvases as the budget needs (the rest of the last one is cut).
- infill: the end of the prefix and the start of the suffix are pinned around a gap of free slots, as training lays
  out a gap; the rest of the prefix is context. The gap is the token budget (no more than the largest gap training
  used), and the fill is variable-length: `<null>` slots are dropped, so a fill that needs fewer tokens than the gap
  comes out shorter instead of padded. The model's own `gap_min_fill` (a share of the gap always written) is turned
  down to `_API_MIN_FILL` here: an editor's budget is a ceiling, not a length to fill.

Invariants: the context always starts with BOS (when the tokenizer has one) and keeps its newest tokens when it is
cut to `max_context` (at least 7/8 of it: the cut moves in steps, so that a growing prompt keeps a stable start);
text is read with a little left context so a SentencePiece decoder keeps a leading space; only slots the model wrote
are read as text (an AR frame's unwritten slots hold noise); `TextReader.text` only grows, except once, when a stop
sequence, a cut rule or a word cut ends it, and never shrinks below `safe`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from canvas.document import Atom, atoms_from_ids
from canvas.document.tokenizer import INCOMPLETE
from canvas.engine.backend import Backend
from canvas.engine.core import GenRequest
from canvas.sampling.sampler import Mode, SamplerConfig

_MIN_TEMPERATURE = 0.01  # "temperature 0": near-greedy; far above 0 so banned logits (-1e4) stay far below
# The largest gap training lays out (CorruptionConfig.max_gap_frac): a longer one is out of distribution.
_MAX_GAP_SHARE = 0.75
# The model's gap_min_fill is the share of a gap it must write (0.75 for the embedded model: 48+ tokens in a 64-slot
# gap). An editor's token budget is an upper bound, so the API keeps only a small head of the gap for text, enough
# that a fill is never empty; on the embedded model 64-slot gaps then filled with 4 to 30 tokens where little fit.
_API_MIN_FILL = 0.125
_LEFT_TOKENS = 8  # prefix tokens decoded before a fill, so its first token keeps its leading space
_CUT_STEP = 256  # a context cut to `max_context` drops its oldest tokens in steps of this many (at most an eighth)

CutRule = Callable[[str], int | None]  # text -> where it must end (a dialect's rule, e.g. llama.cpp's n_indent)
# Why a text ended: "eos" (the model ended it: EOS, or an infill that left slots null), "word" (a stop sequence),
# "rule" (the task's cut rule), "length" (the budget was used up), "time" (settled early at its draft: a time limit).
End = Literal["eos", "word", "rule", "length", "time"]


@dataclass(frozen=True, slots=True)
class TextTask:
    prompt: str  # the text before the generation (for an infill, everything before the gap)
    suffix: str | None = None  # the text after the gap; None or "" is a continuation
    max_tokens: int = 16  # the token budget: a continuation's length limit, an infill's gap
    config: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
    seed: int | None = None  # choice i runs with seed + i; None draws a fresh seed per choice
    n: int = 1  # independent choices, batched together by the engine
    stop: tuple[str, ...] = ()  # the text ends before the first of these
    cut: CutRule | None = None
    # Where a text that ended on its own (EOS, or an infill that left slots null) must end: e.g. before what repeats
    # the text after the gap (`canvas.server.http.endings`). A cut rule sees a text that may still grow; this, one
    # whose end is the model's.
    join: CutRule | None = None

    @property
    def infill(self) -> bool:
        return bool(self.suffix)


@dataclass(frozen=True, slots=True)
class Plan:
    request: GenRequest  # the seedless request; `TextRun` gives each choice its seed
    fill: tuple[int, int]  # slots of the first canvas that hold generated text
    canvas_length: int
    prompt_tokens: int  # tokens the model reads besides the generated ones: context and pinned slots
    left: tuple[Atom, ...]  # the atoms just before the generated text, to decode it in place
    truncated: bool  # the prompt lost its oldest tokens to `max_context`
    infill: bool
    max_tokens: int


def sampler_config(defaults: SamplerConfig, *, temperature: float | None = None, max_steps: int | None = None,
                   entropy_bound: float | None = None, mode: Mode | None = None, top_k: int | None = None,
                   top_p: float | None = None, min_p: float | None = None) -> SamplerConfig:
    """The model's sampler defaults with a request's settings. `mode` is the resolved mode (`Backend.mode_for`). In
    diffusion mode `temperature` is where the annealed schedule starts (t_max; its end keeps the model's t_min /
    t_max ratio; 0 is near-greedy); in AR mode it is the drafts' sampling temperature (0: greedy), and `top_k`,
    `top_p`, `min_p` cut the tail before sampling (diffusion has no such step: they do not apply there). Raises
    ValueError on bad values."""
    fields: dict[str, Any] = {} if mode is None else {"mode": mode}
    if top_k is not None:
        fields["ar_top_k"] = max(0, int(top_k))  # llama.cpp: <= 0 is off
    if top_p is not None:
        fields["ar_top_p"] = float(top_p) if top_p > 0 else 1.0  # 0 would keep nothing: llama.cpp treats it as off
    if min_p is not None:
        fields["ar_min_p"] = float(min_p)
    if temperature is not None and (mode or defaults.mode) == "ar":
        fields["ar_temperature"] = float(temperature)
    elif temperature is not None:
        t_max = max(float(temperature), _MIN_TEMPERATURE)
        fields["t_max"] = t_max
        fields["t_min"] = max(t_max * defaults.t_min / defaults.t_max, _MIN_TEMPERATURE)
    if max_steps is not None:
        fields["max_steps"] = max_steps
    if entropy_bound is not None:
        fields["entropy_bound"] = entropy_bound
    return dataclasses.replace(defaults, **fields) if fields else defaults


def max_gap(canvas_length: int) -> int:
    return max(1, min(canvas_length - 1, int(_MAX_GAP_SHARE * canvas_length)))


def plan(backend: Backend, task: TextTask, *, max_context: int) -> Plan:
    """The engine request for `task`. Raises ValueError when there is nothing to condition on."""
    tok, L = backend.tokenizer, backend.canvas_length
    prefix = list(tok.encode(task.prompt).ids) if task.prompt else []
    left = tuple(atoms_from_ids(tok, prefix[-_LEFT_TOKENS:]))
    cfg = task.config
    if task.infill:
        suffix = list(tok.encode(task.suffix or "").ids)
        gap = min(task.max_tokens, max_gap(L))
        room = L - gap  # pinned slots around the gap: the suffix's head first (the encoder never sees it), >= 1
        b = min(len(suffix), max(1, room - min(len(prefix), room // 2)))
        a = min(len(prefix), room - b)
        before, pinned_left = prefix[: len(prefix) - a], prefix[len(prefix) - a :]
        slot_ids = (*pinned_left, *(tok.placeholder_id,) * gap, *suffix[:b])
        pins = (True,) * a + (False,) * gap + (True,) * b
        cfg = dataclasses.replace(cfg, gap_min_fill=min(cfg.gap_min_fill, _API_MIN_FILL))
        fill, n_canvases = (a, a + gap), 1
    else:
        before = prefix
        if task.max_tokens <= L:
            slot_ids, pins = (tok.placeholder_id,) * task.max_tokens, (False,) * task.max_tokens
            fill, n_canvases = (0, task.max_tokens), 1
        else:  # whole free canvases, each following the committed one
            slot_ids, pins = (), ()
            fill, n_canvases = (0, L), math.ceil(task.max_tokens / L)
    keep = max_context - (backend.bos_id is not None)
    truncated = len(before) > keep
    # The oldest tokens go in whole steps, not one at a time: a prompt that grows by a keystroke keeps its start, and
    # so the engine's cached encoding of it (`canvas.engine.prefix_cache`), until it has grown a step.
    step = max(1, min(_CUT_STEP, keep // 8))
    drop = -(-(len(before) - keep) // step) * step if truncated else 0
    context = backend.context(tuple(before[drop:]))
    if not context:
        raise ValueError("the prompt is empty and the model has no BOS token to start from")
    request = GenRequest(context, tuple(slot_ids), pins, cfg, n_canvases=n_canvases)
    return Plan(request, fill, L, len(context) + sum(pins), left, truncated, task.infill, task.max_tokens)


def stop_cut(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the first stop sequence in `text` starts, and which one."""
    found = [(i, s) for s in stops if s and (i := text.find(s)) >= 0]
    return min(found) if found else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` could still become the start of a stop sequence."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


def _word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


def word_end(atoms: Sequence[Atom], length: int) -> int:
    """Where text made of `atoms` (`length` characters) may end when it goes on past its last atom in text nobody has
    read: at its last word boundary that is also an atom (token) boundary, its start excluded. Two atoms meet at a
    boundary when the left one ends, or the right one starts, with a character that is not a letter, a digit or an
    underscore; the end is one only when the last atom ends so. With no boundary the text is one word begun before it
    (a prompt that ends mid-word), and all of it is kept: `length`."""
    end = length
    for k in range(len(atoms) - 1, -1, -1):
        left = atoms[k].text
        right = atoms[k + 1].text if k + 1 < len(atoms) else ""
        if not _word_char(left[-1]) or (right and not _word_char(right[0])):
            return end
        end -= len(left)
    return length


class TextReader:
    """One choice's generated ids -> text, fed a canvas at a time; ends at EOS, at the budget, at a stop sequence,
    where the task's cut rule says, or early (a draft settled by a time limit).

    Only what the model wrote is text: with a frame's `written` mask (AR rows), a canvas is read up to its first
    unwritten slot (the rest still holds the canvas's initial noise) and the text ends there. A text cut where it goes
    on (a continuation at its budget or settled early, a fill cut at an unwritten slot) is cut back further, to its
    last word boundary (`word_end`); a whole infill, an EOS, a stop sequence and a cut rule end where they end. A
    broken byte sequence at the end of the text is dropped.

    `text` is the final text so far; `safe` is how much of it can be sent now (a stop sequence may still begin in
    the rest, or a word cut still take it back). `reason` is set once the text has ended (see `End`)."""

    def __init__(self, backend: Backend, plan: Plan, task: TextTask) -> None:
        self._backend, self._plan, self._task = backend, plan, task
        self._atoms: list[Atom] = []
        self._pending: list[int] = []  # ids whose bytes do not form a whole character yet
        self.tokens = 0  # generated tokens kept (no nulls, nothing after the end)
        self.canvases = 0
        self.nulls = 0
        self.text = ""
        self.reason: End | None = None
        self.stop_word: str | None = None

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def safe(self) -> int:
        if self.done:
            return len(self.text)
        return min(len(self.text) - held_back(self.text, self._task.stop), word_end(self._atoms, len(self.text)))

    def _read(self, canvas: Sequence[int], index: int,
              written: Sequence[bool] | None) -> tuple[list[int], bool, int, bool]:
        """Canvas `index`'s generated slots as text: (ids, ended at EOS, nulls read, stopped at an unwritten slot).
        Nulls are dropped; reading stops at EOS or at the first slot `written` says the model has not written."""
        start, end = self._plan.fill if index == 0 else (0, self._plan.canvas_length)
        kept: list[int] = []
        nulls = 0
        for k in range(start, min(end, len(canvas))):
            if written is not None and not written[k]:
                return kept, False, nulls, True
            t = canvas[k]
            if t == self._backend.eos_id:
                return kept, True, nulls, False
            if t == self._backend.null_id:
                nulls += 1
            else:
                kept.append(int(t))
        return kept, False, nulls, False

    def feed(self, canvas: Sequence[int], *, last: bool, settled: bool = False,
             written: Sequence[bool] | None = None) -> None:
        """A committed canvas (the next one); `last`: no canvas follows; `settled`: a draft taken as final early;
        `written`: the frame's written mask (None: every slot is text). A canvas read only up to an unwritten slot
        ends the text."""
        if self.done:
            return
        index = self.canvases
        self.canvases += 1
        kept, eos, nulls, short = self._read(canvas, index, written)
        self.nulls += nulls
        room = self._plan.max_tokens - self.tokens
        over = len(kept) > room
        kept = kept[:room]
        self.tokens += len(kept)
        self._add(kept, final=eos or over or last or settled or short)
        if self._apply_cuts():
            return
        if eos:
            self.reason = "eos"
        elif settled:
            self.reason = "time"
        elif over or short or self.tokens >= self._plan.max_tokens:
            self.reason = "length"
        elif last:
            # An infill that left slots null ended on its own; a continuation ends at EOS or at its budget.
            self.reason = "eos" if (self._plan.infill and self.nulls) else "length"
        if self.reason in ("time", "length") and (short or not self._plan.infill):
            self._cut_back(word_end(self._atoms, len(self.text)))  # the text goes on past the cut
        if self.reason == "eos" and self._task.join is not None:
            at = self._task.join(self.text)
            if at is not None and at < len(self.text):
                self.tokens = self._tokens_before(at)
                self.text = self.text[:at]

    def preview(self, canvas: Sequence[int], written: Sequence[bool] | None = None) -> str:
        """The text this choice would end with if it were settled at `canvas` (the draft of the next canvas, with its
        frame's `written` mask) now: what `feed(canvas, last=True, settled=True, written=written)` would leave."""
        return self.probe(canvas, written).text

    def probe(self, canvas: Sequence[int], written: Sequence[bool] | None = None, *,
              settled: bool = True) -> TextReader:
        """A copy of this reader fed `canvas` as its last (`settled`: a draft taken as final early); this one is left
        as it was. Its `text` and `reason` say how the choice would end there (a done reader is its own probe)."""
        if self.done:
            return self
        probe = copy.copy(self)
        probe._atoms, probe._pending = list(self._atoms), list(self._pending)
        probe.feed(canvas, last=True, settled=settled, written=written)
        return probe

    def _add(self, ids: list[int], *, final: bool) -> None:
        atoms = atoms_from_ids(self._backend.tokenizer, self._pending + ids, (*self._atoms[-3:],) or self._plan.left)
        self._pending = []
        if atoms and atoms[-1].text.endswith(INCOMPLETE):
            broken = atoms.pop()
            if final:  # bytes that never formed a character: no text
                self.tokens -= len(broken.ids)
            else:
                self._pending = list(broken.ids)  # its character may complete in the next canvas
        self._atoms.extend(atoms)
        self.text += "".join(a.text for a in atoms)

    def _apply_cuts(self) -> bool:
        found = stop_cut(self.text, self._task.stop)
        at = self._task.cut(self.text) if self._task.cut is not None else None
        if found is None and at is None:
            return False
        self.reason = "rule"
        if found is not None and (at is None or found[0] <= at):
            self.stop_word, at, self.reason = found[1], found[0], "word"
        assert at is not None
        self.tokens = self._tokens_before(at)
        self.text = self.text[:at]
        return True

    def _cut_back(self, at: int) -> None:
        """End the text at `at`, an atom boundary."""
        if at >= len(self.text):
            return
        self.tokens = self._tokens_before(at)
        self._atoms = self._atoms[: self._atoms_before(at)]
        self.text = self.text[:at]

    def _atoms_before(self, at: int) -> int:
        """How many atoms start before character `at`."""
        n = pos = 0
        for a in self._atoms:
            if pos >= at:
                break
            n += 1
            pos += len(a.text)
        return n

    def _tokens_before(self, at: int) -> int:
        """Generated tokens that made the first `at` characters (an atom cut in the middle counts)."""
        return sum(len(a.ids) for a in self._atoms[: self._atoms_before(at)])
