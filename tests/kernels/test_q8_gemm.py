"""Q8 GEMM: reference vs a loop oracle, the C++ kernel (each ISA path this CPU runs) vs the reference, the launcher's
checks and the "auto" fallback when the kernel cannot be built."""

from __future__ import annotations

import pytest
import torch

from canvas.env import Q8_ISA
from kernels import q8_gemm
from kernels.q8_gemm import (
    live_columns,
    q8_linear,
    q8_linear_ref,
    quantize_activations_ref,
    quantize_weight,
    unpack_weight,
)

needs_kernel = pytest.mark.skipif(not q8_gemm.available(), reason="the q8 C++ kernel does not build here")

# M rows (decode 1..16 and the tails of the 3- and 4-row tiles, prefill 256), K (1032: the converted Gemma's
# attention output, 4 x 258; 7, 45, 1030: not multiples of the block of 32, a short last block), N (tails of the
# 16-channel group and of the 3- and 4-group tiles).
SHAPES = [(1, 32, 1), (1, 640, 1536), (3, 96, 33), (8, 2048, 640), (16, 640, 4099), (256, 160, 70), (5, 1032, 7),
          (2, 7, 3), (3, 45, 9), (6, 1030, 100), (7, 64, 200), (2, 640, 1548)]


def _inputs(M: int, K: int, N: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(M, K, generator=gen) * 3
    x[:, ::37] *= 40  # outliers, as the converted Gemma's activations have
    w = torch.randn(N, K, generator=gen) * 0.05
    return x, w


def _oracle(x: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """Loop oracle: integer dot products block by block, times both blocks' scales, in float64."""
    M, K = x.shape
    N = wscale.shape[1]
    wm = unpack_weight(wq, N)  # (N, Kp)
    out = torch.zeros(M, N, dtype=torch.float64)
    for m in range(M):
        for b in range((K + 31) // 32):
            blk = x[m, b * 32 : (b + 1) * 32].double()  # the last one may be short
            d = float(blk.abs().max()) / 127
            q = torch.round(blk / d).long() if d > 0 else torch.zeros(len(blk), dtype=torch.long)
            w = wm[:, b * 32 : b * 32 + len(blk)].long() - 128  # (N, <= 32)
            out[m] += (w @ q).double() * d * wscale[b].double()
    return out.float()


def _tol(ref: torch.Tensor) -> dict[str, float]:
    # fp32 summation order only: relative to the output's scale (single outputs may cancel to near zero).
    return {"rtol": 1e-4, "atol": 1e-5 * max(1.0, float(ref.abs().max()))}


@pytest.mark.parametrize("M,K,N", [(1, 32, 1), (3, 96, 5), (2, 64, 9), (2, 45, 3)])
def test_ref_matches_loop_oracle(M: int, K: int, N: int, gen: torch.Generator) -> None:
    x, w = _inputs(M, K, N, gen)
    x[0, :32] = 0  # an all-zero block: scale 0, contributes nothing
    wq, ws = quantize_weight(w)
    ref = q8_linear_ref(x, wq, ws)
    torch.testing.assert_close(ref, _oracle(x, wq, ws), **_tol(ref))


def test_quantisation_is_per_block(gen: torch.Generator) -> None:
    """An outlier coarsens its own block of 32 only (the reason for Q8 over one scale per row)."""
    x = torch.randn(1, 128, generator=gen)
    x[0, 5] = 1000.0
    q, d = quantize_activations_ref(x)
    assert q.abs().max() <= 127
    assert d[0, 0] == pytest.approx(1000 / 127)
    deq = (q.view(1, 4, 32) * d[..., None]).view(1, 128)
    assert (deq[0, 32:] - x[0, 32:]).abs().max() <= d[0, 1:].max() / 2 + 1e-6
    assert (deq - x).abs()[0, 32:].max() < 0.05  # a per-row scale would err by up to 1000 / 254 ~ 3.9 here


def test_weight_layout(gen: torch.Generator) -> None:
    w = torch.randn(5, 90, generator=gen)
    w[2] = 0
    w[4, 32:64] *= 1e-3  # a block far smaller than its row: it gets its own scale
    wq, ws = quantize_weight(w)
    assert wq.shape == (1, 24, 64) and wq.dtype == torch.uint8  # one group of 16 channels, K 90 -> 96, 4 a step
    assert ws.shape == (3, 5) and ws.dtype == torch.bfloat16  # a scale per (block of 32, channel)
    # byte [g, k4, 4c + j] is channel 16g + c, K 4k4 + j (block 0)
    assert wq[0, 1, 4 * 3 + 2] == torch.round(w[3, 6] / ws[0, 3].float()) + 128
    assert (wq.view(24, 16, 4)[:, 5:] == 128).all()  # padding channels are q = 0
    wm = unpack_weight(wq, 5)
    assert wm.shape == (5, 96)
    assert (ws[:, 2] == 1.0).all() and (wm[2] == 128).all()
    s = ws.t().float().repeat_interleave(32, dim=1)[:, :90]  # (5, 90)
    amax = torch.nn.functional.pad(w, (0, 6)).view(5, 3, 32).abs().amax(-1)  # (5, 3)
    live = amax > 0
    assert (ws.t().float()[live] >= amax[live] / 127).all()  # rounded up: no weight clamps
    assert (ws.t().float()[live] <= amax[live] / 127 * (1 + 2**-7)).all()  # by at most one bf16 step
    deq = (wm[:, :90].float() - 128) * s
    assert ((deq - w).abs() <= s / 2 + 1e-12).all()
    assert (deq[4, 32:64] - w[4, 32:64]).abs().max() < 1e-3 * float(w[4].abs().max()) / 200
    assert (wm[:, 90:] == 128).all()  # padding columns are q = 0


@needs_kernel
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_kernel_matches_ref(M: int, K: int, N: int, gen: torch.Generator) -> None:
    x, w = _inputs(M, K, N, gen)
    wq, ws = quantize_weight(w)
    ref = q8_linear(x, wq, ws, impl="ref")
    torch.testing.assert_close(q8_linear(x, wq, ws, impl="cpp"), ref, **_tol(ref))


@needs_kernel
def test_amx_tiles_give_the_vnni_paths_output_bit_for_bit(gen: torch.Generator) -> None:
    """From 8 rows up the kernel runs on AMX tiles where the CPU has them (int32 block sums, exact either way, then the
    same scaling in the same order): the output must not move by one ulp. Rows past the last full tile of 8, group
    tails and short last blocks included; kmask too."""
    if not q8_gemm.use_amx(True):
        pytest.skip("no AMX here (CPU flags, OS permission or the build)")
    try:
        for M, K, N in [(8, 640, 2048), (9, 45, 9), (13, 1032, 100), (16, 640, 4099), (23, 70, 33), (256, 160, 70)]:
            x, w = _inputs(M, K, N, gen)
            w[:, 1] = 0
            wq, ws = quantize_weight(w)
            kmask = live_columns(w)
            tiles = q8_linear(x, wq, ws, impl="cpp", kmask=kmask)
            assert not q8_gemm.use_amx(False)
            vnni = q8_linear(x, wq, ws, impl="cpp", kmask=kmask)
            assert q8_gemm.use_amx(True)
            assert torch.equal(tiles, vnni), (M, K, N)
            ref = q8_linear_ref(x, wq, ws, kmask)
            torch.testing.assert_close(tiles, ref, **_tol(ref))
    finally:
        q8_gemm.use_amx(True)


@needs_kernel
def test_kernel_leading_dims_and_zero_rows(gen: torch.Generator) -> None:
    x, w = _inputs(6, 64, 10, gen)
    wq, ws = quantize_weight(w)
    got = q8_linear(x.view(2, 3, 64), wq, ws, impl="cpp")
    assert got.shape == (2, 3, 10)
    torch.testing.assert_close(got.view(6, 10), q8_linear_ref(x, wq, ws), **_tol(got))
    assert q8_linear(x[:0], wq, ws, impl="cpp").shape == (0, 10)
    torch.testing.assert_close(q8_linear(torch.zeros(2, 64), wq, ws, impl="cpp"), torch.zeros(2, 10))


def test_live_columns_keep_anchor_dims_out_of_the_scales(gen: torch.Generator) -> None:
    """The converted Gemma's attention output: huge activations under all-zero weight columns. Masked, they leave
    their blocks' scales alone (the product is that of the weights' live columns, which they never touched)."""
    M, K, N = 4, 1032, 40
    x, w = torch.randn(M, K, generator=gen) * 3, torch.randn(N, K, generator=gen) * 0.05
    dead = torch.tensor([3, 258 + 3, 516 + 40, 1031])
    w[:, dead] = torch.randn(N, 4, generator=gen) * 1e-6  # negligible, not zero (as the converted Gemma's)
    x[:, dead] = 5000.0
    kmask = live_columns(w)
    assert kmask is not None and kmask.shape == (K,) and int(kmask.sum()) == K - 4 and (kmask[dead] == 0).all()
    assert live_columns(torch.randn(3, 8, generator=gen)) is None
    wq, ws = quantize_weight(w)
    exact = x @ w.t()
    masked = q8_linear_ref(x, wq, ws, kmask)
    x0 = x.clone()
    x0[:, dead] = 0
    torch.testing.assert_close(masked, q8_linear_ref(x0, wq, ws))
    assert float((masked - x0 @ w.t()).abs().max()) < 0.05 * float(exact.abs().max())
    err_masked = float((masked - exact).abs().max())
    assert err_masked < float((q8_linear_ref(x, wq, ws) - exact).abs().max()) / 10  # unmasked: 4 blocks ruined (~40x)
    if q8_gemm.available():
        torch.testing.assert_close(q8_linear(x, wq, ws, impl="cpp", kmask=kmask), masked, **_tol(masked))
    with pytest.raises(ValueError, match="kmask"):
        q8_linear(x, wq, ws, impl="ref", kmask=kmask[:-1])


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_other_isa_paths_match_ref(isa: str, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator) -> None:
    """The fallbacks a machine without AVX-512 VNNI (or without x86 SIMD) builds, run here where the CPU can."""
    monkeypatch.setenv(Q8_ISA.name, isa)
    try:
        q8_gemm.build_isa()
    except ValueError as e:
        pytest.skip(str(e))
    if not q8_gemm.available():
        pytest.skip(f"the {isa} build failed here")
    for M, K, N in SHAPES[:5] + SHAPES[-3:]:
        x, w = _inputs(M, K, N, gen)
        w[:, 1] = 0
        wq, ws = quantize_weight(w)
        kmask = live_columns(w)
        ref = q8_linear_ref(x, wq, ws, kmask)
        torch.testing.assert_close(q8_linear(x, wq, ws, impl="cpp", kmask=kmask), ref, **_tol(ref))


@pytest.mark.slow
def test_the_avx2_path_gives_the_vnni_paths_output_bit_for_bit(gen: torch.Generator) -> None:
    """Both sum each block of 32 exactly in int32, then convert and scale in the same order: equal outputs, on
    every row count (the AVX2 tiles of 4 rows and their tails; the VNNI path's AMX tiles from 8 rows)."""
    from kernels._cpp import extension

    if q8_gemm.build_isa() != "avx512_vnni":
        pytest.skip("needs a CPU that runs both paths")
    vnni, avx2 = extension("avx512_vnni"), extension("avx2")
    if vnni is None or avx2 is None:
        pytest.skip("a build failed here")
    for M, K, N in SHAPES:
        x, w = _inputs(M, K, N, gen)
        w[:, 1] = 0
        wq, ws = quantize_weight(w)
        kmask = live_columns(w)
        assert torch.equal(avx2.q8_gemm(x, wq, ws, kmask), vnni.q8_gemm(x, wq, ws, kmask)), (M, K, N)


def test_bad_inputs_raise(gen: torch.Generator) -> None:
    wq, ws = quantize_weight(torch.randn(4, 64, generator=gen))
    with pytest.raises(ValueError, match="K > 0"):
        quantize_weight(torch.randn(4, 0))
    with pytest.raises(ValueError, match="64 wide"):
        q8_linear(torch.randn(2, 128), wq, ws, impl="ref")
    with pytest.raises(ValueError, match="fp32"):
        q8_linear(torch.randn(2, 64).double(), wq, ws, impl="ref")
    with pytest.raises(ValueError, match="uint8"):
        q8_linear(torch.randn(2, 64), wq.to(torch.int8), ws, impl="ref")
    with pytest.raises(ValueError, match="impl"):
        q8_linear(torch.randn(2, 64), wq, ws, impl="triton")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=Q8_ISA.name):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(Q8_ISA.name, "neon")
            q8_gemm.build_isa()


@pytest.mark.usefixtures("cpp_unbuilt")
def test_auto_falls_back_with_one_warning(gen: torch.Generator) -> None:
    """Where the kernel cannot be built (no compiler), "auto" runs the reference and warns once."""
    x, w = _inputs(2, 64, 3, gen)
    wq, ws = quantize_weight(w)
    with pytest.warns(RuntimeWarning, match="no compiler"):
        got = q8_linear(x, wq, ws)
    torch.testing.assert_close(got, q8_linear_ref(x, wq, ws))
    q8_linear(x, wq, ws)  # no second warning (filterwarnings = error would raise)
    with pytest.raises(RuntimeError, match="unavailable"):
        q8_linear(x, wq, ws, impl="cpp")
    assert q8_gemm.kernel() is None
