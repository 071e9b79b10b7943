"""RMSNorm fused with its residual add and the layer scale, for fp32 rows on the CPU (the decode step's norms).

Owns `rms_norm_fused` (public, `impl="auto"|"cpp"|"ref"`), its torch reference `rms_norm_fused_ref` and the
validating launcher `rms_norm_fused_cpp` of the C++ kernel beside this file (`rmsnorm_cpu.cpp`, built by
`kernels._cpp`). It computes `(residual + rms_norm(x, weight)) * scale`, each of weight, residual and scale
optional, with `kernels.rmsnorm`'s numerics (fp32: `x * rsqrt(mean(x^2) + eps) * weight`, no `1 + weight`).

Also owns `rms_norm_rope` (same switch, reference `rms_norm_rope_ref`, launcher `rms_norm_rope_cpp`): the decode
step's q / k / v heads (B, P, D) each normed by its row of a stacked weight (P, D), then the first `rotate` heads of
each row rotated by RoPE (cos, sin (B, D)), as `canvas.model.decode.pre_attention` needs them.

Why: a one-token decode step runs ten norms a layer on a few rows; torch's CPU `rms_norm` is ~8 small ops each,
so the norms cost more in dispatch than in arithmetic. One call here does a norm, its residual add and the layer
scale, or (`rms_norm_rope`) the heads' norm and their rotation, seven torch ops a layer. The kernel's sum of squares
is ordered differently from torch's, and its rotation may fuse a multiply-add, so results agree to fp32 rounding.

Legend: R rows (every leading dim flattened), D normalised (last) dim, B decode rows, P heads a row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from kernels._cpp import auto_impl, build_error, extension

__all__ = ["Impl", "fused_kernel", "rms_norm_fused", "rms_norm_fused_cpp", "rms_norm_fused_ref", "rms_norm_rope",
           "rms_norm_rope_cpp", "rms_norm_rope_ref", "rope_kernel"]

Impl = Literal["auto", "cpp", "ref"]
_IMPLS: tuple[str, ...] = ("auto", "cpp", "ref")


def rms_norm_fused_ref(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                       residual: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference. x (..., D) fp32, weight (D,) or (P, D) (broadcast over x's last two dims: stacked
    per-head weights), residual like x, scale (1,) -> (..., D) fp32.

    Bytes: read R*D*4 (x2 with residual) + D*4, write R*D*4. FLOPs: ~5*R*D.
    """
    if weight is None or weight.dim() == 1:
        y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    else:
        y = F.rms_norm(x, (x.shape[-1],), None, eps) * weight
    if residual is not None:
        y = residual + y
    return y if scale is None else y * scale


def _check(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None,
           scale: torch.Tensor | None, eps: float) -> None:
    if x.dim() < 1 or x.shape[-1] == 0 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU fp32 tensor with a non-empty last dim, got {tuple(x.shape)} {x.dtype} "
                         f"on {x.device}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    wshape = (x.shape[-1],) if weight is None or weight.dim() == 1 else tuple(x.shape[-2:])
    for name, t, shape in (("weight", weight, wshape), ("residual", residual, tuple(x.shape)), ("scale", scale, (1,))):
        if t is not None and (tuple(t.shape) != shape or t.dtype != torch.float32 or t.device.type != "cpu"):
            raise ValueError(f"{name} must be a CPU fp32 tensor of shape {shape}, got {tuple(t.shape)} {t.dtype}")


