"""Weights for the decoder pass only: the gap denoiser's adapters on a frozen, shared encoder.

DiffusionGemma runs one set of weights two ways; the converted Gemma's causal pass (with its FIM adapters merged)
serves every AR infill and must not change. So what the gap denoiser trains lives beside the shared weights and is
read only while `canvas.model.model.in_decoder_pass()` is true (`DiffusionModel.run_layers` with `decoder=True`,
i.e. `denoise` and the training objective's decoder pass):
- `DecoderLowRankWeight`: a frozen matrix that carries a LoRA (`canvas.training.adapt.LoRA`); `F.linear(x, w)`
  adds `(x A^T) B^T * scale` in the decoder pass only (no full weight gradient is formed, as `fim_train`'s
  `LowRankWeight`), on `targets` of every converted layer (the appended identity layer stays as it is);
- `DecoderDelta`: a parametrization `w -> w + delta` in the decoder pass, `w` (the very same tensor) elsewhere, on the
  routed experts' parts (`EXPERT_PARTS`: experts, router, their norms) of the converted layers. The converted base
  keeps its experts' branch at exactly zero (post_feedforward_layernorm_2 = 0) and so does the encoder; the decoder's
  delta opens it;
- self-conditioning is trained whole: only the decoder reads it.
Invariant: with adapters attached and trained, `encode` returns bit-identical logits and cache
(`tests/canvas/training/test_decoder_adapt.py`). Tensor names (`decoder_tensors`): `<param>.lora_A/B`,
`<param>.delta`, `self_conditioning.<name>`; `export_decoder_adapters` writes them with `adapters.json`
(`objective: "gap-denoise"`), `load_decoder_adapters` attaches and loads such a set for serving.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from canvas.convert.adapters import META, WEIGHTS
from canvas.model import DiffusionModel
from canvas.model.model import in_decoder_pass
from canvas.training.adapt import LoRA, _owner, linear_regime_lr_scales

DEFAULT_TARGETS = ("attn.qkv", "attn.o_proj", "mlp_gate_up", "mlp_down")
EXPERT_PARTS = ("experts_gate_up", "experts_down", "router_proj", "router_scale", "per_expert_scale",
                "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")  # fmt: skip
OBJECTIVE = "gap-denoise"
_LORA = "_dlora"  # the decoder adapter of matrix `m` is the submodule `m_dlora` beside it


class DecoderLowRankWeight(nn.Parameter):
    """A frozen matrix W with a decoder-only adapter: in the decoder pass `F.linear(x, w)` computes
    x W^T + (x A^T) B^T * scale; everywhere else, and for every other op, W itself."""

    lora: LoRA

    def __new__(cls, data: Tensor, lora: LoRA) -> DecoderLowRankWeight:
        w = super().__new__(cls, data, requires_grad=False)
        w.lora = lora
        return w

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            low_rank = func is F.linear and len(args) == 2 and not kwargs and isinstance(args[1], DecoderLowRankWeight)
            if low_rank and in_decoder_pass():
                x, w = args
                a, b = w.lora.lora_A, w.lora.lora_B
                return F.linear(x, w) + F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * w.lora.scale
            return func(*args, **kwargs)


class DecoderDelta(nn.Module):
    """Parametrization: `w + delta` in the decoder pass, `w` itself otherwise; delta starts at zero."""

    def __init__(self, like: Tensor) -> None:
        super().__init__()
        self.delta = nn.Parameter(torch.zeros_like(like))

    def forward(self, w: Tensor) -> Tensor:
        return w + self.delta.to(w.dtype) if in_decoder_pass() else w


def _converted_layer(name: str, last: int) -> tuple[int, str] | None:
    parts = name.split(".")
    if parts[0] != "layers" or int(parts[1]) >= last:
        return None
    return int(parts[1]), ".".join(parts[2:])


def attach_decoder_adapters(model: DiffusionModel, rank: int, alpha: float,
                            targets: tuple[str, ...] = DEFAULT_TARGETS, seed: int = 0) -> None:
    """Freeze the model; put decoder-only LoRA on `targets` and decoder-only deltas on `EXPERT_PARTS` of every
    converted layer; leave self-conditioning trainable (see the module docstring)."""
    last = model.config.num_hidden_layers - 1
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    for name, p in list(model.named_parameters()):
        where = _converted_layer(name, last)
        if where is None:
            continue
        module, leaf = _owner(model, name)
        if where[1] in targets:
            lora = LoRA(p.shape[0], p.shape[1], rank, alpha, gen).to(p.device)  # drawn on the CPU: any device
            module.add_module(leaf + _LORA, lora)
            setattr(module, leaf, DecoderLowRankWeight(p.detach(), lora))
        elif where[1] in EXPERT_PARTS:
            parametrize.register_parametrization(module, leaf, DecoderDelta(p.detach()))
    for p in model.self_conditioning.parameters():
        p.requires_grad_(True)


def decoder_tensors(model: DiffusionModel) -> dict[str, Tensor]:
    """The trained tensors by name (`<param>.lora_A/B`, `<param>.delta`, `self_conditioning.<name>`)."""
    out: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRA) and name.endswith(_LORA):
            out[name.removesuffix(_LORA) + ".lora_A"] = module.lora_A.detach()
            out[name.removesuffix(_LORA) + ".lora_B"] = module.lora_B.detach()
        elif isinstance(module, DecoderDelta):
            # "<module>.parametrizations.<leaf>.0" -> "<module>.<leaf>.delta"
            owner, _, rest = name.partition(".parametrizations.")
            out[f"{owner}.{rest.removesuffix('.0')}.delta"] = module.delta.detach()
    for name, p in model.self_conditioning.named_parameters():
        out[f"self_conditioning.{name}"] = p.detach()
    return out


def load_decoder_tensors(model: DiffusionModel, tensors: dict[str, Tensor]) -> None:
    own = decoder_tensors(model)
    if set(own) != set(tensors):
        raise ValueError(f"decoder adapter tensors differ from the model's (rank or targets changed?): missing "
                         f"{sorted(set(own) - set(tensors))[:3]}, extra {sorted(set(tensors) - set(own))[:3]}")
    with torch.no_grad():
        for name, t in tensors.items():
            if own[name].shape != t.shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)} differs from the model's {tuple(own[name].shape)}")
            own[name].copy_(t)


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
        elif isinstance(module, LoRA) and name.endswith(_LORA):
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
    cfg = model.config.to_hf_dict()
    cfg.pop("name", None)
    loras = [m for m in model.modules() if isinstance(m, LoRA)]
    if not loras:
        raise ValueError("the model has no decoder adapters attached")
    targets = sorted({n.split(".", 2)[2].removesuffix(_LORA) for n, m in model.named_modules()
                      if isinstance(m, LoRA) and n.endswith(_LORA)})  # fmt: skip
    record = {"objective": OBJECTIVE, "rank": loras[0].lora_A.shape[0], "scale": loras[0].scale, "targets": targets,
              "base_config": cfg, **meta, "sha256": sha256_file(out / WEIGHTS)}  # fmt: skip
    (out / META).write_text(json.dumps(record, indent=2) + "\n")
    return out


def load_decoder_adapters(model: DiffusionModel, path: Path) -> dict[str, Any]:
    """Attach the decoder adapters recorded in `path` to `model` and load them; returns their `adapters.json`."""
    from safetensors.torch import load_file

    from canvas.convert.source import sha256_file

    meta: dict[str, Any] = json.loads((path / META).read_text())
    if meta.get("objective") != OBJECTIVE:
        raise ValueError(f"{path}: not a {OBJECTIVE} adapter set")
    cfg = model.config.to_hf_dict()
    cfg.pop("name", None)
    if meta["base_config"] != cfg:
        raise ValueError(f"{path}: these decoder adapters were trained on another base shape or vocabulary")
    if sha256_file(path / WEIGHTS) != meta["sha256"]:
        raise ValueError(f"{path / WEIGHTS}: sha256 differs from {META}'s (a damaged or mixed-up adapter set)")
    rank = int(meta["rank"])
    attach_decoder_adapters(model, rank, float(meta["scale"]) * rank, tuple(meta["targets"]))
    load_decoder_tensors(model, {k: v.to(model.device) for k, v in load_file(str(path / WEIGHTS)).items()})
    return meta
