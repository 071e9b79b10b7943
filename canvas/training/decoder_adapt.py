"""The gap denoiser's decoder-only adapters, training's side: optimizer groups and export.

What the adapters are, how they attach and how a set loads for serving is `canvas.engine.decoder_weights` (the
engine serves them, so they live at its layer); this module re-exports those names for the trainer and adds
`param_groups` (each norm delta in the conversion's linear regime gets its own learning-rate scale) and
`export_decoder_adapters` (fp32 tensors + `adapters.json`, `objective: "gap-denoise"`, which
`canvas.engine.decoder_weights.load_decoder_adapters` reads; `canvas.engine.backend.load_backend` serves a set found
in a model directory's `decoder_adapters/`).
Invariant: with adapters attached and trained, `encode` returns bit-identical logits and cache
(`tests/canvas/training/test_gap_denoise.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor

from canvas.convert.adapters import META, WEIGHTS
from canvas.engine.decoder_weights import (
    DEFAULT_TARGETS,
    EXPERT_PARTS,
    LORA_SUFFIX,
    OBJECTIVE,
    DecoderDelta,
    DecoderLoRA,
    DecoderLowRankWeight,
    attach_decoder_adapters,
    base_config,
    decoder_tensors,
    load_decoder_adapters,
    load_decoder_tensors,
)
from canvas.model import DiffusionModel
from canvas.training.adapt import linear_regime_lr_scales

__all__ = ["DEFAULT_TARGETS", "EXPERT_PARTS", "OBJECTIVE", "DecoderDelta", "DecoderLoRA", "DecoderLowRankWeight",
           "attach_decoder_adapters", "decoder_tensors", "export_decoder_adapters", "load_decoder_adapters",
           "load_decoder_tensors", "param_groups"]


def param_groups(model: DiffusionModel, lr_scale_sc: float = 1.0) -> list[dict[str, Any]]:
    """Optimizer groups: each delta of a norm that lives in the conversion's linear regime
    (`linear_regime_lr_scales`) gets that norm's scale; every other trained tensor scale 1 (self-conditioning
    `lr_scale_sc`). Each group carries `lr_scale`, multiplied into the schedule's lr."""
    scales = linear_regime_lr_scales(model)
    groups: list[dict[str, Any]] = []
    plain: list[Tensor] = []
    for name, module in model.named_modules():
        if isinstance(module, DecoderDelta):
            owner, _, rest = name.partition(".parametrizations.")
            scale = scales.get(f"{owner}.{rest.removesuffix('.0')}")
            if scale is not None:
                groups.append({"params": [module.delta], "lr_scale": scale})
                continue
            plain.append(module.delta)
        elif isinstance(module, DecoderLoRA) and name.endswith(LORA_SUFFIX):
            plain += [module.lora_A, module.lora_B]
    groups.insert(0, {"params": plain, "lr_scale": 1.0})
    groups.append({"params": list(model.self_conditioning.parameters()), "lr_scale": lr_scale_sc})
    return groups


def export_decoder_adapters(model: DiffusionModel, out: Path, meta: dict[str, Any]) -> Path:
    """Write the decoder adapter set (fp32 tensors + `adapters.json`: rank, scale, targets, base config, `meta`)."""
    from safetensors.torch import save_file

    from canvas.convert.source import sha256_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in decoder_tensors(model).items()}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    cfg = base_config(model)
    loras = [m for m in model.modules() if isinstance(m, DecoderLoRA)]
    if not loras:
        raise ValueError("the model has no decoder adapters attached")
    targets = sorted({n.split(".", 2)[2].removesuffix(LORA_SUFFIX) for n, m in model.named_modules()
                      if isinstance(m, DecoderLoRA) and n.endswith(LORA_SUFFIX)})  # fmt: skip
    record = {"objective": OBJECTIVE, "rank": loras[0].lora_A.shape[0], "scale": loras[0].scale, "targets": targets,
              "base_config": cfg, **meta, "sha256": sha256_file(out / WEIGHTS)}  # fmt: skip
    (out / META).write_text(json.dumps(record, indent=2) + "\n")
    return out
