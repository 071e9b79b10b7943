"""Q8 GEMM on the CPU: fp32 activations quantised at run time to int8 per block of 32, int8 weights per block of 32.

Owns `quantize_weight` (an fp32 (N, K) weight -> the kernel's uint8 layout and bf16 block scales), `live_columns`
(the mask of a weight's non-negligible columns, which the activations are multiplied by before quantisation),
`q8_linear` (public, `impl="auto"|"cpp"|"ref"`), its torch reference `q8_linear_ref`, the validating launcher
`q8_linear_cpp`, and the C++ kernel beside this file (`q8_gemm.cpp`; built once per machine and instruction set by
`kernels._cpp`, cached under ~/.cache/dcanvas/kernels). `available()` says whether it built; "auto" falls back to
the reference with one warning when it did not (no compiler, a failed build), so nothing breaks on a machine
without g++.

Why: a decode step multiplies a few rows by every weight. torch's weight-only int8 kernel reads them at a third of
this CPU's bandwidth and costs nearly K times its one-row time at K rows; fbgemm's dynamic int8 is fast but takes one
activation scale per tensor, which the converted Gemma's outliers make useless. Here, as llama.cpp's Q8_0 does,
each block of 32 activations and each block of 32 weights of a channel gets its own scale (an outlier coarsens only
its block), the dot products run in int32 (AVX-512 VNNI `vpdpbusd`, an AVX2 fallback, a scalar one), and each tile
of weight rows is reused from cache for every activation row, so a batch of 8 reads the weights once. (One scale
per channel cost the default build's probe NLL 1.0034-1.0062x fp32 by kind, over the 1.005x gate; per block
1.0015-1.0036x: BENCHMARKS.md, issue 31.)

Numerics (the contract the reference states): out = dequant(quant(x * kmask)) @ dequant(w).T (kmask: 1 on the live
columns, 0 on the negligible ones, or None: all ones), where quant(x) rounds x / d to the nearest integer (ties to
even), d = max|x_block| / 127 per block of 32 along K, and w = q * s with q in [-127, 127] and s the bf16 scale of
its (block of 32, channel), max|w_block| / 127 rounded up to bf16 (so no weight clamps). The kernel's block dot
products are exact; its fp32 accumulation order differs from the reference's, so the two agree to fp32 rounding,
not bit for bit.

Layout (what `quantize_weight` returns): wq (G, Kp / 4, 64) uint8, the weights + 128 packed in groups of 16
output channels, byte [g, k4, 4 c + j] = q[16 g + c, 4 k4 + j] + 128 (one `vpdpbusd` operand: 4 bytes of K for 16
channels), Kp = K rounded up to 32, G = ceil(N / 16); padding columns and channels are 128 (q = 0); wscale
(Kp / 32, N) bf16, block-major (a group's 16 scales of one block are adjacent), whose width is N. `unpack_weight`
gives back the (N, Kp) uint8 matrix. Any K: the activations are read as zero-padded to Kp (so a K that is not a
multiple of 32 ends in a shorter block: the converted Gemma's attention output has K = 4 x 258). The width only
bounds K (any K in (Kp - 32, Kp] fits it): the caller passes the K the weight was built with (`Int8Linear` does).

Legend: M activation rows, K reduced dim, Kp padded K, N output channels, G groups of 16 channels, nb = Kp / 32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from kernels._cpp import auto_impl, build_error, build_isa, extension

__all__ = ["GROUP", "Impl", "QK", "available", "build_isa", "kernel", "live_columns", "q8_linear",
           "q8_linear_cpp", "q8_linear_ref", "quantize_activations_ref", "quantize_weight", "unpack_weight",
           "use_amx"]

Impl = Literal["auto", "cpp", "ref"]
_IMPLS: tuple[str, ...] = ("auto", "cpp", "ref")
QK = 32  # activation block along K; weights are padded to a multiple of it
GROUP = 16  # output channels per packed group: the 16 int32 lanes of one 512-bit register


def available() -> bool:
    """Whether the C++ kernel builds and loads on this machine (builds it on the first call)."""
    return extension() is not None


def use_amx(wanted: bool = True) -> bool:
    """Let the kernel run batches of 8 rows or more on AMX tiles (the default) or not; returns whether it will: the
    CPU has amx_int8, the OS granted the tile state and the kernel built. The output is the VNNI path's bit for bit
    either way (`q8_gemm.cpp`), so this only ever changes speed. `DCANVAS_Q8_AMX=off` sets the default to off."""
    mod = extension()
    return bool(mod.q8_amx(wanted)) if mod is not None else False


def kernel() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None:
    """The built kernel's raw entry point `q8_gemm(x, wq, wscale, kmask)` (None where it did not build), for hot loops
    that validated their weights once (`canvas.model.int8`): it checks dtypes and shapes itself (RuntimeError),
    but x must be (M, K) fp32 and contiguous."""
    mod = extension()
    return None if mod is None else mod.q8_gemm


def _check_weight(w: torch.Tensor) -> torch.Tensor:
    if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] == 0:
        raise ValueError(f"quantize_weight takes a 2-D fp32 weight with K > 0, got {tuple(w.shape)} {w.dtype}")
    return w.detach()


def _bf16_up(s: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 -> the nearest bf16 value at or above it (as fp32): the low 16 bits rounded up."""
    bits = s.contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def _quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) fp32 -> (q (N, Kp) fp32 holding integers in [-127, 127], zero past K; s (N, Kp / 32) fp32 holding
    bf16 values): symmetric per (channel, block of 32), s = max|w_block| / 127 rounded up to bf16; an all-zero
    block keeps scale 1."""
    w = _check_weight(w)
    N, K = w.shape
    wb = F.pad(w, (0, -K % QK)).view(N, -1, QK)  # (N, nb, 32)
    amax = wb.abs().amax(dim=-1)  # (N, nb)
    s = _bf16_up((amax / 127).masked_fill_(amax == 0, 1.0))  # (N, nb)
    return (wb / s[..., None]).round_().clamp_(-127, 127).view(N, -1), s


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) fp32 -> (wq (G, Kp / 4, 64) uint8, the packed layout of the module docstring; wscale (Kp / 32, N)
    bf16): symmetric per (block of 32, channel), q = round(w / s) in [-127, 127]."""
    qf, s = _quantize_blocks(w)  # (N, Kp), (N, nb)
    N, Kp = qf.shape
    q = F.pad(qf.add_(128).to(torch.uint8), (0, 0, 0, -N % GROUP), value=128)  # (G * 16, Kp)
    G = q.shape[0] // GROUP
    wq = q.view(G, GROUP, Kp // 4, 4).transpose(1, 2).reshape(G, Kp // 4, GROUP * 4)  # (G, Kp / 4, 64)
    return wq.contiguous(), s.t().to(torch.bfloat16).contiguous()


def live_columns(w: torch.Tensor) -> torch.Tensor | None:
    """w (N, K) -> kmask (K,) fp32: 0 where a column is negligible in every row (under half a step of one int8
    scale for the whole row: |w| < max|w_row| / 254), 1 elsewhere; None when every column is live. Such a column
    contributes next to nothing to the product, but its activation, quantised with its neighbours, would set their
    block's scale: the converted Gemma's attention output carries its large value-anchor activations under such
    columns (weights ~1e-5 of their rows' largest: `canvas/convert/gemma3.py` builds them near zero), which cost
    q8 the probe bound (news NLL/char 1.099x fp32) before this mask. The mask drops them from the product."""
    w = _check_weight(w)
    amax = w.abs().amax(dim=1, keepdim=True)  # (N, 1)
    live = (w.abs() * 254 >= amax).logical_and_(amax > 0).any(dim=0)  # (K,)
    return None if bool(live.all()) else live.float().contiguous()


def unpack_weight(wq: torch.Tensor, N: int) -> torch.Tensor:
    """The packed wq (G, Kp / 4, 64) -> the (N, Kp) uint8 matrix q + 128 it holds."""
    G, K4, _ = wq.shape
    return wq.view(G, K4, GROUP, 4).transpose(1, 2).reshape(G * GROUP, K4 * 4)[:N]


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) fp32 -> (q (M, K32) int8 values as fp32, d (M, K32 / 32) block scales): the kernel's rounding,
    x zero-padded to K32, K rounded up to 32."""
    M, K = x.shape
    xb = F.pad(x, (0, -K % QK)).view(M, -1, QK)  # (M, K32 / 32, 32)
    d = xb.abs().amax(dim=-1) / 127  # (M, K32 / 32)
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (xb * inv[..., None]).round_().view(M, -1), d


def q8_linear_ref(x: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor,
                  kmask: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: x (M, K) fp32, packed wq, wscale (Kp / 32, N), kmask (K,) or None -> (M, N) fp32, the
    module's numerics.

    Bytes: read M*K*4 + G*16*Kp + N*Kp/16, write M*N*4. FLOPs: 2*M*N*K (plus the dequantisation, O(M*K + N*K)).
    """
    M, K = x.shape
    q, d = quantize_activations_ref(x.float() if kmask is None else x.float() * kmask)  # (M, K32), (M, K32 / 32)
    xd = (q.view(M, -1, QK) * d[..., None]).view(M, -1)[:, :K]  # (M, K) dequantised activations
    N = wscale.shape[1]
    s = wscale.t().float().repeat_interleave(QK, dim=1)  # (N, Kp): each block's scale over its 32 columns
    w = ((unpack_weight(wq, N).float() - 128) * s)[:, :K]  # (N, K)
    return xd @ w.t()


