"""Our own DiffusionGemma text model: one set of weights run two ways, gpt-fast style.

- `encode`: causal pass over the text before the canvas. Writes the static `KVCache` (sliding layers keep only
  their window) and returns the AR next-token logits. Its decode step (T = 1, any B) builds no causal mask and
  appends sliding keys in place while the window has room (same values as the general path); passes of at most
  the scheme's `row_limit` rows (decode steps; for "q8" prefill too where its kernel has VNNI) go through int8
  weight copies where `canvas.model.int8.quantize_decode` attached them.
- `denoise`: bidirectional pass over a canvas. Reads the cache, never writes it, and applies self-conditioning
  (softmax of the previous step's logits @ embeddings through a gated MLP) when given; skipped, exactly, while that
  MLP is all zeros (`SelfConditioning.inert`, a converted checkpoint). `logits_at` runs the final norm and the LM
  head only for the slots a caller samples (pinned slots need none).
Each layer: attention (q/k norm, RoPE, scale 1, k-as-v on full layers) -> dense gated MLP beside routed experts
(router with per-expert scale, top-k renormalised) -> layer scalar; embeddings tied, scaled by sqrt(hidden).
Numerics follow `transformers/models/diffusion_gemma/modeling_diffusion_gemma.py` (v5.23.0) exactly; the parity
tests in tests/canvas/model hold us to it. Weight I/O lives in `canvas.model.io`.

Legend: B batch, T tokens in this pass, L canvas length, S cached positions, N = B*T, H heads, G KV heads,
D head dim, M hidden size, V vocabulary, E experts, K experts per token.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from canvas.model.band import Band, band_attend, band_for
from canvas.model.cache import KVCache
from canvas.model.config import ModelConfig, RopeConfig
from canvas.model.decode import DecodeCompiler, decode_layers
from canvas.model.int8 import row_limit
from canvas.model.io import load_dir, save_pretrained
from kernels.act_cpu import gelu_mul, softcap_
from kernels.moe import fused_moe
from kernels.rmsnorm import rms_norm, rms_norm_add
from kernels.soft_embed import soft_embedding

if TYPE_CHECKING:
    from canvas.model.int8 import Int8Linear, Scheme
    from canvas.sampling.sampler import SamplerConfig

# Per layer: (layer index, this pass's k and v (B, G, T, D)) -> the keys, values and mask to attend over. `encode`
# writes its cache here, `denoise` reads it, the training objective keeps graph-connected K/V.
# A long causal pass hands its sliding layers a `Band` instead of a mask (`canvas.model.band`).
KVSource = Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor, Tensor | Band | None]]

# True while `run_layers` runs the decoder (bidirectional) pass. Weights that exist for the decoder only
# (`canvas.training.decoder_adapt`: low-rank adapters and deltas the gap denoiser trains) read it, so the encoder
# (the AR pathway) computes with the shared weights exactly as before.
_DECODER_PASS: ContextVar[bool] = ContextVar("decoder_pass", default=False)


def in_decoder_pass() -> bool:
    return _DECODER_PASS.get()


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> Tensor:
    """Inverse frequencies, (D/2,). `proportional` rotates the first `partial * D / 2` pairs, the rest stay put."""
    if rope.rope_type == "proportional":
        n_rot = int(rope.partial_rotary_factor * head_dim // 2)
        rotated = 1.0 / (rope.theta ** (torch.arange(0, 2 * n_rot, 2, dtype=torch.float) / head_dim))
        return torch.cat([rotated, torch.zeros(head_dim // 2 - n_rot)])
    dim = int(head_dim * rope.partial_rotary_factor)
    return 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def linear(x: Tensor, weight: Tensor, int8: Int8Linear | None, quant: bool) -> Tensor:
    """`F.linear(x, weight)`, through the weight's int8 copy when the pass asks for it (`quant`) and one exists."""
    return int8(x) if quant and int8 is not None else F.linear(x, weight)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, T, H, D); cos/sin (B, T, 1, D) built as cat(freqs, freqs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    inv_freq: Tensor

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.layer_kv_heads(layer)
        self.head_dim = cfg.layer_head_dim(layer)
        self.sliding = cfg.is_sliding(layer)
        self.window = cfg.sliding_window
        self.has_v = cfg.layer_has_v_proj(layer)
        self.eps = cfg.rms_norm_eps
        M, H, G, D = cfg.hidden_size, self.n_heads, self.n_kv, self.head_dim
        # q, k (and v on sliding layers) as one matmul: fewer, larger GEMMs.
        self.qkv = nn.Parameter(torch.empty((H + G * (2 if self.has_v else 1)) * D, M))
        self.o_proj = nn.Parameter(torch.empty(M, H * D))
        self.q_norm = nn.Parameter(torch.ones(D))
        self.k_norm = nn.Parameter(torch.ones(D))
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope(layer), D), persistent=False)
        self.qkv_int8: Int8Linear | None = None  # decode-step copies (canvas.model.int8.quantize_decode)
        self.o_proj_int8: Int8Linear | None = None

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions (B, T) -> cos, sin (B, T, 1, D)."""
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def project(self, x: Tensor, positions: Tensor, quant: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, M) -> q (B, H, T, D), k (B, G, T, D), v (B, G, T, D)."""
        B, T, _ = x.shape
        H, G, D = self.n_heads, self.n_kv, self.head_dim
        qkv = linear(x, self.qkv, self.qkv_int8, quant)
        q = qkv[..., : H * D].view(B, T, H, D)
        k = qkv[..., H * D : (H + G) * D].view(B, T, G, D)
        v = qkv[..., (H + G) * D :].view(B, T, G, D) if self.has_v else k
        cos, sin = self.rope(positions, x.dtype)
        q = apply_rope(rms_norm(q, self.q_norm, self.eps), cos, sin)
        k = apply_rope(rms_norm(k, self.k_norm, self.eps), cos, sin)
        v = rms_norm(v, None, self.eps)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | Band | None, quant: bool = False) -> Tensor:
        """q (B, H, T, D), k/v (B, G, S', D), mask broadcastable to (B, H, T, S') bool, None, or a sliding layer's
        `Band` (block by block over the window, `canvas.model.band`) -> (B, T, H*D)."""
        if isinstance(mask, Band):
            out = band_attend(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0,
                                                 enable_gqa=self.n_kv != self.n_heads)
        B, _, T, _ = out.shape
        return linear(out.transpose(1, 2).reshape(B, T, -1), self.o_proj, self.o_proj_int8, quant)


