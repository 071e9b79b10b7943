"""Fused mixture-of-experts FFN for the DiffusionGemma block: routing output in, combined expert output out.

Owns `fused_moe` (public, `impl="auto"|"triton"|"ref"`), its vectorised torch reference `fused_moe_ref`, the
routing metadata builder `moe_align_block_size`, and the Triton path:
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

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels._triton import Impl, KernelUnavailableError, resolve_impl

__all__ = ["MoeAlignment", "fused_moe", "fused_moe_ref", "moe_align_block_size", "validate_moe_inputs"]


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


def fused_moe_ref(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """Vectorised torch reference: sort (token, slot) pairs by expert, one pair of matmuls per expert that has tokens.

    Shapes: hidden_states (T, D); topk_weights (T, K) float; topk_ids (T, K) int in [0, E);
    w_gate_up (E, 2I, D); w_down (E, D, I) -> (T, D) in hidden_states.dtype.
    Per-expert matmuls run in the input dtype (as the transformers module does); the weighted sum over the K slots
    is accumulated in fp32 and rounded once.
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
    y_sorted = torch.empty_like(x_sorted)  # (P, D)
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gate, up = F.linear(x_sorted[rows], w_gate_up[expert]).chunk(2, dim=-1)  # (n, I) each
        y_sorted[rows] = F.linear(F.gelu(gate, approximate="tanh") * up, w_down[expert])  # (n, D)
        start += n
    weighted = y_sorted.float() * topk_weights.reshape(-1)[order].float().unsqueeze(-1)  # (P, D) fp32
    out = torch.zeros(t, d, dtype=torch.float32, device=hidden_states.device)
    out.index_add_(0, token_of, weighted)
    return out.to(hidden_states.dtype)


class MoeAlignment(NamedTuple):
    """Routing metadata for the grouped GEMMs.

    sorted_token_ids (S,) int64: pair indices p = t*K + k grouped by expert, each expert's run padded to a multiple
        of block_m with the sentinel P (= T*K, out of range; kernels mask it). S is a static upper bound,
        P + min(E, P)*(block_m - 1) rounded up to block_m, so building this needs no host sync.
    expert_ids (B,) int64: the expert of each block_m tile; tiles past the real ones hold E (kernels skip them).
    num_tokens_post_padded (1,) int64: sum over experts of the padded run lengths (real tiles * block_m).
    """

    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> MoeAlignment:
    """Sort (token, slot) pairs by expert and pad each expert's run to a multiple of block_m (see MoeAlignment).

    topk_ids (T, K) int in [0, E). Runs on the device of topk_ids with torch ops only, no host sync; ids out of
    range raise (CPU) or trip a device assert (CUDA) in the scatter below.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be (T, K), got shape {tuple(topk_ids.shape)}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # (P,)
    p = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # (E,)
    padded_end = torch.cumsum(padded, 0)  # (E,)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # (P,)
    sorted_expert = flat[order]
    rank = torch.arange(p, device=dev) - count_start[sorted_expert]  # position inside the expert's run
    dest = padded_start[sorted_expert] + rank
    bound = p + min(num_experts, p) * (block_m - 1)
    s = (bound + block_m - 1) // block_m * block_m
    sorted_token_ids = torch.full((s,), p, dtype=torch.long, device=dev)
    sorted_token_ids[dest] = order
    tile_start = torch.arange(0, s, block_m, device=dev)  # (B,)
    expert_ids = torch.searchsorted(padded_end, tile_start, right=True)  # E for tiles past the real ones
    return MoeAlignment(sorted_token_ids, expert_ids, padded_end[-1:].clone())


def fused_moe_triton(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """Triton launcher (kernels land in the next commit; until then the Triton path is unavailable)."""
    validate_moe_inputs(hidden_states, topk_weights, topk_ids, w_gate_up, w_down)
    raise KernelUnavailableError("the Triton fused MoE kernel is not on main yet; use impl='ref'")


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
