"""AR infills in the FIM frame and with SMC resampling (the tiny random model, FIM ids of its own): the lanes read
the FIM prompt, the seam is scored in the plain frame, `<|fim_end|>` ends a draft, SMC moves lanes with their cache
rows, batching changes nothing, and a model without the format refuses a request that requires it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import canvas.engine.ar as engine_ar
from canvas.convert.fim import FimTokens, LeadTokens, fim_prompt
from canvas.engine.core import Engine, GenRequest
from canvas.model import DiffusionModel, ModelConfig
from canvas.sampling.sampler import SamplerConfig
from tests.canvas.engine.test_ar import NULL, infill, run

# The tiny model has no tokenizer: four ids of its vocabulary stand for the sentinels (pad 0, eos 1, bos 2, null 4).
FIM = FimTokens(prefix=6, suffix=7, middle=8, end=9, bos=2, pad=0, eos=1)


@pytest.fixture(scope="module")
def model() -> DiffusionModel:
    torch.manual_seed(0)
    return DiffusionModel(ModelConfig.from_name("tiny").replace(null_token_id=NULL)).eval()


def plain_seam(model: DiffusionModel, left: list[int], draft: list[int], seam: list[int]) -> float:
    """log p(seam | left + draft) by the plain AR frame, encoded from scratch."""
    logits, _ = model.encode(torch.tensor([left + draft + seam]), logits="all")
    assert logits is not None
    logp = torch.log_softmax(logits[0], -1)
    n = len(left) + len(draft)
    return sum(float(logp[n + j - 1, t]) for j, t in enumerate(seam))


def recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, list[engine_ar.Candidate]]]:
    """Record every gap's lane tokens and scored candidates."""
    seen: list[tuple[torch.Tensor, list[engine_ar.Candidate]]] = []
    real = engine_ar.ARWalk.candidates

    def wrapped(self: engine_ar.ARWalk, *a: object) -> list[engine_ar.Candidate]:
        out = real(self, *a)  # type: ignore[arg-type]
        seen.append((self.tokens.clone(), out))
        return out

    monkeypatch.setattr(engine_ar.ARWalk, "candidates", wrapped)
    return seen


def greedy_middle(model: DiffusionModel, prompt: list[int], gap: int) -> list[int]:
    """The greedy middle of `gap` tokens after a FIM prompt, encoded from scratch each token, never a sentinel,
    `<null>` nor EOS."""
    want: list[int] = []
    for _ in range(gap):
        logits, _ = model.encode(torch.tensor([prompt + want]), logits="last")
        assert logits is not None
        last = logits[0, -1].clone()
        last[[NULL, *model.config.eos_token_ids, *FIM.sentinels, FIM.bos]] = -math.inf
        want.append(int(last.argmax()))
    return want


def test_fim_lanes_read_the_fim_prompt(model: DiffusionModel) -> None:
    """Greedy, one lane, no early end: the draft is the greedy middle after `fim_prompt(left, right)`, never a
    sentinel, `<null>` nor EOS."""
    ctx, left, gap, right = (2, 5, 11), 3, 6, 4
    req = infill(ctx, left, gap, right, ar_drafts=1, ar_seam_tokens=2, ar_min_fill=1.0, ar_endings=1, ar_no_repeat=0)
    (done,), _ = run(Engine(model, fim=FIM), [req])
    prompt = fim_prompt(FIM, [*ctx, *req.slot_ids[:left]], list(req.slot_ids[left + gap :]))
    want = greedy_middle(model, prompt, gap)
    assert list(done.canvases[0][left : left + gap]) == want
    assert done.mode == "ar-infill"


