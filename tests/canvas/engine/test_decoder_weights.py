"""A gap denoiser served: its shifted head reads the canvas as its trainer does, shifted and unshifted sets fill
differently, AR generation is byte-identical with or without the adapters, and a set is found, refused or left out
as `load_backend` promises."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from canvas.engine.backend import DECODER_DIR, Backend, load_backend, write_tiny_checkpoint
from canvas.engine.core import Engine, GenRequest
from canvas.engine.decoder_weights import (
    attach_decoder_adapters,
    decoder_tensors,
    denoise_logits,
    load_decoder_adapters,
)
from canvas.env import DECODER_ADAPTERS
from canvas.model import DiffusionModel, ModelConfig
from canvas.sampling.sampler import SamplerConfig
from canvas.training.decoder_adapt import export_decoder_adapters
from canvas.training.gap_denoise import aligned_hidden
from canvas.training.objective import decoder_pass, encoder_pass


def _trained(model: DiffusionModel, seed: int = 7) -> DiffusionModel:
    """Attach decoder adapters and move every decoder-only tensor away from its init, as training would."""
    attach_decoder_adapters(model, 4, 8.0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in decoder_tensors(model).values():
            t.add_(torch.randn(t.shape, generator=gen) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def model() -> DiffusionModel:
    torch.manual_seed(0)
    return _trained(DiffusionModel(ModelConfig.from_name("tiny")))


@pytest.mark.parametrize("soft", [False, True])
def test_shifted_head_matches_the_trainers_forward(model: DiffusionModel, soft: bool) -> None:
    """Slot l's logits are the trainer's `aligned_hidden` head: hidden state l - 1, slot 0 from the encoder's last
    position; unshifted they are the design's own head; the two differ."""
    gen = torch.Generator().manual_seed(1)
    V, L = model.config.vocab_size, 12
    prefix = torch.randint(3, V, (2, 9), generator=gen)  # (B, P)
    canvas = torch.randint(3, V, (2, L), generator=gen)  # (B, L)
    sc = torch.randn(2, L, model.config.hidden_size, generator=gen) if soft else None
    with torch.no_grad():
        enc_h, kv = encoder_pass(model, prefix)
        h = decoder_pass(model, canvas, kv, prefix.shape[1], sc, return_hidden=True)  # (B, L, M)
        want_shift = model.logits(aligned_hidden(h, enc_h[:, -1], True))  # (B, L, V)
        want_plain = model.logits(aligned_hidden(h, enc_h[:, -1], False))
    last, cache = model.encode(prefix, logits="last")
    assert last is not None
    at = torch.tensor([0, 1, 5, 11, L + 0, L + 3, L + 11])  # slot 0 of both rows among them
    got_shift = denoise_logits(model, canvas, cache, at=at, shift=True, last=last[:, -1], soft=sc)
    got_plain = denoise_logits(model, canvas, cache, at=at, shift=False, soft=sc)
    scale = float(want_shift.abs().max())
    assert torch.allclose(got_shift, want_shift.reshape(-1, V)[at], atol=1e-4 * scale)
    assert torch.allclose(got_plain, want_plain.reshape(-1, V)[at], atol=1e-4 * scale)
    assert (got_shift - got_plain).abs().max() > 1e-2 * scale
    with pytest.raises(ValueError, match="last"):
        denoise_logits(model, canvas, cache, at=at, shift=True)


def _infill(model: DiffusionModel, seed: int) -> GenRequest:
    gen = torch.Generator().manual_seed(seed)
    V, L = model.config.vocab_size, model.config.canvas_length
    ctx = tuple(torch.randint(3, V, (7,), generator=gen).tolist())
    slots = tuple(torch.randint(3, V, (L,), generator=gen).tolist())
    pinned = tuple(not 4 <= i < 12 for i in range(L))  # one gap of 8 with text after it
    return GenRequest(ctx, slots, pinned, SamplerConfig(max_steps=6, seed=seed))


def _run(engine: Engine, req: GenRequest) -> tuple[tuple[int, ...], ...]:
    handle = engine.submit(req)
    engine.run_until_idle()
    done = handle.wait(0)
    assert done.status == "completed", done.error
    return done.canvases


def test_engine_shifted_and_unshifted_fill_differently(model: DiffusionModel) -> None:
    req = _infill(model, 3)
    shifted, plain = _run(Engine(model, logit_shift=True), req), _run(Engine(model), req)
    assert shifted != plain
    assert _run(Engine(model, logit_shift=True).twin(), req) == shifted  # a twin keeps the head


