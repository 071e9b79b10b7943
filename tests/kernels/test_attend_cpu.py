"""One-query CPU attention: the reference vs SDPA, the C++ kernel vs the reference (cache views, masks, the ring's
extra key, grouped heads), the launcher's checks and the "auto" fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import attend_cpu as ac
from kernels.attend_cpu import attend_one, attend_one_ref

needs_kernel = pytest.mark.skipif(ac.kernel() is None, reason="the CPU C++ kernels do not build here")

# (B, H, G, S, D): decode rows 1..16, Gemma-3-270M's 4 heads over 1 KV head and head dims 258 / 256 (a tail of the
# 16-lane vector), grouped 2:1, one key, a window-sized cache, odd head dims.
SHAPES = [(1, 4, 1, 288, 258), (8, 4, 1, 290, 256), (16, 4, 1, 33, 258), (3, 4, 2, 17, 7), (2, 2, 2, 1, 16),
          (5, 8, 1, 100, 33)]


def _inputs(B: int, H: int, G: int, S: int, D: int, gen: torch.Generator, cap: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, and keys / values as views of a larger static cache (capacity `cap` past S), as the decode step has them."""
    q = torch.randn(B, H, D, generator=gen) * 0.3
    k = torch.randn(B, G, S + cap, D, generator=gen)[:, :, :S]
    v = torch.randn(B, G, S + cap, D, generator=gen)[:, :, :S]
    return q, k, v


def _extras(B: int, G: int, S: int, D: int, variant: str, gen: torch.Generator
            ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The ring's extra key and value ("extra" in `variant`) and a mask ("mask"), each or None; no row all masked."""
    extra = "extra" in variant
    ek = torch.randn(B, G, D, generator=gen) if extra else None
    ev = torch.randn(B, G, D, generator=gen) if extra else None
    mask = None
    if "mask" in variant:
        mask = torch.rand(B, S + int(extra), generator=gen) > 0.4
        mask[:, -1] = True
    return ek, ev, mask


def _tol(ref: torch.Tensor) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5 * max(1.0, float(ref.abs().max()))}


def test_ref_matches_sdpa(gen: torch.Generator) -> None:
    B, H, G, S, D = 3, 4, 1, 20, 16
    q, k, v = _inputs(B, H, G, S, D, gen)
    mask = torch.rand(B, S, generator=gen) > 0.3
    mask[:, 0] = True
    want = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None, :], scale=1.0,
                                          enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(attend_one_ref(q, k, v, mask), want, **_tol(want))
    # The extra key is one more cached key: the same as attending over the concatenation.
    ek, ev = torch.randn(B, G, D, generator=gen), torch.randn(B, G, D, generator=gen)
    whole = attend_one_ref(q, torch.cat([k, ek[:, :, None]], 2), torch.cat([v, ev[:, :, None]], 2))
    torch.testing.assert_close(attend_one_ref(q, k, v, None, ek, ev), whole, **_tol(whole))


@needs_kernel
@pytest.mark.parametrize("B,H,G,S,D", SHAPES)
@pytest.mark.parametrize("variant", ["plain", "mask", "extra", "extra+mask"])
def test_kernel_matches_ref(B: int, H: int, G: int, S: int, D: int, variant: str, gen: torch.Generator) -> None:
    q, k, v = _inputs(B, H, G, S, D, gen, cap=5)
    ek, ev, mask = _extras(B, G, S, D, variant, gen)
    ref = attend_one(q, k, v, mask, ek, ev, impl="ref")
    torch.testing.assert_close(attend_one(q, k, v, mask, ek, ev, impl="cpp"), ref, **_tol(ref))


# Leaders of the rows (first row of each group leads it): the FIM frame's two contexts of 4 lanes each, one context
# of 3, every row alone, and one lane whose resample duplicated another.
LEADERS = [[0, 0, 0, 0, 4, 4, 4, 4], [0, 0, 0], [0, 1, 2], [0, 1, 1, 3]]