def test_token_healing_moves_the_partial_word_into_the_middle(model: DiffusionModel) -> None:
    """With word edges, the left side's last partial word opens the middle of the FIM prompt (`heal_split`): the
    greedy draft is the middle after `fim_prompt(left minus that word, right) + that word`, and only the drafted
    tokens are written to the gap."""
    ctx, left, gap, right = (2, 5, 11), 3, 6, 4
    req = infill(ctx, left, gap, right, ar_drafts=1, ar_seam_tokens=2, ar_min_fill=1.0, ar_endings=1, ar_no_repeat=0)
    V = model.config.vocab_size
    starts, ends = np.zeros(V, dtype=bool), np.zeros(V, dtype=bool)
    word = req.slot_ids[left - 2 : left]  # the last two left tokens: a word that starts with whitespace, then more
    starts[word[0]] = True
    (done,), _ = run(Engine(model, fim=FIM, word_edges=(starts, ends)), [req])
    plain_left = [*ctx, *req.slot_ids[:left]]
    prompt = fim_prompt(FIM, plain_left[:-2], list(req.slot_ids[left + gap :])) + list(word)
    want = greedy_middle(model, prompt, gap)
    assert list(done.canvases[0][left : left + gap]) == want
    assert list(done.canvases[0][:left]) == list(req.slot_ids[:left])


