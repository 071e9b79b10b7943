"""The encoder's KV cache: preallocated, written only by `DiffusionModel.encode`, read by `denoise`.

Layout per layer (B = batch, H = KV heads of that layer, D = its head dim):
- full-attention layers keep every encoded position: `k`, `v` of shape (B, H, capacity, D), filled in [0, length);
- sliding layers keep only what a future query can see, the last `sliding_window - 1` positions, in order, in
  buffers of shape (B, H, sliding_window - 1, D) filled in [0, min(length, sliding_window - 1)).
`key_valid` (B, capacity) marks real (non-padding) positions; `length` counts encoded positions (padding
included: positions are shared across the batch, as in the reference) and `next_pos` (B,) is where the canvas of
each row starts. A cache built by `KVCache.stack` from several single-row caches is ragged (rows of different
lengths, right-padded) and read-only: the engine batches decoder steps over it, never encodes into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from canvas.model.config import ModelConfig


@dataclass
class LayerKV:
    k: torch.Tensor  # (B, H, C, D)
    v: torch.Tensor  # (B, H, C, D)
    sliding: bool


class KVCache:
    """Static KV cache for one batch of prefixes. Create with `KVCache.empty`, fill with `model.encode`."""

    def __init__(self, config: ModelConfig, layers: list[LayerKV], key_valid: torch.Tensor, length: int,
                 next_pos: torch.Tensor, ragged: bool = False) -> None:
        self.config = config
        self.layers = layers
        self.key_valid = key_valid  # (B, capacity) bool
        self.length = length
        self.next_pos = next_pos  # (B,) long
        self.ragged = ragged
        # Per-row lengths (in cached positions); equal to `length` except in a ragged cache.
        self.row_length = torch.full_like(next_pos, length)

    @classmethod
    def empty(cls, config: ModelConfig, batch_size: int, capacity: int, *, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> KVCache:
        if capacity <= 0:
            raise ValueError(f"cache capacity must be > 0, got {capacity}")
        layers = []
        for i in range(config.num_hidden_layers):
            sliding = config.is_sliding(i)
            n = min(capacity, config.sliding_window - 1) if sliding else capacity
            shape = (batch_size, config.layer_kv_heads(i), n, config.layer_head_dim(i))
            layers.append(LayerKV(torch.zeros(shape, device=device, dtype=dtype),
                                  torch.zeros(shape, device=device, dtype=dtype), sliding))
        key_valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        return cls(config, layers, key_valid, 0, next_pos)

    @property
    def batch_size(self) -> int:
        return int(self.key_valid.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.key_valid.shape[1])

    def sliding_len(self) -> int:
        return min(self.length, self.config.sliding_window - 1)

    def valid_for(self, layer: int) -> torch.Tensor:
        """Key-padding mask of the cached positions layer `layer` attends to: (B, S)."""
        if self.layers[layer].sliding:
            if self.ragged:
                return self._sliding_valid
            n = self.sliding_len()
            return self.key_valid[:, self.length - n : self.length]
        return self.key_valid[:, : self.length]

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached keys and values of one layer: (B, H, S, D) each."""
        kv = self.layers[layer]
        n = (self._sliding_width if self.ragged else self.sliding_len()) if kv.sliding else self.length
        return kv.k[:, :, :n], kv.v[:, :, :n]

    def grown(self, capacity: int) -> KVCache:
        """A copy holding the same positions with room for `capacity` in all (for a private cache to encode into)."""
        if self.ragged:
            raise ValueError("a ragged (stacked) cache cannot grow; it is read-only")
        if capacity < self.length:
            raise ValueError(f"capacity {capacity} is below the {self.length} positions already cached")
        ref = self.layers[0].k
        out = KVCache.empty(self.config, self.batch_size, capacity, device=ref.device, dtype=ref.dtype)
        for src, dst in zip(self.layers, out.layers, strict=True):
            n = src.k.shape[2]  # sliding buffers hold at most window - 1 positions in both
            dst.k[:, :, :n], dst.v[:, :, :n] = src.k, src.v
        out.key_valid[:, : self.length] = self.key_valid[:, : self.length]
        out.length, out.next_pos = self.length, self.next_pos.clone()
        out.row_length.fill_(self.length)
        return out

    @classmethod
    def stack(cls, caches: Sequence[KVCache]) -> KVCache:
        """Batch single-row caches of different lengths into one read-only, right-padded cache."""
        if not caches:
            raise ValueError("stack needs at least one cache")
        for c in caches:
            if c.batch_size != 1 or c.ragged:
                raise ValueError("stack takes single-row, non-ragged caches")
        cfg = caches[0].config
        length = max(c.length for c in caches)
        width = max(c.sliding_len() for c in caches)
        B = len(caches)
        ref = caches[0]
        device, dtype = ref.key_valid.device, ref.layers[0].k.dtype
        layers = []
        for i, lk in enumerate(ref.layers):
            n = width if lk.sliding else length
            shape = (B, lk.k.shape[1], max(n, 1), lk.k.shape[3])
            k = torch.zeros(shape, device=device, dtype=dtype)
            v = torch.zeros(shape, device=device, dtype=dtype)
            for b, c in enumerate(caches):
                ck, cv = c.read(i)
                k[b, :, : ck.shape[2]] = ck[0]
                v[b, :, : cv.shape[2]] = cv[0]
            layers.append(LayerKV(k, v, lk.sliding))
        key_valid = torch.zeros(B, max(length, 1), dtype=torch.bool, device=device)
        sliding_valid = torch.zeros(B, max(width, 1), dtype=torch.bool, device=device)
        for b, c in enumerate(caches):
            key_valid[b, : c.length] = c.key_valid[0, : c.length]
            n = c.sliding_len()
            sliding_valid[b, :n] = c.key_valid[0, c.length - n : c.length]
        next_pos = torch.cat([c.next_pos for c in caches])
        out = cls(cfg, layers, key_valid, length, next_pos, ragged=True)
        out.row_length = torch.tensor([c.length for c in caches], device=device)
        out._sliding_valid = sliding_valid[:, :width]
        out._sliding_width = width
        return out

    _sliding_valid: torch.Tensor
    _sliding_width: int