class Block(nn.Module):
    """One transformer layer; `layer_scalar` differs between the encoder and the decoder (separate buffers
    in the reference checkpoint), every weight is shared."""

    encoder_scalar: Tensor
    decoder_scalar: Tensor

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        M, F_, E, I_ = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.moe_intermediate_size
        self.eps = cfg.rms_norm_eps
        self.top_k = cfg.top_k_experts
        self.attn = Attention(cfg, layer)
        self.input_layernorm = nn.Parameter(torch.ones(M))
        self.post_attention_layernorm = nn.Parameter(torch.ones(M))
        self.pre_feedforward_layernorm = nn.Parameter(torch.ones(M))
        self.post_feedforward_layernorm = nn.Parameter(torch.ones(M))
        self.post_feedforward_layernorm_1 = nn.Parameter(torch.ones(M))
        self.post_feedforward_layernorm_2 = nn.Parameter(torch.ones(M))
        self.pre_feedforward_layernorm_2 = nn.Parameter(torch.ones(M))
        self.mlp_gate_up = nn.Parameter(torch.empty(2 * F_, M))  # gate rows first, then up
        self.mlp_down = nn.Parameter(torch.empty(M, F_))
        self.router_proj = nn.Parameter(torch.empty(E, M))
        self.router_scale = nn.Parameter(torch.ones(M))
        self.per_expert_scale = nn.Parameter(torch.ones(E))
        self.experts_gate_up = nn.Parameter(torch.empty(E, 2 * I_, M))
        self.experts_down = nn.Parameter(torch.empty(E, M, I_))
        self.register_buffer("encoder_scalar", torch.ones(1))
        self.register_buffer("decoder_scalar", torch.ones(1))
        self.mlp_gate_up_int8: Int8Linear | None = None  # decode-step copies (canvas.model.int8.quantize_decode)
        self.mlp_down_int8: Int8Linear | None = None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (N, M) -> top-k weights (N, K) fp32 (renormalised, times per-expert scale), ids (N, K)."""
        h = rms_norm(x, None, self.eps) * self.router_scale * (x.shape[-1] ** -0.5)
        probs = torch.softmax(F.linear(h, self.router_proj), dim=-1, dtype=torch.float32)  # (N, E)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids

    def feed_forward(self, x: Tensor, quant: bool = False) -> Tensor:
        """Dense MLP and routed experts side by side, both on the post-attention residual stream. (B, T, M)."""
        B, T, M = x.shape
        h = rms_norm(x, self.pre_feedforward_layernorm, self.eps)
        gate_up = linear(h, self.mlp_gate_up, self.mlp_gate_up_int8, quant)  # (B, T, 2I)
        act = gelu_mul(gate_up.reshape(B * T, -1)).view(B, T, -1)  # (B, T, I): gelu(gate) * up, one pass on the CPU
        dense = linear(act, self.mlp_down, self.mlp_down_int8, quant)
        flat = x.reshape(-1, M)
        weights, ids = self.route(flat)
        routed = fused_moe(rms_norm(flat, self.pre_feedforward_layernorm_2, self.eps), weights, ids,
                           self.experts_gate_up, self.experts_down).view(B, T, M)
        both = rms_norm(dense, self.post_feedforward_layernorm_1, self.eps) + rms_norm(
            routed, self.post_feedforward_layernorm_2, self.eps)
        return rms_norm_add(both, x, self.post_feedforward_layernorm, self.eps)


class SelfConditioning(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.pre_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, cfg.hidden_size))
        self.down = nn.Parameter(torch.empty(cfg.hidden_size, cfg.intermediate_size))
        self._inert: tuple[tuple[int, ...], bool] | None = None  # (weights' identity and versions, answer)

    def inert(self) -> bool:
        """True when the gated MLP maps every (finite) signal to exactly zero: its down or its gate/up projection is
        all zeros, as a converted checkpoint starts. Self-conditioning then changes nothing, so callers may skip
        computing its signal. Cached until either weight is replaced or modified in place (its version counter)."""
        key = tuple(x for w in (self.gate_up, self.down) for x in (w.data_ptr(), w._version))
        if self._inert is None or self._inert[0] != key:
            self._inert = (key, not bool(self.down.any()) or not bool(self.gate_up.any()))
        return self._inert[1]

    def forward(self, embeds: Tensor, soft: Tensor | None) -> Tensor:
        """embeds (B, L, M) + gated MLP of the soft embeddings (B, L, M), then an unscaled RMSNorm."""
        if soft is None or (not torch.is_grad_enabled() and self.inert()):
            # A zero signal, or a zero MLP, adds exactly zero (gelu(0) * 0 = 0): skip the work. Not under grad: a
            # zero projection still has a gradient to learn from.
            return rms_norm(embeds, None, self.eps)
        h = rms_norm(soft, self.pre_norm, self.eps)
        gate, up = F.linear(h, self.gate_up).chunk(2, dim=-1)
        return rms_norm(embeds + F.linear(F.gelu(gate, approximate="tanh") * up, self.down), None, self.eps)


class DiffusionModel(nn.Module):
    """Encoder + denoiser sharing one set of weights. Construct from a config (random init) or load with
    `DiffusionModel.from_pretrained(path)`; see the module docstring for the two passes."""

    def __init__(self, config: ModelConfig, *, init: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.self_conditioning = SelfConditioning(config)
        self.head_int8: Int8Linear | None = None  # decode-step copies (canvas.model.int8.quantize_decode)
        self.decode_int8: Scheme | None = None
        # Passes of at most this many rows use them; None: the scheme's `ROW_LIMITS` (a fidelity check raises it).
        self.int8_rows: int | None = None
        self.decode_fast = True  # one-token steps through canvas.model.decode (False: the general path, to compare)
        self.decode_compile: DecodeCompiler | None = None  # its compiled halves (canvas.model.decode)
        # Long causal passes attend in sliding layers block by block over the window (False: the dense mask, to
        # compare; canvas.model.band).
        self.band_attention = True
        if init:
            self.reset_parameters()

    # ---- set-up -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Normal(0, std) matrices, unit norms and scales, as the reference initialiser does."""
        for p in self.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std, generator=generator)
            else:
                p.fill_(1.0)
        for layer in self.blocks:
            layer.encoder_scalar.fill_(1.0)
            layer.decoder_scalar.fill_(1.0)

    @classmethod
    def from_pretrained(cls, path: str, *, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> DiffusionModel:
        return load_dir(cls, path, device=device, dtype=dtype)

    def save_pretrained(self, path: str, *, sampler: SamplerConfig | None = None) -> None:
        """Weights and config in the transformers layout, `sampler` as the model's defaults (see `canvas.model.io`)."""
        save_pretrained(self, path, sampler=sampler)

    @property
    def blocks(self) -> list[Block]:
        return cast(list[Block], list(self.layers))

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        return KVCache.empty(self.config, batch_size, capacity, device=self.device, dtype=self.dtype)

    # ---- shared pieces ----------------------------------------------------------------------------------------
    def embed_tokens(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.embed) * torch.tensor(self.config.embed_scale, dtype=self.dtype)

    def logits(self, h: Tensor, quant: bool = False) -> Tensor:
        """Final norm, tied LM head, fp32 softcap. (..., M) -> (..., V) fp32."""
        out = linear(rms_norm(h, self.norm, self.config.rms_norm_eps), self.embed, self.head_int8, quant).float()
        cap = self.config.final_logit_softcapping
        if not cap:
            return out
        if torch.is_grad_enabled():
            return torch.tanh(out / cap) * cap
        # Inference: in place, sparing two (B, T, V) fp32 temporaries a step; one pass on the CPU (kernels.act_cpu).
        return softcap_(out, cap)

    def run_layers(self, x: Tensor, positions: Tensor, kv: KVSource, *, decoder: bool,
                   on_residual: Callable[[Block, Tensor], None] | None = None, quant: bool = False) -> Tensor:
        """The layer stack over hidden states x (B, T, M) at `positions` (B, T), shared by `encode`, `denoise` and
        the training objective. `on_residual(layer, h)` sees each post-attention residual (the router's input);
        the objective takes its load-balance loss there. Keeps the autograd graph when grad is enabled. `quant`:
        the dense projections go through their int8 copies where the model has them (`encode`'s decode steps).
        `in_decoder_pass()` answers `decoder` while it runs."""
        token = _DECODER_PASS.set(decoder)
        try:
            for i, layer in enumerate(self.blocks):
                attn = layer.attn
                q, k, v = attn.project(rms_norm(x, layer.input_layernorm, layer.eps), positions, quant)
                keys, values, mask = kv(i, k, v)
                h = rms_norm_add(attn.attend(q, keys, values, mask, quant), x, layer.post_attention_layernorm,
                                 layer.eps)
                if on_residual is not None:
                    on_residual(layer, h)
                x = layer.feed_forward(h, quant) * (layer.decoder_scalar if decoder else layer.encoder_scalar)
        finally:
            _DECODER_PASS.reset(token)
        return x

    # ---- encoder ----------------------------------------------------------------------------------------------
    def int8_for(self, rows: int) -> bool:
        """Whether an encoder pass of `rows` (batch x tokens) rows runs on the int8 decode weights: the model has
        them and `rows` is within its scheme's `row_limit` on this machine (or `int8_rows`). `encode` and the seam
        scorer (`canvas.engine.ar.seam_logprobs`, an encoder pass that reads a cache without writing it) ask it."""
        if self.decode_int8 is None:
            return False
        return rows <= (row_limit(self.decode_int8) if self.int8_rows is None else self.int8_rows)

    @torch.no_grad()
    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None, cache: KVCache | None = None,
               *, logits: Literal["all", "last", "none"] = "all") -> tuple[Tensor | None, KVCache]:
        """Causal pass over `input_ids` (B, T) appended to `cache` (a new one when None).

        `attention_mask` (B, T) marks real tokens (left padding = False); positions are shared across the batch
        and count padding, as in the reference. Returns the AR logits ((B, T, V), (B, 1, V) or None) and the cache.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, tokens), got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if T == 0:
            raise ValueError("encode needs at least one token")
        if cache is None:
            cache = self.new_cache(B, T + self.config.canvas_length)
        if cache.ragged:
            raise ValueError("cannot encode into a ragged (stacked) cache; it is read-only")
        if cache.batch_size != B:
            raise ValueError(f"cache batch size {cache.batch_size} != input batch size {B}")
        if cache.length + T > cache.capacity:
            raise ValueError(f"cache holds {cache.length} of {cache.capacity} positions; {T} more do not fit")
        dev = input_ids.device
        valid = torch.ones(B, T, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
        start = cache.length
        # A left-padded row (`KVCache.aligned`) counts its positions from its first real token.
        positions = torch.arange(start, start + T, device=dev).expand(B, T) - cache.pos_offset[:, None]
        cache.key_valid[:, start : start + T] = valid
        x = self.embed_tokens(input_ids)  # (B, T, M)

        n_tail = cache.sliding_len()
        band: Band | None = None
        if T == 1 and attention_mask is None:
            # A decode step of a real token: every cached key precedes the query and lies inside the window (the
            # cache keeps window - 1), so the causal masks reduce to the keys' padding, and to none without padding.
            full_mask = self._padding_mask(cache.key_valid[:, : start + 1])
            sliding_mask = self._padding_mask(cache.key_valid[:, start - n_tail : start + 1])
        else:
            q_pos = torch.arange(start, start + T, device=dev)
            full_mask = self._causal_mask(q_pos, torch.arange(start + T, device=dev), cache.key_valid[:, : start + T],
                                          None)
            tail_valid = cache.key_valid[:, start - n_tail : start + T]
            if self.band_attention:
                band = band_for(T, n_tail, self.config.sliding_window, tail_valid)
            tail_pos = torch.arange(start - n_tail, start + T, device=dev)
            sliding_mask = None if band is not None else self._causal_mask(q_pos, tail_pos, tail_valid,
                                                                            self.config.sliding_window)

        sliding_attn = band if band is not None else sliding_mask

        def write_cache(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | Band | None]:
            lkv = cache.layers[i]
            if lkv.sliding and n_tail + T <= lkv.k.shape[2]:  # the window has room: append in place, no copy
                lkv.k[:, :, n_tail : n_tail + T] = k
                lkv.v[:, :, n_tail : n_tail + T] = v
                return lkv.k[:, :, : n_tail + T], lkv.v[:, :, : n_tail + T], sliding_attn
            if lkv.sliding:  # the window's tail, then these tokens; the cache keeps the last window - 1
                keys = torch.cat([lkv.k[:, :, :n_tail], k], dim=2)
                vals = torch.cat([lkv.v[:, :, :n_tail], v], dim=2)
                keep = min(keys.shape[2], lkv.k.shape[2])
                lkv.k[:, :, :keep] = keys[:, :, -keep:]
                lkv.v[:, :, :keep] = vals[:, :, -keep:]
                return keys, vals, sliding_attn
            lkv.k[:, :, start : start + T] = k
            lkv.v[:, :, start : start + T] = v
            return lkv.k[:, :, : start + T], lkv.v[:, :, : start + T], full_mask

        # Decode steps (a few rows) go through the int8 weights when the model has them; prefill only under "q8".
        quant = self.int8_for(B * T)
        if T == 1 and attention_mask is None and self.decode_fast:
            # The one-token step through its own few-op layer stack (canvas.model.decode), same cache writes.
            x = decode_layers(self, x[:, 0], positions[:, 0], cache, start, {False: full_mask, True: sliding_mask},
                              quant)[:, None]
        else:
            cache.unroll()  # the general path writes the sliding buffers in order
            cache.shared = None  # and may shift them: no slot is known to be a copy any more
            x = self.run_layers(x, positions, write_cache, decoder=False, quant=quant)
        cache.length = start + T
        cache.row_length.fill_(cache.length)
        cache.next_pos = cache.length - cache.pos_offset
        if logits == "none":
            return None, cache
        return self.logits(x if logits == "all" else x[:, -1:], quant), cache

    @staticmethod
    def _padding_mask(k_valid: Tensor) -> Tensor | None:
        """(B, 1, 1, S) bool from the keys' validity (B, S); None when every key is valid (SDPA unmasked)."""
        return None if bool(k_valid.all()) else k_valid[:, None, None, :]

    @staticmethod
    def _causal_mask(q_pos: Tensor, k_pos: Tensor, k_valid: Tensor, window: int | None) -> Tensor:
        """(B, 1, T, S) bool: key at or before the query, inside the window, not padding. A query whose row would
        be empty (a padding token with only padding before it) may see itself, so no row is all-masked."""
        allowed = k_pos[None, :] <= q_pos[:, None]  # (T, S)
        if window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        mask = allowed[None] & k_valid[:, None, :]  # (B, T, S)
        mask |= (k_pos[None, :] == q_pos[:, None])[None]
        return mask[:, None]

    # ---- decoder ----------------------------------------------------------------------------------------------
    def soft_embeddings(self, self_conditioning_logits: Tensor) -> Tensor:
        """softmax(logits) @ embeddings * sqrt(M): (..., V) -> (..., M), e.g. (B, L, V) or the (K, V) of `logits_at`."""
        *lead, V = self_conditioning_logits.shape
        soft = soft_embedding(self_conditioning_logits.reshape(-1, V), self.embed, scale=self.config.embed_scale)
        return soft.view(*lead, -1)

    @torch.no_grad()
    def denoise(self, canvas_ids: Tensor, cache: KVCache, self_conditioning_logits: Tensor | None = None,
                *, soft_embeddings: Tensor | None = None, canvas_mask: Tensor | None = None,
                logits_at: Tensor | None = None) -> Tensor:
        """Bidirectional pass over a canvas (B, L) reading `cache`; returns softcapped fp32 logits (B, L, V).

        Self-conditioning comes from the previous step's processed logits (B, L, V), or directly as their soft
        embeddings (B, L, M) when the caller computed them (the fused kernel path). `canvas_mask` (B, L) bool marks
        the slots in use: the others are hidden from every query (their own outputs are meaningless).
        `logits_at` asks for the logits of some slots only, (K, V) in its order: flat slot indices b * L + l (K,)
        long, or a (B, L) bool mask (row-major order). Only those K hidden states go through the final norm, the
        LM head and the softcap (the head is the vocabulary-sized part of a step); every slot still runs the layers,
        so the values equal the full pass's rows."""
        if canvas_ids.dim() != 2:
            raise ValueError(f"canvas_ids must be (batch, canvas_length), got shape {tuple(canvas_ids.shape)}")
        B, L = canvas_ids.shape
        if cache.batch_size != B:
            raise ValueError(f"cache batch size {cache.batch_size} != canvas batch size {B}")
        if self_conditioning_logits is not None and soft_embeddings is None and not self.self_conditioning.inert():
            soft_embeddings = self.soft_embeddings(self_conditioning_logits)
        x = self.self_conditioning(self.embed_tokens(canvas_ids), soft_embeddings)  # (B, L, M)
        dev = canvas_ids.device
        positions = cache.next_pos[:, None] + torch.arange(L, device=dev)  # (B, L)
        masks: dict[bool, Tensor | None] = {}
        for sliding in (False, True):
            layer_idx = next((i for i, lk in enumerate(cache.layers) if lk.sliding == sliding), None)
            if layer_idx is None:
                continue
            kv_valid = cache.valid_for(layer_idx)  # (B, S)
            canvas_valid = torch.ones(B, L, dtype=torch.bool, device=dev) if canvas_mask is None else canvas_mask
            if bool(kv_valid.all()) and canvas_mask is None:
                masks[sliding] = None  # no padding: plain bidirectional attention over cache + canvas
            else:
                masks[sliding] = torch.cat([kv_valid, canvas_valid], dim=1)[:, None, None, :]

        def read_cache(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
            ck, cv = cache.read(i)
            if ck.shape[2]:
                k, v = torch.cat([ck, k], dim=2), torch.cat([cv, v], dim=2)
            return k, v, masks[cache.layers[i].sliding]

        h = self.run_layers(x, positions, read_cache, decoder=True)  # (B, L, M)
        if logits_at is None:
            return self.logits(h)
        if logits_at.dtype == torch.bool:
            if logits_at.shape != (B, L):
                raise ValueError(f"logits_at mask must be (batch, canvas_length) = {(B, L)}, "
                                 f"got {tuple(logits_at.shape)}")
            logits_at = logits_at.reshape(-1).nonzero().squeeze(1)
        return self.logits(h.reshape(B * L, -1).index_select(0, logits_at))  # (K, V)
