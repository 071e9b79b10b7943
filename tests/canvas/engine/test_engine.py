"""Engine: pins hold, batching does not change a request's tokens, cancel, AR mode, continuation, errors."""

from __future__ import annotations

import threading

import pytest
import torch

from canvas.engine.core import Done, Engine, Frame, GenRequest
from canvas.model import DiffusionModel, ModelConfig
from canvas.sampling.sampler import SamplerConfig


@pytest.fixture(scope="module")
def model() -> DiffusionModel:
    torch.manual_seed(0)
    return DiffusionModel(ModelConfig.from_name("tiny")).eval()


def request(model: DiffusionModel, seed: int, n_ctx: int = 6, **kw) -> GenRequest:
    g = torch.Generator().manual_seed(seed)
    V, L = model.config.vocab_size, model.config.canvas_length
    ctx = tuple(torch.randint(3, V, (n_ctx,), generator=g).tolist())
    slots = tuple(torch.randint(3, V, (L,), generator=g).tolist())
    pinned = tuple(bool(i % 3 == 0) for i in range(L))  # every third slot pinned
    cfg = kw.pop("config", SamplerConfig(max_steps=6, seed=seed))
    return GenRequest(ctx, slots, pinned, cfg, **kw)


def run(engine: Engine, reqs: list[GenRequest]) -> tuple[list[Done], list[list[Frame]]]:
    frames: list[list[Frame]] = [[] for _ in reqs]
    handles = [
        engine.submit(r, lambda e, i=i: frames[i].append(e) if isinstance(e, Frame) else None)
        for i, r in enumerate(reqs)
    ]
    engine.run_until_idle()
    return [h.wait(0) for h in handles], frames


def test_pins_hold_in_every_frame_and_result(model: DiffusionModel) -> None:
    req = request(model, 1)
    (done,), (frames,) = run(Engine(model), [req])
    assert done.status == "completed" and len(done.canvases) == 1
    assert 1 <= len(frames) <= req.config.max_steps and done.steps == len(frames)
    for canvas in [*(f.draft for f in frames), done.canvases[0]]:
        for tok, want, pin in zip(canvas, req.slot_ids, req.pinned, strict=True):
            if pin:
                assert tok == want
    for f in frames:
        assert not any(a and p for a, p in zip(f.accepted, req.pinned, strict=True))
        assert all(e == 0.0 for e, p in zip(f.entropy, req.pinned, strict=True) if p)
    assert done.generated == sum(not p for p in req.pinned)


def test_batched_equals_alone(model: DiffusionModel) -> None:
    """Three requests of different context lengths batched together give each the tokens it gets alone."""
    reqs = [request(model, s, n_ctx=n) for s, n in ((2, 3), (3, model.config.sliding_window + 7), (4, 9))]
    alone = [run(Engine(model, max_batch=1), [r])[0][0].canvases for r in reqs]
    together, _ = run(Engine(model, max_batch=8), reqs)
    assert [d.canvases for d in together] == alone


def test_join_between_steps(model: DiffusionModel) -> None:
    """A request submitted while another runs joins the batch at the next step and still matches its solo run."""
    first, second = request(model, 5), request(model, 6, n_ctx=11)
    solo = run(Engine(model), [second])[0][0].canvases
    engine = Engine(model)
    h1 = engine.submit(first)
    engine.step()
    engine.step()
    h2 = engine.submit(second)
    engine.run_until_idle()
    assert h1.wait(0).status == "completed"
    assert h2.wait(0).canvases == solo


def test_cancel_between_steps(model: DiffusionModel) -> None:
    engine = Engine(model)
    req = request(model, 7, config=SamplerConfig(max_steps=40, seed=7))
    h = engine.submit(req)
    engine.step()
    h.cancel()
    engine.run_until_idle()
    done = h.wait(0)
    assert done.status == "cancelled" and done.steps == 1


def test_background_thread(model: DiffusionModel) -> None:
    engine = Engine(model)
    engine.start()
    try:
        got = threading.Event()
        h = engine.submit(request(model, 8), lambda e: got.set() if isinstance(e, Done) else None)
        assert h.wait(60).status == "completed"
        assert got.is_set()
    finally:
        engine.stop()


