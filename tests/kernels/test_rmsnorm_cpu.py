"""Fused CPU RMSNorm (and the heads' norm with RoPE): reference vs the unfused torch ops, the C++ kernel vs the
reference, checks and fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import rmsnorm_cpu as rn
from kernels.rmsnorm import rms_norm_ref
from kernels.rmsnorm_cpu import rms_norm_fused, rms_norm_fused_ref, rms_norm_rope, rms_norm_rope_ref

needs_kernel = pytest.mark.skipif(rn.fused_kernel() is None, reason="the CPU C++ kernels do not build here")

SHAPES = [(1, 1), (1, 7), (3, 64), (2, 5, 37), (4, 1023), (8, 640)]


@pytest.mark.parametrize("shape", SHAPES)
def test_ref_is_residual_plus_scaled_norm(shape: tuple[int, ...], gen: torch.Generator) -> None:
    x, res = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    w, s = torch.randn(shape[-1], generator=gen), torch.tensor([0.3])
    torch.testing.assert_close(rms_norm_fused_ref(x, w, 1e-6, res, s), (res + rms_norm_ref(x, w)) * s,
                               rtol=0, atol=0)
    torch.testing.assert_close(rms_norm_fused_ref(x), rms_norm_ref(x), rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("parts", ["none", "weight", "residual", "all"])
def test_kernel_matches_ref(shape: tuple[int, ...], parts: str, gen: torch.Generator) -> None:
    x = torch.randn(*shape, generator=gen) * 4
    w = torch.randn(shape[-1], generator=gen) if parts in ("weight", "all") else None
    res = torch.randn(*shape, generator=gen) if parts in ("residual", "all") else None
    s = torch.tensor([1.7]) if parts == "all" else None
    want = rms_norm_fused_ref(x, w, 1e-6, res, s)
    torch.testing.assert_close(rms_norm_fused(x, w, 1e-6, res, s, impl="cpp"), want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_stacked_head_weights(gen: torch.Generator) -> None:
    """(P, D) weights: each of P heads its own norm weight, as the decode step's stacked q/k norms."""
    x = torch.randn(3, 6, 256, generator=gen)
    w = torch.randn(6, 256, generator=gen)
    torch.testing.assert_close(rms_norm_fused(x, w, impl="cpp"), rms_norm_ref(x) * w, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise(gen: torch.Generator) -> None:
    """The launcher validates before it looks the kernel up, so these hold with or without a compiler."""
    x = torch.randn(2, 8, generator=gen)
    with pytest.raises(ValueError, match="weight"):
        rn.rms_norm_fused_cpp(x, torch.ones(7))
    with pytest.raises(ValueError, match="residual"):
        rn.rms_norm_fused_cpp(x, residual=torch.ones(2, 7))
    with pytest.raises(ValueError, match="eps"):
        rn.rms_norm_fused_cpp(x, None, 0.0)
    with pytest.raises(ValueError, match="fp32"):
        rn.rms_norm_fused_cpp(x.double())
    with pytest.raises(ValueError, match="impl"):
        rms_norm_fused(x, impl="triton")  # type: ignore[arg-type]


@pytest.mark.usefixtures("cpp_unbuilt")
def test_auto_falls_back_with_one_warning(gen: torch.Generator) -> None:
    x = torch.randn(2, 8, generator=gen)
    with pytest.warns(RuntimeWarning, match="no compiler"):
        got = rms_norm_fused(x)
    torch.testing.assert_close(got, rms_norm_fused_ref(x))
    rms_norm_fused(x)  # warned once only
    with pytest.raises(RuntimeError, match="unavailable"):
        rn.rms_norm_fused_cpp(x)
    x.requires_grad_(True)
    assert rms_norm_fused(x).requires_grad  # grad needed: the differentiable reference


def _rope_inputs(B: int, P: int, D: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.randn(B, P, D, generator=gen) * 3
    weight = torch.rand(P, D, generator=gen) + 0.5
    freqs = torch.arange(B, dtype=torch.float32)[:, None] * 10.0 ** (-torch.arange(D // 2) / (D // 2))
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, D): RoPE's layout, cos and sin repeat at D / 2
    return x, weight, emb.cos(), emb.sin()


def test_rope_ref_is_the_decode_steps_formula(gen: torch.Generator) -> None:
    """The reference against the step's own ops: the stacked norm, then q and k rotated, v untouched."""
    x, weight, cos, sin = _rope_inputs(3, 6, 16, gen)
    y = F.rms_norm(x, (16,), None, 1e-6) * weight
    qk = y[:, :5]
    want = qk * cos[:, None] + torch.cat((-qk[..., 8:], qk[..., :8]), dim=-1) * sin[:, None]
    got = rms_norm_rope_ref(x, weight, 1e-6, cos, sin, 5)
    torch.testing.assert_close(got[:, :5], want)
    torch.testing.assert_close(got[:, 5:], y[:, 5:])


@needs_kernel
@pytest.mark.parametrize("B,P,D,rotate", [(1, 6, 256, 5), (8, 6, 256, 5), (16, 5, 256, 5), (3, 4, 2, 0),
                                          (2, 7, 34, 3)])
def test_rope_kernel_matches_ref(B: int, P: int, D: int, rotate: int, gen: torch.Generator) -> None:
    x, weight, cos, sin = _rope_inputs(B, P, D, gen)
    want = rms_norm_rope_ref(x, weight, 1e-6, cos, sin, rotate)
    torch.testing.assert_close(rms_norm_rope(x, weight, 1e-6, cos, sin, rotate, impl="cpp"), want,
                               rtol=1e-5, atol=1e-5)


def test_rope_bad_inputs_raise(gen: torch.Generator) -> None:
    x, weight, cos, sin = _rope_inputs(2, 3, 8, gen)
    with pytest.raises(ValueError, match="even D"):
        rms_norm_rope(x[..., :7], weight[:, :7], 1e-6, cos[:, :7], sin[:, :7], 1, impl="ref")
    with pytest.raises(ValueError, match="cos"):
        rms_norm_rope(x, weight, 1e-6, cos[:1], sin, 1, impl="cpp")
    with pytest.raises(ValueError, match="rotate"):
        rms_norm_rope(x, weight, 1e-6, cos, sin, 4, impl="cpp")
    with pytest.raises(ValueError, match="impl"):
        rms_norm_rope(x, weight, 1e-6, cos, sin, 1, impl="triton")  # type: ignore[arg-type]
