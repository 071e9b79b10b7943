"""Weights for the decoder pass only: the gap denoiser's adapters on a frozen, shared encoder, as the engine serves
them.

DiffusionGemma runs one set of weights two ways; the converted Gemma's causal pass (with its FIM adapters merged)
serves every AR infill and must not change. So what the gap denoiser trains (`canvas.training.gap_train`) lives
beside the shared weights and is read only while `canvas.model.model.in_decoder_pass()` is true
(`DiffusionModel.run_layers` with `decoder=True`: `denoise` and the training objective's decoder pass). The flag is a
context variable, so an encoder pass on another thread (an eval's twin engine beside the server's) never sees them:
- `DecoderLowRankWeight`: a frozen matrix that carries a `DecoderLoRA`; `F.linear(x, w)` adds `(x A^T) B^T * scale`
  in the decoder pass only (no full weight is formed), on `targets` of every converted layer (the appended identity
  layer stays as it is). Its base, `LowRankWeight`, is the low-rank linear itself, which the FIM fine-tune's
  adapters (`canvas.training.fim_train`) run through too, switched by their own rule;
- `DecoderDelta`: a parametrization `w -> w + delta` in the decoder pass, `w` (the very same tensor) elsewhere, on the
  routed experts' parts (`EXPERT_PARTS`: experts, router, their norms) of the converted layers. The converted base
  keeps its experts' branch at exactly zero (post_feedforward_layernorm_2 = 0) and so does the encoder; the delta
  opens it;
- self-conditioning is loaded whole: only the decoder reads it.
Invariant: with adapters attached, `encode` returns bit-identical logits and cache
(`tests/canvas/training/test_gap_denoise.py`), so the AR pathway is the same with or without them. Tensor names
(`decoder_tensors`): `<param>.lora_A/B`, `<param>.delta`, `self_conditioning.<name>`. An exported set is a directory
with `adapters.safetensors` and `adapters.json` (`objective: "gap-denoise"`, rank, scale, targets, the base's
config, `logit_shift`, the file's sha256); `load_decoder_adapters` attaches and loads one. Training owns the rest
(initialisation seeds, optimizer groups, export: `canvas.training.decoder_adapt`).

`logit_shift` (recorded by the run): slot i's logits come from the decoder's hidden state i - 1 and slot 0's from
the encoder's last position, as the AR head reads them (`canvas.training.gap_denoise.aligned_hidden`); the engine
then reads every canvas so, through `denoise_logits`, the one place it asks the decoder for logits: the sampled
slots' logits and the self-conditioning signal of every slot come from the same aligned head, as in training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from canvas.convert.adapters import META, WEIGHTS, param_owner
from canvas.model import DiffusionModel, KVCache
from canvas.model.model import in_decoder_pass

DEFAULT_TARGETS = ("attn.qkv", "attn.o_proj", "mlp_gate_up", "mlp_down")
EXPERT_PARTS = ("experts_gate_up", "experts_down", "router_proj", "router_scale", "per_expert_scale",
                "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")  # fmt: skip
OBJECTIVE = "gap-denoise"
LORA_SUFFIX = "_dlora"  # the decoder adapter of matrix `m` is the submodule `m_dlora` beside it


class DecoderLoRA(nn.Module):
    """A (rank, in) random, B (out, rank) zero: W + B @ A * scale, as `canvas.training.adapt.LoRA` draws it."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float, gen: torch.Generator) -> None:
        super().__init__()
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.randn(rank, in_features, generator=gen) / in_features**0.5)
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))


class LowRankFactors(Protocol):
    """What a `LowRankWeight` reads of its adapter: A (rank, in), B (out, rank) and the scale."""

    @property
    def lora_A(self) -> Tensor: ...

    @property
    def lora_B(self) -> Tensor: ...

    @property
    def scale(self) -> float: ...


class LowRankWeight(nn.Parameter):
    """A frozen matrix W that carries a low-rank adapter: while `active()` holds, `F.linear(x, w)` computes
    x W^T + (x A^T) B^T * scale; otherwise, and for every other op, W itself. B A is never formed, so a backward
    forms only the adapter's small gradients: a parametrization (W + B A * scale as one tensor) would form the full
    (out, in) weight gradient first, as many FLOPs again as the forward matmul. A subclass says when the adapter
    counts (`DecoderLowRankWeight`: the decoder pass; the FIM fine-tune's: outside its `adapters_off`); here,
    always."""

    lora: LowRankFactors

    def __new__(cls, data: Tensor, lora: LowRankFactors) -> Self:
        w = super().__new__(cls, data, requires_grad=False)
        w.lora = lora
        return w

    @classmethod
    def active(cls) -> bool:
        return True

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            low_rank = func is F.linear and len(args) == 2 and not kwargs and isinstance(args[1], LowRankWeight)
            if low_rank and args[1].active():
                x, w = args
                a, b = w.lora.lora_A, w.lora.lora_B
                return F.linear(x, w) + F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * w.lora.scale
            return func(*args, **kwargs)


