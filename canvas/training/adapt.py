"""Fine-tuning the converted Gemma model: low-rank adapters on its frozen matrices, the new parts trained whole.

`attach_lora(model, rank, alpha)` freezes the base, registers a `LoRA` parametrization on each adapted matrix
(`canvas.convert.adapters.LORA_TARGETS`: the weight the model reads becomes `W + B @ A * alpha / rank`, B zero at
first, so training starts from the converted model exactly) and leaves trainable the tensors the adapter file
stores whole. `adapter_tensors` is what a checkpoint and an export keep; `export_adapters` writes the committed
adapter set (bf16) that `dcanvas model build` merges into the rebuilt base.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.nn.utils import parametrize

from canvas.convert.adapters import LORA_TARGETS, META, WEIGHTS, is_full_tensor, is_lora_target, param_owner
from canvas.model import DiffusionModel


class LoRA(nn.Module):
    """W (out, in) -> W + B @ A * scale, with A (rank, in) random and B (out, rank) zero."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float, gen: torch.Generator) -> None:
        super().__init__()
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.randn(rank, in_features, generator=gen) / in_features**0.5)
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, weight: Tensor) -> Tensor:
        return weight + (self.lora_B @ self.lora_A).to(weight.dtype) * self.scale


def attach_lora(model: DiffusionModel, rank: int, alpha: float, seed: int = 0) -> None:
    """Freeze the base and adapt it in place (see the module docstring)."""
    n = model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(seed)
    names = [(name, p.shape) for name, p in model.named_parameters()]
    for name, shape in names:
        module, leaf = param_owner(model, name)
        p = getattr(module, leaf)
        p.requires_grad_(is_full_tensor(name, shape, n))
        if is_lora_target(name, n):
            lora = LoRA(shape[0], shape[1], rank, alpha, gen).to(p.device)  # drawn on the CPU: same on any device
            parametrize.register_parametrization(module, leaf, lora)
            original: Tensor = getattr(module.parametrizations, leaf).original
            original.requires_grad_(False)


def linear_regime_lr_scales(model: DiffusionModel) -> dict[str, float]:
    """Learning-rate scales for the norms that live at the conversion's tiny scale. Each converted layer's dense
    branch leaves its norm at ~sqrt(alpha * eps) ~ 1e-6 (the outer norm's linear regime); the experts' branch beside
    it (post_feedforward_layernorm_2, zero at first) must grow on that scale, not by Adam's ~lr-sized steps, which
    would swamp the dense branch a million times over in one step."""
    n = model.config.num_hidden_layers
    out: dict[str, float] = {}
    for i, layer in enumerate(model.blocks[: n - 1]):
        ref = float(layer.post_feedforward_layernorm_1.detach().abs().mean())
        if ref < 1e-3:  # a converted layer (a model trained from scratch has norms near 1 and needs nothing)
            out[f"layers.{i}.post_feedforward_layernorm_2"] = ref
    return out


def adapter_tensors(model: DiffusionModel) -> dict[str, Tensor]:
    """The trained tensors, by the names the adapter file uses (`<param>.lora_A/B` or `<param>`)."""
    out: dict[str, Tensor] = {}
    n = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if ".parametrizations." in name:
            if name.endswith(".original"):
                continue
            base, lora = name.split(".parametrizations.")
            leaf, _, tensor = lora.partition(".0.")
            out[f"{base}.{leaf}.{tensor}"] = p.detach()
        elif is_full_tensor(name, p.shape, n):
            out[name] = p.detach()
    return out


def load_adapter_tensors(model: DiffusionModel, tensors: dict[str, Tensor]) -> None:
    """The inverse of `adapter_tensors` on a model with `attach_lora` applied."""
    own = adapter_tensors(model)
    if set(own) != set(tensors):
        missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
        raise ValueError(f"adapter tensors do not match the model (missing {missing[:3]}, unexpected {extra[:3]})")
    with torch.no_grad():
        for name, t in tensors.items():
            own[name].copy_(t)


def lora_scale(model: DiffusionModel) -> float:
    for module in model.modules():
        if isinstance(module, LoRA):
            return module.scale
    raise ValueError("no LoRA adapters on this model")


def export_adapters(model: DiffusionModel, out: Path) -> Path:
    """Write the adapter set (bf16 tensors + metadata) that `canvas.convert.adapters.apply_adapters` merges."""
    from canvas.convert.source import sha256_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in adapter_tensors(model).items()}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    cfg = model.config.to_hf_dict()
    cfg.pop("name", None)
    rank = next(m.lora_A.shape[0] for m in model.modules() if isinstance(m, LoRA))
    meta = {"rank": rank, "scale": lora_scale(model), "targets": list(LORA_TARGETS), "base_config": cfg,
            "sha256": sha256_file(out / WEIGHTS)}
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def export_base_run(base: Path, model: DiffusionModel, history: list[dict[str, float]], out: Path) -> Path:
    """A fine-tuning run's export: `out/adapters` (what gets committed) and, in `out`, the base with exactly those
    (bf16) adapters merged, as `dcanvas model build` will produce it, for `dcanvas eval` and the editor."""
    import csv
    import shutil

    from canvas.convert.adapters import apply_adapters

    if out.exists():
        shutil.rmtree(out)
    export_adapters(model, out / "adapters")
    merged = apply_adapters(DiffusionModel.from_pretrained(str(base)), out / "adapters")
    merged.save_pretrained(str(out))
    for f in base.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("GEMMA_TERMS.html", "NOTICE.md")):
            shutil.copyfile(f, out / f.name)
    keys = sorted({k for row in history for k in row}, key=lambda k: (k != "step", k))
    with (out / "loss_curve.csv").open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(history)
    return out
