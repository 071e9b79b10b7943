"""Gemma 3 -> DiffusionGemma conversion on random tiny Gemma 3 models built with transformers (no downloads).

The converted encoder's logits are compared with `Gemma3ForCausalLM`'s:
- exact (1e-5 of the logit scale) where the mapping is exact: v_norm patched out, global layers' rope theta
  equal to the local one, contexts within the sliding window;
- within 1 % of the logit scale with the value anchor (v_norm on), the real configuration;
- and the saved checkpoint gives transformers' `DiffusionGemmaForBlockDiffusion` the same encoder logits as ours.
The tiny models get what real Gemma 3 has and random weights lack: non-zero norm weights and a dominant, nearly
constant direction in the residual stream (the "massive activation" the value anchor rides on).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import canvas.model.model as model_module
from canvas.convert.gemma3 import ConvertConfig, convert_gemma3
from canvas.model import DiffusionModel

SLIDING, FULL = "sliding_attention", "full_attention"


def tiny_gemma3(kv_heads: int, *, seed: int = 0, global_theta: float = 1_000_000.0, hidden: int = 48,
                head_dim: int = 16, layers: tuple[str, ...] = (SLIDING, SLIDING, FULL, SLIDING, FULL)):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=97, hidden_size=hidden, intermediate_size=72, num_hidden_layers=len(layers),
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim, query_pre_attn_scalar=head_dim,
        sliding_window=24, layer_types=list(layers), max_position_embeddings=256,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                         FULL: {"rope_type": "default", "rope_theta": global_theta}},
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    cfg._attn_implementation = "eager"
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)  # Gemma 3 stores w for a (1 + w) scale: zero would hide a wrong mapping
        model.model.embed_tokens.weight[:, 0] += 0.5  # a dominant constant direction, as in real Gemma 3
    return model


def tokens(n: int, length: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.tensor([2]), torch.randint(3, 97, (length - 1,), generator=g)]) for _ in range(n)]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def encoder_logits(model: DiffusionModel, ids: torch.Tensor) -> torch.Tensor:
    logits, _ = model.encode(ids.view(1, -1))
    assert logits is not None
    return logits[0]


def gemma_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids.view(1, -1)).logits[0].float()


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_exact_mapping_without_v_norm(kv_heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every mapping but v_norm is exact: with v_norm patched out and one rope theta, the logits agree to fp32 noise.
    source = tiny_gemma3(kv_heads, global_theta=10_000.0)
    model, _ = convert_gemma3(source, [], ConvertConfig.tiny().__class__(**{
        **dataclasses.asdict(ConvertConfig.tiny()), "anchor": False}))
    real_norm = model_module.rms_norm

    def no_v_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return x if weight is None else real_norm(x, weight, eps)  # only v_norm and the (zeroed) router use None

    monkeypatch.setattr(model_module, "rms_norm", no_v_norm)
    for ids in tokens(3, 20):
        assert rel_err(encoder_logits(model, ids), gemma_logits(source, ids)) < 1e-5


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_value_anchor_keeps_the_logits(kv_heads: int) -> None:
    source = tiny_gemma3(kv_heads, global_theta=10_000.0)
    model, fits = convert_gemma3(source, tokens(8, 24, seed=5), ConvertConfig.tiny())
    assert all(f.cv < 0.05 for f in fits), [f.cv for f in fits]
    naive, _ = convert_gemma3(source, [], dataclasses.replace(ConvertConfig.tiny(), anchor=False))
    for ids in tokens(3, 20):
        ref = gemma_logits(source, ids)
        err = rel_err(encoder_logits(model, ids), ref)
        assert err < 1e-2, err
        assert err < rel_err(encoder_logits(naive, ids), ref) / 3  # what the anchor buys over none


def test_global_theta_is_the_only_other_approximation() -> None:
    # With Gemma 3's own 1M theta on its global layers, the conversion reproduces the same model with theta 10k.
    source = tiny_gemma3(1, global_theta=1_000_000.0)
    same = tiny_gemma3(1, global_theta=10_000.0)
    same.load_state_dict(source.state_dict())
    model, _ = convert_gemma3(source, tokens(8, 24, seed=5), ConvertConfig.tiny())
    for ids in tokens(2, 20):
        assert rel_err(encoder_logits(model, ids), gemma_logits(same, ids)) < 1e-2


def test_new_parts_are_no_ops_and_deterministic(tmp_path: Path) -> None:
    source = tiny_gemma3(2, global_theta=10_000.0)
    calib = tokens(4, 24, seed=5)
    a, _ = convert_gemma3(source, calib, ConvertConfig.tiny())
    b, _ = convert_gemma3(source, calib, ConvertConfig.tiny())
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    cfg = a.config
    assert cfg.layer_types[-1] == "full_attention" and all(t == "sliding_attention" for t in cfg.layer_types[:-1])
    assert cfg.num_hidden_layers == source.config.num_hidden_layers + 1
    last = a.blocks[-1]
    assert not last.post_attention_layernorm.any() and not last.post_feedforward_layernorm.any()
    assert not a.self_conditioning.down.any()
    assert all(not layer.post_feedforward_layernorm_2.any() for layer in a.blocks)
    a.save_pretrained(str(tmp_path / "x"))
    b.save_pretrained(str(tmp_path / "y"))
    assert (tmp_path / "x" / "model.safetensors").read_bytes() == (tmp_path / "y" / "model.safetensors").read_bytes()


def test_transformers_loads_the_checkpoint_with_the_same_logits(tmp_path: Path) -> None:
    from transformers import DiffusionGemmaForBlockDiffusion

    source = tiny_gemma3(1)
    model, _ = convert_gemma3(source, tokens(8, 24, seed=5), ConvertConfig.tiny())
    model.save_pretrained(str(tmp_path))
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(str(tmp_path)).eval()
    ids = tokens(1, 20)[0].view(1, -1)
    with torch.no_grad():
        enc = ref.model.encoder(input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool))
        theirs = ref.lm_head(enc.last_hidden_state)[0]
    cap = model.config.final_logit_softcapping
    assert cap is not None
    theirs = torch.tanh(theirs / cap) * cap
    assert rel_err(encoder_logits(model, ids[0]), theirs) < 1e-5
