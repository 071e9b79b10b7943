"""The training objective: encoder AR loss + canvas denoising loss (+ router balance), with self-conditioning.

`DiffusionModel.encode`/`denoise` serve inference: the encoder writes a detached KV cache. Training needs the
gradient of the denoising loss to reach the prefix keys/values too (the same weights produce them), so the two
passes here run the model's own layer stack (`DiffusionModel.run_layers`, the one loop `encode` and `denoise` run)
with graph-connected K/V instead of the cache, and take the router balance loss from its per-layer hook.
`tests/canvas/training/test_objective.py` holds them to `model.encode` + `model.denoise` (same logits, no grad).

Recipe (NeMo AutoModel's DiffusionGemma SFT guide, read for the method, no code copied):
- encoder: one causal pass over the clean prefix (or, `encoder_span="window"`, the prefix + the text after it, as
  the recipe does); next-token CE on every position;
- decoder: bidirectional pass over the noisy canvas reading the encoder's prefix K/V (sliding layers: the last
  `sliding_window - 1` prefix positions, as the inference cache keeps); flat CE over every unpinned slot;
- self-conditioning: per example with probability `p_self_cond`, a no-grad first decoder pass gives logits whose
  soft embeddings (softmax @ embeddings * sqrt(M)) feed the second pass, as the sampler feeds the previous step's
  (temperature-scaled, so the first pass's logits get a random temperature from `sc_temperature`);
- total = denoise + `ar_weight` * AR + `balance_weight` * Switch-style router load-balance loss (E * sum f_e p_e,
  averaged over layers and both passes), which keeps the experts in use.

Legend: B batch, P prefix, L canvas, T = P + L, M hidden, V vocabulary, H heads, G KV heads, D head dim, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from canvas.model import DiffusionModel
from canvas.model.model import Block
from canvas.training.corrupt import Batch
from kernels.rmsnorm import rms_norm

KV = list[tuple[Tensor, Tensor]]  # per layer: k, v (B, G, T, D), graph-connected


@dataclass(frozen=True, slots=True)
class ObjectiveConfig:
    ar_weight: float = 1.0  # the encoder's next-token loss, so AR mode (and the prefix K/V) are trained
    p_self_cond: float = 0.5  # share of examples whose decoder pass gets a first pass's soft embeddings
    balance_weight: float = 0.01  # router load balance (Switch Transformer's auxiliary loss)
    # The sampler feeds back temperature-scaled logits (its schedule runs 0.8 -> 0.4), sharper than the raw ones;
    # the first pass's logits are divided by a temperature drawn per example from this range to match.
    sc_temperature: tuple[float, float] = (0.4, 1.0)
    # "prefix": the encoder reads only the prefix (its K/V is all the decoder needs; AR loss on the prefix).
    # "window": it also reads the text after it, as the recipe does, for more AR positions at ~2x encoder cost.
    encoder_span: Literal["prefix", "window"] = "prefix"

    def __post_init__(self) -> None:
        lo, hi = self.sc_temperature
        if not 0 < lo <= hi:
            raise ValueError(f"sc_temperature must be a range 0 < lo <= hi, got {self.sc_temperature}")
        if self.encoder_span not in ("prefix", "window"):
            raise ValueError(f"encoder_span must be 'prefix' or 'window', got {self.encoder_span!r}")
        if self.ar_weight < 0 or self.balance_weight < 0:
            raise ValueError("loss weights must be >= 0")
        if not 0.0 <= self.p_self_cond <= 1.0:
            raise ValueError(f"p_self_cond must be in [0, 1], got {self.p_self_cond}")


@dataclass(slots=True)
class Losses:
    total: Tensor
    denoise: Tensor
    ar: Tensor
    balance: Tensor
    denoise_noised: float  # CE on noised slots only (diagnostic)
    denoise_clean: float  # CE on unpinned slots left clean (diagnostic: copying)
    self_cond_share: float


class Balance:
    """Accumulates the router load-balance loss over the layers of a forward pass."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.count = 0

    def add(self, layer: Block, h: Tensor) -> None:
        flat = h.reshape(-1, h.shape[-1])  # (N, M)
        # The router's own computation (canvas.model.model.Block.route), kept to its full probabilities.
        x = rms_norm(flat, None, layer.eps) * layer.router_scale * (flat.shape[-1] ** -0.5)
        probs = torch.softmax(F.linear(x, layer.router_proj), dim=-1, dtype=torch.float32)  # (N, E)
        top = torch.topk(probs, layer.top_k, dim=-1).indices  # (N, K)
        n_experts = probs.shape[-1]
        chosen = torch.zeros_like(probs).scatter_(1, top, 1.0).mean(0) / layer.top_k  # (E,) fraction routed
        loss = n_experts * (chosen.detach() * probs.mean(0)).sum()
        self.total = loss if self.total is None else self.total + loss
        self.count += 1

    def value(self, device: torch.device) -> Tensor:
        return self.total / self.count if self.total is not None else torch.zeros((), device=device)


