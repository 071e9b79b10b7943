"""Attention of one query a row over its cached keys, fp32 on the CPU (the decode step's, grouped-query).

Owns `attend_one` (public, `impl="auto"|"cpp"|"ref"`), its torch reference `attend_one_ref`, the raw entry point
`kernel` and the C++ kernel beside this file (`attend_cpu.cpp`, built by `kernels._cpp` with the other CPU
kernels). q (B, H, D) attends, scale 1, over keys / values (B, G, S, D) (views of the static cache: only the
last dim must be contiguous) and, optionally, one more key and value per row (`extra_k` / `extra_v` (B, G, D):
the ring window's own token), under a (B, S + X) bool mask or none; query head h reads KV head h // (H / G).
Shared prefixes: `leader` (B,) with `shared` = (lo, hi) says rows b's keys and values in slots [lo, hi) are those of
row `leader[b]` (the K drafts of one context: copies of it), so the kernel reads them once per group of rows with one
leader; the reference takes them from the leader's row, so a test can tell whether the kernel does.

Why: in torch this is two batched matmuls, a masked fill, a softmax (and on the ring a cat and an add) per layer:
~8 small ops, each a dispatch, for a few rows. The kernel is one call that reads each key and value row once for
the query heads sharing it (and for every row of a group over the shared slots); (group, KV head, key chunk) items
spread over the threads, the chunks' partial softmaxes merged after.
Numerics: fp32; the kernel's exp is a polynomial (within 2 ulp) and its sums run in another order, so it agrees
with the reference to fp32 rounding. A masked key weighs exactly 0.

Legend: B rows, H query heads, G KV heads, S cached keys, X extra keys (0 or 1), D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from kernels._cpp import auto_impl, build_error, extension

__all__ = ["Impl", "Share", "attend_one", "attend_one_cpp", "attend_one_ref", "kernel"]

Impl = Literal["auto", "cpp", "ref"]
_IMPLS: tuple[str, ...] = ("auto", "cpp", "ref")


Share = tuple[torch.Tensor, int, int]  # (leader (B,) int64, lo, hi): slots [lo, hi) of row b are row leader[b]'s


def attend_one_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None,
                   extra_k: torch.Tensor | None = None, extra_v: torch.Tensor | None = None,
                   share: Share | None = None) -> torch.Tensor:
    """Torch reference: q (B, H, D), keys / values (B, G, S, D), mask (B, S + X) bool or None, extra_k / extra_v
    (B, G, D) or None, `share` (leader (B,), lo, hi) or None -> (B, H, D).

    Bytes: read 2*B*G*S*D*4 (the cache, once; 2*(groups*(hi - lo) + B*(S - hi + lo))*G*D*4 shared) + B*H*D*4,
    write B*H*D*4. FLOPs: 4*B*H*S*D.
    """
    B, H, D = q.shape
    G, S = keys.shape[1], keys.shape[2]
    if share is not None:  # every row's shared slots from its leader's row
        leader, lo, hi = share
        keys, values = keys.clone(), values.clone()
        keys[:, :, lo:hi] = keys[leader, :, lo:hi]
        values[:, :, lo:hi] = values[leader, :, lo:hi]
    qg = q.view(B, G, H // G, D)  # (B, G, R, D): query heads grouped by their KV head
    scores = qg @ keys.transpose(-1, -2)  # (B, G, R, S)
    if extra_k is not None:
        scores = torch.cat([scores, (qg * extra_k[:, :, None]).sum(-1, keepdim=True)], dim=-1)  # (B, G, R, S + 1)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32)
    out = p[..., :S] @ values  # (B, G, R, D)
    if extra_v is not None:
        out = out + p[..., S:] * extra_v[:, :, None]
    return out.reshape(B, H, D)


def _check(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           extra_k: torch.Tensor | None, extra_v: torch.Tensor | None, share: Share | None = None) -> None:
    for name, t in (("q", q), ("keys", keys), ("values", values), ("extra_k", extra_k), ("extra_v", extra_v)):
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
            raise ValueError(f"{name} must be a CPU fp32 tensor, got {t.dtype} on {t.device}")
    if q.dim() != 3 or keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(f"q must be (B, H, D) and keys, values (B, G, S, D), got {tuple(q.shape)}, "
                         f"{tuple(keys.shape)}, {tuple(values.shape)}")
    B, H, D = q.shape
    G, S = keys.shape[1], keys.shape[2]
    if keys.shape[0] != B or keys.shape[3] != D or G == 0 or H % G or H // G > 8:
        raise ValueError(f"keys {tuple(keys.shape)} do not fit q {tuple(q.shape)} (H a multiple of G, <= 8 G)")
    if (extra_k is None) != (extra_v is None):
        raise ValueError("extra_k and extra_v go together")
    X = 0 if extra_k is None else 1
    for name, t in (("extra_k", extra_k), ("extra_v", extra_v)):
        if t is not None and t.shape != (B, G, D):
            raise ValueError(f"{name} must be {(B, G, D)}, got {tuple(t.shape)}")
    if S + X == 0:
        raise ValueError("no keys to attend over")
    if mask is not None and (mask.dtype != torch.bool or mask.shape != (B, S + X)):
        raise ValueError(f"mask must be ({B}, {S + X}) bool, got {tuple(mask.shape)} {mask.dtype}")
    if share is not None:
        leader, lo, hi = share
        if leader.dtype != torch.int64 or leader.shape != (B,) or leader.device.type != "cpu":
            raise ValueError(f"leader must be a ({B},) int64 CPU tensor, got {tuple(leader.shape)} {leader.dtype}")
        if not 0 <= lo <= hi <= S:
            raise ValueError(f"shared slots [{lo}, {hi}) must lie in [0, {S}]")
        if bool(((leader < 0) | (leader >= B)).any()) or not torch.equal(leader[leader], leader):
            raise ValueError("leader must map each row to a row that leads itself")


def kernel() -> Callable[..., torch.Tensor] | None:
    """The raw entry point `attend_one(q, keys, values, mask, extra_k, extra_v, leader=None, shared_lo=0,
    shared_hi=0)` (it checks shapes itself, not that the shared slots are copies; q, mask, the extras and leader
    contiguous, keys / values with a contiguous last dim), or None where the extension did not build: for hot
    loops."""
    mod = extension()
    return None if mod is None else mod.attend_one


def attend_one_cpp(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None,
                   extra_k: torch.Tensor | None = None, extra_v: torch.Tensor | None = None,
                   share: Share | None = None) -> torch.Tensor:
    """Validating launcher of the C++ kernel; RuntimeError where it could not be built."""
    _check(q, keys, values, mask, extra_k, extra_v, share)
    fn = kernel()
    if fn is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable here: {build_error() or 'unknown'}")

    def last_dense(t: torch.Tensor) -> torch.Tensor:
        return t if t.stride(-1) == 1 else t.contiguous()

    def dense(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.contiguous()

    leader, lo, hi = (None, 0, 0) if share is None else share
    out: torch.Tensor = fn(q.contiguous(), last_dense(keys), last_dense(values), dense(mask), dense(extra_k),
                           dense(extra_v), dense(leader), lo, hi)
    return out


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None,
               extra_k: torch.Tensor | None = None, extra_v: torch.Tensor | None = None,
               share: Share | None = None, *, impl: Impl = "auto") -> torch.Tensor:
    """q (B, H, D) over keys / values (B, G, S, D) (+ extra_k / extra_v (B, G, D)) under mask (B, S + X), rows'
    slots [lo, hi) read from their leader's under `share` -> (B, H, D). "auto": the C++ kernel where it built (one
    warning where it did not) and no input needs grad, else the reference."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                 for t in (q, keys, values, extra_k, extra_v))
        eligible = not grads and q.dtype == torch.float32 and q.device.type == "cpu"
        impl = auto_impl(eligible, eligible and kernel() is not None, "CPU attention kernel")
    if impl == "ref":
        _check(q, keys, values, mask, extra_k, extra_v, share)
        return attend_one_ref(q, keys, values, mask, extra_k, extra_v, share)
    return attend_one_cpp(q, keys, values, mask, extra_k, extra_v, share)
