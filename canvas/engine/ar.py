"""The engine's AR pathway: every AR row's drafts step together, and an infill's drafts are scored by the seam.

Owns `ARWalk` (one AR generation's walk over its canvas) and `ARBatch` (the drafting lanes of every AR row in one
left-padded `KVCache.aligned` cache, stepped by ONE `model.encode` call of (B, 1) tokens per engine step).
A walk goes left to right: a pinned run is fed to the row's context (one prefill) when something after it still
reads the context; a gap (a run of free slots) is drafted. A gap with pinned text after it, under a seam-aware config
(`SamplerConfig.seam_aware`), gets `ar_drafts` lanes that share the row's encoded context (copied, never re-encoded),
sampled at `ar_temperature` from the row's own generator (so a row's tokens do not depend on what it is batched
with), never `<null>` nor EOS. When they reach the gap's budget, every (draft, ending) is scored by the model's
log-likelihood of the first `ar_seam_tokens` pinned tokens after it, all candidates in one forward
(`seam_logprobs`); the best is written and the rest of the gap becomes `<null>`. Any other gap gets one lane and is
filled to its end: the plain AR fill. A later gap sees the chosen fill of earlier ones.

FIM (the model has the fill-in-the-middle format and `SamplerConfig.fim` allows it): a scored gap's lanes draft in
the FIM frame instead, from one prefill of `fim_prompt(left, right)` (the row's text before the gap, the pinned run
after it, both cut to the lengths the fine-tune saw; with `word_edges`, the left side's last partial word moved to
the start of the middle, `canvas.convert.fim.heal_split`), each lane writing the middle until `<|fim_end|>` (never
before `ar_min_fill` of the gap) or the budget. The seam is still scored by the plain AR likelihood of the right
side's first tokens after left + middle (the adapters are merged into the weights, so they are on in both frames):
the seam score then measures one thing with or without FIM (the continuation the judge and a reader see), and a
draft that reads well only in the FIM frame gains nothing. The lanes' plain-frame copies (`shadow`: K rows of the
row's plain context) are encoded lazily, when a score needs them (an SMC resample, the gap's end), by one encode of
the tokens written since (K, new): on a CPU a step's cost grows with its rows (the int8 GEMMs run at the
dot-product rate from a few rows up, BENCHMARKS.md), and a prefill of many tokens a row costs less per token than
a shadow row in every step. The seam pass scores the seam's first token too, re-reading each ending's last draft
token. The FIM frame's own likelihood of the draft (conditioned on both sides) is what `ar_draft_weight` weighs.
The plain context itself may be deferred too (the engine's `lazy_context`): the drafts never read it, so an editor's
long context is encoded only when the seam is scored (or an SMC resample reads it), and not at all when the client's
deadline takes a draft first (`ARWalk.plain`).
A lane that has written `<|fim_end|>` gives up its batch row from the next step on (`ARWalk.active`: K drafts do not
cost K rows to the last), and the gap ends, in the step that decides it, once `EARLY_END_SHARE` of its lanes have
ended: the lanes still writing then offer only the clause ends they have written, never the budget.

SMC (`ar_smc_every` N > 0): every N tokens each lane's running seam score (the seam's plain log-likelihood right
after the draft as it stands, one forward over all lanes) weighs it by its gain since its ancestor was last
weighed, and the K lanes are resampled (multinomial, the row's generator) at `ar_smc_temperature`; their cache rows
follow them at the next batch step (`ARWalk.moved`).

Under `SamplerConfig.ar_first_newline` False (an editor's suggestion), no lane breaks its line while its draft is blank
(`line_tokens`, read from the tokenizer's texts): the suggestion never opens with an empty line. Under
`SamplerConfig.ar_lead` (the writer's partial word, which the caller took out of the left side), the first gap's
lanes start by writing it again, each token one `LineTokens.lead` allows (`canvas.convert.fim.LeadTokens`), and the
FIM prompt is not healed: its left side already ends where a word ends.

Legend: K lanes of one row, B lanes of all rows, g gap slots, E endings per lane, S seam tokens, V vocabulary.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from canvas.convert.fim import (
    MAX_PREFIX,
    MAX_SUFFIX,
    FimTokens,
    LeadTokens,
    Order,
    WordEdges,
    fim_prompt,
    heal_split,
    lead_rest,
)
from canvas.engine.prefix_cache import PrefixCache
from canvas.engine.types import Drafts
from canvas.model import DiffusionModel, KVCache
from canvas.sampling.sampler import SamplerConfig, sample_categorical, truncate_logits
from kernels.sample_cpu import draw_tokens

_NEG = float("-inf")
_serials = itertools.count(1)
_CLAUSE_MARKS = ".,;:!?"  # a token whose text ends with one of these (closing quotes aside) ends a clause
_CLOSERS = "\"')]\u201d\u2019"
_BYTE_TOKENS = {"<0x0A>": "\n", "<0x0D>": "\r", "<0x09>": "\t", "<0x20>": " "}  # SentencePiece's byte fallback
# A FIM prompt's sides are cut to what the fine-tune saw (`canvas.convert.fim`): the last tokens of the left side,
# the first of the right.
_FIM_LEFT, _FIM_RIGHT = MAX_PREFIX, MAX_SUFFIX
_FIM_LEFT_STEP = 32
# The FIM prompt's order (the adapters trained on both, half each): "psm" puts the left side, which a keystroke
# changes, before the right side; "spm" puts it last, so a keystroke changes only the prompt's tail.
DEFAULT_FIM_ORDER: Order = "psm"
# A FIM gap's answer is decided once this share of its lanes have written `<|fim_end|>` (1.0: only when all have):
# the lanes still writing then offer only the clause ends they have written (`ARWalk.endings`), and the gap ends
# without waiting for them to reach the budget. Measured with `dcanvas eval` (the FIM section of README.md).
EARLY_END_SHARE = 0.5


def clause_end_ids(pieces: Sequence[str]) -> frozenset[int]:
    """The ids whose token text (`pieces[id]`, e.g. a tokenizer's `convert_ids_to_tokens` of every id) ends a clause
    or a sentence: punctuation, possibly followed by closing quotes or brackets, or a line break."""
    out = set()
    for i, piece in enumerate(pieces):
        text = piece or ""
        if "\n" in text or "<0x0A>" in text or text.rstrip().rstrip(_CLOSERS)[-1:] in tuple(_CLAUSE_MARKS):
            out.add(i)
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class LineTokens:
    """A tokenizer's ids that break a line before writing on it (a newline or carriage return with nothing but spaces
    or tabs before it in the token) and those that are only spaces or tabs: under `SamplerConfig.ar_first_newline`
    False a draft may not break its line while its text is still blank. `lead`: the ids a draft may start with when
    it must begin with `SamplerConfig.ar_lead` (None: no texts to read them from)."""

    breaks: frozenset[int]
    blanks: frozenset[int]
    lead: LeadTokens | None = field(default=None, compare=False)


def line_tokens(texts: Sequence[str]) -> LineTokens:
    """`LineTokens` from each id's token text (`texts[id]`: the id decoded alone, or its SentencePiece piece)."""
    breaks: set[int] = set()
    blanks: set[int] = set()
    plain: list[str] = []
    for i, piece in enumerate(texts):
        text = (piece or "").replace("\u2581", " ")
        for byte, char in _BYTE_TOKENS.items():
            text = text.replace(byte, char)
        plain.append(text)
        head, *rest = re.split("[\r\n]", text, maxsplit=1)
        if not text or head.strip(" \t"):
            continue
        (breaks if rest else blanks).add(i)
    return LineTokens(frozenset(breaks), frozenset(blanks), LeadTokens(plain))