def _check(x: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor, kmask: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be (M, K) fp32, got {tuple(x.shape)} {x.dtype}")
    if wq.dim() != 3 or wq.shape[2] != 4 * GROUP or wq.dtype != torch.uint8:
        raise ValueError(f"wq must be (G, Kp / 4, 64) uint8 from quantize_weight, got {tuple(wq.shape)} {wq.dtype}")
    if (wscale.dim() != 2 or wscale.dtype != torch.bfloat16 or -(-wscale.shape[1] // GROUP) != wq.shape[0]
            or wscale.shape[0] * QK != wq.shape[1] * 4):
        raise ValueError(f"wscale must be (Kp / 32, N) bf16 with Kp = {wq.shape[1] * 4} and ceil(N / 16) = "
                         f"{wq.shape[0]} groups, got {tuple(wscale.shape)} {wscale.dtype}")
    K = x.shape[1]
    if K == 0:
        raise ValueError("K must be > 0")
    if wq.shape[1] * 4 != K + (-K % QK):
        raise ValueError(f"wq is {wq.shape[1] * 4} wide; K={K} needs {K + (-K % QK)} (quantize_weight's padding)")
    if kmask is not None and (kmask.shape != (K,) or kmask.dtype != torch.float32):
        raise ValueError(f"kmask must be ({K},) fp32 from live_columns, got {tuple(kmask.shape)} {kmask.dtype}")
    if any(t.device.type != "cpu" for t in (x, wq, wscale, *(() if kmask is None else (kmask,)))):
        raise ValueError("q8_linear runs on CPU tensors only")


def q8_linear_cpp(x: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor,
                  kmask: torch.Tensor | None = None) -> torch.Tensor:
    """Validating launcher of the C++ kernel (contract in the module docstring); raises RuntimeError when the
    kernel could not be built here."""
    _check(x, wq, wscale, kmask)
    mod = extension()
    if mod is None:
        raise RuntimeError(f"the q8 C++ kernel is unavailable here: {build_error() or 'unknown'}")
    km = None if kmask is None else kmask.contiguous()
    out: torch.Tensor = mod.q8_gemm(x.contiguous(), wq.contiguous(), wscale.contiguous(), km)
    return out


def q8_linear(x: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor, impl: Impl = "auto",
              kmask: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) fp32 @ the Q8 weight (`quantize_weight`'s; `kmask` from `live_columns`) -> (..., N) fp32.
    "auto": the C++ kernel where it built (a warning, once, where it did not) and no input needs grad, else the
    reference."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if impl == "auto":
        impl = auto_impl(not (torch.is_grad_enabled() and x.requires_grad), available(), "q8 C++ kernel")
    if impl == "ref":
        _check(flat, wq, wscale, kmask)
        out = q8_linear_ref(flat, wq, wscale, kmask)
    else:
        out = q8_linear_cpp(flat, wq, wscale, kmask)
    return out.view(*lead, wscale.shape[1])
