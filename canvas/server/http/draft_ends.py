"""Which of an AR infill's side-by-side drafts ends its row: early, once every draft has reached its end
(`early_end`), or when a time limit settles it (`deadline_end`).

An AR infill's K drafts grow side by side (`canvas.engine.ar`; frames carry them all, with each token's
log-probability in the drafting frame). `early_end` ends the row as soon as every draft has reached its end (a cut
rule, a stop string, or its `<|fim_end|>`), with the best-scored whole ending (`choose`), so a single-line suggestion
costs its line, not the token budget. At a time limit (`TextRun.settle`), `deadline_end` takes the best-scored draft
that has reached its end and is worth showing (else the leading draft is cut where time found it). A draft's text
is read from its tokens' own texts to check (cheap, each step), and the one chosen is read exactly
(`TextReader.probe`) before it ends the choice. The rules of where a text ends and what is worth showing are
`canvas.server.http.endings`'s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from canvas.engine.core import Frame
from canvas.engine.types import Drafts
from canvas.server.http.endings import drop_lead, sensible, trim_tail
from canvas.server.http.textgen import TextReader, TextTask, stop_cut

# Why a probe of a draft ended where it did for the draft to count as ended: never "time" or "length" (cut short).
_ENDED = ("rule", "word", "eos")
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


@dataclass(frozen=True, slots=True)
class LaneEnd:
    """One draft as it ends: its `text` (the lead included), its `tokens` (up to its `<|fim_end|>` when `natural`),
    `score` (the mean log-probability of the tokens that wrote the text and its end, the newline or `<|fim_end|>`
    included: the drafting frame's, conditioned on both sides; 0 where the frame has none) and `whole`: worth
    showing (`sensible`, with the lead taken off)."""

    text: str
    tokens: tuple[int, ...]
    natural: bool
    score: float
    whole: bool


def _score(logp: Sequence[float] | None, pieces: Sequence[str], text: str, natural: bool) -> float:
    """The mean log-probability of the tokens up to the one that ends `text` (the token holding its next character,
    or the `<|fim_end|>` after a natural end)."""
    if not logp:
        return 0.0
    used, n = 0, len(pieces)
    for i, piece in enumerate(pieces):
        used += len(piece)
        if used > len(text):
            n = i + 1
            break
    else:
        n = len(pieces) + natural  # the text is every piece: its end is the next token (`<|fim_end|>`)
    n = max(1, min(n, len(logp)))
    return sum(logp[:n]) / n


def choose(ends: Sequence[LaneEnd], lead: int) -> int:
    """The draft to take: the best-scored whole ending (`LaneEnd.whole`; ties: the one most drafts share, then the
    leading draft's); where none is whole, the ending most drafts share (ties: the leading draft's, else the first),
    which the answer's own checks then drop. A vote among all endings favours short ones that drafts share by
    chance ("a", "be."): it only decides among endings that say nothing anyway."""
    counts = Counter(e.text for e in ends)
    whole = [i for i, e in enumerate(ends) if e.whole]
    if whole:
        return max(whole, key=lambda i: (ends[i].score, counts[ends[i].text], i == lead))
    top = max(counts.values())
    return next(i for i in (lead, *range(len(ends))) if i < len(ends) and counts[ends[i].text] == top)


def _lane_canvas(frame: Frame, tokens: Sequence[int], natural: bool,
                 null_id: int | None) -> tuple[list[int], tuple[bool, ...], bool]:
    """The frame's canvas with one draft's `tokens` in its gap: (canvas, written mask, settled). A draft that ended on
    its own (`natural`) leaves the rest of its gap `<null>`, as the engine leaves a draft that ended: the model ended
    the text; one that goes on has only its tokens so far written (settled: the reader cuts it back to a word)."""
    drafts = frame.drafts
    assert drafts is not None and frame.written is not None
    canvas, written = list(frame.draft), list(frame.written)
    canvas[drafts.start : drafts.start + len(tokens)] = tokens
    if natural:
        canvas[drafts.start + len(tokens) : drafts.end] = [null_id or 0] * (drafts.end - drafts.start - len(tokens))
        written[drafts.start : drafts.end] = [True] * (drafts.end - drafts.start)
    else:
        written[drafts.start : drafts.end] = [i < len(tokens) for i in range(drafts.end - drafts.start)]
    return canvas, tuple(written), not natural


def _lanes(task: TextTask, drafts: Drafts, fim_end: int | None,
           token_text: Callable[[int], str]) -> list[tuple[str | None, tuple[int, ...], list[str], bool]]:
    """Each draft as (its ending's text, None while it goes on; its own tokens, up to its `<|fim_end|>`; their
    texts; whether it ended on its own)."""
    out: list[tuple[str | None, tuple[int, ...], list[str], bool]] = []
    for tokens in drafts.tokens:
        cut = tokens.index(fim_end) if fim_end is not None and fim_end in tokens else None
        own = tokens if cut is None else tokens[:cut]
        pieces = [token_text(t) for t in own]
        out.append((_lane_end(task, "".join(pieces), cut is not None), tuple(own), pieces, cut is not None))
    return out


def early_end(reader: TextReader, task: TextTask, frame: Frame, lead: TextReader, *, fim_end: int | None,
              null_id: int | None, token_text: Callable[[int], str]) -> EarlyEnd | None:
    """What to commit when every draft of the AR canvas `frame` shows has reached where its text ends, else None.
    `reader`: the choice's reader (the frame's canvas is its next); `lead`: its probe of the frame's canvas as drawn
    (the leading draft). A frame without side-by-side drafts ends when the leading draft's written text has reached
    a cut rule or a stop string. With drafts, each draft ends at a cut rule, a stop string or its `<|fim_end|>`
    (`fim_end`; the rest of its gap becomes `<null>`, `null_id`); the one taken is `choose`'s (the best-scored whole
    ending), and it ends the choice only if its exact reading ends there too."""
    if frame.written is None or (task.cut is None and not task.stop):
        return None  # a diffusion row's slots are not final; without a rule nothing ends a draft early
    drafts = frame.drafts
    if drafts is None or drafts.chosen is not None:
        return (list(frame.draft), frame.written, True) if lead.reason in ("rule", "word") else None
    typed = task.config.ar_lead
    after = task.suffix or ""
    lanes = _lanes(task, drafts, fim_end, token_text)
    ends: list[LaneEnd] = []
    for k, (text, own, pieces, natural) in enumerate(lanes):
        if text is None:
            return None  # this draft goes on
        ends.append(LaneEnd(text, own, natural, _score(drafts.logp[k] if drafts.logp else None, pieces, text, natural),
                            sensible(drop_lead(text, typed) if typed else text, task.prompt, after)))
    taken = ends[choose(ends, drafts.lead)]
    if taken.natural and null_id is None:
        return None
    canvas, written, settled = _lane_canvas(frame, taken.tokens, taken.natural, null_id)
    probe = reader.probe(canvas, written, settled=settled)
    return (canvas, written, settled) if probe.reason in _ENDED else None


def deadline_end(reader: TextReader, task: TextTask, frame: Frame, *, fim_end: int | None, null_id: int | None,
                 token_text: Callable[[int], str]) -> EarlyEnd | None:
    """What to commit when a time limit ends an AR infill at `frame` while its drafts grow side by side: the
    best-scored whole draft written so far, not the leading draft's state as the clock finds it. Each draft is read
    exactly as the choice would end with it (`reader.probe`), and as the client would get it (the lead taken off, a
    text that goes on trimmed by `trim_tail`, `sensible`). Taken: the best-scored (`_score`) draft that has reached
    its end (a cut rule, a stop string, its `<|fim_end|>`) and is worth showing (ties: the text most drafts share,
    then the leading draft); None where there is none (the caller settles the leading draft as drawn, cut where
    time found it). Another draft cut short is not taken instead: on llama.vim's 250 ms requests the best-scored
    of those were short, likely fragments ("I am", "root =") that the judge read as noise (issue 51). None too
    where the frame has no drafts to choose from (one lane, a gap already scored, a diffusion row)."""
    drafts = frame.drafts
    if frame.written is None or drafts is None or drafts.chosen is not None:
        return None
    typed = task.config.ar_lead
    after = task.suffix or ""
    commits: list[EarlyEnd] = []
    ends: list[LaneEnd] = []  # as the client would get each; `whole`: ended on its own and worth showing
    for k, (end, own, pieces, natural) in enumerate(_lanes(task, drafts, fim_end, token_text)):
        if natural and null_id is None:  # nothing to pad its gap with: read it as cut where it stands
            natural = False
        commit = _lane_canvas(frame, own, natural, null_id)
        probe = reader.probe(*commit[:2], settled=commit[2])
        ended = end is not None and probe.reason in _ENDED
        shown = drop_lead(probe.text, typed) if typed else probe.text
        if probe.reason == "time":
            shown = trim_tail(shown)
        score = _score(drafts.logp[k] if drafts.logp else None, pieces, probe.text, natural)
        commits.append(commit)
        ends.append(LaneEnd(shown, own, natural, score, ended and sensible(shown, task.prompt, after)))
    if not any(e.whole for e in ends):
        return None
    return commits[choose(ends, drafts.lead)]


def fim_end_id(token_id: Callable[[str], int | None]) -> int | None:
    """The `<|fim_end|>` id of a tokenizer (`HFTokenizer.token_id`), None without one."""
    from canvas.convert.vocab import FIM_END

    return token_id(FIM_END)