def draw(logits: Tensor, bans: Sequence[Sequence[int]], temperature: float, cfg: SamplerConfig,
         generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Each lane's next token from its logits (K, V) without its `bans`, under `cfg`'s truncation, at `temperature`
    (0: greedy), and the token's log-probability at temperature 1 before the bans (the drafting frame's):
    (tok (K,), logp (K,)). Uses one uniform a lane from `generator`, as `sample_categorical` does."""
    logits = logits.float()
    if logits.device.type == "cpu" and (temperature == 0 or (cfg.ar_top_k <= 0 and cfg.ar_top_p >= 1)):
        # Greedy reads no uniform (the generator's stream stays as the torch chain leaves it); top-k / top-p never
        # cut the likeliest token.
        u = torch.rand(logits.shape[0], generator=generator) if temperature > 0 else logits.new_zeros(logits.shape[0])
        return draw_tokens(logits, u, temperature, cfg.ar_min_p, bans)  # one fused pass a lane
    # A GPU, or llama.cpp's top-k / top-p (per request) at a temperature: the torch chain.
    logp = torch.log_softmax(logits, dim=-1)  # (K, V)
    if any(bans):
        logits = logits.clone()
        for k, ids in enumerate(bans):
            logits[k, list(ids)] = _NEG
    if temperature > 0:
        logits = truncate_logits(logits, cfg.ar_top_k, cfg.ar_top_p, cfg.ar_min_p)
        tok = sample_categorical(torch.softmax(logits / temperature, dim=-1), generator)
    else:
        tok = logits.argmax(dim=-1)
    return tok, logp.gather(1, tok[:, None])[:, 0]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One scored (draft, ending) of a gap: `lane`, `length` tokens kept, `score` (higher is better)."""

    lane: int
    length: int
    score: float


