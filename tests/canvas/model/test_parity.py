"""Parity with the transformers reference (the acceptance oracle): same weights, same inputs, fp32.

For each tiny random config: encoder logits, decoder logits without and with self-conditioning, then a second
canvas after encoding the first into the same cache. Tolerance: max |ours - ref| <= 1e-4 * max |ref| + 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from canvas.model import DiffusionModel
from tests.canvas.model.reference import SPECS, RefSpec, build_reference


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x.float() / cap) * cap


def assert_close_rel(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * scale + 1e-5, f"{what}: max abs diff {err:.3g} vs logit scale {scale:.3g}"


@pytest.fixture(scope="module", params=SPECS, ids=lambda s: s.name)
def pair(request, tmp_path_factory) -> tuple[RefSpec, object, DiffusionModel]:
    spec: RefSpec = request.param
    ref = build_reference(spec)
    path = tmp_path_factory.mktemp(spec.name)
    ref.save_pretrained(path)
    ours = DiffusionModel.from_pretrained(str(path))
    return spec, ref, ours


def run_reference(ref, spec: RefSpec, prompt: torch.Tensor, mask: torch.Tensor | None, canvases: list[torch.Tensor],
                  sc: list[torch.Tensor | None]):
    from transformers import DynamicCache

    B, T = prompt.shape
    L = spec.canvas_length
    cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
    attn = torch.ones(B, T, dtype=torch.bool) if mask is None else mask.bool()
    enc = ref.model.encoder(input_ids=prompt, attention_mask=attn, past_key_values=cache,
                            position_ids=torch.arange(T)[None])
    enc_logits = softcap(ref.lm_head(enc.last_hidden_state), spec.final_logit_softcapping)
    outs = []
    cur = T
    for n, canvas in enumerate(canvases):
        if n > 0:  # commit the previous canvas through the encoder, as generate() does
            prev = canvases[n - 1]
            attn = torch.nn.functional.pad(attn, (0, L), value=True)
            ref.model.encoder(input_ids=prev, attention_mask=attn, past_key_values=cache,
                              position_ids=torch.arange(cur, cur + L)[None])
            cur += L
        dec_mask = torch.nn.functional.pad(attn, (0, L), value=True)
        out = ref(decoder_input_ids=canvas, past_key_values=cache, self_conditioning_logits=sc[n],
                  decoder_attention_mask=dec_mask, decoder_position_ids=torch.arange(cur, cur + L)[None])
        outs.append(out.logits)
    return enc_logits, outs


def run_ours(model: DiffusionModel, spec: RefSpec, prompt, mask, canvases, sc):
    B, T = prompt.shape
    L = spec.canvas_length
    cache = model.new_cache(B, T + L * len(canvases))
    enc_logits, cache = model.encode(prompt, mask, cache)
    outs = []
    for n, canvas in enumerate(canvases):
        if n > 0:
            model.encode(canvases[n - 1], None, cache, logits="none")
        outs.append(model.denoise(canvas, cache, sc[n]))
    return enc_logits, outs


@pytest.mark.parametrize("case", ["short", "long", "padded-batch2"])
def test_encoder_and_decoder_match_reference(pair, case: str) -> None:
    spec, ref, ours = pair
    g = torch.Generator().manual_seed(7)
    V, L = spec.vocab_size, spec.canvas_length
    T = {"short": 5, "long": 3 * spec.sliding_window + 1, "padded-batch2": spec.sliding_window + 3}[case]
    B = 2 if case == "padded-batch2" else 1
    prompt = torch.randint(3, V, (B, T), generator=g)
    mask = None
    if case == "padded-batch2":
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, :4] = 0  # left padding on the second row
        prompt[1, :4] = 0
    canvases = [torch.randint(0, V, (B, L), generator=g) for _ in range(2)]
    sc_logits = 4.0 * torch.randn(B, L, V, generator=g)
    for sc in ([None, None], [sc_logits, None], [None, sc_logits]):
        with torch.no_grad():
            ref_enc, ref_dec = run_reference(ref, spec, prompt, mask, canvases, sc)
        our_enc, our_dec = run_ours(ours, spec, prompt, mask, canvases, sc)
        valid = torch.ones(B, T, dtype=torch.bool) if mask is None else mask.bool()
        assert_close_rel(our_enc[valid], ref_enc[valid], f"{spec.name}/{case} encoder logits")
        for n in range(2):
            sc_tag = "sc" if sc[n] is not None else "no-sc"
            assert_close_rel(our_dec[n], ref_dec[n], f"{spec.name}/{case} canvas {n} decoder logits ({sc_tag})")


def test_offline_flag_is_set() -> None:
    import os

    assert os.environ.get("HF_HUB_OFFLINE") == "1"


def test_save_roundtrip_loads_in_transformers(pair, tmp_path: Path) -> None:
    from transformers import DiffusionGemmaForBlockDiffusion

    spec, ref, ours = pair
    ours.save_pretrained(str(tmp_path))
    again = DiffusionModel.from_pretrained(str(tmp_path))
    for (n1, p1), (_, p2) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(p1, p2), n1
    theirs = DiffusionGemmaForBlockDiffusion.from_pretrained(str(tmp_path), experts_implementation="eager").eval()
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, spec.vocab_size, (1, 6), generator=g)
    canvas = torch.randint(0, spec.vocab_size, (1, spec.canvas_length), generator=g)
    with torch.no_grad():
        ref_enc, ref_dec = run_reference(theirs, spec, prompt, None, [canvas], [None])
    our_enc, our_dec = run_ours(ours, spec, prompt, None, [canvas], [None])
    assert_close_rel(our_enc, ref_enc, "encoder after save")
    assert_close_rel(our_dec[0], ref_dec[0], "decoder after save")


def test_zero_self_conditioning_matches_reference(pair) -> None:
    """A converted checkpoint's all-zero self-conditioning MLP: we skip it (`SelfConditioning.inert`), the reference
    runs it on the signal; the decoder logits still agree."""
    import copy

    spec, ref, ours = pair
    ref, ours = copy.deepcopy(ref), copy.deepcopy(ours)
    with torch.no_grad():
        ref.model.decoder.self_conditioning.down_proj.weight.zero_()
        ours.self_conditioning.down.zero_()
    assert ours.self_conditioning.inert()
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(3, spec.vocab_size, (1, 6), generator=g)
    canvas = torch.randint(0, spec.vocab_size, (1, spec.canvas_length), generator=g)
    sc = [4.0 * torch.randn(1, spec.canvas_length, spec.vocab_size, generator=g)]
    with torch.no_grad():
        _, ref_dec = run_reference(ref, spec, prompt, None, [canvas], sc)
    _, our_dec = run_ours(ours, spec, prompt, None, [canvas], sc)
    assert_close_rel(our_dec[0], ref_dec[0], f"{spec.name} decoder logits (zero self-conditioning)")
