from __future__ import annotations

import numpy as np
import pytest
import torch

from canvas.training.corrupt import LAYOUT_GAP, LAYOUT_PINNED, LAYOUT_PLAIN, CorruptionConfig, sample_batch

V, NULL = 6000, 3
STREAM = np.arange(10, 10 + 5000, dtype=np.int64)  # token = position + 10: windows are recoverable
DOCS = np.arange(0, 5000, 250, dtype=np.int64)


def _batch(cfg: CorruptionConfig, seed: int = 0, batch_size: int = 64):  # -> Batch
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    return sample_batch(STREAM, DOCS, batch_size, cfg, vocab_size=V, null_id=NULL, rng=rng, gen=gen)


def test_same_seed_same_batch_other_seed_other_batch() -> None:
    cfg = CorruptionConfig(canvas_length=32, max_prefix=16)
    a, b, c = _batch(cfg, 1), _batch(cfg, 1), _batch(cfg, 2)
    assert torch.equal(a.canvas_noisy, b.canvas_noisy) and torch.equal(a.pinned, b.pinned)
    assert a.prefix_len == b.prefix_len
    assert not torch.equal(a.canvas_noisy, c.canvas_noisy)


def test_shapes_and_plain_layout_is_a_continuation() -> None:
    cfg = CorruptionConfig(canvas_length=32, max_prefix=16, p_pinned=0.0, p_gap=0.0)
    batch = _batch(cfg)
    P = batch.prefix_len
    assert batch.encoder_ids.shape == (64, P + 32) and batch.canvas_clean.shape == (64, 32)
    assert (batch.layout == LAYOUT_PLAIN).all() and not batch.pinned.any()
    assert torch.equal(batch.canvas_clean, batch.encoder_ids[:, P:])
    # Noise: exactly the noised slots may differ from the clean canvas.
    changed = batch.canvas_noisy != batch.canvas_clean
    assert not (changed & ~batch.noised).any()


def test_noise_rate_follows_the_level() -> None:
    cfg = CorruptionConfig(canvas_length=256, max_prefix=8, p_pinned=0.0, p_gap=0.0)
    batch = _batch(cfg, batch_size=256)
    rate = batch.noised.float().mean(1)
    assert torch.allclose(rate, batch.noise_level, atol=0.12)
    assert (batch.noise_level >= cfg.noise_eps).all() and (batch.noise_level <= 1).all()


def test_pinned_slots_are_never_noised() -> None:
    cfg = CorruptionConfig(canvas_length=64, max_prefix=16, p_pinned=0.5, p_gap=0.5)
    batch = _batch(cfg, batch_size=128)
    assert not (batch.noised & batch.pinned).any()
    assert torch.equal(batch.canvas_noisy[batch.pinned], batch.canvas_clean[batch.pinned])
    assert (batch.loss_mask == ~batch.pinned).all()
    pinned_rows = batch.layout == LAYOUT_PINNED
    assert pinned_rows.any() and batch.pinned[pinned_rows].any(1).all() and (~batch.pinned[pinned_rows]).any(1).all()


def test_gap_layout_infill_then_nulls_then_right_context() -> None:
    L = 48
    cfg = CorruptionConfig(canvas_length=L, max_prefix=16, p_pinned=0.0, p_gap=1.0)
    batch = _batch(cfg, batch_size=64)
    assert (batch.layout == LAYOUT_GAP).all()
    P = batch.prefix_len
    nulls = []
    for b in range(64):
        free = (~batch.pinned[b]).nonzero().squeeze(1)
        a, g = int(free[0]), len(free)
        assert torch.equal(free, torch.arange(a, a + g))  # one contiguous gap
        text = batch.encoder_ids[b, P:]
        row = batch.canvas_clean[b]
        n_null = int((row == NULL).sum())
        c = g - n_null
        assert n_null <= int(cfg.max_null_frac * g)  # the infill fills most of its gap
        nulls.append(n_null)
        assert torch.equal(row[:a], text[:a])
        assert torch.equal(row[a : a + c], text[a : a + c])
        assert (row[a + c : a + g] == NULL).all()
        # The right context is the text that followed the infill, shifted right by the unused slots.
        assert torch.equal(row[a + g :], text[a + c : a + c + (L - a - g)])
    assert min(nulls) == 0 and max(nulls) > 0  # some infills fill the whole gap, some leave slots unused
    # With the cap at 1, an infill may be empty (every slot of the gap null).
    wide_cfg = CorruptionConfig(canvas_length=L, max_prefix=16, p_pinned=0.0, p_gap=1.0, max_null_frac=1.0)
    wide = _batch(wide_cfg, batch_size=256)
    free = ~wide.pinned
    assert any(bool((wide.canvas_clean[b][free[b]] == NULL).all()) for b in range(256))


def test_doc_start_alignment() -> None:
    cfg = CorruptionConfig(canvas_length=32, max_prefix=16, p_doc_start=1.0)
    batch = _batch(cfg)
    assert {int(t) - 10 for t in batch.encoder_ids[:, 0]} <= set(DOCS.tolist())
    other = _batch(CorruptionConfig(canvas_length=32, max_prefix=16, p_doc_start=0.0))
    assert not {int(t) - 10 for t in other.encoder_ids[:, 0]} <= set(DOCS.tolist())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"canvas_length": 2},
        {"min_prefix": 0},
        {"min_prefix": 10, "max_prefix": 5},
        {"noise_eps": 0.0},
        {"p_pinned": 0.7, "p_gap": 0.7},
        {"max_spans": 0},
        {"max_null_frac": 1.5},
    ],
)
def test_config_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CorruptionConfig(**kwargs)  # type: ignore[arg-type]


def test_stream_too_short() -> None:
    cfg = CorruptionConfig(canvas_length=32, max_prefix=16)
    with pytest.raises(ValueError, match="shorter than one window"):
        sample_batch(
            STREAM[:20], DOCS[:1], 2, cfg, vocab_size=V, null_id=NULL,
            rng=np.random.default_rng(0), gen=torch.Generator(),
        )  # fmt: skip
