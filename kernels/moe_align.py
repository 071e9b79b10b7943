"""Routing metadata for the fused MoE grouped GEMMs: (token, slot) pairs grouped by expert, padded to the M tile.

Owns `moe_align_block_size` (public, `impl="auto"|"triton"|"ref"`), its torch version and its single-program Triton
kernel, and `MoeAlignment`, the layout both produce. Invariants: every pair index appears exactly once in
`sorted_token_ids`; each expert's run starts at a multiple of block_m; padding slots hold the sentinel P (= T*K)
and tiles past the real ones have expert E, so consumers mask both without a host sync. The layout follows the
public vLLM design (`vllm/model_executor/layers/fused_moe/`).

Dimension legend: T tokens, K experts per token, E experts, P = T*K pairs, S padded slots, B = S / block_m tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels._triton import Impl, jit, next_power_of_2, resolve_impl, tl

__all__ = ["MoeAlignment", "moe_align_block_size", "moe_align_triton"]


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


def _moe_align_torch(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> MoeAlignment:
    """Torch version of `moe_align_block_size` (stable order inside each expert run, ~25 small launches).

    Ids out of range raise (CPU) or trip a device assert (CUDA) in the scatter below.
    """
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
    s = _padded_slots(p, block_m, num_experts)
    sorted_token_ids = torch.full((s,), p, dtype=torch.long, device=dev)
    sorted_token_ids[dest] = order
    tile_start = torch.arange(0, s, block_m, device=dev)  # (B,)
    expert_ids = torch.searchsorted(padded_end, tile_start, right=True)  # E for tiles past the real ones
    return MoeAlignment(sorted_token_ids, expert_ids, padded_end[-1:].clone())


@jit
def _moe_align_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    num_post_ptr,
    cursor_ptr,
    num_pairs,
    num_experts,
    num_tiles,
    num_slots,
    BLOCK_M: tl.constexpr,
    NUM_BINS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Single program: histogram of expert ids -> padded run starts -> tile experts -> scatter pair ids.

    ids (P,) int; sorted (S,) int64, expert_ids (B,) int64, num_post (1,) int64 are outputs; cursor (NUM_BINS,) int32
    is scratch. NUM_BINS is a power of two >= E. Ids outside [0, E) are dropped (masked), never used as addresses.
    Positions inside an expert's run come from atomic increments, so their order is unspecified.
    """
    bins = tl.arange(0, NUM_BINS)
    counts = tl.zeros((NUM_BINS,), tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P).to(tl.int64)
        in_range = offs < num_pairs
        e = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int32)
        valid = in_range & (e >= 0) & (e < num_experts)
        counts += tl.histogram(tl.where(valid, e, 0), NUM_BINS, mask=valid)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # (NUM_BINS,)
    ends = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + bins, ends - padded)
    total = tl.sum(padded, axis=0)
    tl.store(num_post_ptr, total.to(tl.int64))
    for t0 in range(0, num_tiles, BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        tile_start = tiles * BLOCK_M
        # the expert of a tile is the number of runs that end at or before its first slot (searchsorted, right)
        expert = tl.sum((ends[None, :] <= tile_start[:, None]).to(tl.int32), axis=1)
        expert = tl.where(tile_start < total, expert, num_experts)
        tl.store(expert_ids_ptr + tiles, expert.to(tl.int64), mask=tiles < num_tiles)
    for s0 in range(0, num_slots, BLOCK_P):
        offs = s0 + tl.arange(0, BLOCK_P).to(tl.int64)
        tl.store(sorted_ptr + offs, tl.full((BLOCK_P,), num_pairs, tl.int64), mask=offs < num_slots)
    tl.debug_barrier()  # sentinel fill and cursor starts must land before the scatter below
    for p0 in range(0, num_pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P).to(tl.int64)
        in_range = offs < num_pairs
        e = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int32)
        valid = in_range & (e >= 0) & (e < num_experts)
        dest = tl.atomic_add(cursor_ptr + tl.where(valid, e, 0), 1, mask=valid)
        tl.store(sorted_ptr + dest, offs, mask=valid)


def moe_align_triton(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> MoeAlignment:
    """The Triton path of `moe_align_block_size`, without its checks: for a caller that validated `topk_ids`
    (`kernels.moe.fused_moe_triton`)."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    p = flat.numel()
    dev = flat.device
    s = _padded_slots(p, block_m, num_experts)
    num_tiles = s // block_m
    num_bins = next_power_of_2(num_experts)
    sorted_ids = torch.empty(s, dtype=torch.long, device=dev)
    expert_ids = torch.empty(num_tiles, dtype=torch.long, device=dev)
    num_post = torch.empty(1, dtype=torch.long, device=dev)
    cursor = torch.empty(num_bins, dtype=torch.int32, device=dev)
    _moe_align_kernel[(1,)](
        flat,
        sorted_ids,
        expert_ids,
        num_post,
        cursor,
        p,
        num_experts,
        num_tiles,
        s,
        BLOCK_M=block_m,
        NUM_BINS=num_bins,
        BLOCK_P=1024,
        BLOCK_T=max(16, 8192 // num_bins),
        num_warps=4,
        enable_fp_fusion=True,  # explicit: triton 3.9 warns when the default is left implicit
    )
    return MoeAlignment(sorted_ids, expert_ids, num_post)


def _padded_slots(num_pairs: int, block_m: int, num_experts: int) -> int:
    """Static upper bound on the padded length: every expert that has pairs adds at most block_m - 1 slots."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return (bound + block_m - 1) // block_m * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, *, impl: Impl = "auto"
) -> MoeAlignment:
    """Group (token, slot) pairs by expert and pad each expert's run to a multiple of block_m (see MoeAlignment).

    topk_ids (T, K) int in [0, E). No host sync on either path. The Triton path is one single-program launch (the
    torch path is ~25 small ones, which would dominate a 256-token MoE call); it orders pairs inside a run
    arbitrarily and drops out-of-range ids, while the torch path keeps a stable order and raises on them.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be (T, K), got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"topk_ids must be int64 or int32, got {topk_ids.dtype}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if resolve_impl(impl, topk_ids) == "triton":
        return moe_align_triton(topk_ids, block_m, num_experts)
    return _moe_align_torch(topk_ids, block_m, num_experts)
