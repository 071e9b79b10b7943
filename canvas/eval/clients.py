"""`dcanvas eval --task clients`: what real clients get from a running server, scored against the human text.

Owns the metrics of a client's suggestion (pure functions on strings and judge NLLs, tested on hand-made strings),
`ShapeRecord` (one request), `pool_shape` and `run_clients`. Each request shape of `canvas.eval.client_shapes` is
sent at the same half-typed lines; for each shape:
- noise share: the share of the suggestion's judge tokens whose NLL in context (everything before it) is above
  `noise_nats` (12: a token the judge gives under 6e-6), beside the same share of the human text in its place;
- echo share: the share of the suggestion's word 4-grams (lowercased `\\w+` words) that also occur in the text
  after the cursor, beside the human text's (a suggestion that copies what follows repeats it in the buffer);
- first-line ratio: pooled judge perplexity of the suggestion's first line over the human text's first line in the
  same place, exp(sum NLL / sum tokens) of each (a causal judge: the text after a span never changes its NLLs);
- length ratio: the median over requests of suggestion characters / human characters;
- empty share: suggestions that are only whitespace, among the answered requests (errors are counted apart);
- one-word share: suggestions of one word or less that are not empty ("a", "be.", "can"), beside the human text's:
  a reader takes them for no suggestion at all where the line goes on, and no metric above sees them;
- seconds: median and 95th percentile (nearest rank) of each request's wall time.
The human text is the rest of the line (the whole line for `llama-vim-inst`, whose answer replaces it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from canvas.eval.client_shapes import FIM_SHAPES, SHAPES, LineSample, Sender, Shape, line_samples
from canvas.eval.samples import EvalError

NOISE_NATS = 12.0
_WORDS = re.compile(r"\w+")


class TokenScorer(Protocol):
    """What the metrics need of a judge (`canvas.eval.judge.Judge` has it)."""

    name: str

    def token_nlls(self, text: str, start: int, end: int) -> list[tuple[int, float]]: ...


# ---- metrics on strings ------------------------------------------------------------------------------------------
def word_4grams(text: str) -> list[tuple[str, ...]]:
    words = _WORDS.findall(text.lower())
    return [tuple(words[i : i + 4]) for i in range(len(words) - 3)]


def echo(suggestion: str, after: str) -> tuple[int, int]:
    """(4-grams of `suggestion` that occur in `after`, 4-grams of `suggestion`)."""
    grams, seen = word_4grams(suggestion), set(word_4grams(after))
    return sum(g in seen for g in grams), len(grams)


def noise(nlls: Sequence[float], bound: float = NOISE_NATS) -> tuple[int, int]:
    """(tokens whose NLL is above `bound`, tokens)."""
    return sum(v > bound for v in nlls), len(nlls)


def one_word(text: str) -> bool:
    """A suggestion with text but at most one word (`\\w+`): "a", "be.", "API"; ")" too."""
    return bool(text.strip()) and len(_WORDS.findall(text)) <= 1


def first_line(text: str) -> str:
    return text.split("\n", 1)[0]


def length_ratio(suggestion: str, human: str) -> float:
    return len(suggestion) / len(human) if human else math.nan


def share(pairs: Sequence[tuple[int, int]]) -> float:
    """Pooled share: sum of counts over sum of totals (NaN when there is nothing to count)."""
    total = sum(t for _, t in pairs)
    return sum(c for c, _ in pairs) / total if total else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def median(values: Sequence[float]) -> float:
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return math.nan
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


@dataclass(frozen=True, slots=True)
class Scored:
    """A text in its place under the judge: its noise counts and its first line's NLL sum and tokens."""

    noise: tuple[int, int]
    first_nll: float
    first_tokens: int


def score_in_place(judge: TokenScorer, before: str, text: str, *, bound: float = NOISE_NATS,
                   context_chars: int = 2000) -> Scored:  # fmt: skip
    """`text` written after `before` (its last `context_chars` characters: the judge's window is short anyway)."""
    ctx = before[-context_chars:]
    nlls = judge.token_nlls(ctx + text, len(ctx), len(ctx) + len(text))
    head = len(ctx) + len(first_line(text))
    first = [v for start, v in nlls if start < head]
    return Scored(noise([v for _, v in nlls], bound), sum(first), len(first))


# ---- records and pooling -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ShapeRecord:
    server: str  # "url" or "peer"
    shape: Shape
    index: int
    doc_id: str
    seconds: float
    error: str
    text: str = field(repr=False)
    human: str = field(repr=False)
    model: Scored | None  # None on error
    human_scored: Scored
    echo: tuple[int, int]
    human_echo: tuple[int, int]