def test_ar_greedy_matches_manual_decode(model: DiffusionModel) -> None:
    L = model.config.canvas_length
    ctx = (5, 9, 14, 3)
    req = GenRequest(ctx, (), (), SamplerConfig(mode="ar"))
    (done,), (frames,) = run(Engine(model), [req])
    ids = list(ctx)
    for _ in range(L):
        logits, _ = model.encode(torch.tensor([ids]), logits="last")
        assert logits is not None
        ids.append(int(logits[0, -1].argmax()))
    assert list(done.canvases[0]) == ids[len(ctx) :]
    assert done.forwards == L and done.tokens_per_forward == 1.0


def test_ar_feeds_pinned_runs_at_once(model: DiffusionModel) -> None:
    slots = (7, 8, 9, 0, 0, 10)
    pinned = (True, True, True, False, False, True)
    req = GenRequest((4, 5), slots, pinned, SamplerConfig(mode="ar", ar_drafts=1, ar_seam_tokens=0))  # plain fill
    (done,), _ = run(Engine(model), [req])
    out = done.canvases[0]
    assert out[:3] == (7, 8, 9) and out[5] == 10
    # 1 forward for the pinned run, 1 per free slot; the last pinned run is not fed (nothing after it reads the
    # context) and the unused rest of the canvas is skipped
    assert done.forwards == 1 + 2 and len(out) == model.config.canvas_length
    assert done.mode == "ar"


def test_continuation_stops_at_eos(model: DiffusionModel) -> None:
    eos = model.config.eos_token_ids[0]
    req = GenRequest((4, 5, 6), (), (), SamplerConfig(max_steps=3, seed=1), n_canvases=3)
    (done,), _ = run(Engine(model), [req])
    assert 1 <= len(done.canvases) <= 3
    for c in done.canvases[:-1]:
        assert eos not in c and len(c) == model.config.canvas_length
    if eos in done.canvases[-1]:
        assert done.canvases[-1][-1] == eos


def test_context_cache_reused(model: DiffusionModel, monkeypatch) -> None:
    engine = Engine(model)
    calls = []
    original = model.encode

    def counting(*a, **k):
        calls.append(a[0].shape)
        return original(*a, **k)

    monkeypatch.setattr(model, "encode", counting)
    run(engine, [request(model, 9)])
    run(engine, [request(model, 9)])
    assert len(calls) == 1


