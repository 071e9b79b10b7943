"""Guarded Triton import and the `impl` dispatch rule shared by every op in `kernels/`.

Owns: `HAS_TRITON` (False when triton is missing, so the package imports on any machine), `jit` (`triton.jit`, or a
stand-in that raises on launch without triton), `interpreter_active` (whether `TRITON_INTERPRET=1` really took
effect: it must be set before triton is first imported) and `resolve_impl`, the one place that decides between the
Triton kernel and the torch reference.

Dispatch contract (`impl` argument of every public op):
- "ref": the torch reference, always.
- "triton": the Triton kernel; needs triton installed and CUDA tensors, or CPU tensors with `TRITON_INTERPRET=1`.
  Anything else raises `KernelUnavailableError` rather than silently falling back. (The interpreter runs
  CUDA tensors too, slowly; that is Triton's behaviour and is left alone.)
- "auto": the reference whenever autograd needs a backward (an input requires grad and grad mode is on: the
  kernels are forward-only, so training stays correct on CUDA). Otherwise `DCANVAS_KERNELS=triton|ref` decides if
  set (process-wide override of "auto"), else Triton when every tensor is on CUDA and triton is importable, else
  the reference. An explicit "triton"/"ref" per call wins over the variable, so tests can always compare both;
  "triton" with an input that requires grad raises.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

import torch

from canvas.env import KERNELS

try:  # triton is optional: CPU-only installs (macOS, minimal CI) run the torch references.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "cdiv",
    "dot_in_fp32",
    "Impl",
    "KernelUnavailableError",
    "interpreter_active",
    "interpreting",
    "jit",
    "next_power_of_2",
    "resolve_impl",
    "tl",
    "triton",
]

Impl = Literal["auto", "triton", "ref"]
_IMPLS: tuple[str, ...] = ("auto", "triton", "ref")


class KernelUnavailableError(RuntimeError):
    """The Triton path was requested but cannot run here (no triton, or CPU tensors without the interpreter)."""


def interpreting() -> bool:
    """True when Triton's documented CPU interpreter is switched on (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _env_choice() -> Literal["triton", "ref"] | None:
    raw = KERNELS.word()
    if not raw or raw == "auto":
        return None
    if raw == "triton":
        return "triton"
    if raw == "ref":
        return "ref"
    raise ValueError(f"{KERNELS} must be 'triton', 'ref' or 'auto', got {raw!r}")


def _triton_can_run(tensors: tuple[torch.Tensor, ...]) -> tuple[bool, str]:
    if not HAS_TRITON:
        return False, "triton is not installed"
    devices = {t.device.type for t in tensors}
    if devices == {"cuda"}:
        return True, ""
    if devices == {"cpu"} and interpreter_active():
        return True, ""
    if devices == {"cpu"} and interpreting():
        return False, "TRITON_INTERPRET=1 was set after triton was imported; set it before the first import"
    if len(devices) > 1:
        return False, f"tensors are on mixed devices {sorted(devices)}"
    return False, f"tensors are on {devices.pop()!r}; Triton needs CUDA, or CPU with TRITON_INTERPRET=1"


def resolve_impl(impl: str, *tensors: torch.Tensor) -> Literal["triton", "ref"]:
    """Decide which implementation runs for these input tensors (see the module docstring for the rule)."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    choice: str = impl
    if choice == "auto":
        if needs_grad:  # the kernels are forward-only; the references are differentiable
            return "ref"
        forced = _env_choice()
        if forced is not None:
            choice = forced
        else:
            on_cuda = HAS_TRITON and all(t.device.type == "cuda" for t in tensors)
            return "triton" if on_cuda else "ref"
    if choice == "ref":
        return "ref"
    if needs_grad:
        raise KernelUnavailableError("impl='triton' has no backward; an input requires grad (use 'auto' or 'ref')")
    ok, why = _triton_can_run(tensors)
    if not ok:
        raise KernelUnavailableError(f"impl='triton' cannot run: {why}")
    return "triton"


class _MissingTritonKernel:
    """Stands in for a kernel when triton is absent: the module imports, launching raises."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __getitem__(self, grid: Any) -> Any:
        raise KernelUnavailableError(f"{self.__name__}: triton is not installed")


def jit(fn: Callable[..., Any]) -> Any:
    """`triton.jit` when triton is installed, else a stand-in that raises on launch."""
    return triton.jit(fn) if HAS_TRITON else _MissingTritonKernel(fn)


def interpreter_active() -> bool:
    """True when Triton really runs kernels through its interpreter in this process.

    Triton decides interpreter vs compiler when it is imported (its own `tl.sum`, `tl.max`, `tl.rand` are jitted
    then), so `TRITON_INTERPRET=1` set after `import triton` has no effect; this checks the library, not the variable.
    """
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels should upcast `tl.dot` operands to fp32 and ask for IEEE precision.

    True for fp32 inputs (so Ampere+ GPUs do not silently use TF32) and whenever the interpreter runs: its `tl.dot`
    multiplies the raw 16-bit patterns of bf16 operands (triton 3.9 `InterpreterBuilder.create_dot`). Products of
    bf16/fp16 values are exact in fp32, so the upcast computes what tensor cores compute, up to summation order.
    """
    return dtype == torch.float32 or interpreter_active()


def cdiv(a: int, b: int) -> int:
    """Ceiling division for launch grids."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); triton's helper without needing triton installed."""
    return 1 << (max(int(n), 1) - 1).bit_length()
