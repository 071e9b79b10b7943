"""The encoder's KV cache: preallocated, written only by `DiffusionModel.encode`, read by `denoise`.

Layout per layer (B = batch, H = KV heads of that layer, D = its head dim):
- full-attention layers keep every encoded position: `k`, `v` of shape (B, H, capacity, D), filled in [0, length);
- sliding layers keep only what a future query can see, the last `sliding_window - 1` positions, in order, in
  buffers of shape (B, H, sliding_window - 1, D) filled in [0, min(length, sliding_window - 1)); "in order" up to
  a rotation (`ring`) that one-token decode steps leave once the window is full, and `unroll` undoes.
`key_valid` (B, capacity) marks real (non-padding) positions; `length` counts encoded positions (padding
included: positions are shared across the batch, as in the reference) and `next_pos` (B,) is where the canvas of
each row starts. A cache built by `KVCache.stack` from several single-row caches is ragged (rows of different
lengths, right-padded) and read-only: the engine batches decoder steps over it, never encodes into it.
A cache built by `KVCache.aligned` batches rows of different lengths the other way, left-padded so that every row
ends at `length`, and stays encodable: `pos_offset` (B,) is each row's padding, which `encode` subtracts from the
shared slot index, so every row's tokens get the RoPE positions they get alone (the engine's batched AR rows).
Rows that `aligned` copies from one source row (the K drafts of one context) are recorded in `shared`
(`SharedRows`): which row leads each group of copies and which slots still hold the copy, so a decode step's
attention reads those slots once per group (`kernels.attend_cpu`). Only the decode step advances it (a ring write
takes a sliding slot out); anything that moves slots (`unroll`, the general `encode` path) drops it.
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


@dataclass
class SharedRows:
    """Copies among an aligned cache's rows: `leader` (B,) long, the first row with the same source (itself when
    alone); slots [0, full) of the full layers and [lo, hi) of the sliding buffers hold the copy in every row."""

    leader: torch.Tensor
    full: int
    lo: int
    hi: int

    def attend_slots(self, sliding: bool) -> tuple[torch.Tensor, int, int]:
        """`kernels.attend_cpu`'s `share` for a layer of this kind."""
        return (self.leader, self.lo, self.hi) if sliding else (self.leader, 0, self.full)


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
        # Per-row left padding (slots before the row's first real token): a token's position is its slot minus this.
        self.pos_offset = torch.zeros_like(next_pos)
        # Where the sliding buffers' oldest position sits while decode steps use them as a ring (see `unroll`).
        self.ring = 0
        self.shared: SharedRows | None = None  # rows that are copies of one source (`aligned`)

    def ring_written(self, slot: int) -> None:
        """A decode step overwrote sliding slot `slot` of every row (the ring's oldest): it is no longer a copy.
        The ring walks up from slot 0 of an unrolled cache, so the copied slots stay one range."""
        sh = self.shared
        if sh is not None and sh.lo <= slot < sh.hi:
            sh.lo = slot + 1

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

    def unroll(self) -> None:
        """Put the sliding buffers back in order. Once the window is full, `DiffusionModel.encode`'s one-token steps
        overwrite the oldest slot instead of shifting the whole window (attention does not care where a key sits):
        slot (ring + j) % size then holds the j-th oldest position. Everything else that reads or writes the
        buffers (`read`, `grown`, `aligned`, a longer `encode`) calls this first, so it sees them in order."""
        if not self.ring:
            return
        self.shared = None  # the slots move
        for lk in self.layers:
            if lk.sliding:
                lk.k.copy_(torch.roll(lk.k, -self.ring, dims=2))
                lk.v.copy_(torch.roll(lk.v, -self.ring, dims=2))
        self.ring = 0

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached keys and values of one layer: (B, H, S, D) each."""
        self.unroll()
        kv = self.layers[layer]
        n = (self._sliding_width if self.ragged else self.sliding_len()) if kv.sliding else self.length
        return kv.k[:, :, :n], kv.v[:, :, :n]

    def grown(self, capacity: int) -> KVCache:
        """A copy holding the same positions with room for `capacity` in all (for a private cache to encode into)."""
        if self.ragged:
            raise ValueError("a ragged (stacked) cache cannot grow; it is read-only")
        if capacity < self.length:
            raise ValueError(f"capacity {capacity} is below the {self.length} positions already cached")
        self.unroll()
        ref = self.layers[0].k
        out = KVCache.empty(self.config, self.batch_size, capacity, device=ref.device, dtype=ref.dtype)
        for src, dst in zip(self.layers, out.layers, strict=True):
            n = src.k.shape[2]  # sliding buffers hold at most window - 1 positions in both
            dst.k[:, :, :n], dst.v[:, :, :n] = src.k, src.v
        out.key_valid[:, : self.length] = self.key_valid[:, : self.length]
        out.length, out.next_pos = self.length, self.next_pos.clone()
        out.row_length.fill_(self.length)
        out.pos_offset = self.pos_offset.clone()
        return out

    @classmethod
    def aligned(cls, rows: Sequence[tuple[KVCache, int]], room: int) -> KVCache:
        """Batch rows taken from caches (`(cache, row index)`, the same row may come several times) into one
        encodable cache, left-padded so every row ends at the longest row's real length, with `room` free positions
        after it. Each row keeps its real tokens' positions (`pos_offset`), so encoding into it gives each row what
        encoding into its own cache does. A row's real length is its cache's `length - pos_offset[row]`."""
        if not rows:
            raise ValueError("aligned needs at least one row")
        if room < 0:
            raise ValueError(f"room must be >= 0, got {room}")
        for c, b in rows:
            if c.ragged or not 0 <= b < c.batch_size:
                raise ValueError("aligned takes rows of non-ragged caches")
            c.unroll()
        ref = rows[0][0]
        real = [c.length - int(c.pos_offset[b]) for c, b in rows]
        length = max(real)
        device, dtype = ref.key_valid.device, ref.layers[0].k.dtype
        out = KVCache.empty(ref.config, len(rows), max(length + room, 1), device=device, dtype=dtype)
        n_dst = min(length, ref.config.sliding_window - 1)
        for j, ((c, b), r) in enumerate(zip(rows, real, strict=True)):
            for src, dst in zip(c.layers, out.layers, strict=True):
                if src.sliding:  # both buffers hold their last slots in order, ending at their length
                    n_src = min(c.length, ref.config.sliding_window - 1)
                    m = min(r, n_src)
                    dst.k[j, :, n_dst - m : n_dst] = src.k[b, :, n_src - m : n_src]
                    dst.v[j, :, n_dst - m : n_dst] = src.v[b, :, n_src - m : n_src]
                else:
                    dst.k[j, :, length - r : length] = src.k[b, :, c.length - r : c.length]
                    dst.v[j, :, length - r : length] = src.v[b, :, c.length - r : c.length]
            out.key_valid[j, length - r : length] = c.key_valid[b, c.length - r : c.length]
            out.pos_offset[j] = length - r
        out.length = length
        out.row_length.fill_(length)
        out.next_pos = length - out.pos_offset
        first: dict[tuple[int, int], int] = {}
        leader = [first.setdefault((id(c), b), j) for j, (c, b) in enumerate(rows)]
        if len(first) < len(rows):
            out.shared = SharedRows(torch.tensor(leader, device=device), length, 0, n_dst)
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
