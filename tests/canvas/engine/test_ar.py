"""AR mode: batched lanes give each row its tokens alone, one encode per step, seam scoring, endings, nulls, rewrites,
several gaps, cancellation and frames (the tiny random model; a scripted scorer where the choice is the point)."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

import canvas.engine.ar as engine_ar
from canvas.engine.core import Done, Engine, Frame, GenRequest
from canvas.model import DiffusionModel, KVCache, ModelConfig
from canvas.sampling.sampler import GumbelNoise, SamplerConfig, extra_settings, load_sampler_defaults

NULL = 4
PLAIN = {"ar_drafts": 1, "ar_seam_tokens": 0}  # today's left-to-right fill


@pytest.fixture(scope="module")
def model() -> DiffusionModel:
    torch.manual_seed(0)
    return DiffusionModel(ModelConfig.from_name("tiny").replace(null_token_id=NULL)).eval()


def infill(ctx: tuple[int, ...], left: int, gap: int, right: int, slot_seed: int = 0, **cfg: object) -> GenRequest:
    g = torch.Generator().manual_seed(slot_seed)
    slots = tuple(torch.randint(10, 500, (left + gap + right,), generator=g).tolist())
    pinned = tuple(not left <= i < left + gap for i in range(len(slots)))
    config = SamplerConfig(mode="ar", **cfg)  # type: ignore[arg-type]
    return GenRequest(ctx, slots, pinned, config)


def run(engine: Engine, reqs: list[GenRequest]) -> tuple[list[Done], list[list[Frame]]]:
    frames: list[list[Frame]] = [[] for _ in reqs]
    handles = [engine.submit(r, lambda e, i=i: frames[i].append(e) if isinstance(e, Frame) else None)
               for i, r in enumerate(reqs)]
    engine.run_until_idle()
    return [h.wait(0) for h in handles], frames


def greedy(model: DiffusionModel, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        logits, _ = model.encode(torch.tensor([ids + out]), logits="last")
        assert logits is not None
        out.append(int(logits[0, -1].argmax()))
    return out


def test_aligned_cache_encodes_each_row_as_alone(model: DiffusionModel) -> None:
    """Rows of different lengths (one past the sliding window), left-padded together, get their own logits."""
    W = model.config.sliding_window
    ctxs = [[5, 9, 14], list(range(10, 10 + W + 5)), [7] * 9]
    alone = []
    for c in ctxs:
        _, cache = model.encode(torch.tensor([c]), cache=model.new_cache(1, len(c) + 4), logits="none")
        alone.append(cache)
    batch = KVCache.aligned([(c, 0) for c in alone], room=3)
    assert batch.pos_offset.tolist() == [len(ctxs[1]) - len(c) for c in ctxs]
    tokens = torch.tensor([[21], [22], [23]])
    for _ in range(3):
        got, _ = model.encode(tokens, cache=batch, logits="last")
        for b, cache in enumerate(alone):
            want, _ = model.encode(tokens[b : b + 1], cache=cache, logits="last")
            assert want is not None and got is not None
            torch.testing.assert_close(got[b], want[0], atol=1e-5, rtol=1e-5)
        assert got is not None
        tokens = got[:, -1].argmax(-1, keepdim=True)
    # A row taken back out of the batch is a cache of its own again.
    again = KVCache.aligned([(batch, 0)], room=1)
    assert again.length == len(ctxs[0]) + 3 and int(again.pos_offset[0]) == 0


def test_ar_rows_batched_equal_alone(model: DiffusionModel) -> None:
    """Plain and seam-aware AR rows (contexts of different lengths, sampled at a temperature) together give each
    the tokens it gets alone: the batch changes nothing but the cost."""
    W = model.config.sliding_window
    reqs = [
        infill((5, 9), 3, 6, 4, **PLAIN),
        infill(tuple(range(20, 20 + W + 3)), 2, 5, 3, slot_seed=1, ar_drafts=3, ar_seam_tokens=2, ar_temperature=0.8,
               seed=7),
        GenRequest((6, 7, 8), (), (), SamplerConfig(mode="ar", ar_temperature=0.9, seed=3)),
        infill((11,), 0, 7, 2, slot_seed=2, ar_drafts=4, ar_seam_tokens=3, ar_temperature=0.7, seed=9),
    ]
    def used(dones: list[Done]) -> list[tuple[int, ...]]:  # the unused rest of a canvas holds noise
        return [d.canvases[0][: len(r.slot_ids) or None] for d, r in zip(dones, reqs, strict=True)]

    alone = used([run(Engine(model, max_batch=1), [r])[0][0] for r in reqs])
    together, _ = run(Engine(model, max_batch=8), reqs)
    assert used(together) == alone
    assert [d.mode for d in together] == ["ar", "ar-infill", "ar", "ar-infill"]


def test_greedy_plain_fill_is_todays(model: DiffusionModel) -> None:
    """K=1 with no seam tokens fills every free slot left to right, feeding pins: no nulls, greedy decode."""
    req = infill((5, 9, 14), 3, 5, 4, **PLAIN)
    (done,), _ = run(Engine(model), [req])
    out = list(done.canvases[0])
    assert out[3:8] == greedy(model, [5, 9, 14, *req.slot_ids[:3]], 5)
    assert NULL not in out[:12] and done.mode == "ar"


def test_one_encode_per_step_for_all_drafts(model: DiffusionModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two infills of K=4 drafts each: every drafting step is one encode of 8 rows, nothing re-encodes the context
    per draft."""
    calls: list[tuple[int, int]] = []
    real = DiffusionModel.encode

    def counting(self: DiffusionModel, ids: torch.Tensor, *a: object, **kw: object) -> object:
        calls.append(tuple(ids.shape))  # type: ignore[arg-type]
        return real(self, ids, *a, **kw)  # type: ignore[arg-type]

    engine = Engine(model)
    reqs = [infill((5, 9), 0, 6, 3, slot_seed=s, ar_drafts=4, ar_seam_tokens=2, ar_temperature=0.8, seed=s)
            for s in (1, 2)]
    handles = [engine.submit(r) for r in reqs]
    engine.step()  # admission encodes each context once, then the first drafting step
    monkeypatch.setattr(DiffusionModel, "encode", counting)
    engine.run_until_idle()
    assert all(h.wait(0).status == "completed" for h in handles)
    assert calls == [(8, 1)] * 5  # 6 tokens a draft: the first step was before counting
    assert [h.wait(0).steps for h in handles] == [6, 6]


