"""The CPU extension built for the instruction sets below this machine's (`kernels._cpp`'s "avx2" and "scalar"
builds, what a CPU without AVX-512 runs): attention, gelu-mul, soft-cap, the heads' norm with RoPE and the token draw
against their torch references, as the default build is tested in their own files. Slow: each build compiles the
whole extension."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kernels._cpp import _ISA_FLAGS, _cpu_flags, extension
from kernels.act_cpu import gelu_mul_ref, softcap_ref
from kernels.attend_cpu import attend_one_ref
from kernels.rmsnorm_cpu import rms_norm_rope_ref
from kernels.sample_cpu import ban_csr, draw_tokens_ref

pytestmark = pytest.mark.slow


@pytest.fixture(params=["avx2", "scalar"])
def ext(request: pytest.FixtureRequest) -> ModuleType:
    isa = request.param
    if not _ISA_FLAGS[isa][1] <= _cpu_flags():
        pytest.skip(f"this CPU cannot run the {isa} build")
    mod = extension(isa)
    if mod is None:
        pytest.skip(f"the {isa} build failed here")
    assert mod.isa() == isa
    return mod


@pytest.mark.parametrize("B,H,G,S,D", [(1, 4, 1, 290, 256), (8, 4, 1, 33, 258), (3, 4, 2, 17, 7)])
def test_attention(ext: ModuleType, B: int, H: int, G: int, S: int, D: int, gen: torch.Generator) -> None:
    q = torch.randn(B, H, D, generator=gen) * 0.3
    k = torch.randn(B, G, S + 3, D, generator=gen)[:, :, :S]  # views of a larger cache, as the decode step reads
    v = torch.randn(B, G, S + 3, D, generator=gen)[:, :, :S]
    ek, ev = torch.randn(B, G, D, generator=gen), torch.randn(B, G, D, generator=gen)
    mask = torch.rand(B, S + 1, generator=gen) > 0.3
    mask[:, -1] = True
    want = attend_one_ref(q, k, v, mask, ek, ev)
    got = ext.attend_one(q, k, v, mask, ek, ev, None, 0, 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(want.abs().max())))
    lead = torch.zeros(B, dtype=torch.int64)  # every row a copy of row 0's first S // 2 slots
    k[1:, :, : S // 2], v[1:, :, : S // 2] = k[:1, :, : S // 2], v[:1, :, : S // 2]
    want = attend_one_ref(q, k, v, None)
    got = ext.attend_one(q, k, v, None, None, None, lead, 0, S // 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(want.abs().max())))


@pytest.mark.parametrize("rows,width", [(1, 4096), (3, 18), (16, 2 * 2048)])
def test_activations(ext: ModuleType, rows: int, width: int, gen: torch.Generator) -> None:
    gu = torch.randn(rows, width, generator=gen) * 3
    gu[0, :3] = torch.tensor([-60.0, 60.0, 0.0])  # both saturated ends
    torch.testing.assert_close(ext.gelu_mul(gu), gelu_mul_ref(gu), rtol=1e-5, atol=1e-6)
    for scale in (1e-3, 20.0):  # every lane small (the polynomial alone), and mixed
        x = torch.randn(rows, width + 5, generator=gen) * scale
        want = softcap_ref(x.clone(), 30.0)
        torch.testing.assert_close(ext.softcap_(x, 30.0), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("temperature,min_p", [(0.0, 0.0), (0.8, 0.0), (1.0, 0.1)])
def test_token_draw(ext: ModuleType, temperature: float, min_p: float, gen: torch.Generator) -> None:
    logits = torch.randn(8, 96001, generator=gen) * 4
    bans = [[0, 1, 96000 - k] for k in range(8)]
    logits[0, 0] = 50.0  # a banned likeliest token
    u = torch.rand(8, generator=gen)
    want_tok, want_lp = draw_tokens_ref(logits, u, temperature, min_p, bans)
    offsets, ids = ban_csr(bans, 8)
    tok, lp = ext.draw_tokens(logits, u, 1.0 / temperature if temperature > 0 else 0.0, min_p, offsets, ids)
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)


def test_head_norms_and_rope(ext: ModuleType, gen: torch.Generator) -> None:
    x, weight = torch.randn(8, 6, 256, generator=gen) * 3, torch.rand(6, 256, generator=gen) + 0.5
    angles = torch.rand(8, 128, generator=gen) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    want = rms_norm_rope_ref(x, weight, 1e-6, cos, sin, 5)
    got = ext.rms_norm_rope(x.view(48, 256), weight, 1e-6, cos, sin, 5).view(8, 6, 256)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
