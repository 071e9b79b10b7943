"""The encoder's one-token decode step, written for few ops: what `DiffusionModel.encode` runs for (B, 1) ids.

Owns `decode_layers` (the layer stack for one token a row, writing the static `KVCache` as `encode` does), its two
pure per-layer halves `pre_attention` / `post_attention` (tensors in, tensors out: the same code runs eagerly or
through `torch.compile`), and `DecodeCompiler` (compiles those halves once per process, in the background).

Why: a decode step multiplies one row (or a few) by every weight, so it should be bound by reading them; the
general `run_layers` path spends much of a step on per-op dispatch instead (~100 small ops a layer: a rope table
per layer, casts around every norm, routing with host syncs and a sort). Here, per step:
- RoPE's cos / sin are built once per rope kind (sliding / full), not once per layer;
- q, k and v are normed as one (B, H + 2G, D) view of the projection, their norm weights stacked (`_qk_norm_weight`;
  no copy of a strided slice per head kind), and q and k rotated as one (for fp32 on the CPU, eagerly, the norm and
  the rotation in one C++ call: `kernels.rmsnorm_cpu.rms_norm_rope`);
- the experts: with fewer (row, pick) pairs than experts (batch 1 on Gemma-3-270M: top-1 of 4) only the picked
  ones, one row at a time; else (and always when compiled: no data-dependent shapes) all of them, dense: every
  expert's gate/up on every row in one matmul, the routing weights zero for experts a row did not pick (their
  outputs add exact zeros), reading all of a layer's tiny experts (2 MB fp32 on Gemma-3-270M). Either way no
  sort and no grouping (~20 ops a layer on the general path).
- the single query a row attends in one C++ call for fp32 on the CPU (`kernels.attend_cpu`: each cached key and
  value row read once for the query heads sharing it, no per-layer matmul / mask / softmax ops), else by two
  matmuls and a softmax (`attend_one`), faster than CPU SDPA's flash kernel, which is built for blocks of queries;
- once the sliding window is full, its buffers serve as a ring (`KVCache.ring`): the step attends over the window
  and its own key in two pieces and overwrites the oldest slot, where the general path concatenates the window
  with the new key and shifts it back (two copies of every sliding layer's cache, every row, every step).
Compiled (`DecodeCompiler`, `model.decode_compile`): inductor fuses each half's elementwise work around the
matmuls; the cache write and the attention over the cache (whose length grows every step) stay eager, so the
compiled graphs see fixed shapes per batch size and one graph serves every layer of a kind (weights are
arguments, not constants). Until the graphs are ready (compiled on a background thread, cached on disk by
inductor's FX graph cache) steps run eagerly, so a server's first fill never waits for the compiler.
Numerics: the same formulas as `run_layers` in the model's dtype; dense experts, batched matmuls and inductor's
fusions may round differently in the last bits (tests: logits allclose, greedy tokens equal, against the general
path and eager against compiled). int8 "dynamic" weights (opaque packed objects) always run eagerly.
Invariants: inference only (`encode` runs under no_grad); writes the cache exactly where `encode` would; the
caller (`encode`) checks shapes and advances `cache.length`.

Legend: B rows, H query heads, G KV heads, D head dim, M hidden, S cached keys, E experts, I expert FFN size.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from canvas.env import DECODE_COMPILE
from canvas.model.int8 import int8_weight_mm, q8_mm
from kernels import act_cpu, attend_cpu
from kernels.attend_cpu import Share
from kernels.rmsnorm_cpu import fused_kernel, rope_kernel

if TYPE_CHECKING:
    from canvas.model.cache import KVCache
    from canvas.model.int8 import Int8Linear
    from canvas.model.model import Attention, DiffusionModel

# A projection as `pre_attention` / `post_attention` take it: (fp32 weight, int8 weight or None, scales or None,
# pad of the int8 weight's reduced dim, q8's live-column mask or None).
Lin = tuple[Tensor, Tensor | None, Tensor | None, int, Tensor | None]


# The C++ kernels' raw entry points (None where they did not build), looked up once per process: they run per layer.
_fused_norm_kernel = functools.cache(fused_kernel)
_attend_cpu_kernel = functools.cache(attend_cpu.kernel)
_gelu_mul_kernel = functools.cache(act_cpu.gelu_mul_kernel)
_rope_kernel = functools.cache(rope_kernel)


def _norm(x: Tensor, weight: Tensor | None, eps: float, residual: Tensor | None = None,
          scale: Tensor | None = None) -> Tensor:
    """`(residual + kernels.rmsnorm.rms_norm_ref(x, weight)) * scale`, residual and scale optional. fp32 on the CPU,
    eagerly: one call of the fused C++ kernel (`kernels.rmsnorm_cpu`) instead of ~8 aten ops where it built;
    otherwise torch's rms_norm without the reference's casts where x is already fp32 (they are no-ops then)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling():
        fn = _fused_norm_kernel()
        if fn is not None:
            D = x.shape[-1]
            return fn(x.reshape(-1, D).contiguous(), weight, eps,
                      None if residual is None else residual.reshape(-1, D).contiguous(), scale).view(x.shape)
    if x.dtype == torch.float32:
        y = F.rms_norm(x, (x.shape[-1],), weight if weight is None or weight.dim() == 1 else None, eps)
        if weight is not None and weight.dim() > 1:  # stacked per-head weights (H + G, D)
            y = y * weight
    elif weight is not None and weight.dim() > 1:  # in fp32, rounded once, as before the fused kernel
        y = (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * weight.float()).to(x.dtype)
    else:
        w = None if weight is None else weight.float()
        y = F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)
    if residual is not None:
        y = residual + y
    return y if scale is None else y * scale