def test_seam_logprobs_equal_full_encodes(model: DiffusionModel) -> None:
    """The one-forward score of every (draft, ending) equals encoding context + draft[:e] + seam from scratch."""
    ctx = [5, 9, 14, 3]
    drafts = torch.tensor([[30, 31, 32, 33, 34], [40, 41, 42, 43, 44]])
    seam = torch.tensor([50, 51, 52, 53])
    _, base = model.encode(torch.tensor([ctx]), cache=model.new_cache(1, 20), logits="none")
    batch = KVCache.aligned([(base, 0), (base, 0)], room=5)
    model.encode(drafts, cache=batch, logits="none")
    lengths = torch.tensor([[5, 3, 1], [4, 5, 2]])
    last = drafts.gather(1, lengths - 1)  # each candidate's last draft token, re-read as the first query
    got = engine_ar.seam_logprobs(model, batch, torch.tensor([0, 1]), batch.length - 5 + lengths, seam, last)
    for k in range(2):
        for i, e in enumerate(lengths[k].tolist()):
            ids = torch.tensor([ctx + drafts[k, :e].tolist() + seam.tolist()])
            logits, _ = model.encode(ids, logits="all")
            assert logits is not None
            logp = torch.log_softmax(logits[0], -1)
            n = len(ctx) + e
            want = sum(float(logp[n + j - 1, int(seam[j])]) for j in range(len(seam)))  # the first seam token too
            assert abs(float(got[k, i]) - want) < 1e-4