def test_invalid_requests(model: DiffusionModel) -> None:
    engine = Engine(model)
    with pytest.raises(ValueError, match="at least one token"):
        engine.submit(GenRequest((), (), ()))
    with pytest.raises(ValueError, match="exceed the canvas length"):
        engine.submit(GenRequest((1,), (1,) * 999, (True,) * 999))
    with pytest.raises(ValueError, match="pinned has 1 entries for 2 slots"):
        engine.submit(GenRequest((1,), (1, 2), (True,)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(GenRequest((10**6,), (), ()))
    with pytest.raises(ValueError, match="max_steps"):
        SamplerConfig(max_steps=0)


def test_unused_slots_are_hidden_and_never_generated(model: DiffusionModel) -> None:
    """A canvas using 10 of its slots: the rest never influences the result and is never counted as generated."""
    g = torch.Generator().manual_seed(3)
    V = model.config.vocab_size
    slots = tuple(torch.randint(3, V, (10,), generator=g).tolist())
    pinned = (True,) * 4 + (False,) * 3 + (True,) * 3
    req = GenRequest((2, 9, 4), slots, pinned, SamplerConfig(max_steps=4, seed=3))
    (done,), (frames,) = run(Engine(model), [req])
    assert done.generated == 3
    for f in frames:
        assert not any(f.accepted[10:]) and all(e == 0.0 for e in f.entropy[10:])
    # Hidden slots cannot leak into the used ones: a different noise seed for them changes nothing used.
    cache = model.encode(torch.tensor([[2, 9, 4]]), logits="none")[1]
    a = torch.randint(0, V, (1, model.config.canvas_length), generator=g)
    b = a.clone()
    b[0, 10:] = torch.randint(0, V, (model.config.canvas_length - 10,), generator=g)
    mask = torch.zeros(1, model.config.canvas_length, dtype=torch.bool)
    mask[0, :10] = True
    la = model.denoise(a, cache, canvas_mask=mask)
    lb = model.denoise(b, cache, canvas_mask=mask)
    torch.testing.assert_close(la[:, :10], lb[:, :10])
    # ...so the engine may drop them from the forward altogether: the used prefix alone gives the same logits.
    torch.testing.assert_close(model.denoise(a[:, :10], cache), la[:, :10])


def test_forward_covers_only_used_slots(model: DiffusionModel, monkeypatch) -> None:
    """The decoder runs over the longest used prefix in the batch, not the whole canvas; rows of different
    lengths batched together still get the tokens each gets alone."""
    L = model.config.canvas_length
    short = []
    for seed, n in ((11, 10), (12, 40)):
        r = request(model, seed)
        short.append(GenRequest(r.context_ids, r.slot_ids[:n], r.pinned[:n], r.config))
    reqs = [*short, request(model, 13)]
    alone = [run(Engine(model, max_batch=1), [r])[0][0].canvases for r in reqs]
    widths: list[int] = []
    original = model.denoise

    def spy(canvas_ids, *a, **k):
        widths.append(canvas_ids.shape[1])
        return original(canvas_ids, *a, **k)

    monkeypatch.setattr(model, "denoise", spy)
    run(Engine(model), short[:1])
    assert set(widths) == {10}
    widths.clear()
    together, _ = run(Engine(model, max_batch=8), reqs)
    assert widths[0] == L and [d.canvases for d in together] == alone
    assert all(len(c[0]) == L for c in alone)


def _null_loving(model: DiffusionModel, monkeypatch) -> tuple[DiffusionModel, int]:
    """The model with token 3 as <null> and a +40 bias on it at every step: it would put <null> everywhere."""
    import dataclasses

    null = 3
    nully = DiffusionModel(dataclasses.replace(model.config, null_token_id=null)).eval()
    nully.load_state_dict(model.state_dict())
    original = nully.denoise

    def biased(*a, **k):
        logits = original(*a, **k)
        logits[..., null] += 40.0
        return logits

    monkeypatch.setattr(nully, "denoise", biased)
    return nully, null


def test_null_only_inside_gaps(model: DiffusionModel, monkeypatch) -> None:
    """A model that loves <null>: it may fill a gap closed by pinned text, never the free slots after the last pin."""
    nully, null = _null_loving(model, monkeypatch)
    L = model.config.canvas_length
    gap = (True,) * 4 + (False,) * 8 + (True,) * 4 + (False,) * (L - 16)  # a closed gap, then a free tail
    slots = tuple(range(10, 10 + L))
    reqs = [
        GenRequest((2, 9, 4), (), (), SamplerConfig(max_steps=3, seed=1)),  # a continuation
        GenRequest((2, 9, 4), slots, gap, SamplerConfig(max_steps=3, seed=1)),
    ]
    (cont, infill), _ = run(Engine(nully), reqs)
    assert null not in cont.canvases[0]
    assert infill.canvases[0][4:12] == (null,) * 8
    assert null not in infill.canvases[0][16:]


def test_gap_min_fill_keeps_the_head_of_a_gap_for_text(model: DiffusionModel, monkeypatch) -> None:
    """With gap_min_fill, <null> may take only a gap's tail: the same null-loving model as above fills the first
    ceil(0.75 * 8) = 6 slots of an 8-slot gap with text and may leave the last 2 null."""
    nully, null = _null_loving(model, monkeypatch)
    L = model.config.canvas_length
    # A gap at the start of the canvas (closed by a pin), a pin, an 8-slot gap, a pin, then a free tail.
    layout = (False,) * 4 + (True,) * 4 + (False,) * 8 + (True,) * 4 + (False,) * (L - 20)
    slots = tuple(range(10, 10 + L))
    req = GenRequest((2, 9, 4), slots, layout, SamplerConfig(max_steps=3, seed=1, gap_min_fill=0.75))
    (done,), _ = run(Engine(nully), [req])
    canvas = done.canvases[0]
    assert null not in canvas[0:3] and canvas[3] == null  # ceil(0.75 * 4) = 3 slots of text
    assert null not in canvas[8:14] and canvas[14:16] == (null, null)
    assert null not in canvas[20:]


def _dense(model: DiffusionModel, monkeypatch, *, sc_live: bool | None = None) -> list[int]:
    """Make `model` compute every slot's logits (the dense head) and hand the engine the rows it asked for; with
    `sc_live`, also force whether the engine sees its self-conditioning as live. Returns the logits rows per call."""
    original = model.denoise
    asked: list[int] = []

    def dense(canvas_ids, *a, logits_at=None, **k):
        full = original(canvas_ids, *a, **k)  # (B, n, V)
        asked.append(len(logits_at))
        return full.reshape(-1, full.shape[-1]).index_select(0, logits_at)

    monkeypatch.setattr(model, "denoise", dense)
    if sc_live is not None:
        monkeypatch.setattr(model.self_conditioning, "inert", lambda: not sc_live)
    return asked


def _infill_requests(model: DiffusionModel) -> list[GenRequest]:
    """Every third slot pinned; a gap between pinned runs in a shorter window; a whole free canvas."""
    gap = (True,) * 6 + (False,) * 9 + (True,) * 7
    return [
        request(model, 21),
        GenRequest((2, 9, 4), tuple(range(10, 10 + len(gap))), gap, SamplerConfig(max_steps=5, seed=22)),
        GenRequest((5, 6), config=SamplerConfig(max_steps=4, seed=23)),
    ]


def _same_runs(a: tuple[list[Done], list[list[Frame]]], b: tuple[list[Done], list[list[Frame]]]) -> None:
    assert [d.canvases for d in a[0]] == [d.canvases for d in b[0]]
    for fa, fb in zip(a[1], b[1], strict=True):
        assert [(f.draft, f.accepted) for f in fa] == [(f.draft, f.accepted) for f in fb]
        torch.testing.assert_close(torch.tensor([f.entropy for f in fa]), torch.tensor([f.entropy for f in fb]))


def test_sparse_head_gives_the_dense_tokens(model: DiffusionModel, monkeypatch) -> None:
    """The engine asks the model for the logits of the slots a step reads (free slots, plus the pinned ones while
    self-conditioning is live); computing every slot's logits and keeping those rows gives the same tokens, frames
    and entropies, batched or alone."""
    reqs = _infill_requests(model)
    sparse = run(Engine(model, max_batch=8), reqs)
    alone = [run(Engine(model, max_batch=1), [r])[0][0].canvases for r in reqs]
    assert [d.canvases for d in sparse[0]] == alone
    asked = _dense(model, monkeypatch)
    _same_runs(run(Engine(model, max_batch=8), reqs), sparse)
    # Live self-conditioning (a random model's): each used slot's logits, pinned ones too, on the first step.
    assert asked[0] == sum(len(r.slot_ids) or model.config.canvas_length for r in reqs)


def test_inert_self_conditioning_skips_pinned_logits(model: DiffusionModel, monkeypatch) -> None:
    """With a zero self-conditioning MLP (a converted checkpoint) only free slots get logits and no soft embedding
    is computed; the tokens equal those of a dense path that computes every slot's logits and the soft embeddings
    (the engine before this skip)."""
    inert = DiffusionModel(model.config).eval()
    inert.load_state_dict(model.state_dict())
    with torch.no_grad():
        inert.self_conditioning.down.zero_()
    reqs = _infill_requests(model)
    soft_calls: list[int] = []
    original_soft = inert.soft_embeddings
    monkeypatch.setattr(inert, "soft_embeddings", lambda x: soft_calls.append(1) or original_soft(x))
    asked = _dense(inert, monkeypatch)
    sparse = run(Engine(inert, max_batch=8), reqs)
    n_free = sum(sum(not p for p in r.pinned) if r.slot_ids else model.config.canvas_length for r in reqs)
    assert asked[0] == n_free and not soft_calls
    monkeypatch.undo()
    _dense(inert, monkeypatch, sc_live=True)
    _same_runs(run(Engine(inert, max_batch=8), reqs), sparse)


def test_pinned_slots_keep_their_self_conditioning_signal(model: DiffusionModel, monkeypatch) -> None:
    """While self-conditioning is live, every used slot, pinned ones included, gets at step t + 1 the soft
    embeddings of its own step-t logits at step t's temperature, as training and the reference feed it."""
    req = request(model, 31, config=SamplerConfig(max_steps=3, stability_threshold=4, seed=31))
    original = model.denoise
    seen: list[tuple[torch.Tensor | None, torch.Tensor]] = []

    def record(canvas_ids, cache, *a, soft_embeddings=None, logits_at=None, **k):
        seen.append((soft_embeddings, original(canvas_ids, cache, *a, soft_embeddings=soft_embeddings, **k)[0]))
        return original(canvas_ids, cache, *a, soft_embeddings=soft_embeddings, logits_at=logits_at, **k)

    monkeypatch.setattr(model, "denoise", record)
    run(Engine(model), [req])
    assert len(seen) == 3 and seen[0][0] is None
    for step, ((_, logits), (soft, _)) in enumerate(zip(seen, seen[1:], strict=False)):
        assert soft is not None
        want = model.soft_embeddings(logits / req.config.temperature(req.config.max_steps - step))  # (L, M)
        torch.testing.assert_close(soft[0], want, rtol=1e-5, atol=1e-5)
