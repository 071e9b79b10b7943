"""Encoder caches reused by the longest common prefix of token ids (llama.cpp's `cache_prompt` idea).

Owns `PrefixCache`: every context the engine encodes (a request's context, an AR walk's fed pinned runs, a FIM
prompt) is looked up by its token ids; the longest prefix some earlier prefill shares with it is restored from the
cache (its keys and values copied into a new, private `KVCache`) and only the rest is encoded. An editor that sends
its whole context on every keystroke then pays for the few tokens the keystroke changed. A context the engine defers
(a FIM infill's, encoded only when read) goes through `prefill` when it is, as any other; until then `held` says how
much of it the cache holds, without a copy.

Storage: a trie of blocks. A block holds the keys and values of `block` consecutive positions [i*block, (i+1)*block)
of every layer, keyed by (its parent block, its token ids), so a block stands for one whole prefix and is stored
once however many contexts share it. A prefill that ends inside a block leaves a shorter leaf block; the block a
prefill ends in keeps the next-token logits after its last token (`last`), so an exact repeat encodes nothing. A
lookup follows whole blocks while they match, then takes the longest common prefix with any child of the last one
(token-level, not block-level, reuse).

Why blocks hold every position of every layer: `KVCache`'s sliding layers keep only the last `sliding_window - 1`
positions, so a cache cannot be rolled back to an earlier length once the window has moved past it. Restoring a
prefix of length p needs the sliding layers' positions [p - window + 1, p) and the full layers' [0, p), which the
blocks hold for any p. New positions are captured while they are still in the window: the rest of a context is
encoded in pieces that end on block boundaries, each small enough that the block it starts in and the piece both fit
in the sliding buffers; after each piece its whole blocks are inserted.

Memory: the blocks' keys, values and logits live in the pages of one arena (`canvas.engine.block_pool.PagePool`)
sized by the budget and never freed, so a full cache's RSS stays flat instead of fragmenting the allocator (issue
47); a block takes as many pages as it has positions, its logits `logit_pages` more, and the stored bytes are the
pages used, byte-exact. Each prefill also offers the allocator's free pages back to the OS, at most every few
seconds (`canvas.engine.heap.TRIMMER`): the restored caches and activations it freed are of many sizes.

Invariants: a block's pages never change while it is stored (a restored cache is a copy, private to its caller, which
may grow it); a block is inserted only under a live parent, so every stored block is reachable; the stored bytes
(keys, values and logits) stay within `budget_bytes` after every insertion (least recently used childless blocks go
first); a prefill stopped between pieces (`stop`, a cancelled request) leaves every block it inserted whole and
valid. Lookups, restores (copies out of pages that an eviction could hand to another block) and insertions hold a
lock; encodes run outside it, so engines on several threads may share one cache. A piece's size changes which
GEMM shapes run, not what is computed: a restored prefix and its continuation equal a fresh encode of the same tokens
within float tolerance.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from canvas.engine.block_pool import PagePool, page_positions
from canvas.engine.heap import TRIMMER, Trimmer
from canvas.model import DiffusionModel, KVCache

DEFAULT_BLOCK = 64  # positions a block holds (smaller where the sliding window is too short for it)
MB = 1 << 20
# The default budget (`dcanvas serve --context-cache-mb`): the converted Gemma-3-270M holds ~39 KB a position in
# fp32, so 512 MiB keep ~13k positions: a few long documents and the FIM prompts of their recent keystrokes.
DEFAULT_CONTEXT_CACHE_MB = 512


class PrefillCancelled(Exception):
    """`PrefixCache.prefill`'s `stop` said to stop between two pieces; the blocks inserted so far stay."""


@dataclass(frozen=True, slots=True)
class Prefill:
    """A prefilled context: `cache` (private, single-row, holding the tokens with the room asked for), the
    next-token logits after its last token `last` (V,), and how many leading tokens came from the cache (`cached`;
    the rest were encoded now)."""

    cache: KVCache
    last: Tensor
    cached: int


@dataclass(eq=False, slots=True)
class _Block:
    id: int
    parent: int  # 0: the root (the block starts at position 0)
    start: int  # position of its first token
    tokens: tuple[int, ...]
    pages: list[int]  # its keys and values, `PagePool.page` positions a page
    last: list[int] | None = None  # pages of the (V,) logits after its last token, when a prefill ended there
    children: set[int] = field(default_factory=set)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True, slots=True)
class CacheStats:
    bytes: int
    budget_bytes: int
    blocks: int
    lookups: int
    tokens_reused: int  # tokens restored instead of encoded, over all prefills
    tokens_encoded: int


