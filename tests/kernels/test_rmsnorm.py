"""RMSNorm: reference vs transformers' DiffusionGemmaRMSNorm, Triton kernel vs reference (interpreter or CUDA)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaRMSNorm

from kernels._triton import KernelUnavailableError, interpreter_active
from kernels.rmsnorm import rms_norm, rms_norm_add, rms_norm_add_ref, rms_norm_ref
from tests.kernels.kernel_testing import TOLERANCES, requires_cuda

SHAPES = [(1, 1), (1, 7), (3, 64), (2, 5, 37), (4, 1023)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_scale", [True, False])
def test_ref_matches_transformers_module(shape: tuple[int, ...], with_scale: bool, gen: torch.Generator) -> None:
    d = shape[-1]
    module = DiffusionGemmaRMSNorm(d, eps=1e-6, with_scale=with_scale)
    weight = None
    if with_scale:
        weight = torch.randn(d, generator=gen)
        module.weight.data.copy_(weight)
    x = torch.randn(*shape, generator=gen) * 3
    with torch.no_grad():
        expected = module(x)
    torch.testing.assert_close(rms_norm_ref(x, weight, 1e-6), expected, rtol=0, atol=0)


def test_ref_add_is_residual_plus_norm(gen: torch.Generator) -> None:
    x, res = torch.randn(2, 3, 40, generator=gen).bfloat16(), torch.randn(2, 3, 40, generator=gen).bfloat16()
    w = torch.randn(40, generator=gen)
    torch.testing.assert_close(rms_norm_add_ref(x, res, w), res + rms_norm_ref(x, w), rtol=0, atol=0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_scale", [True, False])
def test_kernel_matches_ref(
    triton_device: str, shape: tuple[int, ...], dtype: torch.dtype, with_scale: bool, gen: torch.Generator
) -> None:
    d = shape[-1]
    x = (torch.randn(*shape, generator=gen) * 2).to(triton_device, dtype)
    weight = torch.randn(d, generator=gen).to(triton_device, dtype) if with_scale else None
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(rms_norm(x, weight, impl="triton"), rms_norm_ref(x, weight), rtol=rtol, atol=atol)
    res = torch.randn(*shape, generator=gen).to(triton_device, dtype)
    torch.testing.assert_close(
        rms_norm_add(x, res, weight, impl="triton"), rms_norm_add_ref(x, res, weight), rtol=rtol, atol=atol
    )


def test_kernel_handles_strided_rows(triton_device: str, gen: torch.Generator) -> None:
    base = torch.randn(6, 50, generator=gen).to(triton_device)
    x = base[::2, 3:40]  # (3, 37), row stride 100, not contiguous
    w = torch.randn(37, generator=gen).to(triton_device)
    torch.testing.assert_close(rms_norm(x, w, impl="triton"), rms_norm_ref(x, w), rtol=1e-5, atol=1e-6)


def test_interpreter_takes_effect(triton_device: str) -> None:
    # On CPU the kernel tests only mean something if Triton's interpreter (not a silent fallback) ran them.
    if triton_device == "cpu":
        assert interpreter_active()
        y = rms_norm(torch.ones(2, 8), impl="triton")
        torch.testing.assert_close(y, torch.ones(2, 8))


def test_launcher_rejects_bad_input(triton_device: str) -> None:
    x = torch.randn(4, 8, device=triton_device)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, torch.ones(7, device=triton_device), impl="triton")
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm_add(x, torch.ones(4, 9, device=triton_device), None, impl="triton")
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, None, 0.0, impl="triton")
    with pytest.raises(ValueError, match="impl must be"):
        rms_norm(x, impl="cuda")  # type: ignore[arg-type]


def test_dispatch_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCANVAS_KERNELS", raising=False)
    x = torch.randn(2, 8)
    torch.testing.assert_close(rms_norm(x), rms_norm_ref(x))  # auto on CPU tensors -> reference
    if not interpreter_active():
        with pytest.raises(KernelUnavailableError):
            rms_norm(x, impl="triton")  # CPU tensors without the interpreter
        monkeypatch.setenv("DCANVAS_KERNELS", "triton")
        with pytest.raises(KernelUnavailableError):
            rms_norm(x)  # the variable forces "auto" to Triton, which cannot run here
    monkeypatch.setenv("DCANVAS_KERNELS", "triton")
    torch.testing.assert_close(rms_norm(x, impl="ref"), rms_norm_ref(x))  # an explicit choice wins
    monkeypatch.setenv("DCANVAS_KERNELS", "bogus")
    with pytest.raises(ValueError, match="DCANVAS_KERNELS"):
        rms_norm(x)


def test_auto_uses_the_differentiable_reference_when_grad_is_needed(
    triton_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCANVAS_KERNELS", "triton")  # would force the forward-only kernel without the grad rule
    x = torch.randn(3, 16, device=triton_device)
    w = torch.ones(16, device=triton_device, requires_grad=True)
    y = rms_norm(x, w)
    assert y.grad_fn is not None
    y.sum().backward()
    assert w.grad is not None
    with pytest.raises(KernelUnavailableError, match="no backward"):
        rms_norm(x, w, impl="triton")
    with torch.no_grad():
        assert rms_norm(x, w, impl="triton").grad_fn is None  # inference: the kernel runs


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_matches_ref(dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 2816, device="cuda", generator=gen).to(dtype)
    res = torch.randn(256, 2816, device="cuda", generator=gen).to(dtype)
    w = torch.randn(2816, device="cuda", generator=gen).to(dtype)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(rms_norm(x, w, impl="triton"), rms_norm_ref(x, w), rtol=rtol, atol=atol)
    torch.testing.assert_close(
        rms_norm_add(x, res, w, impl="triton"), rms_norm_add_ref(x, res, w), rtol=rtol, atol=atol
    )
