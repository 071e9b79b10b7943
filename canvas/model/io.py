"""Weight I/O in the transformers layout: `config.json` + `model.safetensors` (or a sharded index).

Loading reads tensors one at a time from memory-mapped safetensors straight into the parameters they belong to,
so at most one extra tensor (the one being fused, e.g. q/k/v into one matrix) exists beside the model. The vision
tower and `lm_head` (tied to the embeddings) are ignored. Shared weights are read from `model.decoder.*` (where
transformers saves tied weights) or, failing that, `model.encoder.language_model.*`. Every failure names the file or
tensor at fault. `save_pretrained` writes the layout transformers' `DiffusionGemmaForBlockDiffusion` loads.
Loading builds the class it is given (`DiffusionModel.from_pretrained` passes its own; `canvas.model.load_pretrained`
is the same as a function), so this module never imports `canvas.model.model`, which imports it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from canvas.model.config import ModelConfig
from canvas.sampling.modes import EXTRA_FILE
from canvas.sampling.sampler import SamplerConfig, extra_settings

if TYPE_CHECKING:
    from canvas.model.model import DiffusionModel

Model = TypeVar("Model", bound="DiffusionModel")


class WeightsError(ValueError):
    """A model directory that cannot be loaded: missing file, wrong model type, missing or misshapen tensor."""


def read_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise WeightsError(f"{path}: no config.json (expected a DiffusionGemma model directory)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise WeightsError(f"{cfg_file}: not valid JSON ({e})") from None
    raw.setdefault("name", path.resolve().name)  # a model is known by its directory unless it says otherwise
    try:
        return ModelConfig.from_hf_dict(raw)
    except ValueError as e:
        raise WeightsError(f"{cfg_file}: {e}") from None


class _TensorSource:
    """Name -> lazily read tensor over one or many safetensors files, tolerant to a missing `model.` prefix."""

    def __init__(self, path: Path) -> None:
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            files = ["model.safetensors"]
        else:
            raise WeightsError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self.handles = []
        self.where: dict[str, int] = {}
        for n, name in enumerate(files):
            f = path / name
            if not f.is_file():
                raise WeightsError(f"{path}: shard {name} listed in the index is missing")
            h = safe_open(str(f), framework="pt")
            self.handles.append(h)
            for key in h.keys():
                self.where[key.removeprefix("model.")] = n
                self.where.setdefault(key, n)
        self._raw_names = {key.removeprefix("model."): key for h in self.handles for key in h.keys()}

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise WeightsError(f"missing tensor {name!r}")
        return self.handles[self.where[name]].get_tensor(self._raw_names.get(name, name))

    def shared(self, suffix: str) -> torch.Tensor:
        for prefix in ("decoder.", "encoder.language_model."):
            if self.has(prefix + suffix):
                return self.get(prefix + suffix)
        raise WeightsError(f"missing tensor 'model.decoder.{suffix}' (nor under model.encoder.language_model.)")


class _DictSource(_TensorSource):
    """The same lookups over an in-memory state dict (e.g. a live transformers module's `state_dict()`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = {k.removeprefix("model."): v for k, v in tensors.items()}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise WeightsError(f"missing tensor {name!r}")
        return self.tensors[name]


Reader = Callable[[_TensorSource], torch.Tensor]


def _shared(*names: str) -> Reader:
    """Read weights shared by encoder and decoder, concatenated along dim 0 when several (a fused matrix)."""
    return lambda s: torch.cat([s.shared(n) for n in names]) if len(names) > 1 else s.shared(names[0])


def _exact(*names: str) -> Reader:
    """Read the first of `names` that exists (decoder-only weights, per-pass buffers)."""

    def read(s: _TensorSource) -> torch.Tensor:
        for n in names[:-1]:
            if s.has(n):
                return s.get(n)
        return s.get(names[-1])

    return read


def _hf_names(model: DiffusionModel) -> Iterator[tuple[torch.Tensor, Reader, str]]:
    """(destination, how to read it, HF name for messages) for every tensor of the model."""
    cfg = model.config
    yield model.embed, _shared("embed_tokens.weight"), "embed_tokens.weight"
    yield model.norm, _shared("norm.weight"), "norm.weight"
    sc = model.self_conditioning
    p = "decoder.self_conditioning."
    yield sc.pre_norm, _exact(p + "pre_norm.weight"), p + "pre_norm.weight"
    gate_up = (p + "gate_proj.weight", p + "up_proj.weight")
    yield sc.gate_up, lambda s: torch.cat([s.get(n) for n in gate_up]), p + "gate/up_proj"
    yield sc.down, _exact(p + "down_proj.weight"), p + "down_proj.weight"
    for i, layer in enumerate(model.blocks):
        lp = f"layers.{i}."
        a = lp + "self_attn."
        qkv = [a + "q_proj.weight", a + "k_proj.weight"] + ([a + "v_proj.weight"] if cfg.layer_has_v_proj(i) else [])
        yield layer.attn.qkv, _shared(*qkv), a + "q/k/v_proj"
        yield layer.attn.o_proj, _shared(a + "o_proj.weight"), a + "o_proj.weight"
        yield layer.attn.q_norm, _shared(a + "q_norm.weight"), a + "q_norm.weight"
        yield layer.attn.k_norm, _shared(a + "k_norm.weight"), a + "k_norm.weight"
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"):
            yield getattr(layer, norm), _shared(lp + norm + ".weight"), lp + norm + ".weight"
        m = lp + "mlp."
        yield layer.mlp_gate_up, _shared(m + "gate_proj.weight", m + "up_proj.weight"), m + "gate/up_proj"
        yield layer.mlp_down, _shared(m + "down_proj.weight"), m + "down_proj.weight"
        for ours, theirs in (("router_proj", "router.proj.weight"), ("router_scale", "router.scale"),
                             ("per_expert_scale", "router.per_expert_scale"),
                             ("experts_gate_up", "experts.gate_up_proj"), ("experts_down", "experts.down_proj")):
            yield getattr(layer, ours), _shared(lp + theirs), lp + theirs
        dec = "decoder." + lp + "layer_scalar"
        yield layer.decoder_scalar, _exact(dec), dec
        # Checkpoints without a separate encoder scalar share the decoder's.
        enc = "encoder.language_model." + lp + "layer_scalar"
        yield layer.encoder_scalar, _exact(enc, dec), enc


def load_dir(cls: type[Model], path: str | Path, *, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32) -> Model:
    """A `cls` (our `DiffusionModel`) from a model directory."""
    path = Path(path)
    if not path.is_dir():
        raise WeightsError(f"{path}: not a directory")
    return _fill(cls, read_config(path), _TensorSource(path), device, dtype)


def load_tensors(cls: type[Model], config: ModelConfig, tensors: dict[str, torch.Tensor], *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Model:
    """A `cls` from tensors named as in a transformers `DiffusionGemmaForBlockDiffusion.state_dict()`."""
    return _fill(cls, config, _DictSource(tensors), device, dtype)


def _fill(cls: type[Model], cfg: ModelConfig, src: _TensorSource, device: torch.device | str,
          dtype: torch.dtype) -> Model:
    # Built on the target device without random init: every tensor is overwritten below.
    with torch.device(device):
        model = cls(cfg, init=False).to(dtype=dtype)
    with torch.no_grad():
        for dest, read, name in _hf_names(model):
            t = read(src)
            if tuple(t.shape) != tuple(dest.shape):
                raise WeightsError(f"tensor {name!r} has shape {tuple(t.shape)}, the config implies "
                                   f"{tuple(dest.shape)}")
            dest.copy_(t.to(device=dest.device, dtype=dtype))
            del t
    return model.eval()


def save_pretrained(model: DiffusionModel, path: str | Path, *, sampler: SamplerConfig | None = None) -> None:
    """Write config.json, generation_config.json and model.safetensors in the transformers layout, and our sampler
    settings that transformers has no key for in `canvas.sampling.sampler.EXTRA_FILE`.

    `sampler` is the model's own sampler defaults for generation_config.json (the reference defaults if None)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    sampler = sampler or SamplerConfig()
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor) -> None:
        out["model." + name] = t.detach().to("cpu").contiguous()

    put("decoder.embed_tokens.weight", model.embed)
    put("decoder.norm.weight", model.norm)
    sc = model.self_conditioning
    gate, up = sc.gate_up.chunk(2)
    put("decoder.self_conditioning.pre_norm.weight", sc.pre_norm)
    put("decoder.self_conditioning.gate_proj.weight", gate)
    put("decoder.self_conditioning.up_proj.weight", up)
    put("decoder.self_conditioning.down_proj.weight", sc.down)
    for i, layer in enumerate(model.blocks):
        lp = f"decoder.layers.{i}."
        H, G, D = cfg.num_attention_heads, cfg.layer_kv_heads(i), cfg.layer_head_dim(i)
        qkv = layer.attn.qkv
        put(lp + "self_attn.q_proj.weight", qkv[: H * D])
        put(lp + "self_attn.k_proj.weight", qkv[H * D : (H + G) * D])
        if cfg.layer_has_v_proj(i):
            put(lp + "self_attn.v_proj.weight", qkv[(H + G) * D :])
        put(lp + "self_attn.o_proj.weight", layer.attn.o_proj)
        put(lp + "self_attn.q_norm.weight", layer.attn.q_norm)
        put(lp + "self_attn.k_norm.weight", layer.attn.k_norm)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"):
            put(lp + norm + ".weight", getattr(layer, norm))
        g, u = layer.mlp_gate_up.chunk(2)
        put(lp + "mlp.gate_proj.weight", g)
        put(lp + "mlp.up_proj.weight", u)
        put(lp + "mlp.down_proj.weight", layer.mlp_down)
        put(lp + "router.proj.weight", layer.router_proj)
        put(lp + "router.scale", layer.router_scale)
        put(lp + "router.per_expert_scale", layer.per_expert_scale)
        put(lp + "experts.gate_up_proj", layer.experts_gate_up)
        put(lp + "experts.down_proj", layer.experts_down)
        put(lp + "layer_scalar", layer.decoder_scalar)
        put(f"encoder.language_model.layers.{i}.layer_scalar", layer.encoder_scalar)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    gen = {
        **sampler.to_generation_config(),
        "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
    }
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (path / EXTRA_FILE).write_text(json.dumps(extra_settings(sampler), indent=2) + "\n")
