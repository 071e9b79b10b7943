"""Fused sampler step: softcap -> temperature -> {Gumbel-max sample, argmax, entropy} in one pass over the vocab.

Owns `sampler_step` (public, `impl="auto"|"triton"|"ref"`), `SamplerStepOut`, the torch reference
`sampler_step_ref` and the Triton kernel `_sampler_step_kernel`. For logits (N, V), any float dtype, math in fp32:
    x = c * tanh(logits / c) if softcap c else logits;  scaled = x / temperature  (temperature > 0, float or (N,))
    argmax = argmax(scaled);  entropy = H(softmax(scaled)) in nats;  sample = argmax(scaled - log(-log(u)))
with u ~ U(0, 1) per logit (Gumbel-max draws exactly from softmax(scaled)). Ties resolve to the lowest index, as
`torch.argmax` does. The kernel keeps an online softmax (running max, rescaled sum and entropy term) per row, so
no (N, V) probability, noise or scaled-logit tensor exists; vLLM's sampler holds several fp32 ones.

Noise: pass `uniform` (N, V) to get identical samples from both paths (tests do). Otherwise `seed` drives the noise:
the kernel uses Triton's Philox (`tl.rand(seed, row * V + col)`) for Gumbel-max, the reference a `torch.Generator`
seeded with `seed` for inverse-CDF sampling (one uniform per row); the two streams differ, so only their
distributions agree. With neither, a seed is drawn from torch's
global CPU generator (reproducible under `torch.manual_seed`, no device sync).

Dimension legend: N rows (canvas slots), V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels._triton import Impl, jit, next_power_of_2, resolve_impl, tl

__all__ = ["SamplerStepOut", "sampler_step", "sampler_step_ref", "sampler_step_triton"]


class SamplerStepOut(NamedTuple):
    """sample (N,) int64 Gumbel-max draw; argmax (N,) int64; entropy (N,) float32, natural log."""

    sample: torch.Tensor
    argmax: torch.Tensor
    entropy: torch.Tensor


def _temperature_column(temperature: float | torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """(N,) float32 temperatures; floats are checked here, tensor values are the caller's contract (no host sync)."""
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() == 0:
            temperature = temperature.reshape(1).expand(n)
        if temperature.shape != (n,):
            raise ValueError(
                f"temperature must be a float, a scalar tensor or shape ({n},), got {tuple(temperature.shape)}"
            )
        if temperature.device != device:
            raise ValueError(f"temperature is on {temperature.device}, logits on {device}")
        return temperature.float().contiguous()
    t = float(temperature)
    if not t > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return torch.full((n,), t, dtype=torch.float32, device=device)


def _validate(
    logits: torch.Tensor, seed: int | None, uniform: torch.Tensor | None, softcap: float | None
) -> tuple[int, int]:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be (N, V) with V >= 1, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if seed is not None and uniform is not None:
        raise ValueError("pass either seed or uniform, not both")
    if uniform is not None:
        if uniform.shape != logits.shape:
            raise ValueError(f"uniform must have the logits shape {tuple(logits.shape)}, got {tuple(uniform.shape)}")
        if not uniform.is_floating_point():
            raise ValueError(f"uniform must be floating point, got {uniform.dtype}")
        if uniform.device != logits.device:
            raise ValueError(f"uniform is on {uniform.device}, logits on {logits.device}")
    if seed is not None and not 0 <= int(seed) < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    return logits.shape[0], logits.shape[1]


def _fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())  # CPU generator: no device sync


def sampler_step_ref(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    *,
    seed: int | None = None,
    uniform: torch.Tensor | None = None,
    softcap: float | None = None,
) -> SamplerStepOut:
    """Vectorised torch reference. logits (N, V) -> SamplerStepOut of three (N,) tensors.

    Materialises several (N, V) fp32 tensors (scaled logits, log-probs, probabilities and their running sum): the
    kernel's whole point is not to. With `uniform` it samples by Gumbel-max exactly as the kernel does; with `seed`
    by inverse CDF (one uniform per row), so seeded samples follow the same distribution through another stream.
    Bytes: read N*V*itemsize (+ 4*N*V for `uniform`), write 20*N. FLOPs: ~10*N*V plus N*V log/exp pairs.
    """
    n, v = _validate(logits, seed, uniform, softcap)
    temp = _temperature_column(temperature, n, logits.device)
    x = logits.float()  # (N, V)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    scaled = x / temp[:, None]  # (N, V)
    logp = F.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    # p * log p with p == 0 (masked -inf logits) contributes 0, not 0 * -inf.
    entropy = -torch.where(probs > 0, probs * logp, torch.zeros_like(probs)).sum(-1)
    if uniform is None:
        # Seeded: inverse-CDF sampling with one uniform per row. It draws from the same softmax as Gumbel-max
        # but needs N random numbers instead of N*V and no logarithms: on the CPU, where this reference is the
        # production path, the Gumbel noise cost more than the rest of the step.
        gen = torch.Generator(device=logits.device).manual_seed(_fresh_seed() if seed is None else int(seed))
        cdf = probs.cumsum(dim=-1)  # (N, V)
        u = torch.rand(n, 1, generator=gen, device=logits.device) * cdf[:, -1:]  # (N, 1)
        # First index whose cdf exceeds u: a zero-probability token never is (its cdf equals its predecessor's).
        sample = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=v - 1)
    else:
        sample = torch.argmax(scaled - torch.log(-torch.log(uniform.float())), dim=-1)
    return SamplerStepOut(sample, torch.argmax(scaled, dim=-1), entropy)


