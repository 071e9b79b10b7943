"""Sliding-window attention of a long causal pass, computed block by block over the band it can see.

Owns `Band` (what `DiffusionModel.encode` hands a sliding layer's attention instead of a (B, 1, T, S) mask when a
pass is long enough to gain: `band_for`) and `band_attend`. Why: a prefill piece of T tokens after the cache's
window tail of n keys attends over n + T keys with a dense mask, although each query sees at most `window` of them;
SDPA's CPU kernel skips no masked block, so a 448-token piece after a full window (n = 511) computes 959 scores a
query for the 512 it keeps. Cut into blocks of `block` queries, each block reads only the `window - 1 + block` keys
its queries can see, so the scores computed per query fall to `window - 1 + block` (575 at block 64: 0.6x).

How: the keys are left-padded to `window - 1` before the pass's first key (`pad`: a cache whose window is not yet
full), so block j's keys are the slice [j * block, j * block + window - 1 + block) of the padded keys and every
block sees the same band: query i of a block sees slot r of its slice iff i <= r <= i + window - 1 (r = i + window
- 1 is the query itself). The slices are strided views of one tensor, gathered once per layer; the band is ANDed
with each slot's validity (padding of the cache or of the batch), and a query may always see itself, as
`DiffusionModel._causal_mask` allows, so no row is all-masked. Every query then attends over exactly the keys the
dense mask allows (the values agree within float summation order; tests/canvas/model/test_band.py).

Legend: B batch, H query heads, G KV heads, T queries in the pass, n cached keys before them (n <= window - 1),
D head dim, b block, nb = ceil(T / b) blocks, K = window - 1 + b keys a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# Queries a block. Smaller blocks waste fewer scores (K / T per query) but run more, smaller SDPA problems; 64 was
# the best of 32, 64 and 128 for the converted Gemma-3-270M's window of 512 (BENCHMARKS.md, issue 52).
BAND_BLOCK = 64


@dataclass(frozen=True, slots=True)
class Band:
    """A sliding layer's attention for one encode pass, computed by blocks: `valid` (B, window - 1 + T) bool marks
    the padded keys that are real (the `pad` slots before the cache's first kept key are not); `window` counts the
    query itself, as `ModelConfig.sliding_window` does."""

    valid: Tensor
    pad: int
    window: int
    block: int = BAND_BLOCK


def band_for(T: int, n_tail: int, window: int, key_valid: Tensor, block: int = BAND_BLOCK) -> Band | None:
    """The `Band` of a pass of T queries after `n_tail` cached keys (key_valid (B, n_tail + T): the keys' validity
    in order), or None when the dense mask computes no more scores than the blocks would (a short pass)."""
    if T < 2 * block or n_tail + T <= window - 1 + block:
        return None
    pad = window - 1 - n_tail
    if pad < 0:
        raise ValueError(f"a sliding layer keeps at most window - 1 = {window - 1} keys, got {n_tail}")
    valid = F.pad(key_valid, (pad, 0), value=False)
    return Band(valid, pad, window, block)


def band_attend(q: Tensor, k: Tensor, v: Tensor, band: Band) -> Tensor:
    """q (B, H, T, D), k / v (B, G, n + T, D) in position order (`band.pad` = window - 1 - n) -> (B, H, T, D),
    scale 1: each query over the keys inside its window (causal), as the dense masked SDPA computes it."""
    B, H, T, D = q.shape
    G = k.shape[1]
    b, W1 = band.block, band.window - 1
    nb = -(-T // b)
    extra = nb * b - T  # queries padding the last block (and as many keys after the last real one: never seen)
    K = W1 + b
    kp = F.pad(k, (0, 0, band.pad, extra))  # (B, G, W1 + nb*b, D)
    vp = F.pad(v, (0, 0, band.pad, extra))

    def blocks(x: Tensor) -> Tensor:  # (B, G, W1 + nb*b, D) -> (B*nb, G, K, D): block j's slice
        s = x.stride()
        return x.as_strided((B, nb, G, K, D), (s[0], b * s[2], s[1], s[2], s[3])).reshape(B * nb, G, K, D)

    valid = F.pad(band.valid, (0, extra), value=False)  # (B, W1 + nb*b)
    vw = valid.as_strided((B, nb, K), (valid.stride(0), b * valid.stride(1), valid.stride(1)))  # (B, nb, K)
    i = torch.arange(b, device=q.device)[:, None]
    r = torch.arange(K, device=q.device)[None, :]
    inside = (r >= i) & (r <= i + W1)  # (b, K): the band, the same in every block
    allowed = (inside & vw[:, :, None, :]) | (r == i + W1)  # (B, nb, b, K): a query always sees itself
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    qb = F.pad(q, (0, 0, 0, extra)).view(B, H, nb, b, D).transpose(1, 2).reshape(B * nb, H, b, D)
    out = F.scaled_dot_product_attention(qb, blocks(kp), blocks(vp), attn_mask=bias.view(B * nb, 1, b, K),
                                         scale=1.0, enable_gqa=G != H)  # (B*nb, H, b, D)
    return out.view(B, nb, H, b, D).transpose(1, 2).reshape(B, H, nb * b, D)[:, :, :T]
