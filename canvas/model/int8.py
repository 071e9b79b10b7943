"""Int8 matmuls for the encoder's decode steps: the few-row passes of AR decoding read 4x fewer weight bytes.

Owns `Int8Linear` (one weight, quantised once: per output channel, or per block of 32 of a channel under "q8"),
`int8_weight_mm` (its "weight" matmul as plain aten ops, for the compiled decode step), `quantize_decode`
(attaches them to a model's dense projections and its LM head), `decode_scheme` (the `DCANVAS_DECODE_INT8`
setting), `scheme_for` (what a served model gets: "auto", the default, is "q8" for fp32 models of
`AUTO_MIN_PARAMS` parameters or more), `q8_mm`,
`decode_copies` / `restore_decode` (swap two schemes' copies in a benchmark), `DECODE_ROWS`, `ROW_LIMITS` and
`row_limit`.

Why: a decode step multiplies one row (or a few) by every weight, so it is bound by reading them: fp32 is ~560 MB
a token for the converted Gemma-3-270M. And fp32 GEMMs with a few rows run far below memory speed on x86 (a
vocabulary-sized head at 8 rows costs several times its one-row time), which makes the batched step cost nearly what
8 steps do.

Schemes (fp32 models only; a bf16 model keeps its own path):
- "weight": weight-only int8 (`aten._weight_int8pack_mm`) with bf16 activations, every projection. The kernel needs
  the reduced dimension to be a multiple of 16 (torch 2.13 returns garbage or crashes otherwise), so such weights are
  stored zero-padded and their inputs padded to match. The closer of the two to fp32.
- "q8" (what "auto" picks where the kernel builds): `kernels.q8_gemm`, llama.cpp's Q8_0 on both sides: int8
  weights with a bf16 scale per block of 32 of a channel, activations quantised at run time to int8 per block of 32
  along K (an outlier coarsens only its block; the attention output's negligible weight columns are masked out
  first, see `quantize_decode`), int32 dot products (AVX-512 VNNI, an AVX2 and a scalar path), every projection and
  the head; a C++ extension built once per machine. Faster than "weight" at one row and far more at eight (it reads
  each weight tile once for all rows), and faster than fp32 at prefill's hundreds of rows, so it serves prefill
  too (`ROW_LIMITS`). Probe NLL per character against fp32 on the default build, by kind: 1.0015-1.0036x, under
  the 1.005x gate (one weight scale per channel was 1.0034-1.0062x, over it on news and code; BENCHMARKS.md,
  issue 31).
- "dynamic": fbgemm's dynamic int8 linear (int8 weights per output channel, activations quantised to 8 bits per
  tensor at run time, int32 accumulation: VNNI on AVX-512) for q/k/v, the dense MLP and the head; faster, at one row
  and far more at eight. The attention output keeps weight-only int8: its outliers make one scale per tensor
  useless (on the converted Gemma-3-270M, dynamic there alone moves top-1 on every position). Even so it is far
  from fp32 on that model (24 decode steps of English text, teacher-forced: mean KL 0.06 nats, top-1 79 %; "weight":
  0.004 nats, 92 %): an option to measure, not to serve, until per-channel activation scales tame the outliers.
Invariants: only encoder passes of at most `ROW_LIMITS[scheme]` rows (batch x tokens) use them
(`DiffusionModel.int8_for` decides, for `encode` and the seam scorer's read-only pass: decode steps for "weight" and
"dynamic", prefill too for "q8"); the denoiser and training keep the model's dtype and exact numerics. The int8 copies
live beside the fp32 weights (about a quarter more memory) and are rebuilt by calling `quantize_decode` again
after the weights change. Fidelity is measured, not assumed: `dcanvas bench ar --int8 SCHEME` reports the top-1
agreement and KL of int8 decode steps against fp32 on the same prefix, `dcanvas model check --only probes --int8
SCHEME` the NLL per character on the probe set against fp32 (the gate "auto" was chosen by: 1.005x).
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from canvas.env import DECODE_INT8
from kernels import q8_gemm

if TYPE_CHECKING:
    from canvas.model.model import DiffusionModel

Scheme = Literal["dynamic", "weight", "q8"]
SCHEMES: tuple[Scheme, ...] = ("dynamic", "weight", "q8")
# Passes of at most this many rows use the int8 weights: AR steps of a few sequences, not prefill or a canvas.
DECODE_ROWS = 16
# ... per scheme (`DiffusionModel.encode` reads it unless `int8_rows` overrides it). "weight" and "dynamic": decode
# steps only (their kernels lose to fp32's oneDNN GEMM at many rows, and prefill keeps exact fp32). "q8": every
# `encode` pass, prefill included: its VNNI kernel beats fp32 at every row count measured (`python -m
# kernels.cpu_bench`; BENCHMARKS.md, "Kernels"), and its fidelity bound is measured with every pass through it
# (`dcanvas model check --int8 q8`); where the kernel is built without VNNI (an AVX2-only CPU) only passes of few
# rows (`row_limit`). The denoiser and training never use int8.
ROW_LIMITS: dict[Scheme, int] = {"weight": DECODE_ROWS, "dynamic": DECODE_ROWS, "q8": 1 << 30}
# "q8" without VNNI: up to about here it beats oneDNN's fp32 GEMM on AVX2 code paths, projection by projection (the
# measured crossover: BENCHMARKS.md, "AR decoding vs llama.cpp"), which covers the AR rows of a few users' drafts.
Q8_AVX2_ROWS = 32


def row_limit(scheme: Scheme) -> int:
    """The most rows an encoder pass may have to run on `scheme`'s int8 weights on this machine: `ROW_LIMITS`, but
    "q8" only up to `Q8_AVX2_ROWS` where its kernel lacks VNNI: the AVX2 path multiplies by int16 pairs, so oneDNN's
    fp32 GEMM beats it at prefill's row counts (BENCHMARKS.md, "AR decoding vs llama.cpp")."""
    if scheme == "q8" and q8_gemm.build_isa() != "avx512_vnni":
        return Q8_AVX2_ROWS
    return ROW_LIMITS[scheme]


