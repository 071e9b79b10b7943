"""Gap canvases for the decoder: text before the gap in the encoder's cache, a gap of 1-64 noised slots, text after
it pinned, and the FIM prompt whose teacher-forced pass gives the FIM model's distribution over the same middle.

One example is a window of the token stream: `P` prefix tokens (the encoder's), then the canvas of `L` slots:
`a` pinned slots of the text that follows the prefix (`min_left..max_left`, as the server pins the end of the
prompt), the gap of `g` slots, and pinned slots of the text after the middle up to `L`. The gap holds the human
middle (`c` tokens, `ceil(min_fill * g) <= c <= g`) and then `g - c` `<null>` slots (DreamOn-style length: a fill
shorter than its gap leaves nulls after it, where the engine's `gap_min_fill` allows them). With word edges given,
the gap starts at a word start and the middle ends before one (the editor's gaps sit at word boundaries), where
such a spot lies within the drawn sizes.

Noise is the design's: each gap slot is replaced, with probability `t`, by a uniform random vocabulary token; at
least one slot of each gap is noised (the loss is taken on the noised slots). Curriculum (`progress` in [0, 1],
the trainer's step over `curriculum_steps`): the largest gap grows from `start_max_gap` to `max_gap` and the
highest noise level from `start_max_noise` to 1, so the first steps see small, lightly noised gaps.

Teacher input: per example the PSM prompt `<bos> <|fim_prefix|> left <|fim_suffix|> right <|fim_middle|> middle`,
right-padded (a causal pass never reads padding after a position); `teacher_pos[b, j]` is the position whose next-
token distribution is the teacher's for middle token j (-1 past the middle). Everything is drawn from the numpy
and torch generators given, so a batch is a function of (seed, step).

Legend: B batch, P prefix, L canvas, G largest gap in the batch, F teacher prompt length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from canvas.convert.fim import FimTokens


@dataclass(frozen=True, slots=True)
class GapDataConfig:
    canvas_length: int = 96  # L: the server's infill window cut to the slots a gap needs (the engine cuts the rest)
    min_prefix: int = 16
    max_prefix: int = 160
    min_left: int = 1  # pinned slots before the gap (>= 1: a shifted head predicts the gap's first slot from one)
    max_left: int = 16
    min_right: int = 8  # pinned slots after the gap at least
    min_gap: int = 1
    max_gap: int = 64
    start_max_gap: int = 8  # curriculum: the largest gap at progress 0
    min_fill: float = 0.5  # the middle fills at least this share of its gap; the rest of the gap is <null>
    noise_eps: float = 0.05  # t ~ U(eps, t_max)
    start_max_noise: float = 0.5  # curriculum: t_max at progress 0 (1.0 at progress 1)
    p_doc_start: float = 0.1  # share of windows starting at a document (prefix begins with <bos>)

    def __post_init__(self) -> None:
        if not 1 <= self.min_prefix <= self.max_prefix:
            raise ValueError(f"need 1 <= min_prefix <= max_prefix, got {self.min_prefix}, {self.max_prefix}")
        if not 0 <= self.min_left <= self.max_left or self.min_right < 1:
            raise ValueError("need 0 <= min_left <= max_left and min_right >= 1")
        if not 1 <= self.min_gap <= self.start_max_gap <= self.max_gap:
            raise ValueError(f"need 1 <= min_gap <= start_max_gap <= max_gap, got {self.min_gap}, "
                             f"{self.start_max_gap}, {self.max_gap}")
        if self.canvas_length < self.max_left + self.max_gap + self.min_right:
            raise ValueError(f"canvas_length {self.canvas_length} < max_left + max_gap + min_right "
                             f"({self.max_left + self.max_gap + self.min_right})")
        if not 0.0 < self.min_fill <= 1.0:
            raise ValueError(f"min_fill must be in (0, 1], got {self.min_fill}")
        if not 0.0 < self.noise_eps <= self.start_max_noise <= 1.0:
            raise ValueError("need 0 < noise_eps <= start_max_noise <= 1")
        if not 0.0 <= self.p_doc_start <= 1.0:
            raise ValueError(f"p_doc_start must be in [0, 1], got {self.p_doc_start}")

    @property
    def window(self) -> int:
        """Stream tokens one example reads at most: prefix, canvas, and the nulls' worth of text past it."""
        return self.max_prefix + self.canvas_length + self.max_gap

    def max_gap_at(self, progress: float) -> int:
        p = min(1.0, max(0.0, progress))
        return max(self.min_gap, round(self.start_max_gap + p * (self.max_gap - self.start_max_gap)))

    def max_noise_at(self, progress: float) -> float:
        p = min(1.0, max(0.0, progress))
        return self.start_max_noise + p * (1.0 - self.start_max_noise)


@dataclass(frozen=True, slots=True)
class GapBatch:
    encoder_ids: Tensor  # (B, P) the prefix: the encoder's input
    canvas_clean: Tensor  # (B, L) targets: left text, middle, nulls, right text
    canvas_noisy: Tensor  # (B, L) the decoder's input
    noised: Tensor  # (B, L) bool: the slots replaced by noise (all in gaps), where the loss is taken
    middle: Tensor  # (B, L) bool: the gap's human-middle slots (the rest of a gap is <null>)
    gap_start: Tensor  # (B,) a
    gap_len: Tensor  # (B,) g
    fill_len: Tensor  # (B,) c
    noise_level: Tensor  # (B,) t
    teacher_ids: Tensor  # (B, F) FIM prompts + middles, right-padded
    teacher_pos: Tensor  # (B, G) where the teacher predicts middle token j, -1 past the middle

    @property
    def prefix_len(self) -> int:
        return int(self.encoder_ids.shape[1])

    def to(self, device: torch.device) -> GapBatch:
        return GapBatch(**{k: getattr(self, k).to(device) for k in self.__dataclass_fields__})


