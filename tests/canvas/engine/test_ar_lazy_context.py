"""The deferred plain context of a FIM infill (`Engine(lazy_context=True)`, `canvas.engine.ar.ARWalk.plain`), on the
tiny random model with FIM ids of its own: the same tokens as encoding it at admission whenever the seam is scored
(so the context is read), nothing of it encoded when the request ends while its drafts are still being written (a
client's deadline), what it reports as cached, a cancel while it is encoded, and which requests keep encoding at
admission."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from canvas.engine.core import Engine, GenRequest
from canvas.engine.prefix_cache import Prefill, PrefixCache
from canvas.engine.types import Done, Event, Frame
from canvas.model import DiffusionModel, ModelConfig
from canvas.sampling.sampler import SamplerConfig
from tests.canvas.engine.test_ar import NULL, infill, run
from tests.canvas.engine.test_ar_fim import FIM
from tests.canvas.engine.test_prefix_cache import _typing, doc


@pytest.fixture(scope="module")
def model() -> DiffusionModel:
    torch.manual_seed(0)
    return DiffusionModel(ModelConfig.from_name("tiny").replace(null_token_id=NULL)).eval()


def prefills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Record the tokens of every `PrefixCache.prefill`, in order."""
    seen: list[tuple[int, ...]] = []
    real = PrefixCache.prefill

    def recorded(self: PrefixCache, tokens: Sequence[int], room: int = 0, **kw: Any) -> Prefill:
        seen.append(tuple(tokens))
        return real(self, tokens, room, **kw)

    monkeypatch.setattr(PrefixCache, "prefill", recorded)
    return seen