class ARWalk:
    """One AR row's walk over its canvas. Mutates the row's `canvas` and `argmax` (L,) tensors in place; owns its
    private single-row context cache `ctx` (the plain frame: `context` and what the walk fed after it, kept in
    `history`) and the next-token logits `last` (V,) after it. `fim`: the FIM ids when this row's infills prompt
    with the FIM format (the engine resolves `SamplerConfig.fim` against the model).

    `ctx` and `last` None: the plain context is not encoded yet (the engine defers it for a FIM infill, whose drafts
    read only the FIM prompt). The walk then encodes it when something first reads the plain frame (`plain()`: the
    seam's scoring, an SMC resample, a gap drafted in the plain frame), by the same `prefix` prefills the eager path
    runs (the context with `room`, `stop` asked between its pieces, then each pinned run fed before the first gap),
    so the same pieces are encoded, the same blocks cached, and the same logits come out. Needs `prefix`."""

    def __init__(self, model: DiffusionModel, cfg: SamplerConfig, ctx: KVCache | None, last: Tensor | None,
                 canvas: Tensor, argmax: Tensor, pinned: Tensor, used: int, generator: torch.Generator, *,
                 keep_context: bool, room: int, clause_ends: frozenset[int] | None = None,
                 avoid: Sequence[tuple[int, ...]] = (), context: Sequence[int] = (), fim: FimTokens | None = None,
                 word_edges: WordEdges | None = None, prefix: PrefixCache | None = None,
                 fim_order: Order = DEFAULT_FIM_ORDER, lines: LineTokens | None = None,
                 stop: Callable[[], bool] | None = None) -> None:
        if (ctx is None) != (last is None) or (ctx is None and (prefix is None or not context)):
            raise ValueError("a deferred plain context needs its tokens and a prefix cache, and no logits")
        self.model, self.cfg, self.ctx, self.last = model, cfg, ctx, last
        # While the plain context is deferred: the history lengths at which each prefill the eager path would have
        # run ends (the context, then each fed pinned run), replayed by `plain()`; empty once it is encoded.
        self._deferred: list[int] = [] if ctx is not None else [len(context)]
        self.stop = stop
        self.context_cached: int | None = None  # a deferred context, once encoded: its tokens the cache restored
        self.context_s = 0.0  # ...the seconds its prefill took
        # ...and the pinned runs' encodes replayed after it: the engine adds them to the row's forwards itself, since
        # they may run inside `take`, whose own encodes it does not count.
        self.context_forwards = 0
        self.lines = lines  # what `SamplerConfig.ar_first_newline` False bans while a draft is blank
        self._breaks = sorted(lines.breaks) if lines is not None else []
        self.prefix = prefix  # the engine's context cache: fed pinned runs and FIM prompts start from it
        self.cached = 0  # tokens of fed pinned runs taken from `prefix` instead of encoded
        # The FIM prompts' prefills (every FIM gap's, summed): their tokens, how many of them `prefix` restored
        # instead of encoding, and the seconds the prefills took (the prompt a llama.cpp client's `timings` mean).
        self.fim_tokens = self.fim_cached = 0
        self.fim_s = 0.0
        self.fim_order = fim_order
        self.canvas, self.argmax, self.pinned, self.used = canvas, argmax, pinned, used
        self.generator, self.keep_context, self.room = generator, keep_context, room
        self.clause_ends, self.avoid = clause_ends, list(avoid)
        self.history, self.fim, self.word_edges = list(context), fim, word_edges
        self.pos = 0  # the next slot to walk
        self.gaps_done = 0
        self.forwards = self.generated = 0
        self.seam_aware_gaps = 0  # gaps filled by scored drafts (the Done's mode says so)
        self.touched: tuple[int, int] = (0, 0)  # slots written since the caller last looked
        self.shown = 0  # while a gap drafts: how many of its slots hold the leading draft's tokens
        self.drafting = False
        self.serial = 0  # a new value for every drafted gap (and SMC resample): its lanes' identity in the batch
        self.moved: dict[int, tuple[int, int]] = {}  # after a resample or a lane's end: row -> (old serial, old row)
        self.lanes = 0
        self.active: list[int] = []  # the lanes that take a batch row: in the FIM frame, those still writing
        self.start = self.end = self.n = 0
        self.scored = False
        self.temperature = cfg.ar_temperature  # this gap's drafting temperature (`_start_gap` sets it)
        self.seam: Tensor | None = None
        self.fim_cache: KVCache | None = None  # the FIM prompt's cache while a FIM gap drafts
        self.shadow: KVCache | None = None  # the FIM lanes in the plain frame, fed up to `shadow_n` tokens
        self.shadow_n = 0
        self.tokens = self.lp = self.feed_next = torch.empty(0)
        self.done = self.length = self.potential = torch.empty(0)
        self.seen: list[dict[tuple[int, ...], set[int]]] = []  # per lane: each n-gram's head -> the tokens after it
        self.lead = 0  # the lane the canvas shows while the lanes grow
        self.lead_rest: list[str] = []  # per lane: what of `SamplerConfig.ar_lead` it has still to write
        self.scored_drafts: Drafts | None = None  # the last scored gap's drafts, with the one chosen

    @property
    def finished(self) -> bool:
        return not self.drafting and self.pos >= self.used

    @property
    def rows(self) -> int:
        """Batch rows of the drafting lanes: one a lane still writing (`active`; a finished FIM lane has none)."""
        return len(self.active)

    def source(self, row: int) -> KVCache:
        """The cache a new batch row starts from: the FIM prompt's in the FIM frame, else the plain context."""
        return self.fim_cache if self.fim_cache is not None else self.plain()[0]

    @property
    def deferred(self) -> bool:
        """Whether the plain context is still unencoded (nothing has read it yet)."""
        return bool(self._deferred)

    def plain(self) -> tuple[KVCache, Tensor]:
        """The plain context's cache and the logits after it, encoded now if it was deferred (see the class).
        Raises `PrefillCancelled` when `stop` says so between two pieces of the context."""
        if self.ctx is None or self.last is None:
            assert self.prefix is not None  # __init__ refuses a deferred context without one
            ends, t0 = self._deferred, time.perf_counter()
            pf = self.prefix.prefill(self.history[: ends[0]], self.room, stop=self.stop)
            self.context_cached, self.context_s = pf.cached, time.perf_counter() - t0
            ctx, last = pf.cache, pf.last
            for a, b in itertools.pairwise(ends):  # each pinned run, as `_feed(lookup=True)` encoded it
                pf = self.prefix.prefill(self.history[:b], max(0, ctx.capacity - b), base=(ctx, last))
                ctx, last = pf.cache, pf.last
                self.cached += max(0, pf.cached - a)
                self.context_forwards += 1
            self.ctx, self.last, self._deferred = ctx, last, []
        return self.ctx, self.last

    @property
    def budget_left(self) -> int:
        """Tokens the current gap's lanes will still encode."""
        return self.end - self.start - self.n if self.drafting else 0

    def drafts(self) -> Drafts | None:
        """For frames: the drafts of the scored gap being drafted (K > 1), else those of the last scored gap."""
        if not (self.drafting and self.scored and self.lanes > 1):
            return self.scored_drafts
        n = min(self.n + 1, self.end - self.start)  # tokens sampled per lane (the next is sampled as the last is fed)
        return Drafts(self.start, self.end, tuple(map(tuple, self.tokens[:, :n].tolist())), self.lead,
                      logp=tuple(map(tuple, self.lp[:, :n].tolist())))

    def written(self) -> Tensor:
        """(L,) bool: the slots that hold a pin or a token the model wrote: every pin, every slot of a gap already
        filled (its nulls too), and the leading draft's tokens so far in the gap being drafted. The others still hold
        the canvas's initial noise (or, in a drafting gap, a token an earlier lead wrote that the new lead has not)."""
        L = self.canvas.shape[0]
        slots = torch.arange(L, device=self.canvas.device)
        out = (self.pinned & (slots < self.used)) | (slots < self.pos)
        if self.drafting:  # pos is the gap's start while it drafts
            out |= (slots >= self.start) & (slots < self.start + self.shown)
        return out

    def _free_after(self, slot: int) -> bool:
        return bool((~self.pinned[slot : self.used]).any())

    def _needs_context(self, after: int) -> bool:
        return self.keep_context or self._free_after(after)

    def advance(self) -> None:
        """Walk pinned runs (feeding them when the context is read later) until a gap starts drafting or the canvas
        ends."""
        while not self.drafting and self.pos < self.used:
            pos = self.pos
            if bool(self.pinned[pos]):
                end = pos
                while end < self.used and bool(self.pinned[end]):
                    end += 1
                if self._needs_context(end):
                    self._feed(self.canvas[pos:end], lookup=True)
                self.pos = end
                continue
            end = pos
            while end < self.used and not bool(self.pinned[end]):
                end += 1
            run_end = end  # the pinned run after the gap: the FIM prompt's right side; its head is the seam
            while run_end < self.used and bool(self.pinned[run_end]):
                run_end += 1
            # A gap that ends before the used slots do ends at a pin: it has text after it.
            seam = self.canvas[end : min(run_end, end + self.cfg.ar_seam_tokens)] if end < self.used else None
            self._start_gap(pos, end, seam, self.canvas[end:run_end])

    def _feed(self, tokens: Tensor, *, lookup: bool = False) -> None:
        """Encode `tokens` after the context. `lookup` (a pinned run: text an earlier request may have fed too):
        from the context cache as far as it holds `history + tokens`, when `ctx` holds exactly `history`. While the
        plain context is deferred, a pinned run is deferred with it (`plain()` encodes both when read)."""
        if lookup and self._deferred:
            self.history.extend(tokens.tolist())
            self._deferred.append(len(self.history))
            return
        ctx, last = self.plain()
        if lookup and self.prefix is not None and ctx.length == len(self.history) and not bool(ctx.pos_offset.any()):
            n = len(self.history)
            pf = self.prefix.prefill(self.history + tokens.tolist(), max(0, ctx.capacity - n - len(tokens)),
                                     base=(ctx, last))
            self.ctx, self.last = pf.cache, pf.last
            self.cached += max(0, pf.cached - n)
        else:
            out, _ = self.model.encode(tokens[None], cache=ctx, logits="last")
            assert out is not None
            self.last = out[0, -1]
        self.history.extend(tokens.tolist())
        self.forwards += 1

    def _start_gap(self, start: int, end: int, seam: Tensor | None, right: Tensor) -> None:
        """Start drafting slots [start, end): sample each lane's first token from the context's logits (the FIM
        prompt's, in the FIM frame)."""
        scored = seam is not None and self.cfg.seam_aware
        self.scored = scored
        self.seam = seam if scored else None
        self.lanes = self.cfg.ar_drafts if scored else 1
        self.start, self.end, self.n = start, end, 0
        g = end - start
        long = scored and 0 < self.cfg.ar_long_gap < g  # a long infill drafts cooler (SamplerConfig.ar_long_gap)
        self.temperature = self.cfg.ar_temperature_long if long else self.cfg.ar_temperature
        dev = self.canvas.device
        # The writer's partial word, written again by the first lanes' tokens (`LeadTokens`): the first gap only.
        index = self.lines.lead if self.lines is not None else None
        lead = self.cfg.ar_lead if self.gaps_done == 0 and index is not None else ""
        self.fim_cache = self.shadow = None
        self.shadow_n = 0
        if scored and self.fim is not None:
            # The left side's start moves in steps of `_FIM_LEFT_STEP` (it keeps the last 161-192 tokens): while a
            # writer types at its end, the prompt's head stays as it was, and so does its cached encoding.
            cut = max(0, len(self.history) - _FIM_LEFT)
            left = self.history[cut + -cut % _FIM_LEFT_STEP :]
            # Token healing (`heal_split`): the left side's last partial word opens the middle instead, as text; with
            # a lead the caller has taken the partial word out already (the left side ends at a word end).
            h = heal_split(left, *self.word_edges) if self.word_edges is not None and not lead else 0
            prompt = fim_prompt(self.fim, left[: len(left) - h], right[:_FIM_RIGHT].tolist(), self.fim_order)
            prompt += left[len(left) - h :]
            t0 = time.perf_counter()
            if self.prefix is not None:  # as far as an earlier prompt shares it (the same gap a keystroke ago)
                pf = self.prefix.prefill(prompt, g)
                self.fim_cache, first = pf.cache, pf.last
                self.fim_cached += pf.cached
            else:
                self.fim_cache = self.model.new_cache(1, len(prompt) + g)
                out, _ = self.model.encode(torch.tensor([prompt], device=dev), cache=self.fim_cache, logits="last")
                assert out is not None
                first = out[0, -1]
            self.fim_s += time.perf_counter() - t0
            self.fim_tokens += len(prompt)
            self.forwards += 1
        else:  # drafted in the plain frame: from the logits after the context (encoded now if it was deferred)
            first = self.plain()[1]
        self.tokens = torch.zeros(self.lanes, g, dtype=torch.long, device=dev)
        self.lp = torch.zeros(self.lanes, g, device=dev)  # log p(draft token) at temperature 1 (the drafting frame)
        self.done = torch.zeros(self.lanes, dtype=torch.bool, device=dev)  # a FIM lane wrote `<|fim_end|>`...
        self.length = torch.full((self.lanes,), g, dtype=torch.long, device=dev)  # ...after this many tokens
        self.potential = torch.zeros(self.lanes, device=dev)  # SMC: each lane's score when last weighed
        self.active = list(range(self.lanes))
        self.serial = next(_serials)
        self.moved = {}
        self.drafting = True
        self.shown = 0
        self.seen = [{} for _ in range(self.lanes)]
        self.lead_rest = [lead] * self.lanes
        self._sample(first[None].expand(self.lanes, -1))

    def _banned(self) -> list[int]:
        """Tokens a scored draft may not write now: `<null>`, EOS and, in the FIM frame, the other sentinels, and
        `<|fim_end|>` until the shortest ending (or always, without `<null>` to pad a short fill)."""
        cfg = self.model.config
        out = [t for t in (cfg.null_token_id, *cfg.eos_token_ids) if t is not None]
        if self.fim_cache is not None and self.fim is not None:
            out += [self.fim.prefix, self.fim.suffix, self.fim.middle, self.fim.bos]
            g = self.end - self.start
            if cfg.null_token_id is None or self.n < max(1, math.ceil(self.cfg.ar_min_fill * g)):
                out.append(self.fim.end)
        return out

    def _lane_bans(self) -> list[list[int]]:
        """Each lane's tokens it may not write next: the scored draft's `_banned`, and the tokens that would repeat
        an `ar_no_repeat`-gram the lane already wrote (every draft, continuations too: a 270M base loops at any
        temperature we use), and, under `ar_first_newline` False, the line breaks while the lane's draft is blank (an
        editor's suggestion never opens with an empty line, and no draft spends its budget on one), and in the FIM
        frame `<|fim_end|>` then too (nor is it only the spaces before one: its first line holds text)."""
        common = self._banned() if self.scored else []
        bans = [list(common) for _ in range(self.lanes)]
        if not self.cfg.ar_first_newline and self.lines is not None and self._breaks:
            blanks = self.lines.blanks
            blank = [*self._breaks, *([self.fim.end] if self.fim is not None and self.fim_cache is not None else [])]
            for k, row in enumerate(self.tokens[:, : self.n].tolist()):
                if all(t in blanks for t in row):
                    bans[k] += blank
        n = self.cfg.ar_no_repeat
        if n and self.n >= n - 1:
            heads = self.tokens[:, self.n - n + 1 : self.n].tolist()
            for k, head in enumerate(heads):
                bans[k] += self.seen[k].get(tuple(head), ())
        return bans

    def _sample(self, logits: Tensor) -> None:
        """Sample each lane's next token from its logits (K, V) and record it; a FIM lane that has ended writes
        `<|fim_end|>` again (fed, never read)."""
        if any(self.lead_rest):
            logits = self._lead_only(logits)
        tok, lp = draw(logits, self._lane_bans(), self.temperature, self.cfg, self.generator)
        if any(self.lead_rest):
            texts = self.lines.lead.texts  # type: ignore[union-attr]  # a lead is set only with its index
            self.lead_rest = [lead_rest(r, texts[t]) if r else "" for r, t in zip(self.lead_rest, tok.tolist(),
                                                                                  strict=True)]
        i = self.n
        if self.fim is not None and self.fim_cache is not None:
            tok = torch.where(self.done, self.fim.end, tok)
            ended = (tok == self.fim.end) & ~self.done
            self.length = torch.where(ended, i, self.length)
            self.done |= ended
        self.tokens[:, i] = tok
        n = self.cfg.ar_no_repeat
        if n and i >= n - 1:
            grams = self.tokens[:, i - n + 1 : i + 1].tolist()
            for k, gram in enumerate(grams):
                self.seen[k].setdefault(tuple(gram[:-1]), set()).add(gram[-1])
        self.lp[:, i] = lp
        # The leading draft is shown while drafts grow: the likeliest of those still writing.
        lead_score = self.lp[:, : i + 1].sum(1).masked_fill(self.done, _NEG) if not bool(self.done.all()) else None
        lead = self.lead = int(lead_score.argmax()) if lead_score is not None else 0
        shown = self.shown = min(i + 1, int(self.length[lead]))
        self.canvas[self.start : self.start + shown] = self.tokens[lead, :shown]
        self.argmax[self.start : self.start + shown] = self.tokens[lead, :shown]
        self.touched = (self.start + shown - 1, self.start + shown) if shown else (self.start, self.start)
        self.feed_next = tok

    def _lead_only(self, logits: Tensor) -> Tensor:
        """logits (K, V) with every id a lane may not start its lead with at -inf (`LeadTokens.allowed`); a lane
        whose lead no id can start (a vocabulary without its characters) drops the lead."""
        index = self.lines.lead if self.lines is not None else None
        assert index is not None
        out = logits.clone()
        for k, rest in enumerate(self.lead_rest):
            if not rest:
                continue
            found = index.allowed(rest)
            ids = torch.from_numpy(found[found < out.shape[-1]]).to(out.device)
            if not len(ids):
                self.lead_rest[k] = ""
                continue
            row = torch.full_like(out[k], _NEG)
            row[ids] = out[k, ids]
            out[k] = row
        return out

    def feed(self) -> Tensor:
        """(rows,) the token each active lane encodes this step."""
        return self.feed_next if len(self.active) == self.lanes else self.feed_next[self.active]

    def take(self, logits: Tensor, batch: KVCache, rows: Tensor) -> None:
        """Consume this step's logits (rows, V) after the fed tokens; `rows` (rows,) are this walk's active lanes in
        `batch`. The gap ends at its budget, or as soon as its answer is decided (`_decided`), without another step."""
        K = self.lanes
        self.n += 1
        g = self.end - self.start
        if self.n < g and not self._decided():
            before, old = {lane: r for r, lane in enumerate(self.active)}, self.serial
            full = logits
            if len(self.active) < K:  # a finished lane samples from zeros: its draw is `<|fim_end|>` again
                full = logits.new_zeros(K, logits.shape[-1])
                full[self.active] = logits
            pick = None
            every = self.cfg.ar_smc_every
            if every and K > 1 and self.n % every == 0 and self.seam is not None and len(self.seam):
                cache, plain_rows, _ = self._plain_frame(batch, rows, logits=False)
                pick = self._resample(cache, plain_rows)
                full = full[pick]
            self._sample(full)
            self._compact(before, old, pick)
            if not self._decided():
                return
        cache, plain_rows, plain = self._plain_frame(batch, rows, logits=True)
        self._choose(plain if self.fim_cache is not None else logits, cache, plain_rows)

    def _decided(self) -> bool:
        """Whether the gap's answer is decided: every lane has written `<|fim_end|>`, or `EARLY_END_SHARE` of two or
        more have (only in the FIM frame with `<null>` to pad: elsewhere no lane ends early)."""
        ended = int(self.done.sum())
        return ended == self.lanes or (self.lanes > 1 and ended >= math.ceil(EARLY_END_SHARE * self.lanes))

    def _compact(self, before: dict[int, int], old: int, pick: Tensor | None) -> None:
        """After a sample (and an SMC resample, `pick` (K,): each lane's source lane), give batch rows only to the
        lanes still writing; `before`: lane -> its batch row under serial `old`. When the rows change, a new serial,
        and `moved` tells the batch where each new row's cache is (a finished lane's never is read again)."""
        src = list(range(self.lanes)) if pick is None else pick.tolist()
        active = [k for k in range(self.lanes) if not bool(self.done[k])]
        if pick is None and active == self.active:
            return
        if pick is None:
            self.serial = next(_serials)
        # A lane still writing has a source that was writing too (`done` follows the pick): it had a row.
        self.moved = {r: (old, before[int(src[k])]) for r, k in enumerate(active)}
        self.active = active

    def _plain_frame(self, batch: KVCache, rows: Tensor, *, logits: bool) -> tuple[KVCache, Tensor, Tensor | None]:
        """The lanes' drafts so far after the row's plain context: (cache, the lanes' rows in it, their next-token
        logits (K, V) when `logits` and they differ from the step's). Outside the FIM frame the lanes are those rows
        of `batch`. In the FIM frame, the shadow: K copies of the plain context (`KVCache.aligned`, which shares
        their slots), brought up to date by one encode of the tokens written since the last time."""
        if self.fim_cache is None:
            return batch, rows, None
        K, g = self.lanes, self.end - self.start
        if self.shadow is None:
            self.shadow, self.shadow_n = KVCache.aligned([(self.plain()[0], 0)] * K, g), 0
        new = self.tokens[:, self.shadow_n : self.n]  # (K, n - shadow_n), at least one at the gap's end
        out = None
        if new.shape[1]:
            out, _ = self.model.encode(new, cache=self.shadow, logits="last" if logits else "none")
            self.shadow_n = self.n
            self.forwards += 1
        return self.shadow, torch.arange(K, device=rows.device), None if out is None else out[:, -1]

    # ---- sequential Monte Carlo ------------------------------------------------------------------------------
    def _resample(self, batch: KVCache, rows: Tensor) -> Tensor:
        """Weigh each lane by the gain of its running seam score and draw K lanes by those weights; every lane's
        state (and at the next step its cache rows) follows its pick. rows (K,) plain-frame rows -> pick (K,)."""
        lengths = torch.where(self.done, self.length, self.n)[:, None]  # (K, 1): a finished lane as it ended
        limits = batch.length - self.n + lengths
        last = self.tokens.gather(1, (lengths - 1).clamp(min=0))
        score = seam_logprobs(self.model, batch, rows, limits, self.seam, last)[:, 0]  # type: ignore[arg-type]
        gain = (score - self.potential) / self.cfg.ar_smc_temperature
        pick = torch.multinomial(torch.softmax(gain, dim=0), self.lanes, replacement=True, generator=self.generator)
        self.tokens, self.lp = self.tokens[pick], self.lp[pick]
        self.done, self.length, self.potential = self.done[pick], self.length[pick], score[pick]
        self.seen = [{h: set(t) for h, t in self.seen[int(j)].items()} for j in pick.tolist()]
        self.lead_rest = [self.lead_rest[int(j)] for j in pick.tolist()]
        self.serial = next(_serials)  # the lanes' batch rows follow their picks (`_compact` says where from)
        if self.shadow is not None:  # the shadow's rows follow their lanes now
            room = self.end - self.start - self.n
            self.shadow = KVCache.aligned([(self.shadow, int(j)) for j in pick.tolist()], room)
        return pick

    # ---- the end of a gap ------------------------------------------------------------------------------------
    def endings(self, lane: int) -> list[int]:
        """Draft lengths lane `lane` may end at: where its FIM middle ended, else the budget, and clause or sentence
        ends (tokens in `clause_ends`; without them, evenly spaced lengths) no shorter than `ar_min_fill` of the
        gap, nearest the budget first. A gap that ends before its budget (`_decided`) offers a lane still writing
        only the lengths it has written (none when it is short of them all)."""
        g = self.end - self.start
        if not self.scored or self.model.config.null_token_id is None:
            return [g]
        if bool(self.done[lane]):
            return [int(self.length[lane])]
        lo = max(1, math.ceil(self.cfg.ar_min_fill * g))
        top = min(self.n, g)  # tokens the lane has written (and fed)
        if self.clause_ends is None:
            n = self.cfg.ar_endings
            spaced = {round(lo + (g - lo) * i / max(n - 1, 1)) for i in range(n)}
            return [e for e in sorted(spaced | {g}, reverse=True)[:n] if e <= top]
        toks = self.tokens[lane].tolist()
        ends = [e for e in range(min(g - 1, top), lo - 1, -1) if toks[e - 1] in self.clause_ends]
        return [g, *ends][: self.cfg.ar_endings] if top == g else ends[: self.cfg.ar_endings]

    def candidates(self, batch: KVCache, rows: Tensor) -> list[Candidate]:
        """Every (lane, ending) with its score: the seam's log-likelihood after it (one forward over all
        candidates), plus `ar_draft_weight` times the draft's mean token log-likelihood; with no seam tokens, the
        draft's mean log-likelihood alone. `rows` (K,): the plain-frame rows of `batch`."""
        ends = [self.endings(k) for k in range(self.lanes)]
        E = max(len(e) for e in ends)
        # (K, E): a lane with no ending (still writing at an early end) is padded and offers no candidate
        lengths = torch.tensor([e + [e[-1] if e else 1] * (E - len(e)) for e in ends], device=rows.device)
        cum = torch.cumsum(self.lp, dim=1)  # (K, g)
        mean_lp = cum.gather(1, lengths - 1) / lengths  # (K, E)
        if self.seam is not None and len(self.seam):
            limits = batch.length - self.n + lengths  # the slot after each candidate's last draft token
            seam = seam_logprobs(self.model, batch, rows, limits, self.seam, self.tokens.gather(1, lengths - 1))
            score = seam + self.cfg.ar_draft_weight * mean_lp
        else:
            score = mean_lp
        return [Candidate(k, e, float(score[k, i])) for k in range(self.lanes) for i, e in enumerate(ends[k])]

    def _choose(self, logits: Tensor | None, batch: KVCache, rows: Tensor) -> None:
        """End the gap: write the best candidate. logits (K, V) and rows (K,): the plain frame's (its next-token
        logits after each lane's whole draft; None when the plain frame has none, the fill is encoded again)."""
        g = self.end - self.start
        cands = self.candidates(batch, rows)
        avoid = self.avoid[self.gaps_done] if self.gaps_done < len(self.avoid) else ()
        if avoid:  # a rewrite offers its old text only when every candidate is the old text
            fresh = [c for c in cands if tuple(self.tokens[c.lane, : c.length].tolist()) != avoid]
            cands = fresh or cands
        if self.cfg.ar_select_temperature > 0 and len(cands) > 1:
            w = torch.softmax(torch.tensor([c.score for c in cands]) / self.cfg.ar_select_temperature, dim=0)
            best = cands[int(torch.multinomial(w, 1, generator=self.generator))]
        else:
            best = max(cands, key=lambda c: c.score)
        k, e = best.lane, best.length
        if self.lanes > 1:
            self.scored_drafts = Drafts(self.start, self.end, tuple(map(tuple, self.tokens.tolist())), self.lead, k, e)
        fill = self.tokens[k, :e]
        self.canvas[self.start : self.start + e] = fill
        self.argmax[self.start : self.start + e] = fill
        if e < g:
            null = self.model.config.null_token_id
            assert null is not None  # endings() offers only the budget without a null token
            self.canvas[self.start + e : self.end] = null
            self.argmax[self.start + e : self.end] = null
        self.touched = (self.start, self.end)
        self.generated += e
        self.seam_aware_gaps += self.scored
        self.gaps_done += 1
        self.drafting = False
        self.pos = self.end
        if self._needs_context(self.end):
            if e == self.n and logits is not None:  # the plain cache holds exactly the fill: take, not encode, it
                self.ctx = KVCache.aligned([(batch, int(rows[k]))], self.room)
                self.last = logits[k]
                self.history.extend(fill.tolist())
            else:
                self._feed(fill)
        self.lanes = 0
        self.fim_cache = self.shadow = None
        self.moved = {}


