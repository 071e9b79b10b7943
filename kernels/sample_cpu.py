"""The AR drafts' token draw for fp32 logit rows on the CPU: bans, min-p, temperature and one inverse-CDF draw a row,
with the drawn token's log-probability.

Owns `draw_tokens` (public, `impl="auto"|"cpp"|"ref"`), its torch reference `draw_tokens_ref` and the validating
launcher `draw_tokens_cpp` of the C++ kernel beside this file (`sample_cpu.cpp`, built by `kernels._cpp`). Per row
k of logits (K, V): the tokens in `bans[k]` are out; of the rest, those under `min_p` times the likeliest are cut;
the token drawn is the first whose running probability at `temperature` passes `u[k]` (uniform in [0, 1)), so one
uniform a row makes the draw (the caller's generator fixes the stream); temperature 0 takes the first likeliest allowed
token (greedy; u unread). Also returned: the drawn token's log-softmax over the raw row at temperature 1, bans
included (the drafting frame's likelihood of what was written).

Why: in torch the draw is ~8 passes over (K, V), most allocating a (K, V) tensor, a sizeable share of the drafts'
decode step at a 96k vocabulary. The kernel copies each row once into a per-thread scratch and reads it from cache
(`sample_cpu.cpp`; BENCHMARKS.md, "Kernels").

Numerics: sums in another order than torch's softmax and cumsum: a draw differs from the reference's only when its
uniform lands within fp32 rounding of a token boundary; log-probabilities agree to ~1e-6.

Legend: K rows (draft lanes), V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from kernels._cpp import auto_impl, build_error, extension

__all__ = ["Impl", "draw_kernel", "draw_tokens", "draw_tokens_cpp", "draw_tokens_ref"]

Impl = Literal["auto", "cpp", "ref"]
_IMPLS: tuple[str, ...] = ("auto", "cpp", "ref")
Bans = Sequence[Sequence[int]]


def draw_tokens_ref(logits: torch.Tensor, u: torch.Tensor, temperature: float, min_p: float = 0.0,
                    bans: Bans | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference. logits (K, V) fp32, u (K,) in [0, 1) -> (tok (K,) int64, logp (K,) fp32).

    Bytes: ~8 passes over K*V*4 (reads and writes). FLOPs: ~6*K*V plus 2*K*V exps.
    """
    logp = torch.log_softmax(logits, dim=-1)  # (K, V)
    masked = logits
    if bans is not None and any(len(b) for b in bans):
        masked = logits.clone()
        for k, ids in enumerate(bans):
            masked[k, list(ids)] = -math.inf
    if min_p > 0:  # p / p_max < min_p  <=>  logit < max logit + log(min_p)
        floor = masked.max(dim=-1, keepdim=True).values + math.log(min_p)  # (K, 1)
        masked = masked.masked_fill(masked < floor, -math.inf)
    if temperature == 0:  # greedy: the first largest allowed logit
        tok = masked.argmax(dim=-1)  # (K,)
    else:
        tok = inverse_cdf(torch.softmax(masked / temperature, dim=-1), u)  # (K,)
    return tok, logp.gather(1, tok[:, None])[:, 0]


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index a row of probs (K, V) (non-negative, any positive sum) at the uniforms u (K,) in [0, 1) -> (K,).

    Never an index of zero probability: the target is kept below the total (u * total may round up to it), and the
    first cumulative sum above it belongs to a token whose probability is positive. Any device.
    """
    cum = probs.float().cumsum(dim=-1)  # (K, V)
    total = cum[:, -1:]  # (K, 1)
    target = u[:, None].to(cum.dtype) * total
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target, right=True)[:, 0]


def _check(logits: torch.Tensor, u: torch.Tensor, temperature: float, min_p: float, bans: Bans | None) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.dtype != torch.float32 or logits.device.type != "cpu":
        raise ValueError(f"logits must be a (K, V) CPU fp32 tensor, got {tuple(logits.shape)} {logits.dtype} on "
                         f"{logits.device}")  # fmt: skip
    K, V = logits.shape
    if u.shape != (K,) or u.dtype != torch.float32 or u.device.type != "cpu":
        raise ValueError(f"u must be a (K,) = ({K},) CPU fp32 tensor, got {tuple(u.shape)} {u.dtype}")
    if not temperature >= 0 or not 0 <= min_p <= 1:
        raise ValueError(f"need temperature >= 0 and min_p in [0, 1], got {temperature}, {min_p}")
    if bans is not None:
        if len(bans) != K:
            raise ValueError(f"bans must hold one list a row ({K}), got {len(bans)}")
        for ids in bans:
            if any(not 0 <= t < V for t in ids):
                raise ValueError(f"a banned id is outside the vocabulary [0, {V})")
            if len(set(ids)) >= V:
                raise ValueError("a row bans every token")


def draw_tokens_cpp(logits: torch.Tensor, u: torch.Tensor, temperature: float, min_p: float = 0.0,
                    bans: Bans | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Validating launcher of the C++ kernel; RuntimeError where it could not be built."""
    _check(logits, u, temperature, min_p, bans)
    fn = draw_kernel()
    if fn is None:
        raise RuntimeError(f"the CPU token-draw kernel is unavailable here: {build_error() or 'unknown'}")
    if logits.stride(1) != 1 or logits.stride(0) < 0:
        logits = logits.contiguous()
    offsets, ids = ban_csr(bans, logits.shape[0])
    return fn(logits, u.contiguous(), 1.0 / temperature if temperature > 0 else 0.0, float(min_p), offsets, ids)


def ban_csr(bans: Bans | None, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`bans` (one id list a row, or None) as the kernel's CSR: offsets (rows + 1,) and ids (N,), int64."""
    lists = [list(b) for b in bans] if bans is not None else [[] for _ in range(rows)]
    offsets = [0]
    for b in lists:
        offsets.append(offsets[-1] + len(b))
    ids = [t for b in lists for t in b]
    return torch.tensor(offsets, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64)


def draw_kernel() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The raw entry point `draw_tokens(logits (K, V), u (K,), inv_temp, min_p, ban_offsets, ban_ids)` (inv_temp 0:
    greedy; it checks its inputs itself), or None where the extension did not build: for hot loops."""
    mod = extension()
    return None if mod is None else mod.draw_tokens


def draw_tokens(logits: torch.Tensor, u: torch.Tensor, temperature: float, min_p: float = 0.0,
                bans: Bans | None = None, *, impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """One token a row drawn at `temperature` after `bans` and `min_p` (module docstring). "auto": the C++ kernel
    where it built (one warning where it did not), else the reference."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        eligible = logits.dtype == torch.float32 and logits.device.type == "cpu" and not logits.requires_grad
        impl = auto_impl(eligible, eligible and draw_kernel() is not None, "CPU token-draw kernel")
    if impl == "ref":
        _check(logits, u, temperature, min_p, bans)
        return draw_tokens_ref(logits, u, temperature, min_p, bans)
    return draw_tokens_cpp(logits, u, temperature, min_p, bans)