def rms_norm_fused_cpp(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                       residual: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Validating launcher of the C++ kernel; RuntimeError where it could not be built."""
    _check(x, weight, residual, scale, eps)
    fn = fused_kernel()
    if fn is None:
        raise RuntimeError(f"the CPU rms_norm kernel is unavailable here: {build_error() or 'unknown'}")
    D = x.shape[-1]
    res = None if residual is None else residual.reshape(-1, D).contiguous()
    out = fn(x.reshape(-1, D).contiguous(), None if weight is None else weight.contiguous(), eps, res,
             None if scale is None else scale.contiguous())
    return out.view(x.shape)


def fused_kernel() -> Callable[..., torch.Tensor] | None:
    """The raw entry point `rms_norm_fused(x (R, D), weight, eps, residual, scale)`, all fp32 and contiguous (it
    checks them itself), or None where the extension did not build: for hot loops."""
    mod = extension()
    return None if mod is None else mod.rms_norm_fused


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                   residual: torch.Tensor | None = None, scale: torch.Tensor | None = None, *,
                   impl: Impl = "auto") -> torch.Tensor:
    """`(residual + rms_norm(x, weight, eps)) * scale` over the last dim. "auto": the C++ kernel where it built
    (one warning where it did not) and no input needs grad, else the reference."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                 for t in (x, weight, residual, scale))
        eligible = not grads and x.dtype == torch.float32 and x.device.type == "cpu"
        impl = auto_impl(eligible, eligible and fused_kernel() is not None, "CPU rms_norm kernel")
    if impl == "ref":
        return rms_norm_fused_ref(x, weight, eps, residual, scale)
    return rms_norm_fused_cpp(x, weight, eps, residual, scale)


def rms_norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      rotate: int) -> torch.Tensor:
    """Torch reference. x (B, P, D) fp32, weight (P, D), cos / sin (B, D) -> (B, P, D): rms_norm(x) * weight, and
    heads [0, rotate) of each row rotated: y * cos + cat(-y[D/2:], y[:D/2]) * sin.

    Bytes: read B*P*D*4 + P*D*4 + 2*B*D*4, write B*P*D*4. FLOPs: ~8*B*P*D.
    """
    y = F.rms_norm(x, (x.shape[-1],), None, eps) * weight  # (B, P, D)
    half = x.shape[-1] // 2
    qk = y[:, :rotate]
    rotated = qk * cos[:, None] + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin[:, None]
    return torch.cat((rotated, y[:, rotate:]), dim=1)


def _check_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                rotate: int) -> None:
    if x.dim() != 3 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] % 2:
        raise ValueError(f"x must be a (B, P, D) CPU fp32 tensor with an even D, got {tuple(x.shape)} {x.dtype}")
    B, P, D = x.shape
    for name, t, shape in (("weight", weight, (P, D)), ("cos", cos, (B, D)), ("sin", sin, (B, D))):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU fp32 tensor of shape {shape}, got {tuple(t.shape)} {t.dtype}")
    if not eps > 0 or not 0 <= rotate <= P:
        raise ValueError(f"need eps > 0 and 0 <= rotate <= P = {P}, got {eps}, {rotate}")


def rope_kernel() -> Callable[..., torch.Tensor] | None:
    """The raw entry point `rms_norm_rope(x (B * P, D), weight (P, D), eps, cos (B, D), sin (B, D), rotate)`, all
    fp32 and contiguous (it checks them itself), or None where the extension did not build: for hot loops."""
    mod = extension()
    return None if mod is None else mod.rms_norm_rope


def rms_norm_rope_cpp(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      rotate: int) -> torch.Tensor:
    """Validating launcher of the C++ kernel; RuntimeError where it could not be built."""
    _check_rope(x, weight, eps, cos, sin, rotate)
    fn = rope_kernel()
    if fn is None:
        raise RuntimeError(f"the CPU rms_norm kernel is unavailable here: {build_error() or 'unknown'}")
    B, P, D = x.shape
    out = fn(x.reshape(B * P, D).contiguous(), weight.contiguous(), eps, cos.contiguous(), sin.contiguous(), rotate)
    return out.view(B, P, D)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  rotate: int, *, impl: Impl = "auto") -> torch.Tensor:
    """The decode step's head norms and RoPE in one call (module docstring). "auto": the C++ kernel where it built
    (one warning where it did not) and no input needs grad, else the reference."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, cos, sin))
        eligible = not grads and x.dtype == torch.float32 and x.device.type == "cpu"
        impl = auto_impl(eligible, eligible and rope_kernel() is not None, "CPU rms_norm kernel")
    if impl == "ref":
        _check_rope(x, weight, eps, cos, sin, rotate)
        return rms_norm_rope_ref(x, weight, eps, cos, sin, rotate)
    return rms_norm_rope_cpp(x, weight, eps, cos, sin, rotate)