def _band_mask(T: int, window: int | None, device: torch.device) -> Tensor:
    """(T, T) bool: causal, and within `window` when given (a query sees itself and window - 1 before it)."""
    q = torch.arange(T, device=device)[:, None]
    k = torch.arange(T, device=device)[None, :]
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    return mask


def encoder_pass(model: DiffusionModel, ids: Tensor, balance: Balance | None = None) -> tuple[Tensor, KV]:
    """Causal pass over `ids` (B, T) from position 0. Returns the final hidden states (B, T, M) and every layer's
    K/V (graph-connected), as `DiffusionModel.encode` computes them into its cache."""
    B, T = ids.shape
    cfg = model.config
    positions = torch.arange(T, device=ids.device).expand(B, T)
    masks = {False: _band_mask(T, None, ids.device), True: _band_mask(T, cfg.sliding_window, ids.device)}
    kv: KV = []

    def keep(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        kv.append((k, v))
        return k, v, masks[model.blocks[i].attn.sliding]

    x = model.run_layers(model.embed_tokens(ids), positions, keep, decoder=False,
                         on_residual=balance.add if balance is not None else None)  # fmt: skip
    return x, kv


def soft_embeddings(model: DiffusionModel, logits: Tensor) -> Tensor:
    """softmax(logits) @ embeddings * sqrt(M), differentiable in the embeddings. (B, L, V) -> (B, L, M)."""
    probs = torch.softmax(logits.float(), dim=-1).to(model.embed.dtype)
    return probs @ model.embed * torch.tensor(model.config.embed_scale, dtype=model.embed.dtype)


def decoder_pass(
    model: DiffusionModel,
    canvas: Tensor,
    prefix_kv: KV,
    prefix_len: int,
    soft: Tensor | None = None,
    balance: Balance | None = None,
    *,
    return_hidden: bool = False,
) -> Tensor:
    """Bidirectional pass over `canvas` (B, L) at positions P.., attending to the first P positions of `prefix_kv`
    (sliding layers: the last sliding_window - 1 of them). Returns softcapped fp32 logits (B, L, V), or the last
    hidden states (B, L, M) with `return_hidden`."""
    B, L = canvas.shape
    P = prefix_len
    cfg = model.config
    positions = torch.arange(P, P + L, device=canvas.device).expand(B, L)
    n_tail = min(P, cfg.sliding_window - 1)

    def after_prefix(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        pk, pv = prefix_kv[i]
        lo = P - n_tail if model.blocks[i].attn.sliding else 0
        return torch.cat([pk[:, :, lo:P], k], dim=2), torch.cat([pv[:, :, lo:P], v], dim=2), None

    x = model.self_conditioning(model.embed_tokens(canvas), soft)  # (B, L, M)
    x = model.run_layers(x, positions, after_prefix, decoder=True,
                         on_residual=balance.add if balance is not None else None)  # fmt: skip
    return x if return_hidden else model.logits(x)


def head_cross_entropy(
    h: Tensor, embed: Tensor, norm: Tensor, targets: Tensor, eps: float, cap: float | None
) -> Tensor:
    """Per-token CE of the LM head: final RMSNorm, tied projection, fp32 softcap, as `DiffusionModel.logits`.

    h (N, M), targets (N,) -> (N,) fp32. (`torch.compile` of this function did not pay on the 2-core CPU: a canvas-6m
    step took a little more CPU time with it than without.)
    """
    x = h.float()
    x = (x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5) * norm.float()).type_as(h)
    logits = F.linear(x, embed).float()
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return F.cross_entropy(logits, targets, reduction="none")


def _token_ce(model: DiffusionModel, h: Tensor, targets: Tensor) -> Tensor:
    """(B, T, M), (B, T) -> per-token CE (B, T)."""
    cfg = model.config
    flat = head_cross_entropy(
        h.reshape(-1, h.shape[-1]),
        model.embed,
        model.norm,
        targets.reshape(-1),
        cfg.rms_norm_eps,
        cfg.final_logit_softcapping,
    )
    return flat.view_as(targets)


def compute_losses(model: DiffusionModel, batch: Batch, cfg: ObjectiveConfig, gen: torch.Generator) -> Losses:
    """One training forward: encoder (AR loss), optional self-conditioning pass, decoder (denoising loss)."""
    device = model.device
    P = batch.prefix_len
    ids = batch.encoder_ids[:, :P] if cfg.encoder_span == "prefix" else batch.encoder_ids
    ids = ids.to(device)
    balance = Balance() if cfg.balance_weight > 0 else None
    hidden, kv = encoder_pass(model, ids, balance)
    if ids.shape[1] > 1:
        ar = _token_ce(model, hidden[:, :-1], ids[:, 1:]).mean()
    else:  # a one-token prefix has no next-token target
        ar = hidden.sum() * 0.0

    noisy = batch.canvas_noisy.to(device)
    B = noisy.shape[0]
    use_sc = torch.rand(B, generator=gen) < cfg.p_self_cond  # (B,) drawn on the CPU generator: reproducible
    soft: Tensor | None = None
    if bool(use_sc.any()):
        rows = use_sc.nonzero().squeeze(1).to(device)
        with torch.no_grad():
            first = decoder_pass(model, noisy[rows], [(k[rows], v[rows]) for k, v in kv], P)
            lo, hi = cfg.sc_temperature
            temperature = lo + (hi - lo) * torch.rand(len(rows), generator=gen)  # (S,)
            first = first / temperature.to(device)[:, None, None]
        soft = torch.zeros(B, noisy.shape[1], model.config.hidden_size, device=device, dtype=model.dtype)
        soft = soft.index_copy(0, rows, soft_embeddings(model, first).to(soft.dtype))
    hidden_dec = decoder_pass(model, noisy, kv, P, soft, balance, return_hidden=True)  # (B, L, M)
    target = batch.canvas_clean.to(device)
    ce = _token_ce(model, hidden_dec, target)  # (B, L)
    mask = batch.loss_mask.to(device)
    denoise = (ce * mask).sum() / mask.sum().clamp_min(1)
    with torch.no_grad():
        noised = batch.noised.to(device)
        kept = mask & ~noised
        denoise_noised = float((ce * noised).sum() / noised.sum().clamp_min(1))
        denoise_clean = float((ce * kept).sum() / kept.sum().clamp_min(1))
    bal = balance.value(device) if balance is not None else torch.zeros((), device=device)
    total = denoise + cfg.ar_weight * ar + cfg.balance_weight * bal
    return Losses(
        total=total,
        denoise=denoise.detach(),
        ar=ar.detach(),
        balance=bal.detach(),
        denoise_noised=denoise_noised,
        denoise_clean=denoise_clean,
        self_cond_share=float(use_sc.float().mean()),
    )