class PrefixCache:
    """The encoder caches of one model, reused by longest common prefix, within `budget_bytes` (0: keep nothing;
    every prefill encodes all its tokens)."""

    def __init__(self, model: DiffusionModel, budget_bytes: int, *, block: int = DEFAULT_BLOCK,
                 trimmer: Trimmer = TRIMMER) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the context cache budget must be >= 0 bytes, got {budget_bytes}")
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.model = model
        self.budget_bytes = budget_bytes
        keep = model.config.sliding_window - 1 if any(model.config.is_sliding(i) for i in
                                                      range(model.config.num_hidden_layers)) else 1 << 30
        # A piece and the unfinished block before it must fit the sliding buffers (`keep` positions) together: a
        # piece ends at most `_piece` positions after the block boundary it starts from.
        self.block = max(1, min(block, keep))
        self._piece = (keep // self.block) * self.block
        cfg = model.config
        shapes = [(cfg.layer_kv_heads(i), cfg.layer_head_dim(i)) for i in range(cfg.num_hidden_layers)]
        self.pool = PagePool(shapes, cfg.vocab_size, page_positions(self.block), budget_bytes, dtype=model.dtype,
                             device=model.device)
        self._trimmer = trimmer
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._index: dict[tuple[int, tuple[int, ...]], _Block] = {}
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self._root_children: set[int] = set()
        self._lookups = self._reused = self._encoded = 0

    # ---- public API ------------------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.pool.used * self.pool.page_bytes, self.budget_bytes, len(self._blocks),
                              self._lookups, self._reused, self._encoded)

    def clear(self) -> None:
        with self._lock:
            self._index.clear()
            self._blocks.clear()
            self._root_children.clear()
            self.pool.reset()

    def held(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` a `prefill` of them would restore now instead of encoding (no copy, no
        encode; the matched blocks count as used, as a prefill's would). For a context that is encoded only if
        something reads it (`canvas.engine.ar`'s lazy plain context): what the cache holds of it."""
        toks = tuple(int(t) for t in tokens)
        if not toks:
            return 0
        with self._lock:
            path, m = self._match(toks)
        b = path[-1][0] if path else None
        if m == len(toks) and b is not None and path[-1][1] == len(b.tokens) and b.last is not None:
            return m
        return min(m, len(toks) - 1)

    @torch.no_grad()
    def prefill(self, tokens: Sequence[int], room: int = 0, *, base: tuple[KVCache, Tensor] | None = None,
                stop: Callable[[], bool] | None = None) -> Prefill:
        """A private cache holding `tokens` with `room` free positions after them, and the logits after the last.

        `base`: a private single-row cache (and its logits) that already holds `tokens[:base.length]` (an AR walk's
        context before a fed run): when the cache shares no longer prefix, the rest is encoded into it in place
        instead of restoring a copy. `stop` is asked before each piece encoded; when it says so, `PrefillCancelled`
        is raised (what was inserted stays valid)."""
        toks = tuple(int(t) for t in tokens)
        n = len(toks)
        if n == 0:
            raise ValueError("prefill needs at least one token")
        if room < 0:
            raise ValueError(f"room must be >= 0, got {room}")
        try:
            return self._prefill(toks, room, base, stop)
        finally:  # what this prefill allocated and freed (restores, activations): see the module docstring
            self._trimmer.maybe()

    def _prefill(self, toks: tuple[int, ...], room: int, base: tuple[KVCache, Tensor] | None,
                 stop: Callable[[], bool] | None) -> Prefill:
        n = len(toks)
        with self._lock:  # restored under the lock: an eviction meanwhile could hand the pages to another block
            self._lookups += 1
            path, m = self._match(toks)
            last_block = path[-1][0] if path else None
            if (m == n and last_block is not None and path[-1][1] == len(last_block.tokens)
                    and last_block.last is not None):
                self._reused += n
                return Prefill(self._restore(path, n, n + room), self.pool.read_logits(last_block.last), n)
            p = min(m, n - 1)
            if base is not None and base[0].length >= p:
                cache, p, cached = base[0], base[0].length, 0
            else:
                cache, cached = self._restore(path, p, n + room), p
        if cache.capacity < n + room:  # a base with too little room (a restored cache has it)
            cache = cache.grown(n + room)
        # Blocks are recorded from the block boundary at or before p, under the block that ends there.
        g = p - p % self.block
        parent: int | None = 0 if g == 0 else None
        for b, used in path:
            if b.end == g and used == len(b.tokens):
                parent = b.id
        if self.budget_bytes == 0:
            parent = None
        last = self._encode_rest(cache, toks, p, g, parent, stop)
        with self._lock:
            self._reused += cached
            self._encoded += n - p
        return Prefill(cache, last, cached)

    # ---- lookup ----------------------------------------------------------------------------------------------
    def _match(self, toks: tuple[int, ...]) -> tuple[list[tuple[_Block, int]], int]:
        """(blocks and how many of each one's positions match, matched length); touches the path. Under the lock."""
        path: list[tuple[_Block, int]] = []
        parent, i, n, B = 0, 0, len(toks), self.block
        while i < n:
            chunk = toks[i : i + B]
            b = self._index.get((parent, chunk))
            if b is not None:
                path.append((b, len(chunk)))
                i += len(chunk)
                if len(chunk) < B:
                    break
                parent = b.id
                continue
            best, best_n = None, 0  # no whole match: the child sharing the longest prefix with the rest
            for cid in self._root_children if parent == 0 else self._blocks[parent].children:
                c = self._blocks[cid]
                k = 0
                for a, t in zip(c.tokens, chunk, strict=False):
                    if a != t:
                        break
                    k += 1
                if k > best_n:
                    best, best_n = c, k
            if best is not None:
                path.append((best, best_n))
                i += best_n
            break
        for b, _ in reversed(path):  # deepest first: an ancestor stays more recent than its descendants
            self._blocks.move_to_end(b.id)
        return path, i

    def _restore(self, path: list[tuple[_Block, int]], p: int, capacity: int) -> KVCache:
        """A new single-row cache of `capacity` holding the first `p` positions of `path`. Under the lock."""
        model = self.model
        cache = model.new_cache(1, max(capacity, 1))
        if p == 0:
            return cache
        window = model.config.sliding_window - 1
        lo_sliding = max(0, p - window)
        # Every block on the path but the last is whole, and blocks start on page boundaries: position x of the
        # context is in page x // page of the path's pages in order.
        pages = [pg for b, _ in path if b.start < p for pg in b.pages]
        for i, lkv in enumerate(cache.layers):
            lo = lo_sliding if lkv.sliding else 0  # sliding slots hold [p - n, p) in order
            lkv.k[0, :, : p - lo] = self.pool.read(pages, i, False, lo, p)
            lkv.v[0, :, : p - lo] = self.pool.read(pages, i, True, lo, p)
        cache.key_valid[:, :p] = True
        cache.length = p
        cache.row_length.fill_(p)
        cache.next_pos = cache.length - cache.pos_offset
        return cache

    # ---- encoding and recording ------------------------------------------------------------------------------
    def _encode_rest(self, cache: KVCache, toks: tuple[int, ...], p: int, g: int, parent: int | None,
                     stop: Callable[[], bool] | None) -> Tensor:
        """Encode toks[p:] into `cache` piece by piece; record blocks from `g` under `parent` (None: record
        nothing). Returns the logits after the last token."""
        n, dev = len(toks), cache.key_valid.device
        pos = p
        out: Tensor | None = None
        while pos < n:
            if stop is not None and stop():
                raise PrefillCancelled
            end = min(n, pos - pos % self.block + self._piece)
            logits, _ = self.model.encode(torch.tensor([toks[pos:end]], device=dev), cache=cache,
                                          logits="last" if end == n else "none")
            if logits is not None:
                out = logits[0, -1]
            pos = end
            if parent is not None:
                parent, g = self._record(cache, toks, g, end, parent, out if end == n else None)
        assert out is not None
        return out

    def _record(self, cache: KVCache, toks: tuple[int, ...], g: int, end: int, parent: int,
                last: Tensor | None) -> tuple[int | None, int]:
        """Insert the blocks of positions [g, end) from `cache` (which holds [0, end)): whole blocks, and the last,
        shorter one when the prefill ends there (`last` given). Returns the parent for what follows (None: it was
        evicted, record no more) and where the next block starts."""
        cache.unroll()
        B = self.block
        window = self.model.config.sliding_window - 1
        P = self.pool.page
        s = g
        with self._lock:
            while s < end and (end - s >= B or last is not None):
                e = min(s + B, end)
                if parent != 0 and parent not in self._blocks:
                    return None, s  # evicted while we encoded: nothing below it can be reached
                key = (parent, toks[s:e])
                b = self._index.get(key)
                if b is None:
                    pages = self._take(-(-(e - s) // P), parent)
                    if pages is None:
                        return None, s  # the budget holds less than this block
                    for i, lkv in enumerate(cache.layers):
                        off = end - min(end, window) if lkv.sliding else 0  # sliding slot j holds position off + j
                        self.pool.write(pages, i, False, lkv.k[0, :, s - off : e - off])
                        self.pool.write(pages, i, True, lkv.v[0, :, s - off : e - off])
                    b = _Block(next(self._ids), parent, s, key[1], pages)
                    self._index[key] = b
                    self._blocks[b.id] = b
                    (self._root_children if parent == 0 else self._blocks[parent].children).add(b.id)
                else:
                    self._blocks.move_to_end(b.id)
                if last is not None and b.end == end and b.last is None:
                    got = self._take(self.pool.logit_pages, b.id)
                    if got is not None:
                        self.pool.write_logits(got, last)
                        b.last = got
                parent, s = b.id, e
        return parent, s

    def _take(self, n: int, keep: int) -> list[int] | None:
        """`n` free pages, evicting least recently used childless blocks (never `keep`, the block about to get a
        child or its logits) until there are; None when even that leaves too few. Under the lock."""
        while self.pool.free_pages < n:
            victim = next((b for b in self._blocks.values() if not b.children and b.id != keep), None)
            if victim is None:
                return None
            del self._blocks[victim.id]
            del self._index[(victim.parent, victim.tokens)]
            (self._root_children if victim.parent == 0 else self._blocks[victim.parent].children).discard(victim.id)
            self.pool.free(victim.pages)
            if victim.last is not None:
                self.pool.free(victim.last)
        return self.pool.take(n)