# (left pinned, gap, right pinned, sampler settings): every one scores its seam
CASES: list[tuple[int, int, int, dict[str, Any]]] = [
    (3, 6, 3, {"ar_drafts": 3, "ar_seam_tokens": 2}),
    (0, 5, 4, {"ar_drafts": 4, "ar_seam_tokens": 3, "ar_temperature": 1.0}),
    (2, 8, 2, {"ar_drafts": 4, "ar_seam_tokens": 2, "ar_smc_every": 3}),  # a resample reads the context mid-gap
    (2, 6, 3, {"ar_drafts": 3, "ar_seam_tokens": 2, "ar_min_fill": 0.25}),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_lazy_and_eager_contexts_give_the_same_tokens(model: DiffusionModel, case: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    left, gap, right, cfg = CASES[case]
    seen = prefills(monkeypatch)
    eager = Engine(model, max_batch=2, fim=FIM, lazy_context=False)
    lazy = Engine(model, max_batch=2, fim=FIM)
    base = tuple(doc(20 + case, 70))
    for k in range(3):  # a writer typing: later requests find the earlier ones' blocks in each engine's cache
        reqs = [infill(_typing(base, k), left, gap, right, slot_seed=k, seed=s, **cfg) for s in (3, 4)]
        seen.clear()
        want, _ = run(eager, reqs)
        assert seen[0] == reqs[0].context_ids  # eager: the context first, at admission
        seen.clear()
        got, _ = run(lazy, reqs)
        assert seen[0][:2] == (FIM.bos, FIM.prefix) and reqs[0].context_ids in seen  # lazy: the FIM prompt first
        for w, g in zip(want, got, strict=True):
            assert w.status == g.status == "completed" and w.mode == g.mode == "ar-infill"
            assert g.canvases == w.canvases, (case, k)
            assert g.forwards == w.forwards
            if k:  # the context was encoded, so it reports what the cache restored of it, as eager does
                assert min(g.cached_tokens, w.cached_tokens) >= len(base) - 1


def test_two_gaps_the_second_reads_the_context_the_first_encoded(model: DiffusionModel) -> None:
    g = torch.Generator().manual_seed(9)
    slots = tuple(torch.randint(10, 500, (16,), generator=g).tolist())
    pinned = tuple(not (2 <= i < 6 or 9 <= i < 13) for i in range(16))
    cfg = SamplerConfig(mode="ar", ar_drafts=3, ar_seam_tokens=2, seed=2)
    req = GenRequest(tuple(doc(5, 40)), slots, pinned, cfg)
    (want,), _ = run(Engine(model, fim=FIM, lazy_context=False), [req])
    (got,), _ = run(Engine(model, fim=FIM), [req])
    assert got.canvases == want.canvases and got.status == "completed"


def test_a_request_ended_while_drafting_never_encodes_its_context(model: DiffusionModel,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """As a client's deadline does: the request is cancelled once its drafts show; the plain context was never
    read, so it was never encoded, and the FIM prompt's blocks are all the cache holds. The next request then
    encodes it when its seam is scored, and the one after that reuses it."""
    seen = prefills(monkeypatch)
    engine = Engine(model, max_batch=1, fim=FIM)
    ctx = tuple(doc(11, 90))
    req = infill(ctx, 3, 8, 3, seed=1, ar_drafts=3, ar_seam_tokens=2)
    frames: list[Frame] = []

    def on_event(ev: Event) -> None:
        if isinstance(ev, Frame):
            frames.append(ev)
            h.cancel()

    h = engine.submit(req, on_event)
    engine.run_until_idle()
    done = h.wait(0)
    assert done.status == "cancelled" and frames and frames[0].drafts is not None
    assert all(s[:2] == (FIM.bos, FIM.prefix) for s in seen), "only the FIM prompt was encoded"
    stats = engine.contexts.stats()
    assert len(seen) == stats.lookups == 1 and stats.tokens_encoded == len(seen[0])
    assert done.cached_tokens == 0 and done.prompt_s < 0.5
    eager = Engine(model, max_batch=1, fim=FIM, lazy_context=False)
    (want,), _ = run(eager, [req])
    (first,), _ = run(engine, [req])  # read this time: its seam is scored
    assert first.canvases == want.canvases and first.cached_tokens <= 1  # at most BOS, from the FIM prompt's block
    assert engine.contexts.stats().tokens_encoded >= len(ctx) - 1
    (second,), _ = run(engine, [req])
    assert second.canvases == want.canvases and second.cached_tokens == len(ctx)


def test_a_deferred_context_reports_what_the_cache_holds_until_it_is_read(model: DiffusionModel) -> None:
    """Admitted, a deferred context reports the tokens the cache holds of it (`PrefixCache.held`): what it will not
    encode; a frame before it is read says so, the `Done` after it is read reports what the encode restored."""
    engine = Engine(model, max_batch=1, fim=FIM)
    ctx = tuple(doc(12, 60))
    run(engine, [GenRequest(ctx, (7,) * 4, (False,) * 4, SamplerConfig(mode="ar", seed=1))])  # encoded eagerly
    assert engine.contexts.held(ctx) == len(ctx) and engine.contexts.held(ctx + (33,)) == len(ctx)
    assert engine.contexts.held(ctx[:-1] + (33,)) == len(ctx) - 1 and engine.contexts.held(()) == 0
    (done,), (frames,) = run(engine, [infill(ctx + (33, 34), 2, 6, 2, seed=1, ar_drafts=2, ar_seam_tokens=2)])
    assert frames[0].cached_tokens == len(ctx)  # held at admission: all of the earlier context
    assert done.cached_tokens == len(ctx) and done.status == "completed"  # restored when read at the gap's end


def test_a_cancel_while_the_deferred_context_is_encoded_ends_cancelled(model: DiffusionModel) -> None:
    engine = Engine(model, max_batch=1, fim=FIM)
    engine.contexts = PrefixCache(model, 64 << 20, block=4)  # many pieces: room to cancel between two
    ctx = tuple(doc(13, 120))
    req = infill(ctx, 2, 3, 2, seed=1, ar_drafts=2, ar_seam_tokens=2)
    real = engine.contexts.prefill
    events: list[Event] = []

    def cancelling(tokens: Sequence[int], room: int = 0, **kw: Any) -> Prefill:
        if tuple(tokens) == ctx:  # the deferred context, read at the gap's end: the writer moves on meanwhile
            h.cancel()
        return real(tokens, room, **kw)

    engine.contexts.prefill = cancelling  # type: ignore[method-assign]
    h = engine.submit(req, events.append)
    engine.run_until_idle()
    done = h.wait(0)
    assert done.status == "cancelled" and isinstance(events[-1], Done) and engine._active == 0
    engine.contexts.prefill = real  # type: ignore[method-assign]
    (again,), _ = run(engine, [req])
    assert again.status == "completed"


def test_only_fim_infills_defer_their_context(model: DiffusionModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A continuation, a diffusion infill, an AR infill in the plain frame (fim off, or a model without the format)
    and one whose first gap is not scored encode the context at admission, before anything else."""
    seen = prefills(monkeypatch)
    ctx = tuple(doc(14, 30))
    scored = {"ar_drafts": 2, "ar_seam_tokens": 2}
    cases = [
        (Engine(model, fim=FIM), GenRequest(ctx, (7,) * 4, (False,) * 4, SamplerConfig(mode="ar"))),
        (Engine(model, fim=FIM), dataclasses.replace(infill(ctx, 2, 4, 2), config=SamplerConfig(max_steps=2))),
        (Engine(model, fim=FIM), infill(ctx, 2, 4, 2, fim=False, **scored)),
        (Engine(model), infill(ctx, 2, 4, 2, **scored)),
        (Engine(model, fim=FIM), infill(ctx, 2, 4, 2, ar_drafts=1, ar_seam_tokens=0)),
    ]
    for engine, req in cases:
        seen.clear()
        (done,), _ = run(engine, [req])
        assert done.status == "completed" and seen[0] == ctx