@needs_kernel
@pytest.mark.parametrize("leaders", LEADERS)
@pytest.mark.parametrize("lo,hi", [(0, 300), (0, 257), (40, 260), (0, 0), (299, 300)])
@pytest.mark.parametrize("variant", ["plain", "extra+mask"])
def test_shared_slots_come_from_the_leader(leaders: list[int], lo: int, hi: int, variant: str,
                                            gen: torch.Generator) -> None:
    """Rows' shared slots hold garbage: the kernel must read the leader's, as the reference does; the chunked
    path (few groups, 2 threads) and the one-item-per-thread path both."""
    B, H, G, S, D = len(leaders), 4, 1, 300, 256
    q, k, v = _inputs(B, H, G, S, D, gen, cap=3)
    leader = torch.tensor(leaders)
    for b in range(B):
        if leaders[b] != b:  # garbage where the leader's slots stand in
            k[b, :, lo:hi] = 1e3
            v[b, :, lo:hi] = -1e3
    ek, ev, mask = _extras(B, G, S, D, variant, gen)
    share = (leader, lo, hi)
    ref = attend_one(q, k, v, mask, ek, ev, share, impl="ref")
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.testing.assert_close(attend_one(q, k, v, mask, ek, ev, share, impl="cpp"), ref, **_tol(ref))
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_chunks_of_a_row_whose_keys_are_all_masked_in_one_chunk(gen: torch.Generator) -> None:
    """Key chunks are merged by their partial maxima: a chunk with no valid key adds nothing."""
    q, k, v = _inputs(1, 4, 1, 400, 64, gen)
    mask = torch.zeros(1, 400, dtype=torch.bool)
    mask[0, 350:] = True  # only in the last chunk
    ref = attend_one(q, k, v, mask, impl="ref")
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # two chunks of 200 keys
    try:
        torch.testing.assert_close(attend_one(q, k, v, mask, impl="cpp"), ref, **_tol(ref))
        assert attend_one(q, k, v, torch.zeros_like(mask), impl="cpp").abs().max() == 0  # nothing to attend: 0
    finally:
        torch.set_num_threads(before)


def test_share_is_checked(gen: torch.Generator) -> None:
    q, k, v = _inputs(3, 4, 1, 5, 8, gen)
    with pytest.raises(ValueError, match="leader must be"):
        attend_one(q, k, v, share=(torch.tensor([0, 0]), 0, 5), impl="ref")
    with pytest.raises(ValueError, match="shared slots"):
        attend_one(q, k, v, share=(torch.tensor([0, 0, 0]), 2, 6), impl="ref")
    with pytest.raises(ValueError, match="leads itself"):
        attend_one(q, k, v, share=(torch.tensor([1, 0, 0]), 0, 5), impl="ref")


@needs_kernel
def test_masked_keys_weigh_nothing(gen: torch.Generator) -> None:
    q, k, v = _inputs(2, 4, 1, 10, 24, gen)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[:, 3] = False
    v2 = v.clone()
    v2[:, :, 3] = 1e30  # would dominate if it leaked at all
    got = attend_one(q, k, v2, mask, impl="cpp")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, attend_one_ref(q, k, v, mask), **_tol(got))


def test_bad_inputs_raise(gen: torch.Generator) -> None:
    q, k, v = _inputs(2, 4, 1, 5, 8, gen)
    with pytest.raises(ValueError, match="fp32"):
        attend_one(q.double(), k, v, impl="ref")
    with pytest.raises(ValueError, match="do not fit"):
        attend_one(q[:, :3], k.expand(2, 2, 5, 8), v.expand(2, 2, 5, 8), impl="ref")
    with pytest.raises(ValueError, match="mask"):
        attend_one(q, k, v, torch.ones(2, 6, dtype=torch.bool), impl="ref")
    with pytest.raises(ValueError, match="together"):
        attend_one(q, k, v, None, torch.zeros(2, 1, 8), impl="ref")
    with pytest.raises(ValueError, match="impl"):
        attend_one(q, k, v, impl="triton")  # type: ignore[arg-type]


@pytest.mark.usefixtures("cpp_unbuilt")
def test_auto_falls_back_with_one_warning(gen: torch.Generator) -> None:
    q, k, v = _inputs(2, 4, 1, 5, 8, gen)
    with pytest.warns(RuntimeWarning, match="no compiler"):
        got = attend_one(q, k, v)
    torch.testing.assert_close(got, attend_one_ref(q, k, v))
    attend_one(q, k, v)  # no second warning
    with pytest.raises(RuntimeError, match="unavailable"):
        attend_one(q, k, v, impl="cpp")