class ARBatch:
    """The drafting lanes of every AR row in one encodable cache (`KVCache.aligned`): rebuilt only when its lanes
    change (a gap starts or ends, a row leaves), stepped by one `model.encode` of (B, 1) tokens."""

    def __init__(self, model: DiffusionModel) -> None:
        self.model = model
        self.cache: KVCache | None = None
        self.members: list[tuple[int, int]] = []  # (walk serial, lane) per batch row
        self.rebuilds = 0

    def step(self, walks: list[ARWalk]) -> list[Tensor]:
        """Encode each drafting walk's next tokens in one call; returns each walk's logits, (its rows, V)."""
        want = [(w.serial, r) for w in walks for r in range(w.rows)]
        if want != self.members or self.cache is None:
            index = {m: i for i, m in enumerate(self.members)}
            sources: list[tuple[KVCache, int]] = []
            for w in walks:
                for r in range(w.rows):
                    i = index.get(w.moved.get(r, (w.serial, r)))  # a resampled lane's row is its pick's
                    sources.append((self.cache, i) if i is not None and self.cache is not None else (w.source(r), 0))
                w.moved = {}
            self.cache = KVCache.aligned(sources, max(w.budget_left for w in walks))
            self.members = want
            self.rebuilds += 1
        tokens = torch.cat([w.feed() for w in walks])[:, None]  # (B, 1)
        out, _ = self.model.encode(tokens, cache=self.cache, logits="last")
        assert out is not None
        return list(out[:, -1].split([w.rows for w in walks]))

    def clear(self) -> None:
        self.cache, self.members = None, []


