"""RMSNorm, with and without scale, and RMSNorm fused with the residual add that follows it in every block.

Owns `rms_norm` and `rms_norm_add` (public, `impl="auto"|"triton"|"ref"`), their torch references and one Triton
kernel serving both. Numerics match `DiffusionGemmaRMSNorm` in transformers 5.23.0
(`models/diffusion_gemma/modeling_diffusion_gemma.py`): compute in fp32 as `x * pow(mean(x^2) + eps, -0.5)`,
multiply by `weight.float()` when a weight is given (no `1 + weight` offset), cast back to `x.dtype`. The fused
add rounds the normed value to `x.dtype` before adding, exactly as `residual + norm(x)` does in torch.

Dimension legend: R = rows (every leading dim flattened), D = normalised (last) dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import Impl, jit, next_power_of_2, resolve_impl, tl

__all__ = ["rms_norm", "rms_norm_add", "rms_norm_ref", "rms_norm_add_ref", "rms_norm_triton", "rms_norm_add_triton"]

# One program holds a whole row in registers; past this the row would spill and a two-pass kernel would be needed.
_MAX_FUSED_D = 65536


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Torch reference. x (..., D), weight (D,) or None -> (..., D) in x.dtype.

    Bytes: read R*D*x.itemsize (+ D*w.itemsize), write R*D*x.itemsize. FLOPs: ~4*R*D (square, sum, scale, weight).
    """
    # torch's fused rms_norm computes x * rsqrt(mean(x^2) + eps) * w in one pass: the same formula, one op instead
    # of seven, which is most of its cost at the small shapes this reference serves on the CPU.
    w = None if weight is None else weight.float()
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps).type_as(x)


def rms_norm_add_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """Torch reference for `residual + rms_norm(x, weight)`. x, residual (..., D) of one dtype -> (..., D).

    Bytes: read 2*R*D*itemsize (+ D*w.itemsize), write R*D*itemsize. FLOPs: ~5*R*D.
    """
    return residual + rms_norm_ref(x, weight, eps)


@jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    res_ptr,
    out_ptr,
    n_cols,
    x_row_stride,
    res_row_stride,
    out_row_stride,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per row. x/res/out rows are strided (unit stride within a row); w is contiguous (D,).

    BLOCK_D is the next power of two >= D; columns past D are masked. Accumulation in fp32.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / n_cols
    # sqrt then divide mirrors torch.pow(m, -0.5) to within 1 ulp; the reference uses pow for JAX parity.
    y = x / tl.sqrt(mean_sq + eps)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = y * w
    # Round to the output dtype first: the unfused model computes `residual + norm(x).type_as(x)`.
    y = y.to(out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + r).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row_stride + cols, y, mask=mask)


def _as_rows(t: torch.Tensor, d: int) -> torch.Tensor:
    rows = t.reshape(-1, d)  # (R, D); a view when possible, a copy otherwise
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float) -> torch.Tensor:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dim, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    d = x.shape[-1]
    if d > _MAX_FUSED_D:
        raise ValueError(f"rms_norm Triton kernel holds a row in registers: D={d} exceeds {_MAX_FUSED_D}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if weight is not None:
        if weight.shape != (d,):
            raise ValueError(f"weight must have shape ({d},), got {tuple(weight.shape)}")
        if weight.device != x.device:
            raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual must match x: got {tuple(residual.shape)} {residual.dtype} vs {tuple(x.shape)} {x.dtype}"
            )
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device}, x on {x.device}")
    x2 = _as_rows(x, d)  # (R, D)
    out = torch.empty_like(x2)
    n_rows = x2.shape[0]
    if n_rows == 0:
        return out.reshape(x.shape)
    w = weight.contiguous() if weight is not None else x2  # dummy pointer, never read when HAS_WEIGHT is False
    r2 = _as_rows(residual, d) if residual is not None else x2
    block_d = next_power_of_2(d)
    num_warps = 4 if block_d <= 2048 else (8 if block_d <= 8192 else 16)
    _rms_norm_kernel[(n_rows,)](
        x2,
        w,
        r2,
        out,
        d,
        x2.stride(0),
        r2.stride(0),
        out.stride(0),
        float(eps),
        HAS_WEIGHT=weight is not None,
        HAS_RESIDUAL=residual is not None,
        BLOCK_D=block_d,
        num_warps=num_warps,
        enable_fp_fusion=True,  # explicit: triton 3.9 warns when the default is left implicit
    )
    return out.reshape(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Triton launcher for `rms_norm_ref`; validates shapes/devices and raises ValueError on bad input."""
    return _launch(x, weight, None, eps)


def rms_norm_add_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """Triton launcher for `rms_norm_add_ref`: one read of x and residual, one write."""
    return _launch(x, weight, residual, eps)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *, impl: Impl = "auto"
) -> torch.Tensor:
    """RMSNorm of the last dim of x (..., D), optional scale weight (D,); returns x.dtype. See module docstring."""
    tensors = (x,) if weight is None else (x, weight)
    if resolve_impl(impl, *tensors) == "triton":
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def rms_norm_add(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *, impl: Impl = "auto"
) -> torch.Tensor:
    """`residual + rms_norm(x, weight, eps)` in one pass; x and residual (..., D) share shape and dtype."""
    tensors = (x, residual) if weight is None else (x, residual, weight)
    if resolve_impl(impl, *tensors) == "triton":
        return rms_norm_add_triton(x, residual, weight, eps)
    return rms_norm_add_ref(x, residual, weight, eps)
