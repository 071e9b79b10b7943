from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from canvas.model import PRESETS, DiffusionModel
from canvas.training.corrupt import CorruptionConfig, sample_batch
from canvas.training.objective import (
    ObjectiveConfig,
    compute_losses,
    decoder_pass,
    encoder_pass,
    head_cross_entropy,
    soft_embeddings,
)

CFG = PRESETS["tiny"]  # sliding window 16, canvas 32, vocab 512


@pytest.fixture(scope="module")
def model() -> DiffusionModel:
    torch.manual_seed(0)
    m = DiffusionModel(CFG)
    m.reset_parameters(std=0.1, generator=torch.Generator().manual_seed(0))
    return m.eval()


@pytest.mark.parametrize("prefix", [1, 9, 40])  # shorter than, and longer than the sliding window
def test_passes_match_encode_and_denoise(model: DiffusionModel, prefix: int) -> None:
    g = torch.Generator().manual_seed(prefix)
    ids = torch.randint(0, CFG.vocab_size, (2, prefix + CFG.canvas_length), generator=g)
    canvas = torch.randint(0, CFG.vocab_size, (2, CFG.canvas_length), generator=g)
    sc_logits = 3 * torch.randn(2, CFG.canvas_length, CFG.vocab_size, generator=g)
    with torch.no_grad():
        hidden, kv = encoder_pass(model, ids)
        ref_ar, _ = model.encode(ids)
        torch.testing.assert_close(model.logits(hidden), ref_ar, rtol=1e-5, atol=1e-5)
        _, cache = model.encode(ids[:, :prefix])
        torch.testing.assert_close(
            decoder_pass(model, canvas, kv, prefix), model.denoise(canvas, cache), rtol=1e-5, atol=1e-5
        )
        ours_sc = decoder_pass(model, canvas, kv, prefix, soft_embeddings(model, sc_logits))
        torch.testing.assert_close(ours_sc, model.denoise(canvas, cache, sc_logits), rtol=1e-5, atol=1e-5)


def test_head_cross_entropy_matches_logits(model: DiffusionModel) -> None:
    h = torch.randn(10, CFG.hidden_size)
    targets = torch.randint(0, CFG.vocab_size, (10,))
    ce = head_cross_entropy(h, model.embed, model.norm, targets, CFG.rms_norm_eps, CFG.final_logit_softcapping)
    ref = torch.nn.functional.cross_entropy(model.logits(h[None])[0], targets, reduction="none")
    torch.testing.assert_close(ce, ref)


def test_denoising_gradient_reaches_the_prefix_keys_and_values(model: DiffusionModel) -> None:
    ids = torch.randint(0, CFG.vocab_size, (1, 20))
    _, kv = encoder_pass(model, ids)
    leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in kv]
    canvas = torch.randint(0, CFG.vocab_size, (1, CFG.canvas_length))
    decoder_pass(model, canvas, leaves, 20).logsumexp(-1).sum().backward()
    for i, (k, v) in enumerate(leaves):
        assert k.grad is not None and k.grad.abs().sum() > 0, f"layer {i} keys"
        assert v.grad is not None and v.grad.abs().sum() > 0, f"layer {i} values"
        if model.config.is_sliding(i):
            # Sliding layers read only the last window - 1 prefix positions, as the inference cache keeps.
            assert k.grad[:, :, : 20 - (CFG.sliding_window - 1)].abs().sum() == 0
        else:
            assert k.grad[:, :, 0].abs().sum() > 0


def _batch(seed: int, batch_size: int = 4):  # -> Batch
    stream = np.random.default_rng(seed).integers(4, CFG.vocab_size, 3000)
    cfg = CorruptionConfig(canvas_length=CFG.canvas_length, max_prefix=24)
    return sample_batch(
        stream, np.array([0]), batch_size, cfg, vocab_size=CFG.vocab_size, null_id=3,
        rng=np.random.default_rng(seed), gen=torch.Generator().manual_seed(seed),
    )  # fmt: skip


def test_losses_at_init_are_near_uniform(model: DiffusionModel) -> None:
    losses = compute_losses(model, _batch(0), ObjectiveConfig(), torch.Generator().manual_seed(0))
    uniform = math.log(CFG.vocab_size)
    assert abs(float(losses.denoise) - uniform) < 1.0 and abs(float(losses.ar) - uniform) < 1.0
    assert 0.9 < float(losses.balance) < 2.0  # 1.0 for perfectly even routing
    expected = losses.denoise + losses.ar + 0.01 * losses.balance
    torch.testing.assert_close(losses.total.detach(), expected)


@pytest.mark.parametrize(("p", "share"), [(0.0, 0.0), (1.0, 1.0)])
def test_self_conditioning_share(model: DiffusionModel, p: float, share: float) -> None:
    losses = compute_losses(model, _batch(1), ObjectiveConfig(p_self_cond=p), torch.Generator().manual_seed(0))
    assert losses.self_cond_share == share


def test_one_token_prefix_has_no_ar_target(model: DiffusionModel) -> None:
    import dataclasses

    batch = _batch(2)
    batch = dataclasses.replace(batch, prefix_len=1, encoder_ids=batch.encoder_ids[:, -(1 + CFG.canvas_length) :])
    losses = compute_losses(model, batch, ObjectiveConfig(), torch.Generator())
    assert float(losses.ar) == 0.0 and math.isfinite(float(losses.denoise))


def test_training_reduces_both_losses() -> None:
    torch.manual_seed(0)
    m = DiffusionModel(CFG)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    batch = _batch(3, batch_size=2)
    first = None
    for _ in range(10):
        losses = compute_losses(m, batch, ObjectiveConfig(), torch.Generator().manual_seed(0))
        opt.zero_grad()
        losses.total.backward()
        opt.step()
        first = first or (float(losses.denoise), float(losses.ar))
    assert float(losses.denoise) < first[0] - 0.5 and float(losses.ar) < first[1] - 0.5


def test_objective_config_validation() -> None:
    with pytest.raises(ValueError):
        ObjectiveConfig(p_self_cond=1.5)
    with pytest.raises(ValueError):
        ObjectiveConfig(ar_weight=-1)
    with pytest.raises(ValueError, match="sc_temperature"):
        ObjectiveConfig(sc_temperature=(1.0, 0.5))
    with pytest.raises(ValueError, match="encoder_span"):
        ObjectiveConfig(encoder_span="all")  # type: ignore[arg-type]