_PACK_MULTIPLE = 16  # `_weight_int8pack_mm`'s reduced dimension must be a multiple of this


class Int8Linear:
    """`F.linear(x, weight)` for x (..., K) fp32 -> (..., N) fp32 through int8 weights (see the module docstring)."""

    def __init__(self, weight: Tensor, scheme: Scheme) -> None:
        if weight.dim() != 2 or weight.dtype != torch.float32:
            raise ValueError(f"Int8Linear takes a 2-D fp32 weight, got {tuple(weight.shape)} {weight.dtype}")
        if scheme not in SCHEMES:
            raise ValueError(f"int8 scheme must be one of {SCHEMES}, got {scheme!r}")
        self.scheme: Scheme = scheme
        self.out_features, self.in_features = weight.shape
        w = weight.detach()
        # Symmetric per-output-channel scales; an all-zero row keeps scale 1 (any scale represents it exactly).
        amax = w.abs().amax(dim=1)  # (N,)
        scale = (amax / 127).masked_fill_(amax == 0, 1.0)  # (N,)
        self._packed: Any = None
        self._kmask: Tensor | None = None
        if scheme == "q8":
            self._q, self._scale = q8_gemm.quantize_weight(w)  # (G, Kp / 4, 64) uint8 (q + 128), (Kp / 32, N) bf16
            self._kmask = q8_gemm.live_columns(w)  # (K,) or None: negligible columns' activations kept out of q8
            self._pad = 0
        elif scheme == "dynamic":
            with warnings.catch_warnings():  # quantised tensors are deprecated as a user API; fbgemm's op is not
                warnings.simplefilter("ignore", UserWarning)
                qw = torch.quantize_per_channel(w, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0,
                                                torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qw, None)
        else:
            q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # (N, K); in place: start-up time
            self._pad = -self.in_features % _PACK_MULTIPLE
            self._q = F.pad(q, (0, self._pad)) if self._pad else q.contiguous()  # (N, K + pad)
            self._scale = scale.to(torch.bfloat16)

    def __call__(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)  # (R, K)
        if self.scheme == "dynamic":
            out = torch.ops.quantized.linear_dynamic(flat.contiguous(), self._packed, True)  # reduce_range
        elif self.scheme == "q8":
            out = q8_mm(flat, self._q, self._scale, self._kmask)
        else:
            out = int8_weight_mm(flat, self._q, self._scale, self._pad)
        return out.view(*lead, self.out_features)

    def weight_tensors(self) -> tuple[Tensor, Tensor, int, Tensor | None] | None:
        """(int8 weight (N, K + pad), bf16 scales (N,), pad, None) of the "weight" scheme, for `int8_weight_mm`;
        under "q8" (packed uint8 weight, bf16 block scales (Kp / 32, N), 0, live-column mask or None), for `q8_mm`
        (the weight's dtype tells them apart); None under "dynamic" (its packed weight is an opaque object)."""
        return None if self.scheme == "dynamic" else (self._q, self._scale, self._pad, self._kmask)