def test_the_seam_is_scored_in_the_plain_frame(model: DiffusionModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every (FIM draft, ending) scores the seam's plain log-likelihood after context + left + draft[:e]."""
    seen = recording(monkeypatch)
    ctx, left, gap, right = (2, 5, 11), 2, 8, 3
    req = infill(ctx, left, gap, right, ar_drafts=3, ar_seam_tokens=3, ar_temperature=1.0, seed=3, ar_endings=2)
    run(Engine(model, fim=FIM), [req])
    (tokens, cands), = seen
    plain_left = [*ctx, *req.slot_ids[:left]]
    seam = list(req.slot_ids[left + gap :])
    for c in cands:
        want = plain_seam(model, plain_left, tokens[c.lane, : c.length].tolist(), seam)
        assert abs(c.score - want) < 1e-3


def test_fim_end_ends_a_draft_and_nulls_pad_the_gap(model: DiffusionModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that always wants `<|fim_end|>`: every lane ends at the shortest fill allowed, the gap ends early
    (one step per token: the step whose logits end the lanes ends the gap), `<null>` pads the rest and no sentinel
    reaches the canvas."""
    real = DiffusionModel.encode

    def ending(self: DiffusionModel, ids: torch.Tensor, *a: object, **kw: object) -> object:
        logits, cache = real(self, ids, *a, **kw)  # type: ignore[arg-type]
        if logits is not None:
            logits[..., FIM.end] += 100.0
        return logits, cache

    monkeypatch.setattr(DiffusionModel, "encode", ending)
    gap = 10
    req = infill((2, 5), 2, gap, 3, ar_drafts=4, ar_seam_tokens=2, ar_temperature=0.8, seed=1, ar_min_fill=0.4)
    (done,), _ = run(Engine(model, fim=FIM), [req])
    fill = done.canvases[0][2 : 2 + gap]
    assert fill[4:] == (NULL,) * (gap - 4) and NULL not in fill[:4]
    assert not set(fill) & {*FIM.sentinels, FIM.bos}
    assert done.generated == 4 and done.steps == 4


def test_fim_switch(model: DiffusionModel) -> None:
    """fim=False is the plain path on a FIM model; fim=True on a model without the format is refused at submit,
    for infills only (a continuation is plain AR whatever the switch)."""
    req = infill((2, 5, 11), 2, 6, 3, ar_drafts=3, ar_seam_tokens=2, ar_temperature=0.9, seed=5)
    off = dataclasses.replace(req, config=dataclasses.replace(req.config, fim=False))
    (plain,), _ = run(Engine(model), [req])
    (switched_off,), _ = run(Engine(model, fim=FIM), [off])
    assert switched_off.canvases == plain.canvases
    required = dataclasses.replace(req, config=dataclasses.replace(req.config, fim=True))
    with pytest.raises(ValueError, match="fim"):
        Engine(model).submit(required)
    cont = GenRequest((2, 5), (), (), SamplerConfig(mode="ar", fim=True, ar_temperature=0.9, seed=1))
    (done,), _ = run(Engine(model), [cont])
    assert done.status == "completed"


@pytest.mark.parametrize("fim", [None, FIM])
def test_smc_moves_lanes_with_their_cache_rows(model: DiffusionModel, monkeypatch: pytest.MonkeyPatch,
                                               fim: FimTokens | None) -> None:
    """A running score that favours the last lane makes every lane its copy at the first resample; afterwards each
    lane's scores still match its own tokens from scratch (its cache rows followed it)."""
    real = engine_ar.seam_logprobs

    def favour_last(model: DiffusionModel, cache: object, rows: torch.Tensor, limits: torch.Tensor,
                    seam: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        out = real(model, cache, rows, limits, seam, last)  # type: ignore[arg-type]
        if limits.shape[1] == 1:  # the resample's one ending per lane (the end of the gap scores two)
            out[-1] += 1e4
        return out

    monkeypatch.setattr(engine_ar, "seam_logprobs", favour_last)
    seen = recording(monkeypatch)
    ctx, left, gap, right = (2, 5, 11), 2, 8, 3
    req = infill(ctx, left, gap, right, ar_drafts=4, ar_seam_tokens=3, ar_temperature=1.0, seed=2, ar_endings=2,
                 ar_min_fill=0.5, ar_smc_every=3)
    run(Engine(model, fim=fim), [req])
    (tokens, cands), = seen
    assert all(tokens[k, :3].tolist() == tokens[-1, :3].tolist() for k in range(4))
    assert len({tuple(t) for t in tokens.tolist()}) > 1  # ...and they drew apart again after it
    plain_left = [*ctx, *req.slot_ids[:left]]
    seam = list(req.slot_ids[left + gap :])
    for c in cands:
        want = plain_seam(model, plain_left, tokens[c.lane, : c.length].tolist(), seam)
        assert abs(c.score - want) < 1e-3


def test_fim_and_smc_rows_batched_equal_alone(model: DiffusionModel) -> None:
    """FIM rows (with shadows), SMC rows and plain rows side by side give each the tokens it gets alone."""
    reqs = [
        infill((2, 5, 11), 2, 6, 3, ar_drafts=3, ar_seam_tokens=2, ar_temperature=0.8, seed=7),
        infill((11, 12), 1, 7, 2, slot_seed=1, ar_drafts=4, ar_seam_tokens=3, ar_temperature=0.9, seed=3,
               ar_smc_every=2, fim=False),
        infill((2, 3), 0, 5, 4, slot_seed=2, ar_drafts=2, ar_seam_tokens=2, ar_temperature=0.7, seed=1,
               ar_smc_every=2),
        infill((5, 9), 3, 6, 4, ar_drafts=1, ar_seam_tokens=0),
    ]
    alone = [run(Engine(model, max_batch=1, fim=FIM), [r])[0][0] for r in reqs]
    together, _ = run(Engine(model, max_batch=8, fim=FIM), reqs)
    used = [len(r.slot_ids) for r in reqs]  # the unused rest of a canvas holds noise
    assert [d.canvases[0][:n] for d, n in zip(together, used, strict=True)] == [
        d.canvases[0][:n] for d, n in zip(alone, used, strict=True)]


def test_smc_settings_are_checked() -> None:
    for bad in ({"ar_smc_every": -1}, {"ar_smc_every": 2.5}, {"ar_smc_temperature": 0.0}, {"fim": 1}):
        with pytest.raises(ValueError):
            SamplerConfig(**bad)  # type: ignore[arg-type]


def lanes_ending_in_turn(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A model whose first batch row wants `<|fim_end|>` at every drafting step (`ARBatch.step`, one walk): once
    `ar_min_fill` allows it, one lane ends a step, the one in the first row. Returns each step's batch rows. (A
    prefill of one token, such as a context whose BOS the FIM prompt's cached blocks hold, is no drafting step.)"""
    real = engine_ar.ARBatch.step
    rows: list[int] = []

    def first_row_ends(self: engine_ar.ARBatch, walks: list[engine_ar.ARWalk]) -> list[torch.Tensor]:
        out = real(self, walks)
        rows.append(sum(len(o) for o in out))
        out[0][0, FIM.end] += 100.0
        return out

    monkeypatch.setattr(engine_ar.ARBatch, "step", first_row_ends)
    return rows


@pytest.mark.parametrize(("share", "steps"), [(0.5, 4), (1.0, 6)])
def test_finished_lanes_leave_the_batch_and_a_decided_gap_ends_early(
        model: DiffusionModel, monkeypatch: pytest.MonkeyPatch, share: float, steps: int) -> None:  # fmt: skip
    """4 lanes, a 12-token gap, `<|fim_end|>` allowed from the 3rd token: the lanes end at 3, 4, 5, 6 tokens. A lane
    that has ended takes no batch row from the next step on (4, 4, 4, 3, ... rows); the gap ends in the step where
    `EARLY_END_SHARE` of the lanes have ended (half: 4 steps, all: 6), long before its budget, and a lane still
    writing offers only lengths it has written. The same seed gives the same canvas."""
    monkeypatch.setattr(engine_ar, "EARLY_END_SHARE", share)
    rows = lanes_ending_in_turn(monkeypatch)
    seen = recording(monkeypatch)
    gap, K = 12, 4
    req = infill((2, 5), 2, gap, 3, ar_drafts=K, ar_seam_tokens=2, ar_temperature=0.8, seed=1, ar_min_fill=0.25)
    (done,), _ = run(Engine(model, fim=FIM), [req])
    assert done.steps == steps < gap
    assert rows == [4, 4, 4, 3, 2, 1][:steps]  # the step in which a lane ends still reads its row
    assert sum(rows) < K * steps
    (tokens, cands), = seen
    assert max(c.length for c in cands) <= steps and {c.lane for c in cands} >= {0, 1}
    assert [c.length for c in cands if c.lane < 2] == [3, 4]
    fill = done.canvases[0][2 : 2 + gap]
    e = next((i for i, t in enumerate(fill) if t == NULL), gap)
    assert 3 <= e <= steps and fill[e:] == (NULL,) * (gap - e) and not set(fill) & {*FIM.sentinels, FIM.bos}
    (again,), _ = run(Engine(model, fim=FIM), [req])
    assert again.canvases == done.canvases


def test_smc_with_finished_lanes_keeps_rows_with_their_lanes(model: DiffusionModel,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """SMC resampling while lanes have ended: the batch rows follow the lanes still writing (the result is the same
    run alone and batched with another row, whose lanes share the batch)."""
    monkeypatch.setattr(engine_ar, "EARLY_END_SHARE", 1.0)
    lanes_ending_in_turn(monkeypatch)
    req = infill((2, 5), 2, 12, 3, ar_drafts=4, ar_seam_tokens=2, ar_temperature=0.9, seed=2, ar_min_fill=0.25,
                 ar_smc_every=2)
    other = infill((3,), 1, 6, 2, slot_seed=5, ar_drafts=1, ar_temperature=0.9, seed=4)
    (alone,), _ = run(Engine(model, fim=FIM), [req])
    (first, _), _ = run(Engine(model, fim=FIM, max_batch=2), [req, other])
    assert alone.canvases == first.canvases


def test_a_lead_is_written_again_first_and_the_left_side_is_not_healed(model: DiffusionModel,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`ar_lead` (the writer's partial word, taken out of the left side by the caller): every lane's first tokens
    write it again, whatever the model prefers, and the FIM prompt is the unhealed one (word edges that would move
    the left side's last word change nothing); the greedy lane takes the likeliest of the tokens the lead allows."""
    V = model.config.vocab_size
    texts = [f"w{i}" for i in range(V)]
    texts[20], texts[21], texts[22], texts[23] = " app", " applied", "lie", " zebra"
    lines = engine_ar.LineTokens(frozenset(), frozenset(), LeadTokens(texts))
    starts, ends = np.zeros(V, dtype=bool), np.zeros(V, dtype=bool)
    ctx, left, gap, right = (2, 5, 11), 3, 6, 4
    req = infill(ctx, left, gap, right, ar_drafts=1, ar_seam_tokens=2, ar_min_fill=1.0, ar_endings=1, ar_no_repeat=0,
                 ar_lead=" applie")
    starts[req.slot_ids[left - 2]] = True  # heal_split would move the last two left tokens
    plain_left = [*ctx, *req.slot_ids[:left]]
    prompt = fim_prompt(FIM, plain_left, list(req.slot_ids[left + gap :]))
    logits, _ = model.encode(torch.tensor([prompt]), logits="last")
    assert logits is not None
    want = 20 if float(logits[0, -1, 20]) > float(logits[0, -1, 21]) else 21
    (done,), _ = run(Engine(model, fim=FIM, word_edges=(starts, ends), lines=lines), [req])
    fill = list(done.canvases[0][left : left + gap])
    assert fill[0] == want
    assert "".join(texts[t] for t in fill[:2]).startswith(" applie")  # " app" is followed by "lie"

    real = DiffusionModel.encode

    def zebra(self: DiffusionModel, ids: torch.Tensor, *a: object, **kw: object) -> object:
        out, cache = real(self, ids, *a, **kw)  # type: ignore[arg-type]
        if out is not None:
            out[..., 23] += 100.0
        return out, cache

    monkeypatch.setattr(DiffusionModel, "encode", zebra)
    sampled = dataclasses.replace(req, config=dataclasses.replace(req.config, ar_drafts=4, ar_temperature=1.0, seed=2))
    (done,), _ = run(Engine(model, fim=FIM, lines=lines), [sampled])
    fill = list(done.canvases[0][left : left + gap])
    assert "".join(texts[t] for t in fill[:2]).startswith(" applie") and 23 in fill  # free after the lead


def test_a_walk_times_its_fim_prompt_and_counts_what_the_cache_restored(model: DiffusionModel,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`ARWalk.fim_tokens` is the FIM prompt's length, `fim_cached` what the engine's cache restored of it (nothing on
    a fresh engine; most of it when the same gap is asked again), `fim_s` the prefill's seconds; a walk that drafts
    in the plain frame has none."""
    walks: list[engine_ar.ARWalk] = []
    real = engine_ar.ARWalk.advance

    def keep(self: engine_ar.ARWalk) -> None:
        if self not in walks:
            walks.append(self)
        real(self)

    monkeypatch.setattr(engine_ar.ARWalk, "advance", keep)
    ctx, left, gap, right = (2, 5, 11, 13, 17, 19, 23, 29, 31), 5, 6, 12
    req = infill(ctx, left, gap, right, ar_drafts=2, ar_seam_tokens=2, ar_min_fill=1.0, ar_endings=1)
    engine = Engine(model, fim=FIM)
    run(engine, [req])
    run(engine, [req])
    prompt = fim_prompt(FIM, [*ctx, *req.slot_ids[:left]], list(req.slot_ids[left + gap :]))
    first, again = walks
    assert (first.fim_tokens, first.fim_cached) == (len(prompt), 0) and first.fim_s > 0
    assert again.fim_tokens == len(prompt) and len(prompt) // 2 < again.fim_cached <= len(prompt)
    plain = infill(ctx, left, gap, right, ar_drafts=2, ar_seam_tokens=2, fim=False)
    run(engine, [plain])
    assert (walks[2].fim_tokens, walks[2].fim_cached, walks[2].fim_s) == (0, 0, 0.0)


def test_frames_and_done_report_the_fim_prompt(model: DiffusionModel) -> None:
    """The walk's FIM prompt figures reach every frame from the first on, and the `Done`: a fresh engine encodes the
    whole prompt, the same gap again restores most of it; a row drafted in the plain frame reports none."""
    ctx, left, gap, right = (2, 5, 11, 13, 17, 19, 23, 29, 31), 5, 6, 12
    req = infill(ctx, left, gap, right, ar_drafts=2, ar_seam_tokens=2, ar_min_fill=1.0, ar_endings=1)
    prompt = fim_prompt(FIM, [*ctx, *req.slot_ids[:left]], list(req.slot_ids[left + gap :]))
    engine = Engine(model, fim=FIM)
    (first,), (frames,) = run(engine, [req])
    (again,), _ = run(engine, [req])
    assert (first.fim_prompt_tokens, first.fim_cached_tokens) == (len(prompt), 0) and first.fim_prompt_s > 0
    assert all((f.fim_prompt_tokens, f.fim_prompt_s) == (len(prompt), first.fim_prompt_s) for f in frames)
    assert again.fim_prompt_tokens == len(prompt) and len(prompt) // 2 < again.fim_cached_tokens <= len(prompt)
    (plain,), (plain_frames,) = run(engine, [infill(ctx, left, gap, right, ar_drafts=2, ar_seam_tokens=2, fim=False)])
    assert (plain.fim_prompt_tokens, plain.fim_cached_tokens, plain.fim_prompt_s) == (0, 0, 0.0)
    assert all(f.fim_prompt_tokens == 0 for f in plain_frames)
