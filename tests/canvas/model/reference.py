"""Helpers that build random tiny transformers `DiffusionGemmaForBlockDiffusion` models (the parity oracle)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class RefSpec:
    name: str
    vocab_size: int = 97
    hidden_size: int = 48
    intermediate_size: int = 36
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 12
    global_head_dim: int = 16
    num_global_key_value_heads: int = 1
    sliding_window: int = 8
    num_experts: int = 5
    top_k_experts: int = 2
    moe_intermediate_size: int = 20
    canvas_length: int = 16
    final_logit_softcapping: float = 30.0

    def text_config(self) -> dict[str, Any]:
        return dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=len(self.layer_types), num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            global_head_dim=self.global_head_dim, num_global_key_value_heads=self.num_global_key_value_heads,
            sliding_window=self.sliding_window, num_experts=self.num_experts, top_k_experts=self.top_k_experts,
            moe_intermediate_size=self.moe_intermediate_size, layer_types=list(self.layer_types),
            final_logit_softcapping=self.final_logit_softcapping, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        )


SPECS = [
    # sliding + full mixed, GQA, k-as-v on full layers, top-k 2 of 5 experts, odd sizes
    RefSpec("mixed-topk2"),
    # top-k 1, more sliding layers, wider window, non-power-of-two everything
    RefSpec("topk1", vocab_size=101, hidden_size=40, intermediate_size=28, head_dim=10, global_head_dim=20,
            layer_types=("sliding_attention", "sliding_attention", "full_attention"), num_experts=3,
            top_k_experts=1, moe_intermediate_size=14, sliding_window=12, canvas_length=12),
    # top-k = experts, MHA on sliding layers, two KV heads on full layers
    RefSpec("topk-all", vocab_size=64, hidden_size=32, intermediate_size=40, num_attention_heads=2,
            num_key_value_heads=2, head_dim=16, global_head_dim=8, num_global_key_value_heads=2, num_experts=4,
            top_k_experts=4, moe_intermediate_size=12, sliding_window=6, canvas_length=8,
            layer_types=("full_attention", "sliding_attention", "full_attention")),
]


def build_reference(spec: RefSpec, seed: int = 0, std: float = 0.2,
                    sc_gain: float = 1.0):  # -> DiffusionGemmaForBlockDiffusion
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    # Eager experts: the plain per-expert loop (transformers' default grouped_mm path rejects odd sizes on CPU).
    config = DiffusionGemmaConfig(text_config=spec.text_config(), vision_config=vision,
                                  canvas_length=spec.canvas_length, experts_implementation="eager")
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    # Random values everywhere, norms and scalars included, so a swapped or skipped weight cannot hide.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name:
                continue
            if p.dim() >= 2:
                p.normal_(0.0, std, generator=g)
                if "self_conditioning.down_proj" in name:
                    p.mul_(sc_gain)
            else:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model


def save_reference(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path
