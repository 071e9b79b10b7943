"""Fused MoE: reference vs a naive loop and transformers' experts; Triton kernels vs reference (interpreter/CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.moe import MoeTiles, fused_moe, fused_moe_ref, fused_moe_triton
from kernels.moe_align import MoeAlignment, moe_align_block_size
from tests.kernels.kernel_testing import TOLERANCES, requires_cuda


def naive_moe(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """Oracle: the formula written out one (token, slot) pair at a time, in fp32."""
    t_count, k_count = ids.shape
    i = wd.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(t_count):
        for k in range(k_count):
            e = int(ids[t, k])
            h = x[t].float() @ wgu[e].float().T
            a = F.gelu(h[:i], approximate="tanh") * h[i:]
            out[t] += float(w[t, k]) * (a @ wd[e].float().T)
    return out.to(x.dtype)


def make_case(
    t: int,
    d: int,
    k: int,
    e: int,
    i: int,
    gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
    ids: torch.Tensor | None = None,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random inputs on `device`; gate_up is scaled so the GELU sees values of order 1-3 (its curved part)."""
    x = torch.randn(t, d, generator=gen).to(dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=gen), -1)
    wgu = (2 * torch.randn(e, 2 * i, d, generator=gen) / d**0.5).to(dtype)
    wd = (torch.randn(e, d, i, generator=gen) / i**0.5).to(dtype)
    return x.to(device), w.to(device), ids.long().to(device), wgu.to(device), wd.to(device)


