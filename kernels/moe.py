"""Fused mixture-of-experts FFN for the DiffusionGemma block: routing output in, combined expert output out.

Owns `fused_moe` (public, `impl="auto"|"triton"|"ref"`), its vectorised torch reference `fused_moe_ref`, and the
Triton path (the routing metadata builder `moe_align_block_size` lives in `kernels.moe_align`):
    moe_align_block_size -> grouped GEMM gate_up with GELU-tanh gating fused (`_moe_gate_up_kernel`)
    -> grouped GEMM down with the routing weight multiplied in (`_moe_down_kernel`) -> sum over the K slots.
Semantics are exactly `DiffusionGemmaTextExperts.forward` (transformers 5.23.0,
`models/diffusion_gemma/modeling_diffusion_gemma.py`): for token t, slot k, e = topk_ids[t, k],
    h = x[t] @ w_gate_up[e].T;  a = gelu_tanh(h[:I]) * h[I:];  out[t] += topk_weights[t, k] * (a @ w_down[e].T).
The kernel layout follows the public vLLM design (`vllm/model_executor/layers/fused_moe/`): tokens sorted by expert
and padded per expert to the M tile so every tile reads one expert's weights.

Dimension legend: T tokens, D hidden, K experts per token (top-k), E experts, I expert FFN (moe_intermediate) size,
P = T*K (token, slot) pairs, S = padded length of the sorted pair list, B = S / BLOCK_M tiles.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels._triton import Impl, dot_in_fp32, jit, next_power_of_2, resolve_impl, tl
from kernels._triton import cdiv as triton_cdiv
from kernels.moe_align import MoeAlignment, moe_align_block_size, moe_align_triton

__all__ = [
    "MoeAlignment",
    "MoeTiles",
    "default_tiles",
    "expert_ffn",
    "fused_moe",
    "fused_moe_ref",
    "fused_moe_triton",
    "moe_align_block_size",
    "validate_moe_inputs",
]


def validate_moe_inputs(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> tuple[int, int, int, int, int]:
    """Check shapes, dtypes and devices (no host sync); return (T, D, K, E, I) or raise ValueError."""
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be (T, D), got shape {tuple(hidden_states.shape)}")
    t, d = hidden_states.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids must be (T={t}, K), got shape {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"topk_ids must be int64 or int32, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != d or w_gate_up.shape[1] % 2 != 0:
        raise ValueError(f"w_gate_up must be (E, 2*I, D={d}), got shape {tuple(w_gate_up.shape)}")
    e, two_i, _ = w_gate_up.shape
    i = two_i // 2
    if w_down.shape != (e, d, i):
        raise ValueError(f"w_down must be (E={e}, D={d}, I={i}), got shape {tuple(w_down.shape)}")
    if k < 1 or k > e:
        raise ValueError(f"top-k must be in [1, E={e}], got K={k}")
    if not hidden_states.is_floating_point():
        raise ValueError(f"hidden_states must be floating point, got {hidden_states.dtype}")
    if w_gate_up.dtype != hidden_states.dtype or w_down.dtype != hidden_states.dtype:
        raise ValueError(
            f"weights must share hidden_states dtype {hidden_states.dtype}, got {w_gate_up.dtype}, {w_down.dtype}"
        )
    devices = {x.device for x in (hidden_states, topk_weights, topk_ids, w_gate_up, w_down)}
    if len(devices) != 1:
        raise ValueError(f"all MoE inputs must be on one device, got {sorted(str(x) for x in devices)}")
    return t, d, k, e, i


def expert_ffn(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert's FFN on its rows: x (n, D), w_gate_up (2I, D), w_down (D, I) -> (n, D), in the input dtype."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)  # (n, I) each
    return F.linear(F.gelu(gate, approximate="tanh") * up, w_down)


def fused_moe_ref(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    ffn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = expert_ffn,
) -> torch.Tensor:
    """Vectorised torch reference: sort (token, slot) pairs by expert, one pair of matmuls per expert that has tokens
    (or, when routing is balanced enough that padding every expert to the longest run at most doubles the work,
    two batched matmuls over all experts).

    Shapes: hidden_states (T, D); topk_weights (T, K) float; topk_ids (T, K) int in [0, E);
    w_gate_up (E, 2I, D); w_down (E, D, I) -> (T, D) in hidden_states.dtype.
    Per-expert matmuls run in the input dtype (as the transformers module does); the weighted sum over the K slots
    is accumulated in fp32 and rounded once. `ffn` replaces `expert_ffn` (the bench passes a `torch.compile`d one:
    compiling this whole function would unroll the data-dependent loop over experts).
    Bytes (weights dominate): read E_hit*3*I*D*w.itemsize + T*D*x.itemsize, write T*D*x.itemsize.
    FLOPs: 2*P*D*2I (gate_up) + 2*P*I*D (down) = 6*P*D*I, P = T*K.
    """
    t, d, k, e, _ = validate_moe_inputs(hidden_states, topk_weights, topk_ids, w_gate_up, w_down)
    flat_ids = topk_ids.reshape(-1).long()  # (P,)
    order = torch.argsort(flat_ids, stable=True)  # (P,) pair index p = t*K + k, grouped by expert
    token_of = order // k  # (P,)
    # One host sync for the per-expert group sizes; the loop below runs only over experts that have tokens.
    counts = torch.bincount(flat_ids, minlength=e)
    if counts.numel() != e or bool((flat_ids < 0).any()):
        raise ValueError(f"topk_ids must lie in [0, E={e})")
    x_sorted = hidden_states[token_of]  # (P, D)
    sizes = counts.tolist()
    p, cap = flat_ids.numel(), max(sizes)
    if ffn is expert_ffn and e * cap <= 2 * p:
        # Balanced routing: pad every expert's run to the longest and run all experts as two batched GEMMs.
        # At most twice the FLOPs of the exact grouping, a dozen ops instead of five per expert.
        sorted_ids = flat_ids[order]  # (P,)
        pos = torch.arange(p, device=flat_ids.device) - (torch.cumsum(counts, 0) - counts)[sorted_ids]  # (P,)
        x_pad = x_sorted.new_zeros(e, cap, d)  # (E, C, D)
        x_pad[sorted_ids, pos] = x_sorted
        gate, up = torch.bmm(x_pad, w_gate_up.transpose(1, 2)).chunk(2, dim=-1)  # (E, C, I) each
        y_pad = torch.bmm(F.gelu(gate, approximate="tanh") * up, w_down.transpose(1, 2))  # (E, C, D)
        y_sorted = y_pad[sorted_ids, pos]  # (P, D)
    else:
        y_sorted = torch.empty_like(x_sorted)  # (P, D)
        start = 0
        for expert, n in enumerate(sizes):
            if n == 0:
                continue
            rows = slice(start, start + n)
            y_sorted[rows] = ffn(x_sorted[rows], w_gate_up[expert], w_down[expert])  # (n, D)
            start += n
    weighted = y_sorted.float() * topk_weights.reshape(-1)[order].float().unsqueeze(-1)  # (P, D) fp32
    # Un-sort (a permutation: every pair lands in its own row), then sum each token's K slots. index_add_ over
    # the token ids would do the same, but on the CPU it is an order of magnitude slower at canvas sizes.
    unsorted = torch.empty_like(weighted)  # (P, D)
    unsorted[order] = weighted
    return unsorted.view(t, k, d).sum(dim=1).to(hidden_states.dtype)  # (T, D)


@jit
def _moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    a_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    num_pairs,
    top_k,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ap,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Grouped GEMM x @ w_gate_up[e].T with the GELU-tanh gate fused: a[p] = gelu_tanh(x[t] @ Wg.T) * (x[t] @ Wu.T).

    x (T, D) rows strided, unit stride in D; w (E, 2I, D) unit stride in D; a (P, I) written at row p = t*K + k.
    DOT_FP32: upcast both dot operands and use IEEE fp32 (see `kernels._triton.dot_in_fp32`).
    One program per (tile of BLOCK_M sorted pairs, BLOCK_N columns of I). Gate and up columns are the same
    offsets n and I + n, so one program owns both halves and applies the gate in registers (fp32).
    Padding pairs (id == P) load zeros and are not stored; tiles past num_tokens_post_padded exit at once.
    """
    pid = tl.program_id(0).to(tl.int64)
    num_n = tl.cdiv(inter, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + offs_m)  # (BM,) the buffer is a whole number of tiles long
    valid = pair < num_pairs
    token = pair // top_k
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]  # (BM, BK)
    wg_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # (BK, BN)
    wu_ptrs = wg_ptrs + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        xa = tl.load(x_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        wg = tl.load(wg_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        wu = tl.load(wu_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            xa = xa.to(tl.float32)
            acc_gate = tl.dot(xa, wg.to(tl.float32), acc_gate, input_precision="ieee")
            acc_up = tl.dot(xa, wu.to(tl.float32), acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(xa, wg, acc_gate)
            acc_up = tl.dot(xa, wu, acc_up)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    # gelu_tanh(g) = 0.5 g (1 + tanh(z)), z = sqrt(2/pi) (g + 0.044715 g^3). tl has no portable tanh; with
    # e = exp(-2|z|) in (0, 1], tanh(|z|) = (1 - e) / (1 + e) never overflows, then the sign is restored.
    z = 0.7978845608028654 * (acc_gate + 0.044715 * acc_gate * acc_gate * acc_gate)
    e2 = tl.exp(-2.0 * tl.abs(z))
    tanh_abs = (1.0 - e2) / (1.0 + e2)
    tanh_z = tl.where(z >= 0, tanh_abs, -tanh_abs)
    act = 0.5 * acc_gate * (1.0 + tanh_z) * acc_up
    a_ptrs = a_ptr + pair[:, None] * stride_ap + offs_n[None, :]
    tl.store(a_ptrs, act.to(a_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@jit
def _moe_down_kernel(
    a_ptr,
    w_ptr,
    y_ptr,
    topk_w_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    num_pairs,
    hidden,
    inter,
    stride_ap,
    stride_we,
    stride_wn,
    stride_yp,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Grouped GEMM y[p] = topk_weight[p] * (a[p] @ w_down[e].T), the routing weight applied to the fp32 accumulator.

    a (P, I) unit stride in I; w (E, D, I) unit stride in I; topk_w (P,) contiguous; y (P, D) fp32 written at row p.
    One program per (tile of BLOCK_M sorted pairs, BLOCK_N columns of D); padding as in `_moe_gate_up_kernel`.
    """
    pid = tl.program_id(0).to(tl.int64)
    num_n = tl.cdiv(hidden, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + offs_m)
    valid = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = a_ptr + pair[:, None] * stride_ap + offs_k[None, :]  # (BM, BK)
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # (BK, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = offs_k < inter - k0
        av = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        wv = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(av.to(tl.float32), wv.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(av, wv, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    route_w = tl.load(topk_w_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * route_w[:, None]
    y_ptrs = y_ptr + pair[:, None] * stride_yp + offs_n[None, :]
    tl.store(y_ptrs, acc, mask=valid[:, None] & n_mask[None, :])


class MoeTiles(NamedTuple):
    """Tile sizes for the two grouped GEMMs (all powers of two, >= 16 as `tl.dot` requires)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_tiles(num_pairs: int, num_experts: int) -> MoeTiles:
    """Pick BLOCK_M so one tile usually holds an expert's whole run (mean + 3 sigma of its pair count).

    At decode/canvas sizes the GEMMs are bound by reading expert weights; an expert whose run spans two tiles is
    read twice (L2 may or may not catch it), while padded rows only cost tensor-core work, which is plentiful.
    """
    mean = num_pairs / num_experts
    block_m = min(64, max(16, next_power_of_2(math.ceil(mean + 3 * math.sqrt(mean)))))
    return MoeTiles(block_m=block_m, block_n=64, block_k=64, num_warps=4, num_stages=3)


def fused_moe_triton(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """Triton launcher: align -> gate_up+GELU kernel -> down*weight kernel -> sum over K. Raises ValueError on bad
    shapes/dtypes/devices. Expert ids outside [0, E) are not checked (that would cost a host sync): their pairs are
    dropped and contribute nothing. Intermediates: a (P, I) in the input dtype, y (P, D) fp32.
    """
    t, d, k, e, i = validate_moe_inputs(hidden_states, topk_weights, topk_ids, w_gate_up, w_down)
    if hidden_states.stride(-1) != 1:
        raise ValueError("hidden_states must have unit stride in its last dim")
    if tiles is None:
        tiles = default_tiles(t * k, e)
    for name in ("block_m", "block_n", "block_k"):
        size = getattr(tiles, name)
        if size < 16 or size & (size - 1):
            raise ValueError(f"tiles.{name} must be a power of two >= 16, got {size}")
    out_dtype = hidden_states.dtype
    if t == 0:
        return torch.zeros(0, d, dtype=out_dtype, device=hidden_states.device)
    w_gate_up = w_gate_up.contiguous()  # no-ops for parameters; the kernels assume unit stride in the reduced dim
    w_down = w_down.contiguous()
    p = t * k
    align = moe_align_triton(topk_ids, tiles.block_m, e)  # inputs validated above
    num_m_tiles = align.sorted_token_ids.numel() // tiles.block_m
    dot_fp32 = dot_in_fp32(out_dtype)
    act = torch.empty(p, i, dtype=out_dtype, device=hidden_states.device)  # (P, I)
    _moe_gate_up_kernel[(num_m_tiles * triton_cdiv(i, tiles.block_n),)](
        hidden_states,
        w_gate_up,
        act,
        align.sorted_token_ids,
        align.expert_ids,
        align.num_tokens_post_padded,
        p,
        k,
        d,
        i,
        hidden_states.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        act.stride(0),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        DOT_FP32=dot_fp32,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        enable_fp_fusion=True,  # explicit: triton 3.9 warns when the default is left implicit
    )
    route_w = topk_weights.reshape(-1).float().contiguous()  # (P,)
    # zeros, not empty: rows of dropped (out-of-range) pairs are never written but are summed below
    y = torch.zeros(p, d, dtype=torch.float32, device=hidden_states.device)  # (P, D)
    _moe_down_kernel[(num_m_tiles * triton_cdiv(d, tiles.block_n),)](
        act,
        w_down,
        y,
        route_w,
        align.sorted_token_ids,
        align.expert_ids,
        align.num_tokens_post_padded,
        p,
        d,
        i,
        act.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        y.stride(0),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        DOT_FP32=dot_fp32,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        enable_fp_fusion=True,  # explicit: triton 3.9 warns when the default is left implicit
    )
    return y.view(t, k, d).sum(dim=1).to(out_dtype)  # (T, D): combine the K slots of each token


def fused_moe(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """MoE expert FFN for routed tokens -> (T, D) in hidden_states.dtype (shapes and semantics: module docstring)."""
    choice = resolve_impl(impl, hidden_states, topk_weights, topk_ids, w_gate_up, w_down)
    if choice == "triton":
        return fused_moe_triton(hidden_states, topk_weights, topk_ids, w_gate_up, w_down)
    return fused_moe_ref(hidden_states, topk_weights, topk_ids, w_gate_up, w_down)