@torch.no_grad()
def seam_logprobs(model: DiffusionModel, cache: KVCache, rows: Tensor, limits: Tensor, seam: Tensor,
                  last: Tensor) -> Tensor:
    """Log-likelihood of the seam after each candidate, in one forward that reads `cache` and never writes it.
    Candidate (k, e) is row `rows[k]` of `cache` up to slot `limits[k, e]`, whose last token `last[k, e]` (the
    draft's, already in the cache) is read again as the first query, so that its logits give the seam's first
    token: the cache is cut at `limits - 1` (keys from there on hidden) and the queries are last, seam[:-1] at the
    positions from the cut. rows (K,), limits and last (K, E) long, seam (S,) -> (K, E) fp32 (zeros when S = 0)."""
    K, E = limits.shape
    S = int(seam.numel())
    dev = cache.key_valid.device
    if S == 0:
        return torch.zeros(K, E, device=dev)
    limits = limits - 1  # the last draft token's slot: re-read as the first query
    T, W, L = S, model.config.sliding_window, cache.length
    j = torch.arange(T, device=dev).repeat(E)  # (E*T,) index inside the seam
    block = torch.arange(E, device=dev).repeat_interleave(T)  # (E*T,) which ending
    lim = limits.repeat_interleave(T, dim=1)  # (K, E*T)
    q_slot = lim + j  # (K, E*T): the query's slot, as if the seam were written after the cut
    positions = q_slot - cache.pos_offset.index_select(0, rows)[:, None]
    valid = cache.key_valid.index_select(0, rows)[:, :L]  # (K, L)
    same = (block[:, None] == block[None, :]) & (j[None, :] <= j[:, None])  # (E*T, E*T) causal inside an ending
    slots = torch.arange(L, device=dev)
    full = (slots < lim[..., None]) & valid[:, None, :]  # (K, E*T, L)
    n = cache.sliding_len()
    tail = slots[L - n :]
    sliding = (tail < lim[..., None]) & (tail > q_slot[..., None] - W) & valid[:, None, L - n :]
    near = same & (j[:, None] - j[None, :] < W)
    masks = {False: torch.cat([full, same.expand(K, -1, -1)], -1)[:, None],
             True: torch.cat([sliding, near.expand(K, -1, -1)], -1)[:, None]}  # (K, 1, E*T, keys)

    def read(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        ck, cv = cache.read(i)
        ck, cv = ck.index_select(0, rows), cv.index_select(0, rows)
        return torch.cat([ck, k], dim=2), torch.cat([cv, v], dim=2), masks[cache.layers[i].sliding]

    ids = torch.cat([last[..., None], seam[:-1].expand(K, E, -1)], dim=-1).reshape(K, E * T)  # (K, E*T)
    quant = model.int8_for(K * E * T)  # as `encode` would run this many rows
    h = model.run_layers(model.embed_tokens(ids), positions, read, decoder=False, quant=quant)
    logits = model.logits(h, quant)  # (K, E*T, V) fp32
    target = seam.repeat(E)[None, :, None].expand(K, -1, 1)
    # log p(target) = its logit - logsumexp: no second (K, E*T, V) tensor for a log_softmax.
    logp = logits.gather(-1, target)[..., 0] - torch.logsumexp(logits, dim=-1)  # (K, E*T)
    return logp.view(K, E, T).sum(-1)
