"""The gap denoiser: decoder-only adapters leave the encoder bit-identical, gap canvases carry the middle and its
<null> tail, the teacher is the FIM prompt's causal pass, the loss falls on a toy corpus, and a run resumes bit for
bit."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from rich.console import Console
from tokenizers import Tokenizer

from canvas.convert.fim import fim_tokens
from canvas.model import DiffusionModel
from canvas.training.decoder_adapt import (
    attach_decoder_adapters,
    decoder_tensors,
    load_decoder_adapters,
)
from canvas.training.gap_data import GapDataConfig, sample_gap_batch
from canvas.training.gap_denoise import GapObjectiveConfig, gap_losses, teacher_log_probs
from canvas.training.gap_train import GapTrainConfig, GapTrainer, export_gap_adapters

DATA = GapDataConfig(canvas_length=24, min_prefix=4, max_prefix=12, min_left=1, max_left=4, min_right=4, max_gap=8,
                     start_max_gap=4, start_max_noise=0.5)  # fmt: skip


@pytest.fixture(scope="module")
def gap_base(fim_base: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny FIM base, recorded as a build with FIM adapters merged (the teacher's precondition)."""
    root = tmp_path_factory.mktemp("gap-base")
    base = root / "base"
    shutil.copytree(fim_base["base"], base)
    # The tied head is frozen: at the random init's scale (std 0.02, 64 wide) its logits span ~2 nats, so no decoder
    # could fit a target; a trained model's embedding is far wider. Scale it so the loss can show learning.
    model = DiffusionModel.from_pretrained(str(base))
    with torch.no_grad():
        model.embed.mul_(25.0)
    model.save_pretrained(str(base))
    (base / "build.json").write_text(json.dumps({"fingerprint": {"fim_adapters": "test"}}), encoding="utf-8")
    return {**fim_base, "base": base}


def _cfg(gap_base: dict[str, Path], **kw: Any) -> GapTrainConfig:
    return dataclasses.replace(
        GapTrainConfig(base=str(gap_base["base"]), tokens_dir=str(gap_base["tokens"]), batch_size=4, lr=3e-3,
                       warmup_steps=1, max_steps=40, curriculum_steps=10, lora_rank=4, lora_alpha=8.0, log_every=5,
                       eval_every=10, eval_batches=2, bf16=False, data=DATA),
        **kw,
    )  # fmt: skip


def _quiet() -> Console:
    return Console(file=io.StringIO())


def _randomize(model: DiffusionModel) -> None:
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for t in decoder_tensors(model).values():
            t.add_(torch.randn(t.shape, generator=gen) * 0.05)


