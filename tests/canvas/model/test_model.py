"""Model behaviour beyond parity: cache reuse, ragged batching, input validation."""

from __future__ import annotations

import pytest
import torch

from canvas.model import DiffusionModel, KVCache, ModelConfig


@pytest.fixture(scope="module")
def model() -> DiffusionModel:
    torch.manual_seed(0)
    return DiffusionModel(ModelConfig.from_name("tiny")).eval()


def test_stacked_ragged_cache_matches_rows(model: DiffusionModel) -> None:
    """A batched decoder step over caches of different lengths equals the rows run one by one."""
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    lengths = [3, cfg.sliding_window + 5, 9]
    caches = []
    for n in lengths:
        _, c = model.encode(torch.randint(3, cfg.vocab_size, (1, n), generator=g), logits="none")
        caches.append(c)
    canvas = torch.randint(0, cfg.vocab_size, (3, cfg.canvas_length), generator=g)
    sc = torch.randn(3, cfg.canvas_length, cfg.vocab_size, generator=g)
    batched = model.denoise(canvas, KVCache.stack(caches), sc)
    for b, c in enumerate(caches):
        single = model.denoise(canvas[b : b + 1], c, sc[b : b + 1])
        torch.testing.assert_close(batched[b : b + 1], single, rtol=1e-4, atol=1e-4)


def test_encode_last_logits_equal_all(model: DiffusionModel) -> None:
    ids = torch.randint(3, model.config.vocab_size, (2, 7))
    all_logits, _ = model.encode(ids)
    last, _ = model.encode(ids, logits="last")
    torch.testing.assert_close(all_logits[:, -1:], last)


def test_cache_is_read_only_for_denoise(model: DiffusionModel) -> None:
    _, cache = model.encode(torch.randint(3, model.config.vocab_size, (1, 5)), logits="none")
    before = [(lk.k.clone(), lk.v.clone()) for lk in cache.layers]
    model.denoise(torch.randint(0, model.config.vocab_size, (1, model.config.canvas_length)), cache)
    for (k, v), lk in zip(before, cache.layers, strict=True):
        assert torch.equal(k, lk.k) and torch.equal(v, lk.v)
    assert cache.length == 5


def test_input_validation(model: DiffusionModel) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        model.encode(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(batch, tokens\)"):
        model.encode(torch.zeros(4, dtype=torch.long))
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="do not fit"):
        model.encode(torch.ones(1, 5, dtype=torch.long), cache=cache)
    _, c1 = model.encode(torch.ones(1, 3, dtype=torch.long), logits="none")
    stacked = KVCache.stack([c1, c1])
    with pytest.raises(ValueError, match="read-only"):
        model.encode(torch.ones(2, 1, dtype=torch.long), cache=stacked)
    with pytest.raises(ValueError, match="batch size"):
        model.denoise(torch.ones(2, model.config.canvas_length, dtype=torch.long), c1)


def test_grown_cache_continues_like_the_original(model: DiffusionModel) -> None:
    """Encoding more text into a grown copy gives what a big-enough cache gives, and leaves the original alone."""
    ids = torch.randint(3, model.config.vocab_size, (1, model.config.sliding_window + 3))
    more = torch.randint(3, model.config.vocab_size, (1, 5))
    _, small = model.encode(ids, cache=model.new_cache(1, ids.shape[1]), logits="none")
    grown = small.grown(ids.shape[1] + 5)
    a, _ = model.encode(more, cache=grown)
    b, _ = model.encode(more, cache=model.encode(ids, cache=model.new_cache(1, ids.shape[1] + 5), logits="none")[1])
    torch.testing.assert_close(a, b)
    assert small.length == ids.shape[1]
    with pytest.raises(ValueError, match="below"):
        small.grown(2)


def test_logits_at_equals_the_full_pass_rows(model: DiffusionModel) -> None:
    """`logits_at` (flat indices in any order, or a bool mask) gives the full pass's rows, batched and masked too:
    only the head is skipped, every slot still runs the layers. (Equal up to the GEMM's rounding: BLAS may sum a
    product of a few rows in another order than the same rows inside a bigger product.)"""
    cfg = model.config
    g = torch.Generator().manual_seed(4)
    _, c1 = model.encode(torch.randint(3, cfg.vocab_size, (1, 5), generator=g), logits="none")
    _, c2 = model.encode(torch.randint(3, cfg.vocab_size, (1, cfg.sliding_window + 2), generator=g), logits="none")
    cache = KVCache.stack([c1, c2])
    L = cfg.canvas_length
    canvas = torch.randint(0, cfg.vocab_size, (2, L), generator=g)
    used = torch.arange(L)[None] < torch.tensor([[L - 7], [L]])  # row 0 uses fewer slots
    sc = torch.randn(2, L, cfg.vocab_size, generator=g)
    full = model.denoise(canvas, cache, sc, canvas_mask=used).reshape(2 * L, -1)  # (B*L, V)
    index = torch.tensor([L + 3, 0, 5, 2 * L - 1, 1])
    close = dict(rtol=1e-5, atol=1e-5)
    sparse = model.denoise(canvas, cache, sc, canvas_mask=used, logits_at=index)
    torch.testing.assert_close(sparse, full[index], **close)
    pick = torch.rand(2, L, generator=g) < 0.3
    sparse = model.denoise(canvas, cache, sc, canvas_mask=used, logits_at=pick)
    torch.testing.assert_close(sparse, full[pick.reshape(-1)], **close)
    assert model.denoise(canvas, cache, logits_at=index[:0]).shape == (0, cfg.vocab_size)
    with pytest.raises(ValueError, match="logits_at mask"):
        model.denoise(canvas, cache, logits_at=pick[:, :4])


def test_a_zero_self_conditioning_mlp_is_skipped_exactly(model: DiffusionModel) -> None:
    """A converted checkpoint's self-conditioning MLP starts all zeros: `inert` says so, the signal is then not
    computed, and the logits are exactly those of no signal. Writing the weight back makes it live again."""
    sc_mod = model.self_conditioning
    cfg = model.config
    g = torch.Generator().manual_seed(5)
    _, cache = model.encode(torch.randint(3, cfg.vocab_size, (1, 6), generator=g), logits="none")
    canvas = torch.randint(0, cfg.vocab_size, (1, cfg.canvas_length), generator=g)
    sc = torch.randn(1, cfg.canvas_length, cfg.vocab_size, generator=g)
    assert not sc_mod.inert()
    live = model.denoise(canvas, cache, sc)
    saved = sc_mod.down.detach().clone()
    try:
        with torch.no_grad():
            sc_mod.down.zero_()
        assert sc_mod.inert()
        assert torch.equal(model.denoise(canvas, cache, sc), model.denoise(canvas, cache))
    finally:
        with torch.no_grad():
            sc_mod.down.copy_(saved)
    assert not sc_mod.inert()
    assert torch.equal(model.denoise(canvas, cache, sc), live)