def test_the_scored_best_candidate_is_written_and_nulls_pad_the_gap(model: DiffusionModel,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine writes the candidate the scorer prefers: that lane's draft cut at that ending, `<null>` after."""
    gap = 8
    seen: list[torch.Tensor] = []

    def score(model: DiffusionModel, cache: KVCache, rows: torch.Tensor, limits: torch.Tensor,
              seam: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        seen.append(limits - (cache.length - gap))  # the candidates' draft lengths
        lengths = limits - (cache.length - gap)
        return torch.where((torch.arange(len(rows))[:, None] == 2) & (lengths == 5), 1e6, 0.0)

    monkeypatch.setattr(engine_ar, "seam_logprobs", score)
    req = infill((5, 9), 2, gap, 3, ar_drafts=4, ar_seam_tokens=3, ar_temperature=1.0, seed=4, ar_min_fill=0.5,
                 ar_endings=4)
    (done,), _ = run(Engine(model), [req])
    lengths = seen[0]
    assert lengths.shape == (4, 4) and all(set(row.tolist()) == {8, 7, 5, 4} for row in lengths)  # evenly spaced
    out = done.canvases[0]
    assert out[2 + 5 : 2 + gap] == (NULL,) * 3 and NULL not in out[2 : 2 + 5]
    assert out[:2] == req.slot_ids[:2] and out[2 + gap : 2 + gap + 3] == req.slot_ids[2 + gap :]
    assert done.generated == 5 and done.mode == "ar-infill"


def test_endings_follow_clause_ends(model: DiffusionModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """With clause-end ids, a draft may end after one of them (no shorter than ar_min_fill) or at the budget."""

    def shortest(model: DiffusionModel, cache: KVCache, rows: torch.Tensor, limits: torch.Tensor,
                 seam: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return -1e6 * limits.float()  # the shortest candidate wins

    monkeypatch.setattr(engine_ar, "seam_logprobs", shortest)
    gap = 10
    req = infill((5, 9), 0, gap, 3, ar_drafts=1, ar_seam_tokens=2, ar_min_fill=0.3, ar_endings=8)
    draft = greedy_banned(model, [5, 9], gap)  # greedy: the one draft the seam-aware run makes
    ends = frozenset({draft[1], draft[5]})  # clause ends after token 2 (below 30% of 10) and after token 6
    want = min([gap] + [e for e in range(3, gap) if draft[e - 1] in ends])
    assert want <= 6
    (done,), _ = run(Engine(model, clause_ends=ends), [req])
    assert done.canvases[0][:want] == tuple(draft[:want])
    assert done.canvases[0][want:gap] == (NULL,) * (gap - want)


def test_drafts_never_repeat_their_own_ngrams(model: DiffusionModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that always prefers token 50, then 60: greedy drafts loop unless n-grams may not repeat."""
    real = DiffusionModel.encode

    def looping(self: DiffusionModel, ids: torch.Tensor, *a: object, **kw: object) -> object:
        logits, cache = real(self, ids, *a, **kw)  # type: ignore[arg-type]
        if logits is not None:
            logits[..., 50] += 100.0
            logits[..., 60] += 50.0
        return logits, cache

    monkeypatch.setattr(DiffusionModel, "encode", looping)
    gap, n = 12, 3

    def fill(no_repeat: int) -> tuple[int, ...]:
        req = infill((5, 9), 1, gap, 2, ar_drafts=2, ar_seam_tokens=2, ar_endings=1, ar_no_repeat=no_repeat)
        (done,), _ = run(Engine(model), [req])
        return done.canvases[0][1 : 1 + gap]

    def repeats(toks: tuple[int, ...]) -> int:
        grams = [toks[i : i + n] for i in range(len(toks) - n + 1)]
        return len(grams) - len(set(grams))

    assert fill(0) == (50,) * gap
    free = fill(n)
    assert repeats(free) == 0 and free[:4] == (50, 50, 50, 60)


def test_a_rewrite_never_offers_the_old_text_while_another_exists(model: DiffusionModel) -> None:
    gap = 6
    base = infill((5, 9), 2, gap, 3, ar_drafts=2, ar_seam_tokens=2, ar_endings=1)  # greedy: both lanes the same
    (first,), _ = run(Engine(model), [base])
    old = first.canvases[0][2 : 2 + gap]
    assert NULL not in old  # one ending: the budget
    (same,), _ = run(Engine(model), [dataclasses.replace(base, avoid=(old,))])
    assert same.canvases[0][2 : 2 + gap] == old  # no other candidate exists: the old text it is
    more = dataclasses.replace(base, config=dataclasses.replace(base.config, ar_endings=3), avoid=(old,))
    (done,), _ = run(Engine(model), [more])
    assert done.canvases[0][2 : 2 + gap] != old


def test_several_gaps_left_to_right(model: DiffusionModel) -> None:
    """The second gap is drafted after the first gap's chosen fill (greedy, one ending: both are greedy decodes)."""
    ctx = [5, 9]
    slots = (20, 21, 0, 0, 0, 0, 22, 23, 0, 0, 0, 24, 25)
    pinned = tuple(t != 0 for t in slots)
    cfg = SamplerConfig(mode="ar", ar_drafts=3, ar_seam_tokens=2, ar_endings=1)
    (done,), _ = run(Engine(model), [GenRequest(tuple(ctx), slots, pinned, cfg)])
    out = list(done.canvases[0])
    first = greedy_banned(model, ctx + [20, 21], 4)
    assert out[2:6] == first
    assert out[8:11] == greedy_banned(model, ctx + [20, 21] + first + [22, 23], 3)
    assert done.mode == "ar-infill"


def greedy_banned(model: DiffusionModel, ids: list[int], n: int) -> list[int]:
    """Greedy decode that never picks `<null>` or EOS (as seam-aware drafts do)."""
    out: list[int] = []
    for _ in range(n):
        logits, _ = model.encode(torch.tensor([ids + out]), logits="last")
        assert logits is not None
        last = logits[0, -1].clone()
        last[[NULL, *model.config.eos_token_ids]] = float("-inf")
        out.append(int(last.argmax()))
    return out


def test_cancel_mid_draft_frees_the_lanes(model: DiffusionModel) -> None:
    engine = Engine(model)
    h = engine.submit(infill((5, 9), 2, 12, 3, ar_drafts=4, ar_seam_tokens=2, ar_temperature=0.8, seed=1))
    for _ in range(3):
        engine.step()
    assert engine._ar.cache is not None and engine._ar.cache.batch_size == 4
    h.cancel()
    engine.run_until_idle()
    assert h.wait(0).status == "cancelled" and engine._ar.cache is None
    (after,), _ = run(engine, [infill((5, 9), 1, 3, 2, **PLAIN)])
    assert after.status == "completed"


def test_frames_show_the_leading_draft_growing_then_the_choice(model: DiffusionModel) -> None:
    gap = 6
    req = infill((5, 9), 2, gap, 3, ar_drafts=3, ar_seam_tokens=2, ar_temperature=0.8, seed=2)
    (done,), (frames,) = run(Engine(model), [req])
    assert len(frames) == gap and [f.step for f in frames] == list(range(1, gap + 1))
    for n, f in enumerate(frames[:-1], start=1):
        assert f.accepted[2 + n] and sum(f.accepted) == 1  # the newest token: n + 1 drafted after n steps
        assert f.draft[:2] == req.slot_ids[:2]
    assert frames[-1].draft == done.canvases[0] and sum(frames[-1].accepted) == gap


def test_frames_carry_every_draft_side_by_side_then_the_one_chosen(model: DiffusionModel) -> None:
    """An infill's K drafts travel in its frames as they grow (one token each per frame); the canvas shows the lead;
    the last frame names the draft chosen and how much of it was kept, which is what the canvas holds."""
    gap, K = 6, 3
    req = infill((5, 9), 2, gap, 3, ar_drafts=K, ar_seam_tokens=2, ar_temperature=0.8, seed=2)
    (done,), (frames,) = run(Engine(model), [req])
    growing = frames[:-1]
    for n, f in enumerate(growing, start=2):  # the first token is sampled from the context, before any frame
        d = f.drafts
        assert d is not None and (d.start, d.end, d.chosen) == (2, 2 + gap, None)
        assert len(d.tokens) == K and all(len(t) == n for t in d.tokens)
        assert f.draft[2 : 2 + n] == d.tokens[d.lead]
        # each token's log-probability travels beside it, for a client's own choice among the drafts
        assert d.logp is not None and [len(lp) for lp in d.logp] == [n] * K
        assert all(v <= 0 and math.isfinite(v) for lp in d.logp for v in lp)
    for before, after in zip(growing, growing[1:], strict=False):  # drafts only grow: earlier tokens stay
        assert before.drafts is not None and after.drafts is not None
        assert all(a[: len(b)] == b for a, b in zip(after.drafts.tokens, before.drafts.tokens, strict=True))
    last = frames[-1].drafts
    assert last is not None and last.chosen is not None and 1 <= last.length <= gap
    assert all(len(t) == gap for t in last.tokens)
    kept = done.canvases[0][2 : 2 + gap]
    assert kept[: last.length] == last.tokens[last.chosen][: last.length]
    assert all(t == NULL for t in kept[last.length :])
    # A plain fill (one lane) and a continuation carry no drafts.
    (_,), (plain,) = run(Engine(model), [infill((5, 9), 2, 4, 3, **PLAIN)])
    assert all(f.drafts is None for f in plain)


def test_settings_are_checked_and_persisted(tmp_path) -> None:  # noqa: ANN001
    for bad in ({"ar_drafts": 0}, {"ar_drafts": 2.5}, {"ar_seam_tokens": -1}, {"ar_min_fill": 1.5},
                {"ar_endings": 0}, {"ar_draft_weight": -1.0}, {"ar_select_temperature": -0.1}, {"ar_no_repeat": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplerConfig(**bad)  # type: ignore[arg-type]
    cfg = SamplerConfig(ar_drafts=5, ar_seam_tokens=6, ar_min_fill=0.25, ar_endings=3, ar_draft_weight=0.5,
                        ar_no_repeat=0, ar_min_p=0.05)
    import json

    (tmp_path / "dcanvas_sampler.json").write_text(json.dumps(extra_settings(cfg)))
    assert load_sampler_defaults(tmp_path) == cfg
    assert SamplerConfig(**PLAIN).seam_aware is False and SamplerConfig(ar_drafts=1, ar_seam_tokens=4).seam_aware
    assert SamplerConfig().seam_aware  # AR mode joins the text after a gap unless told otherwise


def test_a_long_gap_drafts_at_its_own_temperature(model: DiffusionModel) -> None:
    """Gaps longer than `ar_long_gap` draft at `ar_temperature_long`: at 0 (greedy) the seed no longer matters,
    while the same gap at the hot `ar_temperature` (not longer than the bound) differs by seed."""

    def fill(seed: int, long_gap: int) -> tuple[int, ...]:
        req = infill((5, 9), 2, 8, 3, ar_drafts=2, ar_seam_tokens=3, ar_temperature=5.0, seed=seed,
                     ar_long_gap=long_gap, ar_temperature_long=0.0)
        (done,), _ = run(Engine(model), [req])
        return done.canvases[0][2:10]  # the gap (the canvas's free tail is a continuation)

    assert fill(1, 7) == fill(2, 7)  # 8 > 7: greedy, both lanes alike
    assert fill(1, 8) != fill(2, 8)  # 8 is not longer than 8: sampled at 5.0
    for bad in ({"ar_long_gap": -1}, {"ar_temperature_long": -0.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplerConfig(**bad)  # type: ignore[arg-type]
    cfg = SamplerConfig(ar_long_gap=48, ar_temperature_long=0.6)
    assert extra_settings(cfg)["ar_long_gap"] == 48 and extra_settings(cfg)["ar_temperature_long"] == 0.6



SENTINEL = 7  # the marked noise: every slot of a fresh canvas that is not pinned


class _MarkedNoise(GumbelNoise):
    """The engine's noise, recognisable: a fresh canvas's free slots all hold SENTINEL (samples still use the seeded
    generator, so the model's tokens are what they would be)."""

    def uniform_tokens(self, shape: tuple[int, int], vocab_size: int, device: torch.device) -> torch.Tensor:
        return torch.full(shape, SENTINEL, dtype=torch.long, device=device)


def test_ar_frames_say_which_slots_the_model_has_written(model: DiffusionModel) -> None:
    """An AR frame's `written` covers the pins, the filled gaps and the leading draft's tokens so far, and nothing
    else: every other free slot still holds the canvas's noise. Diffusion frames carry None. Frames pickle."""
    engine = Engine(model, noise_factory=lambda cfg: _MarkedNoise(cfg.seed))
    left, gap, right = 2, 6, 3
    scored = infill((5, 9), left, gap, right, ar_drafts=3, ar_seam_tokens=2, ar_temperature=0.8, seed=2)
    plain = GenRequest((5, 9), (), (), SamplerConfig(mode="ar", ar_temperature=0.8, seed=3), n_canvases=2)
    (d1, d2), (f1, f2) = run(engine, [scored, plain])
    for req, frames, done in ((scored, f1, d1), (plain, f2, d2)):
        assert frames and done.status == "completed"
        for f in frames:
            assert f.written is not None and len(f.written) == model.config.canvas_length
            used = len(req.slot_ids) or model.config.canvas_length
            free = [k for k in range(used) if not (req.pinned and req.pinned[k])]
            assert all(f.written[k] for k in range(used) if req.pinned and req.pinned[k])
            shown = [f.written[k] for k in free]
            n = shown.count(True)
            assert shown == [True] * n + [False] * (len(free) - n)  # written left to right
            assert all(f.draft[k] == SENTINEL for k in free[n:])  # the rest is still the noise
            if f.drafts is not None and f.drafts.chosen is None:  # the lead's tokens so far are what is written
                assert [f.draft[k] for k in free[:n]] == list(f.drafts.tokens[f.drafts.lead][:n])
        last = {f.canvas_index: f for f in frames}
        for c, f in last.items():  # each canvas ends fully written, and that is what was committed
            assert f.written is not None and all(f.written[:used])
            assert f.draft[:used] == done.canvases[c][:used]
        assert pickle.loads(pickle.dumps(frames[0])) == frames[0]
    assert any(f.written is not None and not all(f.written[left : left + gap]) for f in f1)
    diffusion = SamplerConfig(max_steps=2, seed=1)
    (_,), (frames,) = run(engine, [GenRequest((5, 9), (0,) * 4, (False,) * 4, diffusion)])
    assert frames and all(f.written is None for f in frames)


def test_done_and_frames_report_the_context_cache_and_encoding(model: DiffusionModel) -> None:
    engine = Engine(model)
    req = infill((5, 9, 11), 1, 3, 2, **PLAIN)
    (first,), (frames,) = run(engine, [req])
    (again,), (frames2,) = run(engine, [req])
    assert (first.cached_tokens, again.cached_tokens) == (0, 3)  # the same context: its kept encoder cache
    assert frames[0].cached_tokens == 0 and frames2[0].cached_tokens == 3
    assert first.prompt_s > 0 and frames[0].prompt_s == first.prompt_s