def _gelu_mul(gate_up: Tensor) -> Tensor:
    """gelu_tanh(gate) * up over gate_up's halves, (B, 2I) -> (B, I): one C++ pass for fp32 on the CPU, eagerly
    (`kernels.act_cpu`), else the torch ops (which inductor fuses when compiled)."""
    if gate_up.dtype == torch.float32 and gate_up.device.type == "cpu" and not torch.compiler.is_compiling():
        fn = _gelu_mul_kernel()
        if fn is not None:
            return fn(gate_up.contiguous())
    return act_cpu.gelu_mul_ref(gate_up)


def _mm(x: Tensor, lin: Lin) -> Tensor:
    """x (B, K) @ the projection: its int8 weights when given, else the fp32 (model dtype) ones."""
    w, q, s, pad, kmask = lin
    if q is None or s is None:
        return F.linear(x, w)
    return q8_mm(x, q, s, kmask) if q.dtype == torch.uint8 else int8_weight_mm(x, q, s, pad)


def pre_attention(x: Tensor, in_norm: Tensor, qkv: Lin, qk_norm: Tensor, cos: Tensor, sin: Tensor, *,
                  heads: int, kv_heads: int, has_v: bool, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """x (B, M) -> q (B, H, 1, D), k (B, G, 1, D), v (B, G, 1, D): input norm, fused q/k/v projection, q/k norms,
    RoPE (cos / sin (B, 1, D)), unscaled v norm (v is the raw key on k-as-v layers), as `Attention.project`."""
    B = x.shape[0]
    H, G, D = heads, kv_heads, cos.shape[-1]
    proj = _mm(_norm(x, in_norm, eps), qkv)  # (B, (H + 2G) * D) or (B, (H + G) * D)
    rows = proj.view(B, -1, D)  # (B, H + 2G, D) or (B, H + G, D): a view, the projection is contiguous
    # One norm for every row (with v, qk_norm's last G rows are ones): no copy of a strided slice per kind.
    eager_cpu = proj.dtype == torch.float32 and proj.device.type == "cpu" and not torch.compiler.is_compiling()
    fn = _rope_kernel() if eager_cpu else None  # traced graphs keep the torch ops (inductor fuses them)
    if fn is not None:  # one C++ call: the norm, and q and k rotated
        P = rows.shape[1]
        normed = fn(proj.view(B * P, D), qk_norm, eps, cos.reshape(B, D), sin.reshape(B, D), H + G).view(B, P, D)
        qk = normed[:, : H + G]
    else:
        normed = _norm(rows, qk_norm, eps)
        qk, half = normed[:, : H + G], D // 2
        qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin  # (B, H + G, D)
    v = normed[:, H + G :] if has_v else _norm(rows[:, H:], None, eps)  # else v is the raw key, normed unweighted
    return qk[:, :H, None], qk[:, H:, None], v[:, :, None]


def post_attention(x: Tensor, att: Tensor, o_proj: Lin, gate_up: Lin, down: Lin, norms: tuple[Tensor, ...],
                   router: tuple[Tensor, Tensor, Tensor], experts: tuple[Tensor, Tensor], scalar: Tensor, *,
                   top_k: int, eps: float, sparse: bool = False, routed_on: bool = True) -> Tensor:
    """The rest of a layer for x (B, M) and the attention's output att (B, H * D): output projection and residual,
    then `Block.feed_forward` (dense MLP beside the routed experts, run dense; see the module docstring), times the
    layer scalar. `norms`: post-attention, pre-FF, pre-FF 2, post-FF 1, post-FF 2, post-FF weights; `router`:
    projection, input scale, per-expert scale; `experts`: gate/up (E, 2I, M), down (E, M, I). `sparse`: run only
    the picked experts, one row at a time (a host sync for their ids; eager only), else all of them. `routed_on`
    False: the routed branch's output norm is all zeros (`_routed_on`), so it adds exact zeros and is skipped.
    -> (B, M)."""
    post_attn, pre_ff, pre_ff2, post_ff1, post_ff2, post_ff = norms
    h = _norm(_mm(att, o_proj), post_attn, eps, residual=x)  # (B, M): x + norm(o)
    B, M = h.shape
    dense = _mm(_gelu_mul(_mm(_norm(h, pre_ff, eps), gate_up)), down)
    if not routed_on:  # norm(routed) * 0 is exactly 0: the same sum without it
        return _norm(_norm(dense, post_ff1, eps), post_ff, eps, residual=h, scale=scalar)
    # Routing as `Block.route`: top-k of the softmax, renormalised, times the per-expert scale.
    router_proj, router_scale, expert_scale = router
    # fp32: the scale inside the fused norm (the same products); other dtypes: rounded as `Block.route` rounds them.
    routed_in = (_norm(h, router_scale, eps) if h.dtype == torch.float32 else _norm(h, None, eps) * router_scale)
    probs = torch.softmax(F.linear(routed_in * (M**-0.5), router_proj), dim=-1,
                          dtype=torch.float32)  # (B, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True) * expert_scale[ids]
    w_gate_up, w_down = experts
    xe = _norm(h, pre_ff2, eps)
    if sparse:
        routed = _picked_experts(xe, weights, ids, w_gate_up, w_down)
    else:
        dense_w = torch.zeros_like(probs).scatter_(1, ids, weights)  # (B, E): zero for the experts a row skips
        E, two_i, _ = w_gate_up.shape
        gu = F.linear(xe, w_gate_up.view(E * two_i, M)).view(B, E, 2, two_i // 2)  # (B, E, 2, I)
        act = F.gelu(gu[:, :, 0], approximate="tanh") * gu[:, :, 1]  # (B, E, I)
        y = torch.bmm(act.transpose(0, 1), w_down.transpose(1, 2))  # (E, B, M)
        # fp32 accumulation of the weighted experts, rounded once (as fused_moe_ref combines its K slots).
        routed = (y.float() * dense_w.t()[:, :, None]).sum(0).to(h.dtype)  # (B, M)
    both = _norm(dense, post_ff1, eps, residual=_norm(routed, post_ff2, eps))  # norm(routed) + norm(dense)
    return _norm(both, post_ff, eps, residual=h, scale=scalar)  # (h + norm(both)) * scalar


def _picked_experts(x: Tensor, weights: Tensor, ids: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """Each row's picked experts only: x (B, M), weights (B, K) fp32, ids (B, K) -> (B, M). Reads K experts a row
    instead of all E (the few-row steps: on Gemma-3-270M one expert in 4), at the price of a host sync."""
    rows = []
    for b, picked in enumerate(ids.tolist()):
        acc: Tensor | None = None
        for slot, e in enumerate(picked):
            gate, up = F.linear(x[b : b + 1], w_gate_up[e]).chunk(2, dim=-1)  # (1, I) each
            y = F.linear(F.gelu(gate, approximate="tanh") * up, w_down[e]).float() * weights[b : b + 1, slot, None]
            acc = y if acc is None else acc + y  # fp32, rounded once below
        assert acc is not None
        rows.append(acc)
    return torch.cat(rows).to(x.dtype)  # (B, M)


def _lin(weight: Tensor, int8: Int8Linear | None, quant: bool) -> Lin:
    t = int8.weight_tensors() if quant and int8 is not None else None
    return (weight, None, None, 0, None) if t is None else (weight, *t)


def _rope(attn: Attention, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions (B,) -> cos, sin (B, 1, D) as `Attention.rope` builds them (cat(freqs, freqs))."""
    freqs = positions[:, None].float() * attn.inv_freq.float()  # (B, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (B, 1, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


_ROUTED: weakref.WeakKeyDictionary[Any, tuple[tuple[int, int], bool]] = weakref.WeakKeyDictionary()


def _routed_on(layer: Any) -> bool:
    """Whether the layer's routed experts can change its output: False when their output norm's weight
    (`post_feedforward_layernorm_2`) is all zeros, as the converted Gemma 3 builds it (its routed branch is an
    exact no-op). Rechecked when the weight is replaced or modified in place (its version counter)."""
    w = layer.post_feedforward_layernorm_2
    key = (w.data_ptr(), w._version)
    hit = _ROUTED.get(layer)
    if hit is None or hit[0] != key:
        hit = _ROUTED[layer] = (key, bool(w.detach().any()))
    return hit[1]


_QK_NORMS: weakref.WeakKeyDictionary[Attention, tuple[tuple[int, ...], Tensor]] = weakref.WeakKeyDictionary()


def _qk_norm_weight(attn: Attention) -> Tensor:
    """q_norm for each query head, k_norm for each KV head and, on a layer with its own v, ones for each KV head
    (v's norm has no weight): (H + G, D) or (H + 2G, D), so that one norm covers the projection's rows (`pre_attention`;
    times 1.0 is exact). Rebuilt when either weight is replaced or modified in place (their version counters)."""
    key = tuple(x for w in (attn.q_norm, attn.k_norm) for x in (w.data_ptr(), w._version))
    hit = _QK_NORMS.get(attn)
    if hit is None or hit[0] != key:
        parts = [attn.q_norm.detach().expand(attn.n_heads, -1), attn.k_norm.detach().expand(attn.n_kv, -1)]
        if attn.has_v:
            parts.append(torch.ones_like(parts[1]))
        hit = _QK_NORMS[attn] = (key, torch.cat(parts))
    return hit[1]


def _cache_step(cache: KVCache, i: int, k: Tensor, v: Tensor, start: int, n_tail: int) -> tuple[Tensor, Tensor]:
    """Write one token's k, v (B, G, 1, D) into layer i's cache as `encode` does, where the layer has room for it
    (a full layer, or a sliding one whose window is not full yet); the keys and values to attend over (B, G, S, D)."""
    lkv = cache.layers[i]
    at = n_tail if lkv.sliding else start
    lkv.k[:, :, at : at + 1] = k
    lkv.v[:, :, at : at + 1] = v
    return lkv.k[:, :, : at + 1], lkv.v[:, :, : at + 1]


def _attend_kernel(q: Tensor) -> Any:
    """`kernels.attend_cpu`'s raw kernel where it built and q is fp32 on the CPU, else None (the torch ops)."""
    return _attend_cpu_kernel() if q.dtype == torch.float32 and q.device.type == "cpu" else None


def attend_one(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, share: Share | None = None) -> Tensor:
    """One query a row over its keys, scale 1: q (B, H, 1, D), keys / values (B, G, S, D), mask (B, 1, 1, S) bool
    or None -> (B, H, 1, D). `share`: rows whose slots are copies of a leader's (`SharedRows`), which the C++
    kernel reads once per group. Else two matmuls and a softmax: for a single query this beats CPU SDPA's flash
    kernel, which is built for blocks of queries."""
    B, H, _, D = q.shape
    fn = _attend_kernel(q)
    if fn is not None:
        m = None if mask is None else mask.reshape(B, -1).contiguous()  # (B, S)
        lead, lo, hi = (None, 0, 0) if share is None else share
        return fn(q.reshape(B, H, D).contiguous(), keys, values, m, None, None, lead, lo, hi).view(B, H, 1, D)
    G = keys.shape[1]
    scores = q.reshape(B, G, H // G, D) @ keys.transpose(-1, -2)  # (B, G, H/G, S): heads grouped by KV head
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (p @ values).view(B, H, 1, D)


def _ring_attend(q: Tensor, k: Tensor, v: Tensor, buf_k: Tensor, buf_v: Tensor, ring: int,
                 mask: Tensor | None, share: Share | None = None) -> Tensor:
    """Attention of one query a row over a full sliding window and its own key, then the oldest slot (`ring`)
    overwritten with this token's k, v: no copy of the window (the general path concatenates and shifts it).
    q (B, H, 1, D), k / v (B, G, 1, D), buffers (B, G, S, D) holding the S previous positions rotated by `ring`,
    mask (B, 1, 1, S + 1) over them in order then this token, or None. -> (B, H, 1, D), scale 1 as everywhere."""
    B, H, _, D = q.shape
    G, S = buf_k.shape[1], buf_k.shape[2]
    # In slot order: the old positions rotated as the buffers are, then this token.
    slots = None if mask is None else torch.cat([torch.roll(mask[..., :S], ring, dims=-1), mask[..., S:]], -1)
    fn = _attend_kernel(q)
    if fn is not None:
        m = None if slots is None else slots.reshape(B, S + 1)
        lead, lo, hi = (None, 0, 0) if share is None else share
        out = fn(q.reshape(B, H, D).contiguous(), buf_k, buf_v, m, k.reshape(B, G, D).contiguous(),
                 v.reshape(B, G, D).contiguous(), lead, lo, hi)
    else:
        qg = q.reshape(B, G, H // G, D)  # query heads grouped by their KV head (SDPA's enable_gqa order)
        scores = torch.cat([qg @ buf_k.transpose(-1, -2), (qg * k.view(B, G, 1, D)).sum(-1, keepdim=True)], dim=-1)
        if slots is not None:
            scores = scores.masked_fill(~slots, float("-inf"))
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (B, G, H/G, S + 1)
        out = p[..., :S] @ buf_v + p[..., S:] * v.view(B, G, 1, D)  # (B, G, H/G, D)
    buf_k[:, :, ring] = k[:, :, 0]
    buf_v[:, :, ring] = v[:, :, 0]
    return out.view(B, H, 1, D)


def decode_layers(model: DiffusionModel, x: Tensor, positions: Tensor, cache: KVCache, start: int,
                  masks: dict[bool, Tensor | None], quant: bool, *, halves: tuple[Any, Any] | None = None) -> Tensor:
    """The encoder's layers for one token a row: x (B, M) at `positions` (B,), cache filled to `start`; `masks`
    by sliding-ness: the keys' padding (B, 1, 1, S) bool or None. Returns the last hidden states (B, M).
    `halves`: (pre, post) to run; by default the compiled ones where `model.decode_compile` has them ready."""
    compiler = model.decode_compile
    if halves is None and compiler is not None and not (quant and model.decode_int8 in ("dynamic", "q8")):
        halves = compiler.ready_or_start(model)
        if compiler.ready:
            with torch.compiler.set_stance(compiler.stance):
                return _layers(model, x, positions, cache, start, masks, quant, halves)
    return _layers(model, x, positions, cache, start, masks, quant, halves or (pre_attention, post_attention))


def _layers(model: DiffusionModel, x: Tensor, positions: Tensor, cache: KVCache, start: int,
            masks: dict[bool, Tensor | None], quant: bool, halves: tuple[Any, Any]) -> Tensor:
    pre, post = halves
    n_tail = cache.sliding_len()
    # Eager steps of fewer (row, expert) pairs than experts run only the picked ones; compiled graphs run all.
    cfg = model.config
    sparse = post is post_attention and x.shape[0] * cfg.top_k_experts < cfg.num_experts
    ring_size = 0
    shared = cache.shared  # rows that are copies of one context: the attention reads those slots once a group
    ropes: dict[bool, tuple[Tensor, Tensor]] = {}
    for i, layer in enumerate(model.blocks):
        attn, eps = layer.attn, layer.eps
        if attn.sliding not in ropes:
            ropes[attn.sliding] = _rope(attn, positions, x.dtype)
        cos, sin = ropes[attn.sliding]
        q, k, v = pre(x, layer.input_layernorm, _lin(attn.qkv, attn.qkv_int8, quant), _qk_norm_weight(attn), cos,
                      sin, heads=attn.n_heads, kv_heads=attn.n_kv, has_v=attn.has_v, eps=eps)
        lkv = cache.layers[i]
        share = None if shared is None else shared.attend_slots(lkv.sliding)
        if lkv.sliding and n_tail == lkv.k.shape[2]:  # the window is full: use its buffers as a ring
            out = _ring_attend(q, k, v, lkv.k, lkv.v, cache.ring, masks[True], share)
            ring_size = n_tail
        else:
            keys, values = _cache_step(cache, i, k, v, start, n_tail)
            out = attend_one(q, keys, values, masks[attn.sliding], share)
        x = post(x, out.reshape(x.shape[0], -1), _lin(attn.o_proj, attn.o_proj_int8, quant),
                 _lin(layer.mlp_gate_up, layer.mlp_gate_up_int8, quant),
                 _lin(layer.mlp_down, layer.mlp_down_int8, quant),
                 (layer.post_attention_layernorm, layer.pre_feedforward_layernorm, layer.pre_feedforward_layernorm_2,
                  layer.post_feedforward_layernorm_1, layer.post_feedforward_layernorm_2,
                  layer.post_feedforward_layernorm),
                 (layer.router_proj, layer.router_scale, layer.per_expert_scale),
                 (layer.experts_gate_up, layer.experts_down), layer.encoder_scalar, top_k=layer.top_k, eps=eps,
                 sparse=sparse, routed_on=_routed_on(layer))
    if ring_size:  # this token took the oldest slot of every sliding layer
        cache.ring_written(cache.ring)
        cache.ring = (cache.ring + 1) % ring_size
    return x


class DecodeCompiler:
    """`torch.compile`d `pre_attention` / `post_attention` for one process (inductor, CPU or wherever the model
    is), compiled on a background thread the first time a step asks for them (`ready_or_start`) or when `warm`
    is called (`background=False`: only then); steps run eagerly until then. `compile_s` is the wall time the
    warm-up took (None until done), `error` what stopped it (the step then stays eager for good)."""

    def __init__(self, *, background: bool = True) -> None:
        # Variants a process may need: {sliding, full} x {fp32, int8} x {batch 1, dynamic batch} of the first half.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
        self.pre: Any = torch.compile(pre_attention, dynamic=None, fullgraph=True)
        self.post: Any = torch.compile(post_attention, dynamic=None, fullgraph=True)
        # Once warm, a step whose shapes no graph covers runs eagerly rather than stall on a recompile ("default":
        # recompile, as the benchmark wants).
        self.stance = "eager_on_recompile"
        self.background = background  # False: only an explicit `warm` compiles
        self.compile_s: float | None = None
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self.compile_s is not None

    def ready_or_start(self, model: DiffusionModel) -> tuple[Any, Any]:
        """The compiled halves when ready; else the eager ones, starting the background warm-up once."""
        if self.ready:
            return self.pre, self.post
        with self._lock:
            if self._thread is None and self.error is None and self.background:
                self._thread = threading.Thread(target=self.warm, args=(model,), name="decode-compile", daemon=True)
                self._thread.start()
        return pre_attention, post_attention

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the warm-up ends (or `timeout` s); True when the compiled halves are ready."""
        t = self._thread
        if t is not None:
            t.join(timeout)
        return self.ready

    def warm(self, model: DiffusionModel, batches: tuple[int, ...] = (1, 2)) -> None:
        """Compile by running one step's worth of layers on a scratch cache at each batch size of `batches` (two
        sizes: inductor then makes the batch dimension dynamic, so later sizes reuse the graphs)."""
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                for B in batches:
                    cache = model.new_cache(B, 2)
                    ids = torch.full((B, 1), int(model.config.bos_token_id or 0), device=model.device)
                    x = model.embed_tokens(ids)[:, 0]
                    quant = model.decode_int8 == "weight" and B <= _decode_rows()
                    _run_compiled(self, model, x, cache, quant)
        except Exception as e:  # noqa: BLE001 - any compiler failure leaves the eager step in place
            self.error = f"{type(e).__name__}: {e}"
            return
        self.compile_s = time.perf_counter() - t0


def compile_setting(choice: str | None = None) -> bool:
    """Whether decode steps go through `torch.compile`: `choice`, else `DCANVAS_DECODE_COMPILE` ("on" / "off";
    unset: off)."""
    raw = (DECODE_COMPILE.text() if choice is None else choice).strip().lower()
    if raw in ("", "off", "0", "no"):
        return False
    if raw in ("on", "1", "yes"):
        return True
    raise ValueError(f"{DECODE_COMPILE} must be 'on' or 'off', got {raw!r}")


def attach_compiler(model: DiffusionModel, *, warm: bool = True) -> DecodeCompiler:
    """Give `model` a `DecodeCompiler` and (`warm`) start compiling on a background thread now, so the graphs
    are likely ready by the first AR fill; steps run eagerly meanwhile."""
    compiler = DecodeCompiler()
    model.decode_compile = compiler
    if warm:
        compiler.ready_or_start(model)
    return compiler


def _decode_rows() -> int:
    from canvas.model.int8 import DECODE_ROWS

    return DECODE_ROWS


def _run_compiled(compiler: DecodeCompiler, model: DiffusionModel, x: Tensor, cache: KVCache, quant: bool) -> None:
    """One step's layers through the compiled halves on a scratch cache (warm-up; the cache is thrown away)."""
    positions = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    decode_layers(model, x, positions, cache, 0, {False: None, True: None}, quant,
                  halves=(compiler.pre, compiler.post))


__all__ = ["DecodeCompiler", "attach_compiler", "attend_one", "compile_setting", "decode_layers",
           "post_attention", "pre_attention"]
