"""The FIM fine-tune's training data: examples, packed batches, word boundaries.

The format itself (sentinels, `fim_prompt`, whether a model has it) is `canvas.convert.fim`'s; this module builds
training examples in it.

Training rows (`sample_rows`) are packed: fixed-length rows of whole pieces (a FIM example or a plain left-to-right
window, each starting with `<bos>` at position 0), every token tagged with its piece (`segment`), so attention never
crosses a piece boundary (`attention_mask`) and packing changes nothing a piece sees. Loss targets: every token of a
plain piece after its `<bos>`; of a FIM piece only the middle and `<end>`, never the prefix, suffix or sentinels
before `<mid>`. Cuts fall at word boundaries (a token whose text starts with whitespace, or one after a token that
ends with it), so a middle is whole words, as the editor's selections are. A row is a pure function of
`(seed, stream, step)` (numpy's `default_rng([seed, stream, step])`): a resumed run reads the same rows.

Gaps (`FimDataConfig.gaps`): "spans", token spans whose lengths are log-uniform over 1..`max_middle` tokens: equal
weight on each scale, a word (1-4 tokens), a phrase (4-16), a sentence (16-64), a paragraph (64-256), the range of
what users select in the editor (a uniform draw would spend three quarters of the examples on gaps over 64 tokens);
"editor" (the default) adds the gaps editors make (`canvas.training.fim_gaps`): in code the rest of a line, a line, a
block, a body; in prose the rest of the line or the sentence; each middle ends where the line or sentence ends, so
`<end>` is taught there. Those are cut in the decoded text of a window and its parts encoded apart (`Corpus.codec`),
as the engine encodes the two sides of a gap; a third of the line gaps take llama.cpp's `/infill` layout, the cursor
line's text before the cursor after `<mid>` (`<bos> <pre> prefix <suf> suffix <mid> line-prompt middle <end>`, the
line prompt untaught), which the engine's token healing also produces. `code_share` is the share of pieces drawn
from code documents where the corpus has them (`<split>.kinds.npy`); a corpus without code draws as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from canvas.convert.fim import MAX_PREFIX, MAX_SUFFIX, FimTokens, Order, fim_prompt
from canvas.training.fim_gaps import TextGap, code_gap, prose_gap
from canvas.training.tokens import KIND_CODE, KIND_PROSE

# Token kinds in a row: what a loss position teaches (0: nothing; padding, `<bos>`, a FIM piece's context).
NONE, PLAIN, FIM = 0, 1, 2
GAPS = ("spans", "editor")
LINE_PROMPT_RATE = 1 / 3  # line gaps (rest of line, line) in llama.cpp's layout: the cursor line after <mid>


def fim_example(t: FimTokens, prefix: Sequence[int], middle: Sequence[int], suffix: Sequence[int],
                order: Order = "psm") -> tuple[list[int], list[int]]:
    """One training example: its ids and each id's kind (`FIM` on the middle and `<end>`, else `NONE`)."""
    ids = [*fim_prompt(t, prefix, suffix, order), *middle, t.end]
    teach = len(middle) + 1
    return ids, [NONE] * (len(ids) - teach) + [FIM] * teach


@dataclass(frozen=True, slots=True)
class FimDataConfig:
    seq_len: int = 512  # packed row length; the converted Gemma's sliding window is 512
    fim_rate: float = 0.5  # share of pieces (and about of tokens) in FIM form; the rest plain text, for AR quality
    spm_rate: float = 0.5  # share of FIM pieces in SPM order
    max_middle: int = 256  # tokens; the canvas
    max_prefix: int = MAX_PREFIX  # context lengths drawn uniformly up to these (fewer where a document is short)
    max_suffix: int = MAX_SUFFIX
    min_fim_piece: int = 24  # a FIM piece needs this much room in the row; less is filled with plain text
    gaps: str = "editor"  # GAPS; a saved config without the key is a run before editor gaps: "spans"
    code_share: float | None = 0.35  # of pieces, from code documents (None: by length, whatever their kind)

    def __post_init__(self) -> None:
        if self.gaps not in GAPS:
            raise ValueError(f"gaps must be one of {GAPS}, got {self.gaps!r}")
        if self.code_share is not None and not 0.0 <= self.code_share <= 1.0:
            raise ValueError(f"code_share must be in [0, 1] or None, got {self.code_share}")
        if not 0.0 <= self.fim_rate <= 1.0 or not 0.0 <= self.spm_rate <= 1.0:
            raise ValueError("fim_rate and spm_rate must be in [0, 1]")
        if self.max_middle < 1 or self.max_prefix < 0 or self.max_suffix < 0:
            raise ValueError("need max_middle >= 1, max_prefix >= 0, max_suffix >= 0")
        if not 8 <= self.min_fim_piece <= self.seq_len:
            raise ValueError(f"need 8 <= min_fim_piece <= seq_len, got {self.min_fim_piece} and {self.seq_len}")


