"""The longest-common-prefix context cache (`canvas.engine.prefix_cache`) on the tiny random model, whose sliding
window (16) is far shorter than the contexts: a restored prefix plus what is encoded after it equals a fresh encode
(logits, and what a later encode and a denoise read from the cache), whatever the block and piece boundaries, the
stored bytes stay within the budget, and a prefill stopped between pieces leaves the cache consistent."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from canvas.engine.core import Engine
from canvas.engine.prefix_cache import Prefill, PrefillCancelled, PrefixCache
from canvas.model import DiffusionModel, KVCache, ModelConfig

TOL = 1e-4


@pytest.fixture(scope="module")
def model() -> DiffusionModel:
    torch.manual_seed(0)
    return DiffusionModel(ModelConfig.from_name("tiny")).eval()


def doc(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [2, *torch.randint(10, 500, (n - 1,), generator=g).tolist()]


def fresh(model: DiffusionModel, toks: list[int], room: int = 8) -> tuple[torch.Tensor, KVCache]:
    logits, cache = model.encode(torch.tensor([toks]), cache=model.new_cache(1, len(toks) + room), logits="last")
    assert logits is not None
    return logits[0, -1], cache


def assert_same_cache(model: DiffusionModel, a: KVCache, b: KVCache) -> None:
    """Same length, and the same logits for what comes next: one more encode, and a denoise over a canvas."""
    assert a.length == b.length
    nxt = torch.tensor([[11, 12, 13]])
    la, _ = model.encode(nxt, cache=a.grown(max(a.capacity, a.length + 3)), logits="all")
    lb, _ = model.encode(nxt, cache=b.grown(max(b.capacity, b.length + 3)), logits="all")
    assert la is not None and lb is not None
    torch.testing.assert_close(la, lb, atol=TOL, rtol=TOL)
    canvas = torch.tensor([[20, 21, 22, 23]])
    torch.testing.assert_close(model.denoise(canvas, a), model.denoise(canvas, b), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("block", [3, 7])
def test_lcp_reuse_after_appending_or_changing_the_tail_equals_a_fresh_encode(model: DiffusionModel,
                                                                              block: int) -> None:
    pc = PrefixCache(model, 64 << 20, block=block)
    base = doc(1, 53)
    first = pc.prefill(base, room=8)
    assert first.cached == 0
    want, cache = fresh(model, base)
    torch.testing.assert_close(first.last, want, atol=TOL, rtol=TOL)
    assert_same_cache(model, first.cache, cache)
    variants = {
        "appended": base + [40, 41, 42],
        "tail changed": base[:-2] + [77, 78, 79, 80],
        "changed early": base[:9] + [99] + base[10:],
        "shorter": base[:30],
        "exact repeat": base,
        "longer than a piece": base + doc(5, 40),
    }
    for name, toks in variants.items():
        lcp = next((i for i, (a, b) in enumerate(zip(base, toks, strict=False)) if a != b), min(len(base), len(toks)))
        got = pc.prefill(toks, room=8)
        want, cache = fresh(model, toks)
        torch.testing.assert_close(got.last, want, atol=TOL, rtol=TOL, msg=name)
        assert_same_cache(model, got.cache, cache)
        # Token-level reuse: everything the earlier contexts share with it (the last token is re-read when it ends
        # inside a stored block, for its logits).
        assert got.cached >= min(lcp, len(toks) - 1), name
        if name == "exact repeat":
            assert got.cached == len(toks)


def test_restored_caches_are_private(model: DiffusionModel) -> None:
    pc = PrefixCache(model, 64 << 20, block=4)
    toks = doc(2, 40)
    a = pc.prefill(toks, room=8)
    model.encode(torch.tensor([[5, 6, 7]]), cache=a.cache, logits="none")  # the row grows its own copy
    b = pc.prefill(toks, room=8)
    assert b.cached == len(toks) and b.cache.length == len(toks)
    assert_same_cache(model, b.cache, fresh(model, toks)[1])


def test_base_cache_is_continued_in_place(model: DiffusionModel) -> None:
    pc = PrefixCache(model, 64 << 20, block=4)
    ctx = doc(3, 30)
    first = pc.prefill(ctx, room=20)
    run = [30, 31, 32, 33, 34]
    out = pc.prefill(ctx + run, room=8, base=(first.cache, first.last))
    assert out.cache is first.cache  # nothing stored goes further than the base: encoded into it
    want, cache = fresh(model, ctx + run)
    torch.testing.assert_close(out.last, want, atol=TOL, rtol=TOL)
    assert_same_cache(model, out.cache, cache)
    again = pc.prefill(ctx + run, room=8, base=(pc.prefill(ctx, room=20).cache, first.last))
    assert again.cached == len(ctx + run)  # the fed run was recorded too


def test_stays_within_budget_with_twenty_documents(model: DiffusionModel) -> None:
    one = PrefixCache(model, 1 << 30, block=4)
    one.prefill(doc(0, 60))
    per_doc = one.stats().bytes
    budget = int(per_doc * 3.5)
    pc = PrefixCache(model, budget, block=4)
    for i in range(20):
        pc.prefill(doc(100 + i, 60))
        assert pc.stats().bytes <= budget
        assert pc.stats().blocks > 0
    # The newest documents stay, the oldest went; every stored block is still reachable and correct.
    assert pc.prefill(doc(119, 60)).cached == 60
    assert pc.prefill(doc(100, 60)).cached <= 1  # every document starts with BOS
    toks = doc(118, 60)
    got = pc.prefill(toks)
    torch.testing.assert_close(got.last, fresh(model, toks)[0], atol=TOL, rtol=TOL)


def test_a_short_leaf_costs_its_pages_and_the_arena_stays_put_with_twenty_documents(model: DiffusionModel) -> None:
    pc = PrefixCache(model, 64 << 20, block=12)  # pages of 6 positions
    pool = pc.pool
    assert pool.page == 6
    pc.prefill(doc(0, 15))  # one whole block (2 pages) and a leaf of 3 positions (1 page), with its logits
    assert pc.stats().bytes == (3 + pool.logit_pages) * pool.page_bytes
    budget = 12 * pool.page_bytes + 3 * pool.logit_pages * pool.page_bytes
    pc = PrefixCache(model, budget, block=12)
    pc.prefill(doc(1, 40))
    arena = pc.pool._arena
    assert arena is not None and pc.pool.pages * pc.pool.page_bytes <= budget
    for i in range(20):  # twenty documents open, edited at their ends, each past the budget's room
        toks = doc(200 + i % 7, 40 + i)
        got = pc.prefill(toks)
        assert pc.stats().bytes <= budget and pc.pool._arena is arena
        torch.testing.assert_close(got.last, fresh(model, toks)[0], atol=TOL, rtol=TOL)
    assert pc.prefill(toks).cached == len(toks)


def test_zero_budget_keeps_nothing(model: DiffusionModel) -> None:
    pc = PrefixCache(model, 0, block=4)
    toks = doc(4, 30)
    pc.prefill(toks)
    out = pc.prefill(toks)
    assert out.cached == 0 and pc.stats().bytes == 0
    torch.testing.assert_close(out.last, fresh(model, toks)[0], atol=TOL, rtol=TOL)


def test_cancelled_mid_prefill_leaves_the_cache_consistent(model: DiffusionModel) -> None:
    pc = PrefixCache(model, 64 << 20, block=4)
    toks = doc(6, 70)
    asked = 0

    def stop() -> bool:
        nonlocal asked
        asked += 1
        return asked > 2  # two pieces run, then the request is cancelled

    with pytest.raises(PrefillCancelled):
        pc.prefill(toks, stop=stop)
    assert 0 < pc.stats().blocks
    kept = pc.stats().tokens_encoded
    out = pc.prefill(toks)  # the next request starts where the cancelled one stopped
    assert 0 < out.cached < len(toks)
    torch.testing.assert_close(out.last, fresh(model, toks)[0], atol=TOL, rtol=TOL)
    assert_same_cache(model, out.cache, fresh(model, toks)[1])
    assert kept == 0  # a cancelled prefill is not counted as encoded


def test_bad_arguments(model: DiffusionModel) -> None:
    with pytest.raises(ValueError):
        PrefixCache(model, -1)
    pc = PrefixCache(model, 1 << 20)
    with pytest.raises(ValueError):
        pc.prefill([])
    with pytest.raises(ValueError):
        pc.prefill([2, 3], room=-1)


# ---- through the engine -----------------------------------------------------------------------------------------
def _typing(ctx: tuple[int, ...], k: int) -> tuple[int, ...]:
    """The context after `k` keystrokes at its end (each changes its last token or adds one)."""
    out = list(ctx)
    for i in range(k):
        if i % 2:
            out[-1] = 30 + i
        else:
            out.append(60 + i)
    return tuple(out)


@pytest.mark.parametrize(("fim", "window", "n"), [(False, 16, 45), (True, 16, 45), (True, 144, 400)])
def test_cached_and_uncached_requests_return_the_same_tokens(fim: bool, window: int, n: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Window 144: the context's pieces (128 tokens after a full window) run the sliding layers' banded attention
    (`canvas.model.band`), as the served model's 448-token pieces do; the dense mask gives the same tokens too."""
    import canvas.model.model as model_module
    from canvas.convert.fim import FimTokens
    from tests.canvas.engine.test_ar import NULL, infill

    banded: list[int] = []
    band_attend = model_module.band_attend

    def counted(*args: Any) -> torch.Tensor:
        banded.append(1)
        return band_attend(*args)

    monkeypatch.setattr(model_module, "band_attend", counted)
    torch.manual_seed(0)
    m = DiffusionModel(ModelConfig.from_name("tiny").replace(null_token_id=NULL, sliding_window=window)).eval()
    tokens = FimTokens(prefix=6, suffix=7, middle=8, end=9, bos=2, pad=0, eos=1) if fim else None
    cached = Engine(m, max_batch=1, fim=tokens)
    uncached = Engine(m, max_batch=1, fim=tokens, context_cache_mb=0)
    dense = Engine(m, max_batch=1, fim=tokens, context_cache_mb=0)
    base = tuple(doc(7, n))
    for k in range(4):
        req = infill(_typing(base, k), 3, 6, 3, slot_seed=k, seed=5, ar_drafts=3, ar_seam_tokens=2)
        a = cached.submit(req)
        cached.run_until_idle()
        b = uncached.submit(req)
        uncached.run_until_idle()
        da, db = a.wait(0), b.wait(0)
        assert da.status == db.status == "completed"
        assert da.canvases == db.canvases, k
        if window > 16:
            m.band_attention = False
            try:
                c = dense.submit(req)
                dense.run_until_idle()
            finally:
                m.band_attention = True
            assert c.wait(0).canvases == db.canvases, k
        assert db.cached_tokens == 0
        if k:  # everything but the changed tail came from the cache
            assert da.cached_tokens >= len(base) - 1
    assert cached.contexts.stats().tokens_reused > 0 and uncached.contexts.stats().bytes == 0
    assert bool(banded) == (window > 16)


