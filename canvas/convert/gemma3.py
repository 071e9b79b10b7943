"""Gemma 3 (a causal LM) -> our DiffusionGemma text model, keeping the encoder's next-token predictions.

Owns the weight mapping only: `convert_gemma3(source, calibration, cfg)` takes a transformers `Gemma3ForCausalLM`
(loaded from GGUF or an HF directory by `canvas.convert.source`) and returns a `DiffusionModel`. Vocabulary
trimming (`canvas.convert.vocab`) and the checkpoint layout (`canvas.model.io`) live elsewhere.

The mapping, each step beside its code below:
- every Gemma 3 layer becomes a sliding layer (its own v_proj kept) and one appended full-attention layer, whose
  residual branches are zero, ends the stack as an exact identity (DiffusionGemma requires a full last layer, and
  its full layers use keys as values, which destroys Gemma 3's global layers);
- RMSNorm weights w -> 1 + w (Gemma 3 scales by 1 + w); the attention scale folds into q_norm;
- the dense MLP's output norm runs in the outer norm's linear regime (`linear_alpha`), so the double norm that
  DiffusionGemma applies is Gemma 3's single norm; the routed experts' branch is exactly zero (post_ff_2 = 0);
- v_norm (an unscaled RMSNorm over each value) is neutralised by a "value anchor": the head gains two dims, one
  of which carries a large, nearly constant projection of the layer input, so v_norm divides every token's
  value by nearly the same number, which o_proj then multiplies back;
- the final softcap is 10,000 (the identity in fp32; transformers cannot run without one);
- self-conditioning starts as an exact no-op (its down projection is zero).
Invariants: the result is deterministic for a given source, calibration and config (the new weights come from
a seeded generator), and has the source's vocabulary and special token ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from canvas.model import DiffusionModel, ModelConfig, RopeConfig
from canvas.model.config import FULL, SLIDING


@dataclass(frozen=True, slots=True)
class ConvertConfig:
    num_experts: int = 4  # the routed branch starts at zero; a few small experts leave room to train it
    top_k_experts: int = 1
    moe_intermediate_size: int = 64
    anchor: bool = True  # the value anchor (False: v_norm left to damage the model, for diagnostics)
    anchor_margin: float = 100.0  # the anchor is >= margin x |value| on every calibration token
    linear_alpha: float = 1e-6  # post_ff_1 = sqrt(alpha * eps): the outer norm stays linear
    softcap: float = 10_000.0
    init_std: float = 0.02
    seed: int = 0
    canvas_length: int = 256
    sliding_window: int | None = None  # None: the source's window
    name: str = "gemma3-diffusion"

    @classmethod
    def tiny(cls) -> ConvertConfig:
        return cls(num_experts=2, top_k_experts=1, moe_intermediate_size=8, canvas_length=32, name="tiny-gemma3")


@dataclass(frozen=True, slots=True)
class AnchorFit:
    """One layer's anchor: the direction u (M,), the per-KV-head scale s (G,), the per-head value RMS after v_norm
    that o_proj restores (G,), and the fit's quality on the calibration text (the CV of u . h)."""

    u: Tensor
    scale: Tensor
    rms: Tensor
    cv: float


def _text_config(source: Any) -> Any:
    cfg = source.config
    return getattr(cfg, "text_config", None) or cfg


