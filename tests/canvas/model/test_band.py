"""Banded sliding-window attention (`canvas.model.band`) against the dense masked pass it replaces."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import canvas.model.model as model_module
from canvas.model import DiffusionModel, ModelConfig
from canvas.model.band import band_attend, band_for


@pytest.fixture(scope="module")
def model() -> DiffusionModel:
    torch.manual_seed(0)
    return DiffusionModel(ModelConfig.from_name("tiny")).eval()  # window 16: sliding and full layers


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, window: int) -> torch.Tensor:
    T, S = q.shape[2], k.shape[2]
    q_pos = torch.arange(S - T, S)
    k_pos = torch.arange(S)
    mask = (k_pos[None] <= q_pos[:, None]) & (k_pos[None] > q_pos[:, None] - window)
    mask = (mask[None] & valid[:, None, :]) | (k_pos[None] == q_pos[:, None])[None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=1.0, enable_gqa=True)


@pytest.mark.parametrize(("n_tail", "T", "block"), [(15, 40, 8), (0, 37, 8), (6, 64, 16), (15, 17, 4)])
def test_band_attend_equals_the_dense_mask(n_tail: int, T: int, block: int) -> None:
    g = torch.Generator().manual_seed(n_tail * 100 + T)
    B, H, G, D, W = 2, 4, 2, 8, 16
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(2, B, G, n_tail + T, D, generator=g)
    valid = torch.ones(B, n_tail + T, dtype=torch.bool)
    valid[1, : n_tail + 5] = False  # a left-padded row: its padding queries see only themselves
    band = band_for(T, n_tail, W, valid, block)
    assert band is not None
    torch.testing.assert_close(band_attend(q, k, v, band), _dense(q, k, v, valid, W), rtol=1e-5, atol=1e-5)


def test_short_passes_keep_the_dense_mask() -> None:
    valid = torch.ones(1, 100, dtype=torch.bool)
    assert band_for(20, 80, 512, valid[:, :100]) is None  # fewer than two blocks of queries
    assert band_for(128, 0, 512, valid[:, :128]) is None  # every query sees every key: nothing to skip
    assert band_for(448, 511, 512, torch.ones(1, 959, dtype=torch.bool)) is not None


def _encode(model: DiffusionModel, ids: torch.Tensor, mask: torch.Tensor | None, pieces: list[int],
            band: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.band_attention = band
    try:
        cache = model.new_cache(ids.shape[0], ids.shape[1] + 8)
        outs, at = [], 0
        for n in pieces:
            m = None if mask is None else mask[:, at : at + n]
            out, _ = model.encode(ids[:, at : at + n], m, cache=cache, logits="all")
            assert out is not None
            outs.append(out)
            at += n
        return torch.cat(outs, 1), [t for lkv in cache.layers for t in (lkv.k, lkv.v)]
    finally:
        model.band_attention = True


@pytest.mark.parametrize("pieces", [[300], [10, 290], [15, 150, 135]])
def test_encode_with_bands_equals_the_dense_pass(model: DiffusionModel, pieces: list[int],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def counted(*args: Any) -> torch.Tensor:
        calls.append(1)
        return band_attend(*args)

    monkeypatch.setattr(model_module, "band_attend", counted)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (2, sum(pieces)), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :7] = False  # left padding
    ref, ref_kv = _encode(model, ids, mask, pieces, band=False)
    assert not calls
    out, kv = _encode(model, ids, mask, pieces, band=True)
    assert calls  # the long pieces ran the sliding layers by blocks
    scale = ref.abs().max()
    torch.testing.assert_close(out / scale, ref / scale, rtol=0, atol=1e-5)
    for a, b in zip(kv, ref_kv, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