@dataclass(frozen=True, slots=True)
class Corpus:
    """One split's flat token array (`canvas.training.tokens` layout: `<bos> doc <eos>` per document) and the
    tokenizer facts the sampler needs."""

    tokens: np.ndarray  # (N,)
    doc_starts: np.ndarray  # (D,)
    starts_word: np.ndarray  # (V,) bool
    ends_word: np.ndarray  # (V,) bool
    ids: FimTokens
    kinds: np.ndarray | None = None  # (D,) uint8 KIND_*; None: all prose
    codec: Any = None  # a `tokenizers.Tokenizer`: "editor" gaps decode a window and encode its parts
    # Per kind, the documents' indices and cumulative lengths (filled in __post_init__; empty: the kind is absent).
    _by_kind: dict[int, tuple[np.ndarray, np.ndarray]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_kind: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if self.kinds is not None and bool((self.kinds == KIND_CODE).any()):
            lengths = np.diff(np.append(self.doc_starts, self.tokens.size))
            for k in (KIND_PROSE, KIND_CODE):
                idx = np.flatnonzero(self.kinds == k)
                by_kind[k] = (idx, np.cumsum(lengths[idx]))
        object.__setattr__(self, "_by_kind", by_kind)

    @property
    def has_code(self) -> bool:
        return bool(self._by_kind)

    def draw_kind(self, rng: np.random.Generator, code_share: float | None) -> int | None:
        """The kind of the next piece's document, or None (by length): no draw where the corpus has no code, so a
        prose corpus reads the same rows as before kinds existed."""
        if code_share is None or not self._by_kind:
            return None
        return KIND_CODE if rng.random() < code_share else KIND_PROSE

    def pick(self, rng: np.random.Generator, kind: int | None = None) -> tuple[np.ndarray, int]:
        """A document's text tokens and its `<eos>` (no `<bos>`), chosen with probability proportional to length
        among the documents of `kind` (None: all), and its kind."""
        if kind is None or kind not in self._by_kind or self._by_kind[kind][0].size == 0:
            p = int(rng.integers(0, self.tokens.size))
            d = int(np.searchsorted(self.doc_starts, p, side="right")) - 1
        else:
            idx, cum = self._by_kind[kind]
            d = int(idx[int(np.searchsorted(cum, int(rng.integers(0, int(cum[-1]))), side="right"))])
        end = int(self.doc_starts[d + 1]) if d + 1 < self.doc_starts.size else int(self.tokens.size)
        found = KIND_PROSE if self.kinds is None else int(self.kinds[d])
        return np.asarray(self.tokens[int(self.doc_starts[d]) + 1 : end], dtype=np.int64), found

    def document(self, rng: np.random.Generator) -> np.ndarray:
        return self.pick(rng)[0]

    def boundary(self, doc: np.ndarray, i: int) -> bool:
        """A cut before position i of `doc` falls between words."""
        return i <= 0 or i >= doc.size or bool(self.starts_word[doc[i]] or self.ends_word[doc[i - 1]])

    def snap(self, doc: np.ndarray, i: int, hi: int) -> int:
        """The first word boundary in [i, hi], or `hi` where there is none."""
        for j in range(i, hi + 1):
            if self.boundary(doc, j):
                return j
        return max(i, hi)


def _plain_piece(c: Corpus, rng: np.random.Generator, room: int,
                 kind: int | None = None) -> tuple[list[int], list[int]]:
    doc, _ = c.pick(rng, kind)
    w = min(room - 1, doc.size)
    s = int(rng.integers(0, doc.size - w + 1))
    return [c.ids.bos, *doc[s : s + w].tolist()], [NONE] + [PLAIN] * w


def _fim_piece(c: Corpus, cfg: FimDataConfig, rng: np.random.Generator, room: int,
               kind: int | None = None) -> tuple[list[int], list[int]]:
    doc = c.pick(rng, kind)[0][:-1]  # without `<eos>`: a middle is never the document's end
    m = min(cfg.max_middle, int(math.exp(rng.uniform(0.0, math.log(cfg.max_middle + 1)))))
    a, b = int(rng.integers(0, cfg.max_prefix + 1)), int(rng.integers(0, cfg.max_suffix + 1))
    avail = min(doc.size, room - 6)  # six sentinels and specials at most (SPM: bos pre suf mid ... end)
    if avail < 3:
        return _plain_piece(c, rng, room, kind)
    if a + m + b > avail:  # a short document or a full row: shrink all three alike
        f = avail / (a + m + b)
        a, m, b = int(a * f), max(1, int(m * f)), int(b * f)
        a = max(0, min(a, avail - m - b))
        b = avail - m - a if a + m + b > avail else b
    s = int(rng.integers(0, doc.size - (a + m + b) + 1))
    e = s + a + m + b
    # Cut at words: the window's start, then the middle's start and end, each moved forward to the next boundary
    # (the suffix gives way); a cut stays mid-word only where the window has no boundary left.
    s = c.snap(doc, s, s + a)
    c1 = c.snap(doc, min(s + a, e - 1), e - 1)
    c2 = c.snap(doc, min(c1 + m, e), e)
    prefix, middle, suffix = doc[s:c1].tolist(), doc[c1:c2].tolist(), doc[c2:e].tolist()
    order: Order = "spm" if rng.random() < cfg.spm_rate else "psm"
    return fim_example(c.ids, prefix, middle, suffix, order)


@dataclass(frozen=True, slots=True)
class EditorGap:
    """An editor gap's parts, encoded apart: `prompt` is the cursor line before the cursor in llama.cpp's layout
    (after `<mid>`), else empty; prefix / suffix not yet cut to their drawn lengths."""

    text: str  # the window's text the gap was cut in
    gap: TextGap
    prefix: list[int]
    prompt: list[int]
    middle: list[int]
    suffix: list[int]


def editor_gap(c: Corpus, cfg: FimDataConfig, rng: np.random.Generator, kind: int | None) -> EditorGap | None:
    """Draw a document and a window of it, and an editor gap in the window's text (`fim_gaps`); None where the
    shape drawn is a token span or does not fit."""
    if c.codec is None:
        raise ValueError("editor gaps need the corpus's tokenizer (Corpus.codec); or use gaps='spans'")
    doc, kind = c.pick(rng, kind)
    doc = doc[:-1]  # without `<eos>`
    width = cfg.max_prefix + cfg.max_middle + cfg.max_suffix
    s = int(rng.integers(0, max(1, doc.size - width + 1)))
    text = c.codec.decode(doc[s : s + width].tolist(), skip_special_tokens=False)
    if kind == KIND_CODE:
        gap = code_gap(text, rng, first_whole=s == 0, max_chars=3 * cfg.max_middle)
    else:
        gap = prose_gap(text, rng, max_chars=4 * cfg.max_middle)
    if gap is None:
        return None
    line = gap.mid_word or (gap.shape in ("rest", "line") and rng.random() < LINE_PROMPT_RATE)
    split = gap.line_start if line else gap.cut

    def enc(part: str) -> list[int]:
        return list(c.codec.encode(part, add_special_tokens=False).ids) if part else []

    middle = enc(text[gap.cut : gap.end])
    if not middle or len(middle) > cfg.max_middle:
        return None
    return EditorGap(text, gap, enc(text[:split]), enc(text[split : gap.cut]), middle, enc(text[gap.end :]))


def editor_piece(c: Corpus, cfg: FimDataConfig, rng: np.random.Generator, room: int,
                 kind: int | None) -> tuple[list[int], list[int]] | None:
    """A FIM piece of an editor gap (`editor_gap`) fitted into `room` tokens, or None (the caller cuts a span)."""
    g = editor_gap(c, cfg, rng, kind)
    if g is None:
        return None
    a, b = int(rng.integers(0, cfg.max_prefix + 1)), int(rng.integers(0, cfg.max_suffix + 1))
    a, b = min(a, len(g.prefix)), min(b, len(g.suffix))
    fixed = 6 + len(g.prompt) + len(g.middle)  # bos pre suf mid end, and one spare as `_fim_piece` keeps
    if fixed > room:
        return None
    if fixed + a + b > room:  # shrink both sides alike
        f = (room - fixed) / (a + b)
        a, b = int(a * f), int(b * f)
    prefix, suffix = g.prefix[len(g.prefix) - a :], g.suffix[:b]
    if g.prompt:
        ids = [*fim_prompt(c.ids, prefix, suffix, "psm"), *g.prompt, *g.middle, c.ids.end]
        teach = len(g.middle) + 1
        return ids, [NONE] * (len(ids) - teach) + [FIM] * teach
    order: Order = "spm" if rng.random() < cfg.spm_rate else "psm"
    return fim_example(c.ids, prefix, g.middle, suffix, order)


@dataclass(frozen=True, slots=True)
class Rows:
    """A batch of packed rows. ids, positions (within each piece), segment (piece index in the row, -1 padding),
    kind (`NONE`/`PLAIN`/`FIM`: what predicting this token teaches), all (B, T)."""

    ids: Tensor
    positions: Tensor
    segment: Tensor
    kind: Tensor

    @property
    def tokens(self) -> int:
        return int((self.segment >= 0).sum())

    def to(self, device: torch.device) -> Rows:
        return Rows(*(getattr(self, f).to(device) for f in ("ids", "positions", "segment", "kind")))


def sample_rows(c: Corpus, cfg: FimDataConfig, batch: int, seed: int, step: int, stream: int = 0) -> Rows:
    """`batch` packed rows of `cfg.seq_len` tokens, a pure function of `(seed, stream, step)`."""
    rng = np.random.default_rng([seed, stream, step])
    T = cfg.seq_len
    ids = np.full((batch, T), c.ids.pad, dtype=np.int64)
    pos = np.zeros((batch, T), dtype=np.int64)
    seg = np.full((batch, T), -1, dtype=np.int64)
    kind = np.zeros((batch, T), dtype=np.int64)
    for r in range(batch):
        at, piece = 0, 0
        while T - at >= 2:
            room = T - at
            if room >= cfg.min_fim_piece and rng.random() < cfg.fim_rate:
                doc_kind = c.draw_kind(rng, cfg.code_share)
                edited = editor_piece(c, cfg, rng, room, doc_kind) if cfg.gaps == "editor" else None
                p_ids, p_kind = edited if edited is not None else _fim_piece(c, cfg, rng, room, doc_kind)
            elif room >= cfg.min_fim_piece:
                doc_kind = c.draw_kind(rng, cfg.code_share)
                # As long as a FIM piece on average (not the whole row), so fim_rate is also the share of tokens.
                p_ids, p_kind = _plain_piece(c, rng, int(rng.integers(cfg.min_fim_piece, room + 1)), doc_kind)
            else:  # the row's end
                p_ids, p_kind = _plain_piece(c, rng, room, c.draw_kind(rng, cfg.code_share))
            n = len(p_ids)
            ids[r, at : at + n] = p_ids
            kind[r, at : at + n] = p_kind
            pos[r, at : at + n] = np.arange(n)
            seg[r, at : at + n] = piece
            at, piece = at + n, piece + 1
    return Rows(*(torch.from_numpy(x) for x in (ids, pos, seg, kind)))


def attention_mask(rows: Rows, window: int | None) -> Tensor:
    """(B, 1, T, T) bool: causal within a piece (and within `window` positions when given), nothing across pieces.
    A padding token sees itself only, so no row of the mask is empty."""
    T = rows.ids.shape[1]
    idx = torch.arange(T, device=rows.ids.device)
    same = rows.segment[:, :, None] == rows.segment[:, None, :]  # (B, T, T)
    allowed = same & (idx[None, :] <= idx[:, None])[None]
    if window is not None:
        allowed &= (idx[None, :] > idx[:, None] - window)[None]
    pad = rows.segment < 0
    allowed &= ~(pad[:, :, None] | pad[:, None, :]) | torch.eye(T, dtype=torch.bool, device=idx.device)[None]
    return allowed[:, None]