@jit
def _sampler_step_kernel(
    logits_ptr,
    temp_ptr,
    uniform_ptr,
    sample_ptr,
    argmax_ptr,
    entropy_ptr,
    vocab,
    stride_l,
    stride_u,
    seed,
    softcap,
    HAS_UNIFORM: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per row, one pass over V in BLOCK_V chunks (columns past V masked to -inf).

    logits/uniform (N, V) with row strides, unit stride in V; temp (N,) fp32; outputs (N,) int64/int64/fp32.
    Running state, fp32: m (max of scaled so far), s = sum exp(x - m), t = sum exp(x - m) * (x - m); both sums are
    rescaled by exp(m_old - m_new) when the max grows, so entropy = log(s) - t / s without cancellation against m.
    """
    row = tl.program_id(0).to(tl.int64)
    inv_temp = 1.0 / tl.load(temp_ptr + row)
    cols = tl.arange(0, BLOCK_V).to(tl.int64)
    neg_inf = float("-inf")
    m = tl.full((), neg_inf, tl.float32)
    s = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)
    best = tl.full((), neg_inf, tl.float32)
    best_idx = tl.zeros((), tl.int64)
    gbest = tl.full((), neg_inf, tl.float32)
    gbest_idx = tl.zeros((), tl.int64)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + cols
        mask = offs < vocab
        x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            # c * tanh(x / c) with tanh(|z|) = (1 - e) / (1 + e), e = exp(-2|z|): finite for every input.
            z = x / softcap
            e2 = tl.exp(-2.0 * tl.abs(z))
            th = (1.0 - e2) / (1.0 + e2)
            x = softcap * tl.where(z >= 0, th, -th)
        x = tl.where(mask, x * inv_temp, neg_inf)  # (BV,) scaled logits
        # argmax of scaled: first index of the block max; a later block must be strictly larger to win.
        blk_best = tl.max(x, axis=0)
        blk_idx = tl.min(tl.where(x == blk_best, offs, vocab), axis=0)
        take = blk_best > best
        best_idx = tl.where(take, blk_idx, best_idx)
        best = tl.maximum(best, blk_best)
        # online softmax statistics; -inf-only prefixes are guarded so no inf - inf appears.
        m_new = tl.maximum(m, blk_best)
        m_safe = tl.where(m_new == neg_inf, 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        shift = tl.where(s > 0, m - m_safe, 0.0)
        p = tl.exp(x - m_safe)  # 0 for masked or -inf entries
        xm = tl.where(p > 0, x - m_safe, 0.0)
        t = alpha * (t + shift * s) + tl.sum(p * xm, axis=0)
        s = alpha * s + tl.sum(p, axis=0)
        m = m_new
        # Gumbel-max
        if HAS_UNIFORM:
            u = tl.load(uniform_ptr + row * stride_u + offs, mask=mask, other=0.5).to(tl.float32)
        else:
            u = tl.rand(seed, row * vocab + offs)
        g = tl.where(mask, x - tl.log(-tl.log(u)), neg_inf)
        gblk = tl.max(g, axis=0)
        gblk_idx = tl.min(tl.where(g == gblk, offs, vocab), axis=0)
        gtake = gblk > gbest
        gbest_idx = tl.where(gtake, gblk_idx, gbest_idx)
        gbest = tl.maximum(gbest, gblk)
    tl.store(sample_ptr + row, gbest_idx)
    tl.store(argmax_ptr + row, best_idx)
    tl.store(entropy_ptr + row, tl.log(s) - t / s)


def sampler_step_triton(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    *,
    seed: int | None = None,
    uniform: torch.Tensor | None = None,
    softcap: float | None = None,
    block_v: int | None = None,
) -> SamplerStepOut:
    """Triton launcher: validates, then one program per row. block_v (power of two) overrides the chunk width."""
    n, v = _validate(logits, seed, uniform, softcap)
    temp = _temperature_column(temperature, n, logits.device)
    if block_v is None:
        block_v = max(16, min(4096, next_power_of_2(v)))
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    u = uniform
    if u is not None and u.stride(1) != 1:
        u = u.contiguous()
    dev = logits.device
    sample = torch.empty(n, dtype=torch.int64, device=dev)
    argmax = torch.empty(n, dtype=torch.int64, device=dev)
    entropy = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return SamplerStepOut(sample, argmax, entropy)
    _sampler_step_kernel[(n,)](
        logits,
        temp,
        u if u is not None else logits,  # dummy pointer, never read when HAS_UNIFORM is False
        sample,
        argmax,
        entropy,
        v,
        logits.stride(0),
        u.stride(0) if u is not None else 0,
        (_fresh_seed() if seed is None else int(seed)) if u is None else 0,
        float(softcap) if softcap is not None else 1.0,
        HAS_UNIFORM=u is not None,
        HAS_SOFTCAP=softcap is not None,
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
        enable_fp_fusion=True,  # explicit: triton 3.9 warns when the default is left implicit
    )
    return SamplerStepOut(sample, argmax, entropy)


def sampler_step(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    *,
    seed: int | None = None,
    uniform: torch.Tensor | None = None,
    softcap: float | None = None,
    impl: Impl = "auto",
) -> SamplerStepOut:
    """One fused sampler step over logits (N, V); see the module docstring for the math and the noise contract."""
    tensors = [logits] + [x for x in (temperature, uniform) if isinstance(x, torch.Tensor)]
    if resolve_impl(impl, *tensors) == "triton":
        return sampler_step_triton(logits, temperature, seed=seed, uniform=uniform, softcap=softcap)
    return sampler_step_ref(logits, temperature, seed=seed, uniform=uniform, softcap=softcap)
