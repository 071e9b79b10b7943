"""The decode step's elementwise activations for fp32 on the CPU: the MLP's gated GELU and the logit soft-cap.

Owns `gelu_mul` and `softcap_` (public, `impl="auto"|"cpp"|"ref"`), their torch references `gelu_mul_ref` /
`softcap_ref`, the validating launchers and the raw entry points (`gelu_mul_kernel`, `softcap_kernel`) of the C++
kernels beside this file (`act_cpu.cpp`, built by `kernels._cpp` with the other CPU kernels).
- `gelu_mul(gate_up)`: (R, 2I) -> (R, I), `gelu(gate, approximate="tanh") * up` with gate, up = the row's halves
  (`Block.feed_forward`'s dense MLP and the decode step's);
- `softcap_(x, cap)`: in place, `tanh(x / cap) * cap` (`DiffusionModel.logits`' final soft-cap).

Why: each is three torch ops over the tensor (views, the activation, a multiply), a pass over memory and a dispatch
each, on a few rows a step, where the passes and dispatches, not the arithmetic, are the cost. One pass each here
(BENCHMARKS.md, "Kernels").
Numerics: fp32; the kernels' exp is a polynomial (within 2 ulp) and their tanh is `cpu_math.h`'s (a few ulp
relative, near 0 too), so they agree with the references to fp32 rounding, not bit for bit.

Legend: R rows, I the MLP's hidden width (half of gate_up's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from kernels._cpp import auto_impl, build_error, extension

__all__ = ["Impl", "gelu_mul", "gelu_mul_cpp", "gelu_mul_kernel", "gelu_mul_ref", "softcap_", "softcap_cpp",
           "softcap_kernel", "softcap_ref"]

Impl = Literal["auto", "cpp", "ref"]
_IMPLS: tuple[str, ...] = ("auto", "cpp", "ref")


def gelu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch reference: gate_up (R, 2I) -> (R, I) = gelu_tanh(gate) * up.

    Bytes: read R*2I*4, write R*I*4. FLOPs: ~12*R*I.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def softcap_ref(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Torch reference, in place: x = tanh(x / cap) * cap; returns x.

    Bytes: read and write numel*4. FLOPs: ~3*numel (and a tanh each).
    """
    return x.div_(cap).tanh_().mul_(cap)


def _fp32_cpu(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU fp32 tensor, got {t.dtype} on {t.device}")


def _check_gelu(gate_up: torch.Tensor) -> None:
    _fp32_cpu("gate_up", gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be (R, 2I), got {tuple(gate_up.shape)}")


def _check_softcap(x: torch.Tensor, cap: float) -> None:
    _fp32_cpu("x", x)
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous (softcap_ works in place)")


def gelu_mul_kernel() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The raw entry point `gelu_mul(gate_up (R, 2I) fp32 contiguous)` (it checks that itself), or None where the
    extension did not build: for hot loops."""
    mod = extension()
    return None if mod is None else mod.gelu_mul


def softcap_kernel() -> Callable[[torch.Tensor, float], torch.Tensor] | None:
    """The raw entry point `softcap_(x fp32 contiguous, cap)`, in place, or None where the extension did not
    build."""
    mod = extension()
    return None if mod is None else mod.softcap_


def gelu_mul_cpp(gate_up: torch.Tensor) -> torch.Tensor:
    """Validating launcher of the C++ kernel; RuntimeError where it could not be built."""
    _check_gelu(gate_up)
    fn = gelu_mul_kernel()
    if fn is None:
        raise RuntimeError(f"the CPU activation kernels are unavailable here: {build_error() or 'unknown'}")
    return fn(gate_up.contiguous())


def softcap_cpp(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Validating launcher of the C++ kernel (in place); RuntimeError where it could not be built."""
    _check_softcap(x, cap)
    fn = softcap_kernel()
    if fn is None:
        raise RuntimeError(f"the CPU activation kernels are unavailable here: {build_error() or 'unknown'}")
    return fn(x, cap)


def _auto(*tensors: torch.Tensor, built: bool) -> Literal["cpp", "ref"]:
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    # Inside torch.compile the reference: the compiler fuses it, and an opaque call would break the graph.
    eligible = (not grads and not torch.compiler.is_compiling()
                and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors))
    return auto_impl(eligible, eligible and built, "CPU activation kernels")


def gelu_mul(gate_up: torch.Tensor, *, impl: Impl = "auto") -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up (R, 2I) -> (R, I). "auto": the C++ kernel where it built (one warning where
    it did not), the input is fp32 on the CPU, needs no grad and is not being compiled, else the reference."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = _auto(gate_up, built=gelu_mul_kernel() is not None)
    if impl == "ref":
        return gelu_mul_ref(gate_up)
    return gelu_mul_cpp(gate_up)


def softcap_(x: torch.Tensor, cap: float, *, impl: Impl = "auto") -> torch.Tensor:
    """x = tanh(x / cap) * cap in place; returns x. "auto" as `gelu_mul`'s (and contiguous x)."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = _auto(x, built=softcap_kernel() is not None) if x.is_contiguous() else "ref"
    if impl == "ref":
        return softcap_ref(x, cap)
    return softcap_cpp(x, cap)
