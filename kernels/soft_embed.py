"""Fused self-conditioning soft embedding: softmax(logits) @ embedding * scale without the (N, V) softmax.

Owns `soft_embedding` (public, `impl="auto"|"triton"|"ref"`), the torch reference `soft_embedding_ref` and the
Triton kernel `_soft_embed_kernel`. Numerics follow the self-conditioning input of `DiffusionGemmaModel.forward`
(transformers 5.23.0, `models/diffusion_gemma/modeling_diffusion_gemma.py`): softmax in fp32, probabilities cast
to the embedding dtype, matmul with the embedding, times `scale` rounded to the embedding dtype (the model passes
`hidden_size ** 0.5` through a buffer of that dtype).
The kernel is a GEMM over the vocabulary with flash-attention-style online rescaling: per tile of rows it keeps a
running max m and sum l, rescales its fp32 (rows, D-tile) accumulator by exp(m_old - m_new) whenever m grows, and
divides by l at the end, so only (tile, BLOCK_V) pieces of the softmax ever exist, in registers. At canvas sizes
(N = 256) the (row tile, D tile) grid is smaller than the GPU, so the vocabulary is also split across programs
and the per-split (max, sum, accumulator) partials are merged afterwards, as split-K flash decoding does.

Dimension legend: N rows (all leading dims of logits flattened, e.g. B * canvas), V vocabulary, D hidden.
"""

from __future__ import annotations

import torch

from kernels._triton import Impl, cdiv, dot_in_fp32, jit, resolve_impl, tl

__all__ = ["DEFAULT_TILES", "soft_embedding", "soft_embedding_ref", "soft_embedding_triton"]

# (BLOCK_N, BLOCK_D, BLOCK_V). BLOCK_D is wide because every D tile recomputes the exps of its rows' logits
# (N * V * D / BLOCK_D exps in all); a (64, 256) fp32 accumulator is 64 registers a thread at 8 warps.
DEFAULT_TILES: tuple[int, int, int] = (64, 256, 64)


def _validate(logits: torch.Tensor, embedding: torch.Tensor) -> tuple[int, int]:
    if logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor (..., V), got {logits.dtype} shape {tuple(logits.shape)}")
    if embedding.dim() != 2 or not embedding.is_floating_point():
        raise ValueError(f"embedding must be a float (V, D) matrix, got {embedding.dtype} {tuple(embedding.shape)}")
    v, d = embedding.shape
    if logits.shape[-1] != v or v == 0:
        raise ValueError(f"logits last dim {logits.shape[-1]} must equal the embedding vocab size {v} (> 0)")
    if logits.device != embedding.device:
        raise ValueError(f"logits are on {logits.device}, embedding on {embedding.device}")
    return v, d


def _scale_in(scale: float, dtype: torch.dtype) -> float:
    """`scale` rounded to the embedding dtype: the model multiplies by `embed_scale.to(dtype)`."""
    return float(torch.tensor(float(scale), dtype=dtype).item())


