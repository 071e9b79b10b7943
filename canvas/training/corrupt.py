"""Training batches for the DiffusionGemma recipe: windows of the token stream, pinned spans, gaps, uniform noise.

One example is a window of the corpus token stream: `P` prefix tokens for the causal encoder, then a canvas of
`L = canvas_length` slots for the denoiser. Three layouts, drawn per example:
- plain: the canvas is the next `L` tokens (a continuation);
- pinned: as plain, with 1..`max_spans` random spans left clean (a user's pins); the rest is to be filled;
- gap: the canvas holds clean left context `[0, a)`, a gap `[a, a+g)` and clean right context `[a+g, L)`. The gap's
  true text has `c <= g` tokens, at least `(1 - max_null_frac) * g`; the `g - c` slots after it hold `<null>` and the
  right context is the text that follows the `c` tokens. This teaches infill between pins and infills somewhat
  shorter than their gap (the editor drops nulls), with the right context where the editor puts it, shifted by the
  unused slots. The cap matters: with infill lengths uniform over the whole gap, nulls became the best-predicted
  slots of every gap and a long-trained model's infills collapsed to all-null (a masked phrase deleted).
Noise follows the recipe: a level `t ~ U(eps, 1)` per example; every unpinned slot is replaced, with probability `t`,
by a token drawn uniformly from the vocabulary (there is no mask token). Pinned slots are never noised and carry no
loss; every other slot (noised or not) is a target, as in the recipe's flat cross-entropy over the canvas.

Determinism: `sample_batch` draws everything from the numpy and torch generators it is given; the trainer seeds
them from `(seed, step)`, so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

LAYOUT_PLAIN, LAYOUT_PINNED, LAYOUT_GAP = 0, 1, 2


@dataclass(frozen=True, slots=True)
class CorruptionConfig:
    canvas_length: int = 256
    min_prefix: int = 1  # a prefix may be as short as one token (the editor's first canvas after <bos>)
    max_prefix: int = 256  # the sliding window: longer prefixes only add full-attention context
    noise_eps: float = 1e-3  # t ~ U(eps, 1): never a fully clean canvas
    p_pinned: float = 0.3  # layout probabilities; plain gets the rest
    p_gap: float = 0.3
    max_spans: int = 3  # pinned layout: 1..max_spans spans ...
    max_span_frac: float = 0.25  # ... each at most this share of the canvas
    max_gap_frac: float = 0.75  # gap layout: the gap is at most this share of the canvas ...
    max_null_frac: float = 0.25  # ... and at most this share of its slots are <null> (the infill fills the rest)
    p_doc_start: float = 0.2  # share of windows aligned to a document start (prefix begins with <bos>)

    def __post_init__(self) -> None:
        if self.canvas_length < 4:
            raise ValueError(f"canvas_length must be >= 4, got {self.canvas_length}")
        if not 1 <= self.min_prefix <= self.max_prefix:
            raise ValueError(f"need 1 <= min_prefix <= max_prefix, got {self.min_prefix}, {self.max_prefix}")
        if not 0.0 < self.noise_eps < 1.0:
            raise ValueError(f"noise_eps must be in (0, 1), got {self.noise_eps}")
        for name in ("p_pinned", "p_gap", "p_doc_start"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.p_pinned + self.p_gap > 1.0:
            raise ValueError("p_pinned + p_gap must be <= 1")
        if self.max_spans < 1 or not 0.0 < self.max_span_frac <= 1.0 or not 0.0 < self.max_gap_frac <= 1.0:
            raise ValueError("max_spans must be >= 1 and the fractions in (0, 1]")
        if not 0.0 <= self.max_null_frac <= 1.0:
            raise ValueError(f"max_null_frac must be in [0, 1], got {self.max_null_frac}")

    @property
    def window(self) -> int:
        """Tokens of the stream one example reads at most (prefix + canvas)."""
        return self.max_prefix + self.canvas_length


@dataclass(frozen=True, slots=True)
class Batch:
    """B examples sharing one prefix length P (so the encoder pass needs no padding)."""

    encoder_ids: Tensor  # (B, P + L) clean stream tokens: the prefix, then the text that follows (AR targets)
    prefix_len: int  # P
    canvas_clean: Tensor  # (B, L) targets: the text, nulls in a gap's unused slots
    canvas_noisy: Tensor  # (B, L) the decoder's input
    pinned: Tensor  # (B, L) bool: clean, given, no loss
    noised: Tensor  # (B, L) bool: replaced by a random token
    noise_level: Tensor  # (B,) t
    layout: Tensor  # (B,) LAYOUT_*

    @property
    def loss_mask(self) -> Tensor:
        return ~self.pinned


def _window_starts(
    rng: np.random.Generator, n_tokens: int, doc_starts: np.ndarray, size: int, batch: int, p_doc_start: float
) -> np.ndarray:
    last = n_tokens - size
    if last < 0:
        raise ValueError(f"token stream of {n_tokens} tokens is shorter than one window of {size}")
    starts = rng.integers(0, last + 1, size=batch)
    aligned = rng.random(batch) < p_doc_start
    usable = doc_starts[doc_starts <= last]
    if usable.size and aligned.any():
        starts[aligned] = rng.choice(usable, size=int(aligned.sum()))
    return starts


def sample_batch(
    tokens: np.ndarray,
    doc_starts: np.ndarray,
    batch_size: int,
    cfg: CorruptionConfig,
    *,
    vocab_size: int,
    null_id: int,
    rng: np.random.Generator,
    gen: torch.Generator,
) -> Batch:
    """Draw one training batch from a flat token stream (see the module docstring for the layouts)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    L = cfg.canvas_length
    P = int(rng.integers(cfg.min_prefix, cfg.max_prefix + 1))
    starts = _window_starts(rng, len(tokens), doc_starts, P + L, batch_size, cfg.p_doc_start)
    stream = np.stack([np.asarray(tokens[s : s + P + L], dtype=np.int64) for s in starts])  # (B, P+L)
    clean = stream[:, P:].copy()  # (B, L)
    pinned = np.zeros((batch_size, L), dtype=bool)
    u = rng.random(batch_size)
    layout = np.where(u < cfg.p_pinned, LAYOUT_PINNED, np.where(u < cfg.p_pinned + cfg.p_gap, LAYOUT_GAP, LAYOUT_PLAIN))
    for b in range(batch_size):
        if layout[b] == LAYOUT_PINNED:
            for _ in range(int(rng.integers(1, cfg.max_spans + 1))):
                length = int(rng.integers(1, max(2, int(cfg.max_span_frac * L)) + 1))
                start = int(rng.integers(0, L - length + 1))
                pinned[b, start : start + length] = True
            if pinned[b].all():  # keep at least one slot to fill
                pinned[b, int(rng.integers(0, L))] = False
        elif layout[b] == LAYOUT_GAP:
            g = int(rng.integers(2, max(3, int(cfg.max_gap_frac * L)) + 1))
            a = int(rng.integers(0, L - g + 1))
            c = g - int(rng.integers(0, int(cfg.max_null_frac * g) + 1))  # true infill length: g minus the nulls
            text = stream[b, P:]
            # Left context, the c-token infill, nulls, then the text that followed the infill (right context).
            right = text[a + c : a + c + (L - a - g)]
            clean[b] = np.concatenate([text[:a], text[a : a + c], np.full(g - c, null_id, dtype=np.int64), right])
            pinned[b, :a] = True
            pinned[b, a + g :] = True
    canvas_clean = torch.from_numpy(clean)
    pinned_t = torch.from_numpy(pinned)
    level = cfg.noise_eps + (1.0 - cfg.noise_eps) * torch.rand(batch_size, generator=gen)  # (B,)
    noised = (torch.rand(batch_size, L, generator=gen) < level[:, None]) & ~pinned_t
    random_tokens = torch.randint(0, vocab_size, (batch_size, L), generator=gen)
    noisy = torch.where(noised, random_tokens, canvas_clean)
    return Batch(
        encoder_ids=torch.from_numpy(stream),
        prefix_len=P,
        canvas_clean=canvas_clean,
        canvas_noisy=noisy,
        pinned=pinned_t,
        noised=noised,
        noise_level=level,
        layout=torch.from_numpy(layout.astype(np.int64)),
    )
