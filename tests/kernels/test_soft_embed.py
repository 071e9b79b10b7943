"""Soft embedding: reference vs transformers' formula and a naive loop; Triton kernel vs reference."""

from __future__ import annotations

import pytest
import torch

from kernels.soft_embed import soft_embedding, soft_embedding_ref, soft_embedding_triton
from tests.kernels.kernel_testing import TOLERANCES, requires_cuda


def naive_soft_embedding(logits: torch.Tensor, emb: torch.Tensor, scale: float) -> torch.Tensor:
    """Oracle: per row, sum over the vocabulary of p_v * emb[v], in float64."""
    rows = logits.reshape(-1, logits.shape[-1]).double()
    out = torch.zeros(rows.shape[0], emb.shape[1], dtype=torch.float64)
    for r in range(rows.shape[0]):
        p = torch.softmax(rows[r], -1)
        for v in range(rows.shape[1]):
            out[r] += p[v] * emb[v].double()
    return (out * scale).reshape(*logits.shape[:-1], emb.shape[1])


def make_inputs(
    lead: tuple[int, ...], v: int, d: int, gen: torch.Generator, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(*lead, v, generator=gen) * 4
    if v > 2:
        x[..., : v // 2] = float("-inf")  # half the vocab banned: -inf logits must get probability 0
    return x, torch.randn(v, d, generator=gen).to(dtype)


SHAPES = [((1,), 1, 16), ((3,), 37, 19), ((2, 5), 300, 40), ((7,), 1023, 24)]


@pytest.mark.parametrize(("lead", "v", "d"), SHAPES[:3])
def test_ref_matches_naive_oracle(lead: tuple[int, ...], v: int, d: int, gen: torch.Generator) -> None:
    x, emb = make_inputs(lead, v, d, gen)
    torch.testing.assert_close(
        soft_embedding_ref(x, emb, scale=2.5), naive_soft_embedding(x, emb, 2.5).float(), rtol=1e-5, atol=1e-5
    )


def test_ref_matches_transformers_formula(gen: torch.Generator) -> None:
    # The expression in DiffusionGemmaModel.forward (self-conditioning), bf16 embedding, embed_scale buffer.
    x, emb = make_inputs((2, 3), 64, 32, gen, torch.bfloat16)
    embed_scale = torch.tensor(32**0.5)
    want = torch.matmul(x.softmax(dim=-1, dtype=torch.float32).to(emb.dtype), emb) * embed_scale.to(emb.dtype)
    torch.testing.assert_close(soft_embedding_ref(x, emb, scale=32**0.5), want, rtol=0, atol=0)


@pytest.mark.parametrize(("lead", "v", "d"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tiles", "splits"), [(None, 1), ((16, 16, 16), 1), ((16, 16, 16), 3)])
def test_kernel_matches_ref(
    triton_device: str,
    lead: tuple[int, ...],
    v: int,
    d: int,
    dtype: torch.dtype,
    tiles: tuple[int, int, int] | None,
    splits: int,
    gen: torch.Generator,
) -> None:
    # splits=3 also gives splits that see only -inf logits (the first half of the vocab is banned)
    x, emb = make_inputs(lead, v, d, gen, dtype)
    x, emb = x.to(triton_device), emb.to(triton_device)
    got = soft_embedding_triton(x, emb, scale=3.0, tiles=tiles, splits=splits)
    want = soft_embedding_ref(x, emb, scale=3.0)
    assert got.dtype == dtype and got.shape == want.shape
    rtol, atol = TOLERANCES[dtype]
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * scale)


def test_kernel_bf16_logits_and_strided_rows(triton_device: str, gen: torch.Generator) -> None:
    x, emb = make_inputs((6,), 90, 20, gen)
    wide = torch.zeros(6, 120)
    wide[:, 10:100] = x
    xs = wide[:, 10:100].bfloat16().to(triton_device)  # bf16, row stride 120
    emb = emb.to(triton_device)
    torch.testing.assert_close(
        soft_embedding(xs, emb, impl="triton"), soft_embedding_ref(xs, emb), rtol=1e-4, atol=1e-5
    )


def test_rejects_bad_input(triton_device: str) -> None:
    emb = torch.randn(10, 4, device=triton_device)
    for impl in ("ref", "triton"):
        with pytest.raises(ValueError, match="vocab size"):
            soft_embedding(torch.randn(3, 9, device=triton_device), emb, impl=impl)
        with pytest.raises(ValueError, match=r"\(V, D\)"):
            soft_embedding(torch.randn(3, 10, device=triton_device), emb[0], impl=impl)
    with pytest.raises(ValueError, match="powers of two"):
        soft_embedding_triton(torch.randn(3, 10, device=triton_device), emb, tiles=(16, 24, 16))
    with pytest.raises(ValueError, match="splits"):
        soft_embedding_triton(torch.randn(3, 10, device=triton_device), emb, splits=0)


@pytest.mark.gpu
@requires_cuda
def test_gpu_real_shapes() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(256, 262144, device="cuda", generator=gen) * 4).bfloat16()
    emb = (torch.randn(262144, 2816, device="cuda", generator=gen) * 0.02).bfloat16()
    got = soft_embedding(x, emb, scale=2816**0.5, impl="triton")
    want = soft_embedding_ref(x, emb, scale=2816**0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.float().abs().max()))