def test_continuation_canvases_read_slot_zero_after_the_last_canvas(model: DiffusionModel,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A two-canvas continuation under the shifted head: the first canvas's slot 0 reads the logits after the context,
    the second's the logits after the context and the first canvas."""
    import canvas.engine.core as core

    seen: list[torch.Tensor] = []

    def spy(*args: Any, **kw: Any) -> torch.Tensor:
        seen.append(kw["last"].clone())
        return denoise_logits(*args, **kw)

    monkeypatch.setattr(core, "denoise_logits", spy)
    L, ctx = model.config.canvas_length, (5, 6, 7)
    req = GenRequest(ctx, (0,) * L, (False,) * L, SamplerConfig(max_steps=3, seed=2), n_canvases=2)
    first, second = _run(Engine(model, logit_shift=True), req)
    after_ctx, _ = model.encode(torch.tensor([ctx]), logits="last")
    after_first, _ = model.encode(torch.tensor([ctx + first]), logits="last")
    assert after_ctx is not None and after_first is not None
    n_first = next(i for i, t in enumerate(seen) if not torch.allclose(t, after_ctx[:, -1], atol=1e-5))
    assert n_first >= 1 and all(torch.allclose(t, after_first[:, -1], atol=1e-4) for t in seen[n_first:])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoder")
    base = write_tiny_checkpoint(root / "base")
    sets = {}
    for shift in (True, False):
        m = _trained(DiffusionModel.from_pretrained(str(base)))
        sets[shift] = export_decoder_adapters(m, root / f"adapters-{shift}", {"logit_shift": shift, "step": 1})
    return {"base": base, "shift": sets[True], "plain": sets[False], "root": root}


def _backend_run(backend: Backend, req: GenRequest) -> tuple[tuple[int, ...], ...]:
    return _run(backend.engine.twin(max_batch=1, context_cache_mb=0), req)


def test_backend_serves_the_set_and_ar_stays_byte_identical(tiny_dir: dict[str, Path]) -> None:
    plain = load_backend(tiny_dir["base"], max_batch=1, threads=1, decoder_adapters=None)
    shifted = load_backend(tiny_dir["base"], max_batch=1, threads=1, decoder_adapters=tiny_dir["shift"])
    unshifted = load_backend(tiny_dir["base"], max_batch=1, threads=1, decoder_adapters=tiny_dir["plain"])
    assert plain.decoder is None and not plain.engine.logit_shift
    assert shifted.engine.logit_shift and shifted.decoder is not None and shifted.decoder["step"] == 1
    assert not unshifted.engine.logit_shift
    model = plain.engine.model
    req = _infill(model, 4)
    diff = [_backend_run(b, req) for b in (plain, shifted, unshifted)]
    assert len(set(diff)) == 3  # the adapters change diffusion fills, and so does the head
    for kind in ("infill", "continuation"):
        ar = req if kind == "infill" else GenRequest(req.context_ids, req.slot_ids, (False,) * len(req.pinned),
                                                     req.config)
        ar = GenRequest(ar.context_ids, ar.slot_ids, ar.pinned, SamplerConfig(mode="ar", seed=5, ar_drafts=3))
        outs = {_backend_run(b, ar) for b in (plain, shifted, unshifted)}
        assert len(outs) == 1, kind  # AR: the same bytes with any decoder set


def test_adapter_set_found_refused_or_off(tiny_dir: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    import shutil

    base = tmp_path / "model"
    shutil.copytree(tiny_dir["base"], base)
    assert load_backend(base, max_batch=1, threads=1).decoder is None
    shutil.copytree(tiny_dir["shift"], base / DECODER_DIR)
    found = load_backend(base, max_batch=1, threads=1)
    assert found.decoder is not None and found.decoder["path"] == str(base / DECODER_DIR)
    monkeypatch.setenv(DECODER_ADAPTERS.name, "off")
    assert load_backend(base, max_batch=1, threads=1).decoder is None
    monkeypatch.setenv(DECODER_ADAPTERS.name, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="adapters.json"):
        load_backend(base, max_batch=1, threads=1)
    monkeypatch.delenv(DECODER_ADAPTERS.name)
    # A damaged set and a set of another base are refused, never served half-loaded.
    meta = json.loads((base / DECODER_DIR / "adapters.json").read_text())
    (base / DECODER_DIR / "adapters.json").write_text(json.dumps({**meta, "sha256": "0" * 64}))
    with pytest.raises(ValueError, match="sha256"):
        load_backend(base, max_batch=1, threads=1)
    other = {**meta, "base_config": {**meta["base_config"], "hidden_size": 1}}
    (base / DECODER_DIR / "adapters.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="another base"):
        load_backend(base, max_batch=1, threads=1)
    (base / DECODER_DIR / "adapters.json").write_text(json.dumps({**meta, "objective": "fim"}))
    with pytest.raises(ValueError, match="not a gap-denoise"):
        load_backend(base, max_batch=1, threads=1)


def test_loading_twice_is_refused(tiny_dir: dict[str, Path]) -> None:
    m = DiffusionModel.from_pretrained(str(tiny_dir["base"]))
    load_decoder_adapters(m, tiny_dir["shift"])
    with pytest.raises(ValueError, match="already"):
        load_decoder_adapters(m, tiny_dir["shift"])
