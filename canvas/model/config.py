"""Model configuration: one frozen dataclass for the DiffusionGemma text path, read from an HF `config.json`.

`ModelConfig` owns every shape and constant the model needs; `from_hf_dict` maps the transformers layout
(`model_type` `diffusion_gemma` with a `text_config`, or a bare `diffusion_gemma_text` config) onto it, including
the per-layer overrides of full-attention layers (`per_layer_config`, or the legacy `global_head_dim` /
`num_global_key_value_heads`), and `to_hf_dict` writes the same layout back. Presets live in `PRESETS`
(`tiny` for tests, `bench-15m` for CPU benchmarks, `26b-a4b` for the published text shapes; the embedded
model's shape lives with its training recipe, `canvas.training.train.MODEL_SHAPES`).

Invariants (checked in `__post_init__`): the last layer is full attention, heads divide evenly into KV groups,
top-k <= experts, and every special token id lies inside the vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

LayerType = Literal["sliding_attention", "full_attention"]
SLIDING: LayerType = "sliding_attention"
FULL: LayerType = "full_attention"


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """RoPE for one layer type. `proportional` keeps the full head dim but rotates only `partial_rotary_factor`
    of it (the remaining frequencies are zero), as Gemma 4's full-attention layers do."""

    rope_type: Literal["default", "proportional"] = "default"
    theta: float = 10_000.0
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "proportional"):
            raise ValueError(f"unsupported rope_type {self.rope_type!r} (expected 'default' or 'proportional')")
        if self.theta <= 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 262_144
    hidden_size: int = 2816
    intermediate_size: int = 2112  # dense MLP that runs beside the experts in every layer
    num_hidden_layers: int = 30
    num_attention_heads: int = 16
    num_key_value_heads: int = 8  # sliding layers
    head_dim: int = 256  # sliding layers
    global_head_dim: int = 512  # full-attention layers use wider heads...
    num_global_key_value_heads: int = 2  # ...and fewer KV heads, with K doubling as V (no v_proj)
    layer_types: tuple[LayerType, ...] = ()
    sliding_window: int = 1024  # a query sees itself and the sliding_window - 1 tokens before it
    rope_sliding: RopeConfig = field(default_factory=lambda: RopeConfig("default", 10_000.0, 1.0))
    rope_full: RopeConfig = field(default_factory=lambda: RopeConfig("proportional", 1_000_000.0, 0.25))
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = 30.0
    num_experts: int = 128
    top_k_experts: int = 8
    moe_intermediate_size: int = 704
    canvas_length: int = 256
    max_position_embeddings: int = 262_144
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_ids: tuple[int, ...] = (1,)
    # Optional gap token: lets an infill come out shorter than its gap. From the tokenizer, never a literal here.
    null_token_id: int | None = None
    name: str = "diffusion-gemma"

    def __post_init__(self) -> None:
        if not self.layer_types:
            # Gemma's default pattern: five sliding layers, then one full layer.
            types = tuple(SLIDING if (i + 1) % 6 else FULL for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        for t in self.layer_types:
            if t not in (SLIDING, FULL):
                raise ValueError(f"unknown layer type {t!r} (expected {SLIDING!r} or {FULL!r})")
        if self.layer_types[-1] != FULL:
            raise ValueError("the last layer must use full_attention (the reference forces it)")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "global_head_dim", "num_global_key_value_heads",
                     "sliding_window", "num_experts", "top_k_experts", "moe_intermediate_size", "canvas_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for kv in (self.num_key_value_heads, self.num_global_key_value_heads):
            if self.num_attention_heads % kv:
                raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of kv heads={kv}")
        if self.top_k_experts > self.num_experts:
            raise ValueError(f"top_k_experts={self.top_k_experts} exceeds num_experts={self.num_experts}")
        for name in ("pad_token_id", "bos_token_id", "null_token_id"):
            tok = getattr(self, name)
            if tok is not None and not 0 <= tok < self.vocab_size:
                raise ValueError(f"{name}={tok} is outside the vocabulary [0, {self.vocab_size})")
        for tok in self.eos_token_ids:
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"eos token id {tok} is outside the vocabulary [0, {self.vocab_size})")

    # ---- per-layer shapes -------------------------------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim if self.is_sliding(layer) else self.global_head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.num_key_value_heads if self.is_sliding(layer) else self.num_global_key_value_heads

    def layer_has_v_proj(self, layer: int) -> bool:
        # Full-attention layers reuse the (un-normalised, un-rotated) key projection as the value.
        return self.is_sliding(layer)

    def rope(self, layer: int) -> RopeConfig:
        return self.rope_sliding if self.is_sliding(layer) else self.rope_full

    @property
    def embed_scale(self) -> float:
        return float(self.hidden_size) ** 0.5

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- HF config.json ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a transformers `config.json` dict (`diffusion_gemma` or `diffusion_gemma_text`)."""
        model_type = cfg.get("model_type")
        if model_type == "diffusion_gemma":
            text = dict(cfg.get("text_config") or {})
            canvas_length = cfg.get("canvas_length", 256)
        elif model_type == "diffusion_gemma_text":
            text, canvas_length = dict(cfg), cfg.get("canvas_length", 256)
        else:
            raise ValueError(f"config model_type is {model_type!r}; expected 'diffusion_gemma'")
        if text.get("use_bidirectional_attention") == "all":
            raise ValueError("use_bidirectional_attention='all' (a bidirectional encoder) is not supported")
        if text.get("num_experts") is None or text.get("top_k_experts") is None:
            raise ValueError("text_config must set num_experts, top_k_experts and moe_intermediate_size (MoE model)")
        n_layers = int(text.get("num_hidden_layers", 30))
        layer_types = list(text.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)])
        layer_types[-1] = FULL  # as the reference config does
        head_dim = int(text.get("head_dim", 256))
        kv_heads = int(text.get("num_key_value_heads", 4))
        # Full-attention overrides: explicit per-layer config, else the legacy global_* keys.
        global_head_dim = int(text.get("global_head_dim", 512))
        global_kv = text.get("num_global_key_value_heads")
        per_layer = text.get("per_layer_config") or {}
        found = [per_layer.get(str(i), per_layer.get(i)) for i, t in enumerate(layer_types) if t == FULL]
        full_overrides: list[dict[str, Any]] = [o for o in found if o]
        if full_overrides:
            if any(o != full_overrides[0] for o in full_overrides):
                raise ValueError("full-attention layers with differing per_layer_config are not supported")
            global_head_dim = int(full_overrides[0].get("head_dim", head_dim))
            global_kv = full_overrides[0].get("num_key_value_heads", global_kv)
        rope = text.get("rope_parameters") or {}

        def rope_cfg(kind: str, default: RopeConfig) -> RopeConfig:
            p = rope.get(kind)
            if not p:
                return default
            return RopeConfig(p.get("rope_type", "default"), float(p.get("rope_theta", default.theta)),
                              float(p.get("partial_rotary_factor", 1.0)))

        eos = text.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(text.get("vocab_size", 262_144)),
            hidden_size=int(text.get("hidden_size", 2304)),
            intermediate_size=int(text.get("intermediate_size", 9216)),
            num_hidden_layers=n_layers,
            num_attention_heads=int(text.get("num_attention_heads", 8)),
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            global_head_dim=global_head_dim,
            num_global_key_value_heads=int(global_kv) if global_kv is not None else kv_heads,
            layer_types=tuple(layer_types),
            sliding_window=int(text.get("sliding_window", 512)),
            rope_sliding=rope_cfg(SLIDING, RopeConfig("default", 10_000.0)),
            rope_full=rope_cfg(FULL, RopeConfig("proportional", 1_000_000.0, 0.25)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            final_logit_softcapping=text.get("final_logit_softcapping", 30.0),
            num_experts=int(text["num_experts"]),
            top_k_experts=int(text["top_k_experts"]),
            moe_intermediate_size=int(text["moe_intermediate_size"]),
            canvas_length=int(canvas_length),
            max_position_embeddings=int(text.get("max_position_embeddings", 131_072)),
            pad_token_id=text.get("pad_token_id", 0),
            bos_token_id=text.get("bos_token_id", 2),
            eos_token_ids=eos_ids,
            null_token_id=cfg.get("null_token_id", text.get("null_token_id")),
            name=str(cfg.get("name") or cfg.get("_name_or_path") or "diffusion-gemma"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers `config.json` layout; loads with `DiffusionGemmaForBlockDiffusion.from_pretrained`."""

        def rope_dict(r: RopeConfig) -> dict[str, Any]:
            d: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
            if r.partial_rotary_factor != 1.0 or r.rope_type == "proportional":
                d["partial_rotary_factor"] = r.partial_rotary_factor
            return d

        full = {"head_dim": self.global_head_dim, "num_key_value_heads": self.num_global_key_value_heads}
        text: dict[str, Any] = {
            "model_type": "diffusion_gemma_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": list(self.layer_types),
            "per_layer_config": {str(i): dict(full) for i, t in enumerate(self.layer_types) if t == FULL},
            "sliding_window": self.sliding_window,
            "rope_parameters": {SLIDING: rope_dict(self.rope_sliding), FULL: rope_dict(self.rope_full)},
            "rms_norm_eps": self.rms_norm_eps,
            "final_logit_softcapping": self.final_logit_softcapping,
            "num_experts": self.num_experts,
            "top_k_experts": self.top_k_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "tie_word_embeddings": True,
            "attention_bias": False,
            "use_bidirectional_attention": None,
        }
        out: dict[str, Any] = {
            "model_type": "diffusion_gemma",
            "name": self.name,
            "architectures": ["DiffusionGemmaForBlockDiffusion"],
            "canvas_length": self.canvas_length,
            "tie_word_embeddings": True,
            "text_config": text,
            # A minimal vision tower keeps transformers from building its ~167M-parameter default; we ship no
            # vision weights (the text path never touches them).
            "vision_config": {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 16,
                              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                              "head_dim": 8},
        }
        if self.null_token_id is not None:
            out["null_token_id"] = self.null_token_id
        return out

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


PRESETS: dict[str, ModelConfig] = {
    # Tests: every feature (sliding + full layers, GQA, k-as-v, top-k > 1) at toy size.
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        layer_types=(SLIDING, FULL, SLIDING, FULL), sliding_window=16, num_experts=8, top_k_experts=2,
        moe_intermediate_size=32, canvas_length=32, pad_token_id=0, bos_token_id=2, eos_token_ids=(1,),
        name="tiny",
    ),
    # The shape measured on this CPU in ../shared/offline-assets.md (vocab 8192, hidden 256, 6 layers, 8 experts
    # top-2, ~15M text parameters): the benchmark size.
    "bench-15m": ModelConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1,
        layer_types=(SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL), sliding_window=128, num_experts=8,
        top_k_experts=2, moe_intermediate_size=256, canvas_length=256, name="bench-15m",
    ),
    # The published 26B-A4B text shapes (for GPU benchmarks with random weights).
    "26b-a4b": ModelConfig(name="26b-a4b"),
}