def _snap(candidates: np.ndarray, ok: np.ndarray) -> int:
    """The first candidate index whose `ok` holds, else the first candidate."""
    hit = np.flatnonzero(ok)
    return int(candidates[hit[0]]) if hit.size else int(candidates[0])


def sample_gap_batch(
    tokens: np.ndarray,
    doc_starts: np.ndarray,
    batch_size: int,
    cfg: GapDataConfig,
    *,
    vocab_size: int,
    null_id: int,
    fim: FimTokens,
    rng: np.random.Generator,
    gen: torch.Generator,
    progress: float = 1.0,
    gap_len: int | None = None,
    starts_word: np.ndarray | None = None,
) -> GapBatch:
    """One batch (see the module docstring); `gap_len` fixes every gap's size (the evaluation's buckets)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if gap_len is not None and not 1 <= gap_len <= cfg.max_gap:
        raise ValueError(f"gap_len must be in [1, {cfg.max_gap}], got {gap_len}")
    L = cfg.canvas_length
    P = int(rng.integers(cfg.min_prefix, cfg.max_prefix + 1))
    size = P + L + cfg.max_gap
    last = len(tokens) - size
    if last < 0:
        raise ValueError(f"token stream of {len(tokens)} tokens is shorter than one window of {size}")
    starts = rng.integers(0, last + 1, size=batch_size)
    aligned = rng.random(batch_size) < cfg.p_doc_start
    usable = doc_starts[doc_starts <= last]
    if usable.size and aligned.any():
        starts[aligned] = rng.choice(usable, size=int(aligned.sum()))
    hi_gap = cfg.max_gap if gap_len is not None else cfg.max_gap_at(progress)
    t_max = cfg.max_noise_at(progress) if gap_len is None else 1.0

    prefixes, clean = np.empty((batch_size, P), np.int64), np.empty((batch_size, L), np.int64)
    middle = np.zeros((batch_size, L), bool)
    a_s, g_s, c_s = (np.empty(batch_size, np.int64) for _ in range(3))
    teacher: list[list[int]] = []
    for b in range(batch_size):
        stream = np.asarray(tokens[starts[b] : starts[b] + size], dtype=np.int64)
        g = gap_len if gap_len is not None else int(rng.integers(cfg.min_gap, hi_gap + 1))
        left_hi = min(cfg.max_left, L - g - cfg.min_right)
        a = int(rng.integers(cfg.min_left, left_hi + 1))
        c = int(rng.integers(max(1, math.ceil(cfg.min_fill * g)), g + 1))
        if starts_word is not None:  # gap at a word start, middle ending before one, within the drawn sizes
            cands = np.arange(a, cfg.min_left - 1, -1)
            a = _snap(cands, starts_word[stream[P + cands]])
            lens = np.arange(c, max(1, math.ceil(cfg.min_fill * g)) - 1, -1)
            c = _snap(lens, starts_word[stream[P + a + lens]])
        text = stream[P:]
        right = text[a + c : a + c + (L - a - g)]
        clean[b] = np.concatenate([text[:a], text[a : a + c], np.full(g - c, null_id, np.int64), right])
        prefixes[b] = stream[:P]
        middle[b, a : a + c] = True
        a_s[b], g_s[b], c_s[b] = a, g, c
        left = [int(x) for x in stream[: P + a]]
        if left and left[0] == fim.bos:
            left = left[1:]
        prompt = [fim.bos, fim.prefix, *left, fim.suffix, *(int(x) for x in right), fim.middle]
        teacher.append(prompt + [int(x) for x in text[a : a + c]])

    G = int(g_s.max())
    F_len = max(len(t) for t in teacher)
    teacher_ids = torch.full((batch_size, F_len), fim.pad, dtype=torch.long)
    teacher_pos = torch.full((batch_size, G), -1, dtype=torch.long)
    for b, ids in enumerate(teacher):
        teacher_ids[b, : len(ids)] = torch.tensor(ids)
        mid = len(ids) - int(c_s[b]) - 1  # the <|fim_middle|> position predicts middle token 0
        teacher_pos[b, : c_s[b]] = torch.arange(mid, mid + int(c_s[b]))

    canvas_clean = torch.from_numpy(clean)
    slots = torch.arange(L)[None, :]
    a_t, g_t = torch.from_numpy(a_s), torch.from_numpy(g_s)
    in_gap = (slots >= a_t[:, None]) & (slots < (a_t + g_t)[:, None])  # (B, L)
    level = cfg.noise_eps + (t_max - cfg.noise_eps) * torch.rand(batch_size, generator=gen)  # (B,)
    noised = (torch.rand(batch_size, L, generator=gen) < level[:, None]) & in_gap
    forced = a_t + (torch.rand(batch_size, generator=gen) * g_t).long()  # one gap slot always noised
    noised[torch.arange(batch_size), forced] = True
    noisy = torch.where(noised, torch.randint(0, vocab_size, (batch_size, L), generator=gen), canvas_clean)
    return GapBatch(
        encoder_ids=torch.from_numpy(prefixes), canvas_clean=canvas_clean, canvas_noisy=noisy, noised=noised,
        middle=torch.from_numpy(middle), gap_start=a_t, gap_len=g_t, fill_len=torch.from_numpy(c_s),
        noise_level=level, teacher_ids=teacher_ids, teacher_pos=teacher_pos,
    )  # fmt: skip