def int8_weight_mm(x: Tensor, q: Tensor, scale: Tensor, pad: int) -> Tensor:
    """x (R, K) fp32 @ the "weight" scheme's int8 weight q (N, K + pad) with per-channel bf16 `scale` -> (R, N)
    fp32: bf16 activations, zero-padded to the kernel's multiple of 16. Plain aten ops, so `torch.compile` can
    trace it."""
    xb = x.to(torch.bfloat16)
    if pad:
        xb = F.pad(xb, (0, pad))
    return torch.ops.aten._weight_int8pack_mm(xb, q, scale).float()


_q8_kernel = functools.cache(q8_gemm.kernel)  # the built kernel's entry point (or None), looked up once per process


def q8_mm(x: Tensor, wq: Tensor, wscale: Tensor, kmask: Tensor | None = None) -> Tensor:
    """x (R, K) fp32 @ the "q8" scheme's weight (`kernels.q8_gemm.quantize_weight`'s layout; `kmask` from
    `live_columns`) -> (R, N) fp32: the C++ kernel where it built, else its torch reference (`q8_linear` warns
    once)."""
    fn = _q8_kernel()
    if fn is None:
        return q8_gemm.q8_linear(x, wq, wscale, kmask=kmask)
    out: Tensor = fn(x.contiguous(), wq, wscale, kmask)
    return out


def decode_scheme(choice: str | None = None) -> Scheme | None:
    """The int8 scheme an explicit setting names: `choice`, else `DCANVAS_DECODE_INT8` ("dynamic", "weight"; "",
    "off" or unset: none). What a model gets by default is `scheme_for`'s rule."""
    raw = (DECODE_INT8.text() if choice is None else choice).strip().lower()
    if raw in ("", "off", "none", "0"):
        return None
    if raw not in SCHEMES:
        raise ValueError(f"{DECODE_INT8} must be one of {('auto', 'off', *SCHEMES)}, got {raw!r}")
    return "dynamic" if raw == "dynamic" else "q8" if raw == "q8" else "weight"


# "auto" (the default) gives int8 decode weights to fp32 models of at least this many parameters: there
# the int8 step is the faster one and its fidelity was measured (probe NLL per character within 0.5 % of fp32 on the
# converted Gemma-3-270M; BENCHMARKS.md, issue 31). Smaller models (the embedded canvas-6m,
# the test presets) keep exact fp32, as `canvas.model.cpu` keeps them out of bf16.
AUTO_MIN_PARAMS = 50_000_000