class DecoderLowRankWeight(LowRankWeight):
    """A frozen matrix W with a decoder-only adapter (`DecoderLoRA`): in the decoder pass `F.linear(x, w)` computes
    x W^T + (x A^T) B^T * scale; everywhere else, and for every other op, W itself."""

    @classmethod
    def active(cls) -> bool:
        return in_decoder_pass()


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
        module, leaf = param_owner(model, name)
        if where[1] in targets:
            lora = DecoderLoRA(p.shape[0], p.shape[1], rank, alpha, gen).to(p.device)  # drawn on the CPU: any device
            module.add_module(leaf + LORA_SUFFIX, lora)
            setattr(module, leaf, DecoderLowRankWeight(p.detach(), lora))
        elif where[1] in EXPERT_PARTS:
            parametrize.register_parametrization(module, leaf, DecoderDelta(p.detach()))
    for p in model.self_conditioning.parameters():
        p.requires_grad_(True)


def decoder_tensors(model: DiffusionModel) -> dict[str, Tensor]:
    """The trained tensors by name (`<param>.lora_A/B`, `<param>.delta`, `self_conditioning.<name>`)."""
    out: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, DecoderLoRA) and name.endswith(LORA_SUFFIX):
            out[name.removesuffix(LORA_SUFFIX) + ".lora_A"] = module.lora_A.detach()
            out[name.removesuffix(LORA_SUFFIX) + ".lora_B"] = module.lora_B.detach()
        elif isinstance(module, DecoderDelta):
            # "<module>.parametrizations.<leaf>.0" -> "<module>.<leaf>.delta"
            owner, _, rest = name.partition(".parametrizations.")
            out[f"{owner}.{rest.removesuffix('.0')}.delta"] = module.delta.detach()
    for name, p in model.self_conditioning.named_parameters():
        out[f"self_conditioning.{name}"] = p.detach()
    return out


def has_decoder_adapters(model: DiffusionModel) -> bool:
    return any(isinstance(m, DecoderLoRA) for m in model.modules())


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


def base_config(model: DiffusionModel) -> dict[str, Any]:
    """The model's config as an adapter set records its base (the display name left out)."""
    cfg = model.config.to_hf_dict()
    cfg.pop("name", None)
    return cfg


def read_decoder_meta(path: Path) -> dict[str, Any]:
    """The `adapters.json` of a decoder adapter set at `path`; ValueError when it is another kind of set."""
    record = path / META
    if not record.is_file():
        raise FileNotFoundError(f"{path}: no {META}; is this an exported gap-denoise adapter set?")
    meta: dict[str, Any] = json.loads(record.read_text(encoding="utf-8"))
    if meta.get("objective") != OBJECTIVE:
        raise ValueError(f"{path}: not a {OBJECTIVE} adapter set (objective {meta.get('objective')!r})")
    return meta


def load_decoder_adapters(model: DiffusionModel, path: Path) -> dict[str, Any]:
    """Attach the decoder adapters recorded in `path` to `model` and load them; returns their `adapters.json`.
    Refuses a set trained on another base shape or vocabulary, and a damaged one (sha256)."""
    from safetensors.torch import load_file

    from canvas.convert.source import sha256_file

    meta = read_decoder_meta(path)
    if meta["base_config"] != base_config(model):
        raise ValueError(f"{path}: these decoder adapters were trained on another base shape or vocabulary")
    if sha256_file(path / WEIGHTS) != meta["sha256"]:
        raise ValueError(f"{path / WEIGHTS}: sha256 differs from {META}'s (a damaged or mixed-up adapter set)")
    if has_decoder_adapters(model):
        raise ValueError("the model already has decoder adapters attached")
    rank = int(meta["rank"])
    attach_decoder_adapters(model, rank, float(meta["scale"]) * rank, tuple(meta["targets"]))
    tensors = load_file(str(path / WEIGHTS))
    load_decoder_tensors(model, {k: v.to(model.device) for k, v in tensors.items()})
    for p in model.parameters():  # served: nothing trains
        p.requires_grad_(False)
    return meta


def denoise_logits(model: DiffusionModel, canvas: Tensor, cache: KVCache, *, at: Tensor, shift: bool,
                   last: Tensor | None = None, soft: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
    """The logits of the canvas slots `at` (K,) (flat indices b * n + l into `canvas` (B, n)), (K, V) fp32.

    Unshifted: exactly `model.denoise(..., logits_at=at)`. Shifted: slot l > 0 reads the decoder's hidden state
    l - 1 (a slot in use always follows a slot in use: the used slots are a prefix), slot 0 reads the encoder's
    last position, whose logits are `last` (B, V), each row's next-token logits after its context (what its
    `encode` returned). The LM head runs on K hidden states either way."""
    if not shift:
        return model.denoise(canvas, cache, soft_embeddings=soft, canvas_mask=mask, logits_at=at)
    if last is None:
        raise ValueError("a shifted head needs each row's logits after its context (last)")
    n = canvas.shape[1]
    first = at % n == 0  # (K,) slot 0 of its row
    logits = model.denoise(canvas, cache, soft_embeddings=soft, canvas_mask=mask,
                           logits_at=torch.where(first, at, at - 1))  # (K, V)
    if bool(first.any()):
        logits[first] = last[at[first] // n].to(logits.dtype)
    return logits
