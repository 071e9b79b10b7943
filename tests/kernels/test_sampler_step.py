"""Fused sampler step: reference vs a naive per-row oracle, Triton kernel vs reference, seeded-noise statistics."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.sampler_step import SamplerStepOut, sampler_step, sampler_step_ref, sampler_step_triton
from tests.kernels.kernel_testing import requires_cuda


def naive_step(logits: torch.Tensor, temps: list[float], u: torch.Tensor, softcap: float | None) -> SamplerStepOut:
    """Oracle: one row at a time, in float64, straight from the definitions."""
    samples, argmaxes, entropies = [], [], []
    for r in range(logits.shape[0]):
        x = logits[r].double()
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
        scaled = x / temps[r]
        p = torch.softmax(scaled, -1)
        entropies.append(-sum(float(pi) * math.log(float(pi)) for pi in p if pi > 0))
        argmaxes.append(int(torch.argmax(scaled)))
        samples.append(int(torch.argmax(scaled - torch.log(-torch.log(u[r].double())))))
    return SamplerStepOut(torch.tensor(samples), torch.tensor(argmaxes), torch.tensor(entropies, dtype=torch.float32))


def make_logits(n: int, v: int, gen: torch.Generator, masked: bool = True) -> torch.Tensor:
    x = torch.randn(n, v, generator=gen) * 3
    if masked and v > 3:
        x[0, : v // 3] = float("-inf")  # a row with banned tokens, as the sampler produces
    return x


@pytest.mark.parametrize(("n", "v"), [(1, 1), (3, 37), (4, 1023), (2, 300)])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_ref_matches_naive_oracle(n: int, v: int, softcap: float | None, gen: torch.Generator) -> None:
    x, u = make_logits(n, v, gen), torch.rand(n, v, generator=gen)
    temps = [0.5 + 0.25 * r for r in range(n)]
    got = sampler_step_ref(x, torch.tensor(temps), uniform=u, softcap=softcap)
    want = naive_step(x, temps, u, softcap)
    assert torch.equal(got.sample, want.sample) and torch.equal(got.argmax, want.argmax)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n", "v", "block_v"), [(1, 1, 16), (3, 37, 16), (5, 1000, 64), (4, 1023, None)])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_ref_with_given_noise(
    triton_device: str,
    n: int,
    v: int,
    block_v: int | None,
    softcap: float | None,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> None:
    x = make_logits(n, v, gen).to(triton_device, dtype)
    u = torch.rand(n, v, generator=gen).to(triton_device)
    temp = (torch.rand(n, generator=gen) + 0.3).to(triton_device)
    got = sampler_step_triton(x, temp, uniform=u, softcap=softcap, block_v=block_v)
    want = sampler_step_ref(x, temp, uniform=u, softcap=softcap)
    assert torch.equal(got.sample, want.sample)
    assert torch.equal(got.argmax, want.argmax)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-4, atol=1e-5)


def test_kernel_ties_pick_lowest_index(triton_device: str) -> None:
    x = torch.zeros(2, 40, device=triton_device)
    x[0, [5, 21, 37]] = 2.0  # ties inside one 16-wide block and across blocks
    x[1, [33, 38]] = 1.0
    got = sampler_step_triton(x, 1.0, uniform=torch.full_like(x, 0.5), block_v=16)
    assert got.argmax.tolist() == [5, 33] and got.sample.tolist() == [5, 33]
    torch.testing.assert_close(got.entropy, sampler_step_ref(x, 1.0, uniform=torch.full_like(x, 0.5)).entropy)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_seeded_noise_is_reproducible(triton_device: str, impl: str, gen: torch.Generator) -> None:
    logits = make_logits(8, 64, gen, masked=False).to(triton_device)
    out = sampler_step(logits, 1.0, seed=7, impl=impl)  # type: ignore[arg-type]
    assert torch.equal(out.sample, sampler_step(logits, 1.0, seed=7, impl=impl).sample)  # type: ignore[arg-type]
    assert not torch.equal(out.sample, sampler_step(logits, 1.0, seed=8, impl=impl).sample)  # type: ignore[arg-type]


def _check_seeded_distribution(device: str, impl: str, n: int) -> None:
    # n i.i.d. rows of one 3-way distribution (plus a banned token): counts within 4.5 sigma of softmax.
    probs = torch.tensor([0.2, 0.3, 0.5, 0.0])
    logits = probs.log().repeat(n, 1).to(device)
    out = sampler_step(logits, 1.0, seed=11, impl=impl)  # type: ignore[arg-type]
    counts = torch.bincount(out.sample.cpu(), minlength=4).double()
    sigma = (n * probs * (1 - probs)).double().sqrt()
    assert counts[3] == 0, counts.tolist()
    assert bool(((counts - n * probs.double()).abs() <= 4.5 * sigma).all()), counts.tolist()
    torch.testing.assert_close(out.entropy.cpu(), torch.full((n,), float(-(probs[:3] * probs[:3].log()).sum())))


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_seeded_noise_is_distributed_like_softmax(triton_device: str, impl: str) -> None:
    _check_seeded_distribution(triton_device, impl, 160)


@pytest.mark.slow
def test_seeded_noise_is_distributed_like_softmax_many_rows(triton_device: str) -> None:
    _check_seeded_distribution(triton_device, "triton", 2000)


def test_low_temperature_sample_is_argmax(triton_device: str, gen: torch.Generator) -> None:
    x = make_logits(4, 50, gen, masked=False).to(triton_device)
    out = sampler_step(x, 1e-4, seed=1, impl="triton")
    assert torch.equal(out.sample, out.argmax)
    torch.testing.assert_close(out.entropy, torch.zeros(4, device=triton_device), atol=1e-4, rtol=0)


def test_rejects_bad_input(triton_device: str) -> None:
    x = torch.randn(2, 8, device=triton_device)
    for impl in ("ref", "triton"):
        with pytest.raises(ValueError, match="temperature must be > 0"):
            sampler_step(x, 0.0, impl=impl)
        with pytest.raises(ValueError, match="either seed or uniform"):
            sampler_step(x, 1.0, seed=1, uniform=torch.rand(2, 8, device=triton_device), impl=impl)
        with pytest.raises(ValueError, match="uniform must have"):
            sampler_step(x, 1.0, uniform=torch.rand(2, 7, device=triton_device), impl=impl)
        with pytest.raises(ValueError, match="softcap"):
            sampler_step(x, 1.0, softcap=0.0, impl=impl)
        with pytest.raises(ValueError, match=r"\(N, V\)"):
            sampler_step(x[0], 1.0, impl=impl)
        with pytest.raises(ValueError, match="temperature must be a float"):
            sampler_step(x, torch.ones(3, device=triton_device), impl=impl)


@pytest.mark.gpu
@requires_cuda
def test_gpu_real_shapes() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(256, 262144, device="cuda", generator=gen) * 4).bfloat16()
    u = torch.rand(256, 262144, device="cuda", generator=gen)
    got = sampler_step(x, 0.8, uniform=u, softcap=30.0, impl="triton")
    want = sampler_step_ref(x, 0.8, uniform=u, softcap=30.0)
    assert torch.equal(got.argmax, want.argmax)
    assert float((got.sample == want.sample).float().mean()) >= 0.99  # tanh formulas may flip exact near-ties
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-4, atol=1e-4)