def pool_shape(records: Sequence[ShapeRecord]) -> dict[str, Any]:
    if not records:
        raise EvalError("no records to pool")
    ok = [r for r in records if not r.error and r.model is not None]

    def ppl(nll: float, tokens: int) -> float:
        return math.exp(nll / tokens) if tokens else math.nan

    model_ppl = ppl(sum(r.model.first_nll for r in ok if r.model), sum(r.model.first_tokens for r in ok if r.model))
    human_ppl = ppl(sum(r.human_scored.first_nll for r in ok), sum(r.human_scored.first_tokens for r in ok))
    seconds = [r.seconds for r in ok]
    return {
        "server": records[0].server, "shape": records[0].shape, "requests": len(records),
        "errors": len(records) - len(ok), "error_examples": sorted({r.error for r in records if r.error})[:3],
        "empty_share": sum(not r.text.strip() for r in ok) / len(ok) if ok else math.nan,
        "one_word_share": sum(map(one_word, (r.text for r in ok))) / len(ok) if ok else math.nan,
        "one_word_share_human": sum(map(one_word, (r.human for r in ok))) / len(ok) if ok else math.nan,
        "noise_share": share([r.model.noise for r in ok if r.model]),
        "noise_share_human": share([r.human_scored.noise for r in ok]),
        "echo_share": share([r.echo for r in ok]), "echo_share_human": share([r.human_echo for r in ok]),
        "first_line_ppl": model_ppl, "first_line_ppl_human": human_ppl,
        "first_line_ratio": model_ppl / human_ppl if human_ppl > 0 and not math.isnan(model_ppl) else math.nan,
        "length_ratio_median": median([length_ratio(r.text, r.human) for r in ok]),
        "seconds_median": median(seconds), "seconds_p95": percentile(seconds, 0.95),
    }  # fmt: skip


# ---- the run -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ClientsConfig:
    samples: int = 16  # half-typed lines, each sent in every shape
    seed: int = 0
    per_doc: int = 2  # lines from one document at most
    shapes: tuple[Shape, ...] = SHAPES
    peer_shapes: tuple[Shape, ...] = FIM_SHAPES  # what a peer (llama.cpp) server is sent
    noise_nats: float = NOISE_NATS
    ws_gap_tokens: int = 32  # the websocket shape's gap (the TUI's default is 16; 32 as the eval's infill-32)
    context_chars: int = 2000  # left context the judge sees
    examples: int = 3  # requests quoted per shape beside the human text

    def __post_init__(self) -> None:
        if self.samples < 1 or self.per_doc < 1 or self.ws_gap_tokens < 1 or self.context_chars < 1:
            raise ValueError("samples, per_doc, ws_gap_tokens and context_chars must be >= 1")
        if not self.shapes or any(s not in SHAPES for s in (*self.shapes, *self.peer_shapes)):
            raise ValueError(f"shapes must be some of {SHAPES}, got {self.shapes} / {self.peer_shapes}")
        if not self.noise_nats > 0:
            raise ValueError(f"noise_nats must be > 0, got {self.noise_nats}")


def human_of(shape: Shape, s: LineSample) -> tuple[str, str]:
    """(the text before the span the shape's answer fills, the human text of that span)."""
    if shape == "llama-vim-inst":
        return s.input_prefix, s.typed + s.reference
    return s.before, s.reference


def run_clients(servers: dict[str, Sender], judge: TokenScorer, docs: Sequence[tuple[str, str]], cfg: ClientsConfig,
                progress: Callable[[str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Send every sample in every shape to each server ("url": `cfg.shapes`, "peer": `cfg.peer_shapes`), score the
    replies; the JSON-ready result (`results`: one pooled row per server and shape, `examples`, `records`)."""
    samples = line_samples(docs, cfg.samples, cfg.seed, per_doc=cfg.per_doc)
    humans: dict[tuple[bool, int], Scored] = {}
    records: list[ShapeRecord] = []
    for server, sender in servers.items():
        for shape in cfg.shapes if server == "url" else cfg.peer_shapes:
            for i, s in enumerate(samples):
                if progress is not None:
                    progress(f"{server} {shape} #{i}")
                before, human = human_of(shape, s)
                key = (shape == "llama-vim-inst", i)  # the FIM shapes and the websocket share a human span
                if key not in humans:
                    humans[key] = score_in_place(judge, before, human, bound=cfg.noise_nats,
                                                 context_chars=cfg.context_chars)  # fmt: skip
                reply = sender.send(shape, s)
                scored = None if reply.error else score_in_place(judge, before, reply.text, bound=cfg.noise_nats,
                                                                context_chars=cfg.context_chars)  # fmt: skip
                records.append(ShapeRecord(server, shape, i, s.doc_id, reply.seconds, reply.error, reply.text, human,
                                           scored, humans[key], echo(reply.text, s.input_suffix),
                                           echo(human, s.input_suffix)))  # fmt: skip
    groups: dict[tuple[str, Shape], list[ShapeRecord]] = {}
    for r in records:
        groups.setdefault((r.server, r.shape), []).append(r)
    examples = [{"server": r.server, "shape": r.shape, "index": r.index, "doc_id": r.doc_id,
                 "before": human_of(r.shape, samples[r.index])[0][-200:], "human": r.human, "output": r.text,
                 "after": samples[r.index].input_suffix[:120], "error": r.error}
                for r in records if r.index < cfg.examples]  # fmt: skip
    return {
        "task": "clients", "judge": judge.name, "servers": {k: v.url for k, v in servers.items()},
        "samples": len(samples), "results": [pool_shape(g) for g in groups.values()], "examples": examples,
        "records": [{k: v for k, v in asdict(r).items() if k not in ("text", "human")} for r in records],
        "config": asdict(cfg),
    }  # fmt: skip
