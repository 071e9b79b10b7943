"""Fused MoE: reference vs a naive per-(token, slot) loop and transformers' DiffusionGemmaTextExperts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.moe import fused_moe, fused_moe_ref, moe_align_block_size
from tests.kernels.kernel_testing import TOLERANCES


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
    t: int, d: int, k: int, e: int, i: int, gen: torch.Generator, dtype: torch.dtype = torch.float32, ids=None
) -> tuple[torch.Tensor, ...]:
    x = torch.randn(t, d, generator=gen).to(dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if t else torch.empty(0, k)
    ids = ids.long()
    w = torch.softmax(torch.randn(t, k, generator=gen), -1)
    wgu = (torch.randn(e, 2 * i, d, generator=gen) / d**0.5).to(dtype)
    wd = (torch.randn(e, d, i, generator=gen) / i**0.5).to(dtype)
    return x, w, ids, wgu, wd


CASES = {
    "one_token": dict(t=1, d=16, k=2, e=4, i=8),
    "odd_sizes": dict(t=7, d=19, k=3, e=5, i=11),
    "topk_equals_experts": dict(t=5, d=16, k=4, e=4, i=8),
    "many_tokens": dict(t=33, d=32, k=2, e=6, i=24),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_ref_matches_naive_oracle(name: str, gen: torch.Generator) -> None:
    x, w, ids, wgu, wd = make_case(**CASES[name], gen=gen)
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


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_block_size_invariants(block_m: int, gen: torch.Generator) -> None:
    e = 6
    ids = torch.randint(0, e - 1, (11, 3), generator=gen)  # expert 5 never chosen
    p = ids.numel()
    al = moe_align_block_size(ids, block_m, e)
    total = int(al.num_tokens_post_padded)
    assert total % block_m == 0 and al.sorted_token_ids.numel() % block_m == 0
    real = al.sorted_token_ids[:total]
    assert bool((al.sorted_token_ids[total:] == p).all())
    valid = real[real < p]
    assert sorted(valid.tolist()) == list(range(p))  # every pair exactly once
    tile_expert = al.expert_ids[: total // block_m].repeat_interleave(block_m)
    assert bool((ids.reshape(-1)[valid] == tile_expert[real < p]).all())  # each pair in a tile of its expert
    assert bool((al.expert_ids[total // block_m :] == e).all())
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