def soft_embedding_ref(logits: torch.Tensor, embedding: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    """Torch reference. logits (..., V) any float dtype, embedding (V, D) -> (..., D) in embedding.dtype.

    Materialises the (N, V) fp32 softmax and its cast. Bytes: read N*V*l.itemsize + V*D*e.itemsize, write
    N*D*e.itemsize (plus ~3 (N, V) temporaries here). FLOPs: 2*N*V*D (matmul) + ~5*N*V (softmax).
    """
    _validate(logits, embedding)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(embedding.dtype)  # (..., V)
    return torch.matmul(probs, embedding) * _scale_in(scale, embedding.dtype)


@jit
def _soft_embed_kernel(
    logits_ptr,
    emb_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    n_rows,
    vocab,
    dim,
    v_chunk,
    stride_l,
    stride_e,
    stride_o,
    scale,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """softmax(logits[rows, vrange]) @ emb[vrange, dcols], one program per (row tile, D tile, vocab split).

    logits (N, V) row-strided, unit stride in V; emb (V, D) row-strided, unit stride in D; out (N, D) likewise.
    Split s covers vocab [s * v_chunk, (s + 1) * v_chunk), v_chunk a multiple of BLOCK_V. Without SPLIT (one split)
    the program normalises and writes out * scale directly. With SPLIT it writes its unnormalised fp32 partials,
    part_acc (S, N, D) and part_ml (S, 2, N) = (running max m, sum l), merged by `_combine_splits`.
    Masked vocab columns load -inf (probability 0); masked rows load -inf and are not stored. m, l and acc are fp32;
    probabilities are rounded to the embedding dtype before the dot, as the reference does.
    """
    pid_n = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    dcols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    vcols = tl.arange(0, BLOCK_V).to(tl.int64)
    row_mask = rows < n_rows
    d_mask = dcols < dim
    neg_inf = float("-inf")
    m = tl.full((BLOCK_N,), neg_inf, tl.float32)
    l_sum = tl.zeros((BLOCK_N,), tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    v_begin = pid_s * v_chunk
    v_end = tl.minimum(v_begin + v_chunk, vocab)
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v = v0 + vcols
        v_mask = offs_v < v_end
        x = tl.load(
            logits_ptr + rows[:, None] * stride_l + offs_v[None, :],
            mask=row_mask[:, None] & v_mask[None, :],
            other=neg_inf,
        ).to(tl.float32)  # (BN, BV)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_safe = tl.where(m_new == neg_inf, 0.0, m_new)  # rows with only -inf so far: avoid -inf - -inf
        alpha = tl.exp(m - m_safe)
        p = tl.exp(x - m_safe[:, None])  # (BN, BV) unnormalised probabilities
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        e = tl.load(
            emb_ptr + offs_v[:, None] * stride_e + dcols[None, :], mask=v_mask[:, None] & d_mask[None, :], other=0.0
        )  # (BV, BD)
        acc = acc * alpha[:, None]
        if DOT_FP32:
            acc = tl.dot(p.to(e.dtype).to(tl.float32), e.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(e.dtype), e, acc)
        m = m_new
    out_mask = row_mask[:, None] & d_mask[None, :]
    if SPLIT:
        tl.store(part_acc_ptr + (pid_s * n_rows + rows[:, None]) * dim + dcols[None, :], acc, mask=out_mask)
        if pid_d == 0:
            tl.store(part_ml_ptr + (pid_s * 2) * n_rows + rows, m, mask=row_mask)
            tl.store(part_ml_ptr + (pid_s * 2 + 1) * n_rows + rows, l_sum, mask=row_mask)
    else:
        inv = scale / tl.where(l_sum > 0, l_sum, 1.0)
        out = acc * inv[:, None]
        tl.store(out_ptr + rows[:, None] * stride_o + dcols[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


def _combine_splits(part_acc: torch.Tensor, part_ml: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Merge per-split softmax partials: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s * scale."""
    m, l_sum = part_ml[:, 0], part_ml[:, 1]  # (S, N) each
    m_max = m.max(dim=0).values  # (N,)
    m_max = torch.where(torch.isinf(m_max), torch.zeros_like(m_max), m_max)
    w = torch.exp(m - m_max)  # (S, N); 0 for splits that saw only -inf
    den = (w * l_sum).sum(0).clamp_min(torch.finfo(torch.float32).tiny)  # (N,)
    num = torch.einsum("sn,snd->nd", w, part_acc)  # (N, D)
    out.copy_(num * (scale / den)[:, None])


def _default_splits(n_programs: int, vocab: int, block_v: int, device: torch.device) -> int:
    """Vocab splits so the grid has about two programs per SM, each still looping over >= 16 vocab tiles."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-2 * sms // n_programs), vocab // (16 * block_v)))


def soft_embedding_triton(
    logits: torch.Tensor,
    embedding: torch.Tensor,
    *,
    scale: float = 1.0,
    tiles: tuple[int, int, int] | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Triton launcher; tiles = (BLOCK_N, BLOCK_D, BLOCK_V), powers of two >= 16 (default `DEFAULT_TILES`).

    splits partitions the vocabulary across programs (default: enough for ~2 programs per SM on CUDA, 1 elsewhere);
    with more than one, fp32 partials of size splits * N * (D + 2) are merged by a few torch ops. Never (N, V).
    """
    v, d = _validate(logits, embedding)
    block_n, block_d, block_v = tiles if tiles is not None else DEFAULT_TILES
    for size in (block_n, block_d, block_v):
        if size < 16 or size & (size - 1):
            raise ValueError(f"tiles must be powers of two >= 16, got {(block_n, block_d, block_v)}")
    lead = logits.shape[:-1]
    x = logits.reshape(-1, v)  # (N, V)
    if x.stride(-1) != 1:
        x = x.contiguous()
    emb = embedding if embedding.stride(-1) == 1 else embedding.contiguous()
    n = x.shape[0]
    out = torch.empty(n, d, dtype=embedding.dtype, device=embedding.device)  # (N, D)
    if n == 0 or d == 0:
        return out.reshape(*lead, d)
    grid_nd = cdiv(n, block_n) * cdiv(d, block_d)
    if splits is None:
        splits = _default_splits(grid_nd, v, block_v, embedding.device)
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    v_chunk = cdiv(cdiv(v, splits), block_v) * block_v
    splits = cdiv(v, v_chunk)  # no empty splits
    split = splits > 1
    part_acc = torch.empty(splits, n, d, dtype=torch.float32, device=out.device) if split else out  # (S, N, D)
    part_ml = torch.empty(splits, 2, n, dtype=torch.float32, device=out.device) if split else out  # (S, 2, N)
    _soft_embed_kernel[(cdiv(n, block_n), cdiv(d, block_d), splits)](
        x,
        emb,
        out,
        part_acc,
        part_ml,
        n,
        v,
        d,
        v_chunk,
        x.stride(0),
        emb.stride(0),
        out.stride(0),
        _scale_in(scale, embedding.dtype),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_V=block_v,
        SPLIT=split,
        DOT_FP32=dot_in_fp32(embedding.dtype),
        num_warps=8,
        num_stages=3,
        enable_fp_fusion=True,  # explicit: triton 3.9 warns when the default is left implicit
    )
    if split:
        _combine_splits(part_acc, part_ml, _scale_in(scale, embedding.dtype), out)
    return out.reshape(*lead, d)


def soft_embedding(
    logits: torch.Tensor, embedding: torch.Tensor, *, scale: float = 1.0, impl: Impl = "auto"
) -> torch.Tensor:
    """(softmax(logits.float(), -1) @ embedding) * scale; logits (..., V), embedding (V, D) -> (..., D), emb dtype."""
    if resolve_impl(impl, logits, embedding) == "triton":
        return soft_embedding_triton(logits, embedding, scale=scale)
    return soft_embedding_ref(logits, embedding, scale=scale)