def scheme_for(model: DiffusionModel, choice: str | None = None) -> Scheme | None:
    """The int8 decode scheme `model` gets: `choice`, else `DCANVAS_DECODE_INT8`; "auto" or unset: "q8" (or "weight"
    where the C++ kernel does not build) for an fp32 model of at least `AUTO_MIN_PARAMS`
    parameters, none otherwise. A non-fp32 model never gets one."""
    raw = (DECODE_INT8.text() if choice is None else choice).strip().lower()
    if model.dtype != torch.float32:
        decode_scheme(raw if raw != "auto" else "")  # still reject a malformed setting
        return None
    if raw in ("", "auto"):
        if sum(p.numel() for p in model.parameters()) < AUTO_MIN_PARAMS:
            return None
        # q8 where its kernel builds (faster, and within the probe bound: NLL/char 1.0015-1.0036x fp32 by kind on
        # the default build; BENCHMARKS.md, issue 31); its torch reference would be far slower than "weight" where
        # it does not.
        return "q8" if q8_gemm.available() else "weight"
    return decode_scheme(raw)


def quantize_decode(model: DiffusionModel, scheme: Scheme | None) -> DiffusionModel:
    """Attach int8 copies of every layer's q/k/v, output, dense gate/up and down projections and of the LM head to
    `model` (in place, returned), or drop them (`scheme` None). The attention output is weight-only under the "dynamic"
    scheme (see the module docstring). The routed experts stay as they are: one small expert a token, a few percent
    of a step's bytes."""
    if scheme is not None and model.dtype != torch.float32:
        raise ValueError(f"int8 decode needs an fp32 model, this one is {model.dtype}")
    with torch.no_grad():
        for layer in model.blocks:
            layer.attn.qkv_int8 = None if scheme is None else Int8Linear(layer.attn.qkv, scheme)
            # The attention output: q8 keeps the converted Gemma's value-anchor dims (large activations under
            # negligible weight columns) out of its blocks' scales (`live_columns`), which without it
            # cost the probe bound (news NLL/char 1.099x fp32); with it the probe NLL is within 0.0005x of
            # weight-only int8's here on every kind, lower on news and code (BENCHMARKS.md, issue 31). "dynamic"
            # keeps it weight-only: those outliers defeat fbgemm's per-tensor activation scale.
            o_scheme: Scheme = "q8" if scheme == "q8" else "weight"
            layer.attn.o_proj_int8 = None if scheme is None else Int8Linear(layer.attn.o_proj, o_scheme)
            layer.mlp_gate_up_int8 = None if scheme is None else Int8Linear(layer.mlp_gate_up, scheme)
            layer.mlp_down_int8 = None if scheme is None else Int8Linear(layer.mlp_down, scheme)
        model.head_int8 = None if scheme is None else Int8Linear(model.embed, scheme)
    model.decode_int8 = scheme
    return model


DecodeCopies = tuple[list[tuple[Any, ...]], Any, Any]


def decode_copies(model: DiffusionModel) -> DecodeCopies:
    """The int8 copies `quantize_decode` attached (and the scheme), to put back later with `restore_decode`: a
    benchmark keeps two schemes' copies and swaps them between runs instead of quantising again."""
    layers = [(b.attn.qkv_int8, b.attn.o_proj_int8, b.mlp_gate_up_int8, b.mlp_down_int8) for b in model.blocks]
    return layers, model.head_int8, model.decode_int8


def restore_decode(model: DiffusionModel, copies: DecodeCopies) -> None:
    """Put back what `decode_copies` took (same model)."""
    layers, model.head_int8, model.decode_int8 = copies
    for b, (qkv, o, gu, down) in zip(model.blocks, layers, strict=True):
        b.attn.qkv_int8, b.attn.o_proj_int8, b.mlp_gate_up_int8, b.mlp_down_int8 = qkv, o, gu, down
