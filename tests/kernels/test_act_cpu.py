"""The decode step's CPU activations: the C++ gated GELU and logit soft-cap against their references (tails of the
16-lane vector, saturated inputs, thread splits), the launchers' checks and the "auto" fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import act_cpu as ac
from kernels.act_cpu import gelu_mul, gelu_mul_ref, softcap_, softcap_ref

needs_kernel = pytest.mark.skipif(ac.gelu_mul_kernel() is None, reason="the CPU C++ kernels do not build here")


def test_gelu_ref_is_the_mlp_formula(gen: torch.Generator) -> None:
    gu = torch.randn(3, 10, generator=gen)
    torch.testing.assert_close(gelu_mul_ref(gu), F.gelu(gu[:, :5], approximate="tanh") * gu[:, 5:])


@needs_kernel
@pytest.mark.parametrize("rows,width", [(1, 2048), (16, 2048), (3, 7), (5, 33), (40000, 3)])  # last: a row split
def test_gelu_mul_matches_ref(rows: int, width: int, gen: torch.Generator) -> None:
    gu = torch.randn(rows, 2 * width, generator=gen) * 3
    gu[0, :2] = torch.tensor([-60.0, 60.0])  # saturated ends: ~0 and x
    ref = gelu_mul_ref(gu)
    got = gelu_mul(gu, impl="cpp")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)


@needs_kernel
def test_softcap_is_accurate_for_small_logits(gen: torch.Generator) -> None:
    """A tiny model's logits are all near 0, where tanh as 1 - 2 / (exp(2y) + 1) would lose its digits."""
    x = torch.randn(4, 1000, generator=gen) * 1e-3
    want = softcap_ref(x.clone(), 30.0)
    torch.testing.assert_close(softcap_(x, 30.0, impl="cpp"), want, rtol=3e-7, atol=1e-12)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 98304), (16, 98304), (3, 17), (5,)])
def test_softcap_matches_ref(shape: tuple[int, ...], gen: torch.Generator) -> None:
    x = torch.randn(shape, generator=gen) * 20
    x.view(-1)[:3] = torch.tensor([1e4, -1e4, 0.0])[: x.numel()]
    want = softcap_ref(x.clone(), 30.0)
    got = softcap_(x, 30.0, impl="cpp")
    assert torch.isfinite(got).all()
    assert got.data_ptr() == x.data_ptr()  # in place
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # a few ulp, small logits included


def test_bad_inputs_raise(gen: torch.Generator) -> None:
    with pytest.raises(ValueError, match="2I"):
        gelu_mul(torch.randn(2, 5, generator=gen), impl="cpp")
    with pytest.raises(ValueError, match="fp32"):
        gelu_mul(torch.randn(2, 4, generator=gen).double(), impl="cpp")
    with pytest.raises(ValueError, match="cap"):
        softcap_(torch.randn(4, generator=gen), 0.0, impl="cpp")
    with pytest.raises(ValueError, match="contiguous"):
        softcap_(torch.randn(4, 4, generator=gen).t(), 30.0, impl="cpp")
    with pytest.raises(ValueError, match="impl"):
        gelu_mul(torch.randn(2, 4, generator=gen), impl="triton")  # type: ignore[arg-type]


@pytest.mark.usefixtures("cpp_unbuilt")
def test_auto_falls_back_with_one_warning(gen: torch.Generator) -> None:
    gu = torch.randn(2, 8, generator=gen)
    with pytest.warns(RuntimeWarning, match="no compiler"):
        got = gelu_mul(gu)
    torch.testing.assert_close(got, gelu_mul_ref(gu))
    x = torch.randn(5, generator=gen)
    torch.testing.assert_close(softcap_(x.clone(), 30.0), softcap_ref(x.clone(), 30.0))  # no second warning
    with pytest.raises(RuntimeError, match="unavailable"):
        gelu_mul(gu, impl="cpp")
