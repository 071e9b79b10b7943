"""A fixed arena of pages for the context cache's keys, values and logits (`canvas.engine.prefix_cache`).

Owns `PagePool`: one tensor of `pages` rows, allocated once (on first use) and never freed, each row holding
`page` consecutive positions of every layer's keys and values; a block of the prefix cache takes as many pages as
it has positions (a short leaf block takes one page, not a whole block's room), and its next-token logits take
`logit_pages` more. Why: the cache used to hold each block in ~40 small tensors of its own, freed on eviction and
allocated again in other sizes by other threads; glibc kept the freed memory in per-thread arenas, fragmented, and
a replica's RSS went on growing for minutes after its cache was full (issue 47). Here the cache's memory is the
arena: RSS grows as pages are first written, up to `pages * page_bytes`, then stays; freed pages are reused last
in, first out, so the written set stays as small as the cache's fill.

Invariants: a page is either free or owned by exactly one caller until `free`; the stored bytes the cache reports
are `used * page_bytes` (byte-exact for what it holds, a page's unused tail included). Not locked: the owner
(`PrefixCache`) calls it under its own lock, including `gather` (a page freed and reused while a copy reads it would
give another block's values).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def page_positions(block: int, most: int = 8) -> int:
    """Positions a page holds for blocks of `block` positions: the largest divisor of `block` up to `most` (so a
    whole block fills its pages exactly, and a leaf wastes less than a page)."""
    return next(p for p in range(min(block, most), 0, -1) if block % p == 0)


class PagePool:
    """As many pages of `page` positions as `budget_bytes` holds, for layers of (kv heads, head dim) `shapes`, and
    logits of `vocab` values."""

    def __init__(self, shapes: Sequence[tuple[int, int]], vocab: int, page: int, budget_bytes: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if page < 1 or budget_bytes < 0 or not shapes:
            raise ValueError(f"a pool needs layers, page >= 1 and budget_bytes >= 0, got {len(shapes)} layers, "
                             f"page={page}, budget_bytes={budget_bytes}")
        self.shapes, self.page = list(shapes), page
        self.dtype, self.device = dtype, torch.device(device)
        # Columns of a page row: per layer its keys (H, page, D) then its values.
        self._offsets: list[int] = []
        width = 0
        for h, d in self.shapes:
            self._offsets.append(width)
            width += 2 * h * page * d
        self.width = width
        self.vocab = vocab
        self.page_bytes = width * torch.empty((), dtype=dtype).element_size()
        # Logits are kept in float32 whatever the cache's dtype (an exact repeat returns them as computed), in the
        # pages' bytes.
        self.logit_pages = -(-vocab * 4 // self.page_bytes)
        self.pages = pages = budget_bytes // self.page_bytes
        self._arena: Tensor | None = None  # allocated on first `take`: a cache that stores nothing costs nothing
        self._free = list(range(pages - 1, -1, -1))  # a stack: the most recently freed page is reused first
        self.used = 0

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """`n` free pages, or None when fewer are free."""
        if n > len(self._free):
            return None
        if self._arena is None:
            self._arena = torch.empty((self.pages, self.width), dtype=self.dtype, device=self.device)
        out = [self._free.pop() for _ in range(n)]
        self.used += n
        return out

    def reset(self) -> None:
        """Every page free (the arena stays)."""
        self._free = list(range(self.pages - 1, -1, -1))
        self.used = 0

    def free(self, pages: Sequence[int]) -> None:
        self._free.extend(reversed(pages))
        self.used -= len(pages)

    def _layer(self, layer: int, values: bool) -> Tensor:
        """(pages, H, page, D) view of one layer's keys or values."""
        assert self._arena is not None
        h, d = self.shapes[layer]
        o = self._offsets[layer] + (h * self.page * d if values else 0)
        return self._arena[:, o : o + h * self.page * d].unflatten(1, (h, self.page, d))

    # ---- keys and values -------------------------------------------------------------------------------------
    def write(self, pages: Sequence[int], layer: int, values: bool, src: Tensor) -> None:
        """Store `src` (H, n, D), n <= len(pages) * page, in `pages` in order."""
        dst, P = self._layer(layer, values), self.page
        n = src.shape[1]
        full, rem = divmod(n, P)
        if full:
            idx = torch.tensor(pages[:full], dtype=torch.long, device=self.device)
            dst[idx] = src[:, : full * P].unflatten(1, (full, P)).transpose(0, 1)
        if rem:
            dst[pages[full], :, :rem] = src[:, full * P :]

    def read(self, pages: Sequence[int], layer: int, values: bool, lo: int, hi: int) -> Tensor:
        """Positions [lo, hi) of what `pages` hold in order (page j holds [j * page, (j + 1) * page)): (H, n, D)."""
        P = self.page
        first, last = lo // P, (hi - 1) // P
        idx = torch.tensor(pages[first : last + 1], dtype=torch.long, device=self.device)
        got = self._layer(layer, values).index_select(0, idx)  # (m, H, P, D)
        seq = got.transpose(0, 1).flatten(1, 2)  # (H, m * P, D)
        return seq[:, lo - first * P : hi - first * P]

    # ---- logits ----------------------------------------------------------------------------------------------
    def _bytes(self) -> Tensor:
        assert self._arena is not None
        return self._arena.view(torch.uint8)  # (pages, page_bytes)

    def write_logits(self, pages: Sequence[int], logits: Tensor) -> None:
        """Store (vocab,) logits in `logit_pages` pages."""
        assert len(pages) == self.logit_pages
        flat = logits.reshape(-1).to(torch.float32).contiguous().view(torch.uint8)
        rows, per = self._bytes(), self.page_bytes
        for j, pg in enumerate(pages):
            part = flat[j * per : (j + 1) * per]
            rows[pg, : part.numel()] = part

    def read_logits(self, pages: Sequence[int]) -> Tensor:
        """A new (vocab,) float32 tensor."""
        idx = torch.tensor(list(pages), dtype=torch.long, device=self.device)
        return self._bytes().index_select(0, idx).reshape(-1)[: self.vocab * 4].view(torch.float32)