def _layer_inputs(source: Any, calibration: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """Run the source over the calibration sequences; per layer, every token's attention input h (N, M) and raw
    values v (N, G, D), in fp32."""
    layers = source.model.layers
    hs: list[list[Tensor]] = [[] for _ in layers]
    vs: list[list[Tensor]] = [[] for _ in layers]

    def hook(i: int) -> Any:
        def capture(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            h = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach().float()
            h = h.reshape(-1, h.shape[-1])
            hs[i].append(h)
            v = torch.nn.functional.linear(h, module.v_proj.weight.float())
            vs[i].append(v.view(h.shape[0], -1, module.head_dim))

        return capture

    handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            for ids in calibration:
                source(input_ids=ids.view(1, -1))
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(x) for x in hs], [torch.cat(x) for x in vs]


def fit_anchor(h: Tensor, v: Tensor, head_dim_new: int, margin: float, eps: float) -> AnchorFit:
    """The direction u maximising mean(u.h)^2 / var(u.h) over the calibration tokens h (N, M): u = Sigma^-1 mu
    (a generalised Rayleigh quotient), ridge-regularised. Its scale per KV head makes the anchor >= `margin` x the
    largest value norm |v| (v: (N, G, D)), so v_norm's divisor is set by the anchor alone."""
    h = h.double()
    mu = h.mean(0)
    cov = torch.cov(h.T)
    ridge = 1e-6 * cov.diagonal().mean().clamp_min(1e-12)
    u = torch.linalg.solve(cov + ridge * torch.eye(cov.shape[0], dtype=cov.dtype), mu)
    proj = h @ u
    if proj.mean() < 0:
        u, proj = -u, -proj
    u = u / proj.mean()  # u . h has mean 1 over the calibration tokens
    proj = h @ u
    cv = float(proj.std() / proj.mean())
    if float(proj.min()) <= 0:
        raise ValueError(f"no usable anchor direction: u.h changes sign over the calibration text (cv {cv:.3f})")
    vnorm = v.double().norm(dim=-1)  # (N, G)
    scale = margin * (vnorm / proj[:, None]).amax(0)  # (G,)
    anchor = proj[:, None] * scale  # (N, G)
    rms = torch.sqrt((vnorm**2 + anchor**2) / head_dim_new + eps)  # v_norm's divisor per token and head
    return AnchorFit(u.float(), scale.float(), rms.mean(0).float(), cv)


def _widen(w: Tensor, heads: int, d: int, fill: Tensor | None = None) -> Tensor:
    """Projection rows (heads * d, M) -> (heads * (d + 2), M): a new row after each rope half, so rotate_half pairs
    (j, j + d/2) stay pairs. The first new row of each head is `fill` (heads, M) when given, else zero."""
    M = w.shape[-1]
    x = w.reshape(heads, 2, d // 2, M)
    extra = torch.zeros(heads, 2, 1, M, dtype=w.dtype)
    if fill is not None:
        extra[:, 0, 0] = fill
    return torch.cat([x, extra], dim=2).reshape(heads * (d + 2), M)


def _widen_cols(o: Tensor, heads: int, d: int, scale: Tensor) -> Tensor:
    """o_proj (M, heads * d) -> (M, heads * (d + 2)): zero on the new dims, each head's columns x `scale[head]`."""
    M = o.shape[0]
    x = o.reshape(M, heads, 2, d // 2) * scale.view(1, heads, 1, 1)
    return torch.cat([x, torch.zeros(M, heads, 2, 1, dtype=o.dtype)], dim=3).reshape(M, heads * (d + 2))


def diffusion_config(source: Any, cfg: ConvertConfig) -> ModelConfig:
    """The DiffusionGemma shape for a Gemma 3 text config: every layer sliding plus one full identity layer."""
    t = _text_config(source)
    n, D = t.num_hidden_layers, t.head_dim
    D_new = D + 2 if cfg.anchor else D
    local_theta = float(t.rope_parameters["sliding_attention"]["rope_theta"])
    eos = t.eos_token_id
    return ModelConfig(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=n + 1,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=D_new,
        global_head_dim=D,
        num_global_key_value_heads=t.num_key_value_heads,
        layer_types=(SLIDING,) * n + (FULL,),
        sliding_window=cfg.sliding_window or t.sliding_window,
        # theta^(D'/D) over D' dims gives the original D/2 frequencies exactly (and one more for the anchor pair).
        # The former global layers lose their 1M theta: the one approximation that no weight change can undo.
        rope_sliding=RopeConfig("default", local_theta ** (D_new / D)),
        rope_full=RopeConfig("default", float(t.rope_parameters["full_attention"]["rope_theta"])),
        rms_norm_eps=t.rms_norm_eps,
        final_logit_softcapping=cfg.softcap,
        num_experts=cfg.num_experts,
        top_k_experts=cfg.top_k_experts,
        moe_intermediate_size=cfg.moe_intermediate_size,
        canvas_length=cfg.canvas_length,
        max_position_embeddings=t.max_position_embeddings,
        pad_token_id=t.pad_token_id,
        bos_token_id=t.bos_token_id,
        eos_token_ids=tuple(eos) if isinstance(eos, list | tuple) else (int(eos),),
        name=cfg.name,
    )


@torch.no_grad()
def convert_gemma3(source: Any, calibration: list[Tensor], cfg: ConvertConfig = ConvertConfig()
                   ) -> tuple[DiffusionModel, list[AnchorFit]]:
    """Convert a `Gemma3ForCausalLM` into our model (fp32). `calibration`: token id sequences (T,), each starting
    with BOS as the model sees text, used to fit the value anchors. Returns the model and the anchor fits."""
    t = _text_config(source)
    if getattr(t, "attn_logit_softcapping", None) or getattr(t, "final_logit_softcapping", None):
        raise ValueError("attention or final logit softcapping in the source is not supported (Gemma 2 style)")
    if any(t.rope_parameters[k].get("rope_type", "default") != "default" for k in (SLIDING, FULL)):
        raise ValueError(f"only default rope is supported, got {t.rope_parameters}")
    mc = diffusion_config(source, cfg)
    n, H, G, D, eps = t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.rms_norm_eps
    if D % 2:
        raise ValueError(f"head_dim {D} is odd; rope needs pairs")
    sd = {k.removeprefix("model.").removeprefix("language_model."): v.float() for k, v in source.state_dict().items()}
    gen = torch.Generator().manual_seed(cfg.seed)
    model = DiffusionModel(mc, init=False)
    model.reset_parameters(std=cfg.init_std, generator=gen)  # the new parts: experts, router, SC, identity layer

    fits: list[AnchorFit] = []
    if cfg.anchor:
        if not calibration:
            raise ValueError("the value anchor needs calibration text")
        hs, vs = _layer_inputs(source, calibration)
        fits = [fit_anchor(hs[i], vs[i], D + 2, cfg.anchor_margin, eps) for i in range(n)]

    def norm(name: str) -> Tensor:
        return 1.0 + sd[name]  # Gemma 3 scales by (1 + w), DiffusionGemma by w

    model.embed.copy_(sd["embed_tokens.weight"])  # both scale embeddings by sqrt(hidden) and tie the head
    model.norm.copy_(norm("norm.weight"))
    scaling = float(t.query_pre_attn_scalar) ** -0.5  # Gemma 3's attention scale; ours is 1
    alpha = cfg.linear_alpha
    for i in range(n):
        p, layer = f"layers.{i}.", model.blocks[i]
        a = layer.attn
        q, k, v, o = (sd[p + f"self_attn.{x}_proj.weight"] for x in "qkvo")
        qn, kn = norm(p + "self_attn.q_norm.weight"), norm(p + "self_attn.k_norm.weight")
        if cfg.anchor:
            fit = fits[i]
            # The widened q/k are zero on the new dims; over D + 2 dims their RMS shrinks by sqrt(D / (D + 2)),
            # which the norm weights undo. q/k norm weights get one (ignored) entry per new dim.
            widen = math.sqrt(D / (D + 2))
            q, k = _widen(q, H, D), _widen(k, G, D)
            v = _widen(v, G, D, fill=fit.scale[:, None] * fit.u[None, :])
            o = _widen_cols(o, H, D, fit.rms.repeat_interleave(H // G))
            qn = torch.cat([qn[: D // 2], qn.new_ones(1), qn[D // 2 :], qn.new_ones(1)]) * widen
            kn = torch.cat([kn[: D // 2], kn.new_ones(1), kn[D // 2 :], kn.new_ones(1)]) * widen
        a.qkv.copy_(torch.cat([q, k, v]))
        a.o_proj.copy_(o)
        a.q_norm.copy_(qn * scaling)  # rope is linear, so the scale commutes with it
        a.k_norm.copy_(kn)
        layer.input_layernorm.copy_(norm(p + "input_layernorm.weight"))
        layer.post_attention_layernorm.copy_(norm(p + "post_attention_layernorm.weight"))
        layer.pre_feedforward_layernorm.copy_(norm(p + "pre_feedforward_layernorm.weight"))
        # DiffusionGemma: post_ff(post_ff_1(mlp) + post_ff_2(experts)). With post_ff_1 = sqrt(alpha * eps) the sum
        # has mean square <= alpha * eps << eps, so the outer norm divides by ~sqrt(eps) whatever the input: it is
        # linear, and post_ff = (1 + w) / sqrt(alpha) makes the pair Gemma 3's single norm (to ~alpha / 2).
        # post_ff_1 = 1 is not exact: some MLP outputs have a mean square of ~10 eps, where eps matters twice.
        layer.post_feedforward_layernorm_1.fill_(math.sqrt(alpha * eps))
        layer.post_feedforward_layernorm.copy_(norm(p + "post_feedforward_layernorm.weight") / math.sqrt(alpha))
        layer.post_feedforward_layernorm_2.zero_()  # the routed experts' branch: exactly zero until trained
        layer.mlp_gate_up.copy_(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
        layer.mlp_down.copy_(sd[p + "mlp.down_proj.weight"])
    last = model.blocks[n]
    last.post_attention_layernorm.zero_()  # both residual branches add zero: the layer is the identity
    last.post_feedforward_layernorm.zero_()
    last.post_feedforward_layernorm_2.zero_()  # its experts start at zero too, once training opens the layer
    model.self_conditioning.down.zero_()  # self-conditioning adds exactly zero until trained
    return model.eval(), fits