# (T, D, K, E, I)
CASES: dict[str, tuple[int, int, int, int, int]] = {
    "one_token": (1, 16, 2, 4, 8),
    "odd_sizes": (7, 19, 3, 5, 11),
    "topk_equals_experts": (5, 16, 4, 4, 8),
    "many_tokens": (33, 32, 2, 6, 24),
    "multi_tile_k_and_n": (6, 70, 2, 3, 80),  # D, I > 64: several K-loop steps and N tiles
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_ref_matches_naive_oracle(name: str, gen: torch.Generator) -> None:
    x, w, ids, wgu, wd = make_case(*CASES[name], gen=gen)
    torch.testing.assert_close(fused_moe_ref(x, w, ids, wgu, wd), naive_moe(x, w, ids, wgu, wd), rtol=1e-5, atol=1e-5)


def test_ref_empty_expert_and_all_to_one(gen: torch.Generator) -> None:
    ids = torch.zeros(6, 1, dtype=torch.long)  # every token to expert 0; experts 1..3 get nothing
    x, w, ids, wgu, wd = make_case(6, 16, 1, 4, 8, gen, ids=ids)
    torch.testing.assert_close(fused_moe_ref(x, w, ids, wgu, wd), naive_moe(x, w, ids, wgu, wd), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_transformers_experts(dtype: torch.dtype, gen: torch.Generator) -> None:
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaTextExperts

    t, d, k, e, i = 9, 32, 3, 6, 16
    config = DiffusionGemmaTextConfig(
        hidden_size=d, num_experts=e, top_k_experts=k, moe_intermediate_size=i, hidden_activation="gelu_pytorch_tanh"
    )
    experts = DiffusionGemmaTextExperts(config).to(dtype)
    x, w, ids, wgu, wd = make_case(t, d, k, e, i, gen, dtype=dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(wgu)
        experts.down_proj.copy_(wd)
        expected = experts(x, ids, w)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(fused_moe_ref(x, w, ids, wgu, wd), expected, rtol=rtol, atol=atol)


def test_ref_rejects_bad_input(gen: torch.Generator) -> None:
    x, w, ids, wgu, wd = make_case(3, 16, 2, 4, 8, gen)
    with pytest.raises(ValueError, match="w_down"):
        fused_moe(x, w, ids, wgu, wd[:, :, :-1], impl="ref")
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, w[:, :1], ids, wgu, wd, impl="ref")
    with pytest.raises(ValueError, match=r"\[0, E=4\)"):
        fused_moe(x, w, ids + 3, wgu, wd, impl="ref")


def check_alignment(ids: torch.Tensor, e: int, block_m: int, al: MoeAlignment) -> None:
    """Invariants of MoeAlignment (order inside an expert's run is free)."""
    p = ids.numel()
    flat = ids.reshape(-1).cpu()
    sorted_ids, expert_ids = al.sorted_token_ids.cpu(), al.expert_ids.cpu()
    total = int(al.num_tokens_post_padded)
    counts = torch.bincount(flat, minlength=e)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.numel() % block_m == 0 and expert_ids.numel() == sorted_ids.numel() // block_m
    assert bool((sorted_ids[total:] == p).all()) and bool((expert_ids[total // block_m :] == e).all())
    real = sorted_ids[:total]
    valid = real < p
    assert sorted(real[valid].tolist()) == list(range(p))  # every pair exactly once
    tile_expert = expert_ids[: total // block_m].repeat_interleave(block_m)
    assert bool((flat[real[valid]] == tile_expert[valid]).all())  # each pair sits in a tile of its own expert
    assert bool((tile_expert[1:] >= tile_expert[:-1]).all())  # runs in expert order


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_block_size_invariants_torch(block_m: int, gen: torch.Generator) -> None:
    ids = torch.randint(0, 5, (11, 3), generator=gen)  # expert 5 of 6 never chosen
    check_alignment(ids, 6, block_m, moe_align_block_size(ids, block_m, 6, impl="ref"))


@pytest.mark.parametrize(("t", "k", "e", "block_m"), [(11, 3, 6, 16), (1, 2, 4, 16), (300, 4, 5, 32), (40, 8, 8, 64)])
def test_align_block_size_invariants_triton(
    triton_device: str, t: int, k: int, e: int, block_m: int, gen: torch.Generator
) -> None:
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[ids == e - 1] = 0  # an expert with no pairs
    ids = ids.to(triton_device)
    al = moe_align_block_size(ids, block_m, e, impl="triton")
    check_alignment(ids, e, block_m, al)
    ref = moe_align_block_size(ids.cpu(), block_m, e, impl="ref")
    assert torch.equal(al.expert_ids.cpu(), ref.expert_ids) and int(al.num_tokens_post_padded) == int(
        ref.num_tokens_post_padded
    )


def test_kernel_drops_out_of_range_ids(triton_device: str, gen: torch.Generator) -> None:
    x, w, ids, wgu, wd = make_case(5, 16, 2, 4, 8, gen, device=triton_device)
    bad = ids.clone()
    bad[2, 1] = 9  # out of range: the Triton path drops the pair instead of reading out of bounds
    w_dropped = w.clone()
    w_dropped[2, 1] = 0.0
    out = fused_moe(x, w, bad, wgu, wd, impl="triton")
    assert_moe_close(out, fused_moe_ref(x, w_dropped, ids, wgu, wd), torch.float32)


def assert_moe_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # The reference rounds h and the activation to the input dtype (as transformers does); the kernel keeps them in
    # fp32 until the activation store. Scale atol by the output magnitude so near-zero outputs are judged fairly.
    rtol, atol = TOLERANCES[dtype]
    scale = float(expected.float().abs().max()) or 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol * scale)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_ref(triton_device: str, name: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    x, w, ids, wgu, wd = make_case(*CASES[name], gen=gen, dtype=dtype, device=triton_device)
    out = fused_moe(x, w, ids, wgu, wd, impl="triton")
    assert out.dtype == dtype and out.shape == x.shape
    assert_moe_close(out, fused_moe_ref(x, w, ids, wgu, wd), dtype)


@pytest.mark.parametrize("block_m", [16, 32])
def test_kernel_empty_expert_and_all_to_one(triton_device: str, block_m: int, gen: torch.Generator) -> None:
    ids = torch.full((20, 1), 2, dtype=torch.long)  # all tokens to expert 2; 0, 1, 3 empty; 20 pairs span 2 tiles
    x, w, ids, wgu, wd = make_case(20, 24, 1, 4, 16, gen, ids=ids, device=triton_device)
    out = fused_moe_triton(x, w, ids, wgu, wd, tiles=MoeTiles(block_m, 16, 16, 4, 2))
    assert_moe_close(out, fused_moe_ref(x, w, ids, wgu, wd), torch.float32)


def test_kernel_strided_hidden_and_tiny_tiles(triton_device: str, gen: torch.Generator) -> None:
    x, w, ids, wgu, wd = make_case(9, 33, 3, 7, 17, gen, device=triton_device)
    wide = torch.zeros(9, 50, device=triton_device)
    wide[:, 5:38] = x
    x_view = wide[:, 5:38]  # row stride 50
    out = fused_moe_triton(x_view, w, ids, wgu, wd, tiles=MoeTiles(16, 16, 16, 4, 2))
    assert_moe_close(out, fused_moe_ref(x, w, ids, wgu, wd), torch.float32)


def test_kernel_rejects_bad_tiles(triton_device: str, gen: torch.Generator) -> None:
    x, w, ids, wgu, wd = make_case(3, 16, 2, 4, 8, gen, device=triton_device)
    with pytest.raises(ValueError, match="power of two"):
        fused_moe_triton(x, w, ids, wgu, wd, tiles=MoeTiles(24, 64, 64, 4, 2))
    with pytest.raises(ValueError, match="w_gate_up"):
        fused_moe(x, w, ids, wgu[:, :-1], wd, impl="triton")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_ref_larger(triton_device: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    x, w, ids, wgu, wd = make_case(64, 96, 4, 16, 80, gen, dtype=dtype, device=triton_device)
    assert_moe_close(fused_moe(x, w, ids, wgu, wd, impl="triton"), fused_moe_ref(x, w, ids, wgu, wd), dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("tokens", [1, 256])
def test_gpu_real_shapes(tokens: int) -> None:
    # DiffusionGemma 26B-A4B text config: hidden 2816, 128 experts, top-8, moe_intermediate_size 704.
    gen = torch.Generator().manual_seed(0)
    x, w, ids, wgu, wd = make_case(tokens, 2816, 8, 128, 704, gen, dtype=torch.bfloat16, device="cuda")
    assert_moe_close(fused_moe(x, w, ids, wgu, wd, impl="triton"), fused_moe_ref(x, w, ids, wgu, wd), torch.bfloat16)