def test_a_request_cancelled_mid_prefill_ends_cancelled_and_the_next_reuses_its_pieces(
        model: DiffusionModel) -> None:
    from canvas.engine.core import GenRequest
    from canvas.sampling.sampler import SamplerConfig

    engine = Engine(model, max_batch=1)
    ctx = tuple(doc(8, 90))
    req = GenRequest(ctx, (5, 6), (True, False), SamplerConfig(max_steps=2))
    h = engine.submit(req)
    real = engine.contexts.prefill

    def cancelling(tokens: Sequence[int], room: int = 0, *, stop: Callable[[], bool] | None = None,
                   **k: Any) -> Prefill:
        asked = 0

        def later() -> bool:
            nonlocal asked
            asked += 1
            if asked == 3:
                h.cancel()  # the writer typed on while the context was encoded
            return bool(stop and stop())

        return real(tokens, room, stop=later, **k)

    engine.contexts.prefill = cancelling  # type: ignore[method-assign]
    engine.run_until_idle()
    assert h.wait(0).status == "cancelled"
    engine.contexts.prefill = real  # type: ignore[method-assign]
    h2 = engine.submit(req)
    engine.run_until_idle()
    done = h2.wait(0)
    assert done.status == "completed" and 0 < done.cached_tokens < len(ctx)