def test_encoder_bit_identical_with_decoder_adapters(gap_base: dict[str, Path]) -> None:
    model = DiffusionModel.from_pretrained(str(gap_base["base"]))
    ids = torch.tensor([[2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58]])
    canvas = torch.randint(10, 200, (1, 8), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_cache = model.encode(ids)
    ref_step, ref_cache = model.encode(torch.tensor([[60]]), cache=ref_cache)  # a one-token AR step (its own path)
    ref_denoise = model.denoise(canvas, ref_cache)
    attach_decoder_adapters(model, 4, 8.0)
    _randomize(model)  # trained adapters: every decoder-only tensor away from its initial value
    logits, cache = model.encode(ids)
    step, cache = model.encode(torch.tensor([[60]]), cache=cache)
    assert ref_logits is not None and logits is not None and ref_step is not None and step is not None
    assert torch.equal(logits, ref_logits) and torch.equal(step, ref_step)
    for i in range(model.config.num_hidden_layers):  # `read`: the sliding layers' ring buffers in order
        (k, v), (ref_k, ref_v) = cache.read(i), ref_cache.read(i)
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    # The decoder pass does read them.
    assert not torch.allclose(model.denoise(canvas, cache), ref_denoise)


def test_gap_canvas_middle_nulls_and_teacher_prompt(gap_base: dict[str, Path]) -> None:
    tok = Tokenizer.from_file(str(gap_base["base"] / "tokenizer.json"))
    fim = fim_tokens(tok)
    tokens = np.arange(1000, 1600, dtype=np.int64)  # distinct ids: every position is recognisable
    batch = sample_gap_batch(tokens, np.array([0]), 16, DATA, vocab_size=2000, null_id=5, fim=fim,
                             rng=np.random.default_rng(0), gen=torch.Generator().manual_seed(0), progress=1.0)
    P = batch.prefix_len
    for b in range(16):
        a, g, c = int(batch.gap_start[b]), int(batch.gap_len[b]), int(batch.fill_len[b])
        start = int(batch.encoder_ids[b, 0]) - 1000
        text = tokens[start + P :]
        row = batch.canvas_clean[b].numpy()
        assert 1 <= DATA.min_left <= a and 1 <= g <= DATA.max_gap and np.ceil(DATA.min_fill * g) <= c <= g
        assert (row[:a] == text[:a]).all() and (row[a : a + c] == text[a : a + c]).all()
        assert (row[a + c : a + g] == 5).all()  # the gap's tail past the middle: <null> targets
        assert (row[a + g :] == text[a + c : a + c + DATA.canvas_length - a - g]).all()  # text right after the middle
        noised = batch.noised[b].numpy()
        assert noised.any() and not noised[:a].any() and not noised[a + g :].any()
        assert (batch.middle[b].numpy() == (np.arange(DATA.canvas_length) >= a) & (np.arange(DATA.canvas_length)
                                                                                     < a + c)).all()
        ids, pos = batch.teacher_ids[b], batch.teacher_pos[b]
        assert (pos[c:] == -1).all() and int(ids[int(pos[0])]) == fim.middle
        assert [int(ids[int(p) + 1]) for p in pos[:c]] == text[a : a + c].tolist()  # teacher-forced middle
        suffix = int((ids == fim.suffix).nonzero()[0, 0])
        assert ids[suffix + 1 : int(pos[0])].tolist() == row[a + g :].tolist()  # FIM suffix: the pinned right text


def test_curriculum_grows_gaps_and_noise() -> None:
    assert DATA.max_gap_at(0.0) == 4 and DATA.max_gap_at(1.0) == 8 and DATA.max_gap_at(5.0) == 8
    assert DATA.max_noise_at(0.0) == 0.5 and DATA.max_noise_at(1.0) == 1.0
    with pytest.raises(ValueError):
        GapDataConfig(canvas_length=16, max_gap=16)


def test_teacher_is_the_fim_prompts_causal_pass(gap_base: dict[str, Path]) -> None:
    t = GapTrainer(gap_base["base"].parent / "unused-run", _cfg(gap_base))
    _randomize(t.model)
    batch, _ = t.batch(3)
    slots = batch.middle.nonzero()
    got = teacher_log_probs(t.model, batch, slots)
    for k in (0, len(slots) - 1):
        b, s = (int(x) for x in slots[k])
        j = s - int(batch.gap_start[b])
        pos = int(batch.teacher_pos[b, j])
        logits, _ = t.model.encode(batch.teacher_ids[b : b + 1, : pos + 1])
        assert logits is not None
        torch.testing.assert_close(got[k], torch.log_softmax(logits[0, -1], -1), atol=1e-4, rtol=1e-4)


def test_loss_decreases_on_a_toy_corpus(gap_base: dict[str, Path], tmp_path: Path) -> None:
    # No teacher: the tiny base's FIM pathway is random, a teacher to move away from, not toward.
    t = GapTrainer(tmp_path / "run", _cfg(gap_base, max_steps=20, eval_every=20, log_every=20, lr=2e-2,
                                          objective=GapObjectiveConfig(teacher_weight=0.0)))
    t.fit(max_minutes=None, stop_at_step=None, console=_quiet())
    first, last = t.state.history[0], t.state.history[-1]
    assert last["step"] == 20 and last["valid_denoise"] < first["valid_denoise"] - 0.3, (first, last)
    assert (tmp_path / "run" / "loss.csv").is_file() and (tmp_path / "run" / "checkpoint.pt").is_file()


def test_resume_is_bit_for_bit(gap_base: dict[str, Path], tmp_path: Path) -> None:
    cfg = _cfg(gap_base, max_steps=6, log_every=1, eval_every=3)
    whole = GapTrainer(tmp_path / "whole", cfg)
    whole.fit(max_minutes=None, stop_at_step=None, console=_quiet())
    first = GapTrainer(tmp_path / "split", cfg)
    first.fit(max_minutes=None, stop_at_step=3, console=_quiet())
    second = GapTrainer(tmp_path / "split", cfg)
    assert second.load() and second.state.step == 3
    second.fit(max_minutes=None, stop_at_step=None, console=_quiet())
    a, b = decoder_tensors(whole.model), decoder_tensors(second.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = ("wall_s", "tokens_per_s")
    rows = [[{k: v for k, v in r.items() if k not in strip} for r in h] for h in (whole.state.history,
                                                                                   second.state.history)]
    assert rows[0] == rows[1]


def test_export_then_load_gives_the_trained_decoder(gap_base: dict[str, Path], tmp_path: Path) -> None:
    t = GapTrainer(tmp_path / "run", _cfg(gap_base))
    _randomize(t.model)
    out = export_gap_adapters(t, tmp_path / "adapters")
    fresh = DiffusionModel.from_pretrained(str(gap_base["base"]))
    meta = load_decoder_adapters(fresh, out)
    assert meta["objective"] == "gap-denoise" and meta["logit_shift"] is True
    batch, gen = t.batch(0)
    ids = batch.encoder_ids[:1]
    _, c1 = t.model.encode(ids)
    _, c2 = fresh.encode(ids)
    torch.testing.assert_close(fresh.denoise(batch.canvas_noisy[:1], c2), t.model.denoise(batch.canvas_noisy[:1], c1))


def test_teacher_needs_a_fim_build(fim_base: dict[str, Path], tmp_path: Path) -> None:
    cfg = GapTrainConfig(base=str(fim_base["base"]), tokens_dir=str(fim_base["tokens"]), data=DATA)
    with pytest.raises(ValueError, match="no FIM adapters"):
        GapTrainer(tmp_path / "run", cfg)
    GapTrainer(tmp_path / "run", dataclasses.replace(cfg, objective=GapObjectiveConfig(teacher_weight=0.0)))


def test_logit_shift_reads_the_previous_slot(gap_base: dict[str, Path]) -> None:
    t = GapTrainer(gap_base["base"].parent / "unused-run", _cfg(gap_base))
    batch, gen = t.batch(0)
    state = gen.get_state()
    plain = gap_losses(t.model, batch, GapObjectiveConfig(p_self_cond=0.0, logit_shift=False), gen)
    gen.set_state(state)
    shifted = gap_losses(t.model, batch, GapObjectiveConfig(p_self_cond=0.0, logit_shift=True), gen)
    assert plain.ce.shape == shifted.ce.shape and not torch.allclose(plain.ce, shifted.ce)


def test_gpu_job_round_trip_on_the_cpu(gap_base: dict[str, Path], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-call GPU job (run here with --allow-cpu): staged int8 base, a short budget, parts back; `gap-unpack`
    gives a run whose decoder computes with the job's trained values on the exact local base."""
    monkeypatch.setenv("DCANVAS_KERNELS", "ref")  # the job sets it; restored after the test

    from canvas.training import gpu_gap
    from canvas.training.gpu_base import pack
    from canvas.training.gpu_job import main

    pack(gap_base["base"], tmp_path / "stage", parts=2)
    out = tmp_path / "out"
    rc = main(["gap", "--out", str(out), "--base-staged", str(tmp_path / "stage"), "--model-files",
               str(gap_base["base"]), "--tokens-dir", str(gap_base["tokens"]), "--minutes", "0.05",
               "--reserve-seconds", "0", "--batch-size", "2", "--eval-batches", "1", "--work", str(tmp_path / "w"),
               "--allow-cpu", "--max-steps", "3"])  # fmt: skip
    assert rc == 0 and (out / gpu_gap.RESULT).is_file()
    result = json.loads((out / gpu_gap.RESULT).read_text())
    assert result["end_step"] >= 1 and "valid_g8" in result["valid_after"]
    run = gpu_gap.unpack(out, tmp_path / "run", base=str(gap_base["base"]), tokens_dir=str(gap_base["tokens"]))
    assert run.state.step == result["end_step"] and (tmp_path / "run" / "checkpoint.pt").is_file()
    sent = torch.load(io.BytesIO(b"".join((out / p["name"]).read_bytes() for p in result["parts"])),
                      weights_only=True)["tensors"]  # fmt: skip
    layer = run.model.blocks[0]
    name = "layers.0.experts_down.delta"
    with torch.no_grad():
        from canvas.model.model import _DECODER_PASS

        token = _DECODER_PASS.set(True)
        try:
            decoder_value = layer.experts_down.clone()
        finally:
            _DECODER_PASS.reset(token)
    torch.testing.assert_close(decoder_value, sent[name].float(), atol=0, rtol=0)
    original: Any = layer.parametrizations  # the encoder's (local base) value, untouched
    assert torch.equal(original.experts_down.original,
                       DiffusionModel.from_pretrained(str(gap_base["base"])).blocks[0].experts_down)
