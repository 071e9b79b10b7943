"""CPU kernel benchmark: the Q8 GEMM, the fused RMSNorm, the activations and the decode attention against what they
replace, at Gemma-3-270M's shapes.

Run: `python -m kernels.cpu_bench [--threads N] [--reps R] [--json]`. For each projection of the converted
Gemma-3-270M (q/k/v 1548x640, attention output 640x1032, MLP gate/up 4096x640 and down 640x2048, the 96k head
98304x640) at M = 1, 8 and 256 rows it times, interleaved rep by rep (so load on a shared machine falls on all
alike): `q8_linear` (C++), torch's weight-only int8 (`aten._weight_int8pack_mm`, bf16 activations: the "weight"
decode scheme) and fp32 `F.linear`, and where the CPU has AMX the same q8 call with the tiles off (its VNNI path,
"vnni"); then the decode step's norm (8 rows of 640) fused against torch's, and the
gated GELU (gate/up of 2 x 2048) and the logit soft-cap (98304 logits) at 1 and 16 rows against torch's, and the
decode step's attention (`kernels.attend_cpu`, 4 query heads over 1 KV head of 256, 290 cached keys and the ring's
own) for one row, 8 drafts sharing one context and 8 distinct rows against its torch reference, and the drafts' token
draw (`kernels.sample_cpu`: 1 and 8 rows of 98304 logits, 7 bans a row) against its torch reference. Reports the
median and best ms of each, the weight GB/s of the best (weight bytes / time: how near memory speed a few-row
call runs) and the speed-up of q8 over the others. The table goes to stdout; the last line is one JSON object
(CPU flags, ISA built, torch, threads, git sha, rows). Checks q8 and the attention against their references (exit 1
if off, or if a draw differs).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kernels import attend_cpu
from kernels._cpp import build_isa
from kernels.act_cpu import gelu_mul, gelu_mul_ref, softcap_, softcap_ref
from kernels.attend_cpu import attend_one
from kernels.bench import git_sha
from kernels.q8_gemm import available, q8_linear, q8_linear_ref, quantize_weight, use_amx
from kernels.rmsnorm_cpu import rms_norm_fused
from kernels.sample_cpu import draw_tokens, draw_tokens_ref

__all__ = ["SHAPES", "main"]

# (name, N, K) of the converted Gemma-3-270M (96k build): head_dim 258, 4 query heads, 1 KV head.
SHAPES = [("qkv", 1548, 640), ("o_proj", 640, 1032), ("gate_up", 4096, 640), ("down", 640, 2048),
          ("head", 98304, 640)]


def _interleaved(fns: dict[str, Callable[[], Any]], reps: int,
                 prepare: Callable[[str], Any] | None = None) -> dict[str, list[float]]:
    """Each of `fns` `reps` times, rep by rep, in ms; `prepare(name)` runs untimed before each call."""
    for k, fn in fns.items():
        if prepare is not None:
            prepare(k)
        fn()  # warm-up: packing, allocator, thread pool
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            if prepare is not None:
                prepare(k)
            t0 = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return times


def _fns(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, xb: torch.Tensor, w8: torch.Tensor,
         s8: torch.Tensor) -> dict[str, Callable[[], Any]]:
    return {"q8": lambda: q8_linear(x, wq, ws, impl="cpp"),
            "int8pack": lambda: torch.ops.aten._weight_int8pack_mm(xb, w8, s8),
            "fp32": lambda: F.linear(x, w)}


def _amx_off_for_vnni(name: str) -> None:
    use_amx(name != "vnni")


def _act_fns(gu: torch.Tensor, logits: torch.Tensor) -> dict[str, Callable[[], Any]]:
    return {"gelu_cpp": lambda: gelu_mul(gu, impl="cpp"), "gelu_torch": lambda: gelu_mul_ref(gu),
            "softcap_cpp": lambda: softcap_(logits, 30.0, impl="cpp"),
            "softcap_torch": lambda: softcap_ref(logits, 30.0)}


def _attention(reps: int, g: torch.Generator) -> list[dict[str, Any]]:
    """The decode step's attention, C++ against the torch reference: one row, the 8 drafts of one context (their
    cached slots shared: read once for the 32 query heads) and 8 rows of distinct contexts."""
    out = []
    H, G, S, D = 4, 1, 290, 256
    raw = attend_cpu.kernel()  # the entry point the decode step calls (no validation per call)
    assert raw is not None
    for case, B, shared in (("1 row", 1, False), ("8 drafts", 8, True), ("8 rows", 8, False)):
        q = torch.randn(B, H, D, generator=g)
        k, v = torch.randn(B, G, S, D, generator=g), torch.randn(B, G, S, D, generator=g)
        share = None
        if shared:
            k[:], v[:] = k[:1].clone(), v[:1].clone()
            share = (torch.zeros(B, dtype=torch.long), 0, S)
        ek, ev = torch.randn(B, G, D, generator=g), torch.randn(B, G, D, generator=g)
        mask = torch.ones(B, S + 1, dtype=torch.bool)
        ref = attend_one(q, k, v, mask, ek, ev, share, impl="ref")
        err = float((attend_one(q, k, v, mask, ek, ev, share, impl="cpp") - ref).abs().max() / ref.abs().max())
        leader, lo, hi = share if share is not None else (None, 0, 0)
        t = _interleaved({"cpp": functools.partial(raw, q, k, v, mask, ek, ev, leader, lo, hi),
                          "torch": functools.partial(attend_one, q, k, v, mask, ek, ev, share, impl="ref")},
                         reps * 20)
        out.append({"case": case, "rows": B, "keys": S, "rel_err": err,
                    **{f"{n}_best_us": min(ts) * 1e3 for n, ts in t.items()}})
    return out


def _draws(reps: int, g: torch.Generator) -> list[dict[str, Any]]:
    """The drafts' token draw (temperature 0.8, no min-p), C++ against the torch reference, on 1 and 8 rows."""
    out = []
    for K in (1, 8):
        logits, u = torch.randn(K, 98304, generator=g) * 4, torch.rand(K, generator=g)
        bans = [[0, 1, 2, 3, 4, 5, 6 + k] for k in range(K)]
        same = bool(torch.equal(draw_tokens(logits, u, 0.8, 0.0, bans, impl="cpp")[0],
                                draw_tokens_ref(logits, u, 0.8, 0.0, bans)[0]))
        t = _interleaved({"cpp": lambda: draw_tokens(logits, u, 0.8, 0.0, bans, impl="cpp"),  # noqa: B023
                          "torch": lambda: draw_tokens_ref(logits, u, 0.8, 0.0, bans)}, reps * 4)  # noqa: B023
        out.append({"rows": K, "same_tokens": same, **{f"{n}_best_us": min(ts) * 1e3 for n, ts in t.items()},
                    **{f"{n}_median_us": statistics.median(ts) * 1e3 for n, ts in t.items()}})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--rows", default="1,8,256")
    p.add_argument("--json", action="store_true", help="only the JSON line")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not available():
        raise SystemExit("kernels.cpu_bench: the C++ kernels did not build here (see kernels._cpp.build_error)")
    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    ok = True
    amx = use_amx(True)
    for name, N, K in SHAPES:
        w = torch.randn(N, K, generator=g) * 0.05
        wq, ws = quantize_weight(w)
        w8 = ((w / (w.abs().amax(1, keepdim=True) / 127)).round().clamp(-127, 127).to(torch.int8))
        pad = -K % 16  # _weight_int8pack_mm's K multiple
        w8 = F.pad(w8, (0, pad)).contiguous()
        s8 = (w.abs().amax(1) / 127).to(torch.bfloat16)
        for M in (int(r) for r in args.rows.split(",")):
            x = torch.randn(M, K, generator=g)
            ref = q8_linear_ref(x, wq, ws)
            err = float((q8_linear(x, wq, ws, impl="cpp") - ref).abs().max()) / max(1e-9, float(ref.abs().max()))
            ok &= err < 1e-4
            xb = F.pad(x.bfloat16(), (0, pad))
            fns = _fns(x, w, wq, ws, xb, w8, s8)
            t = _interleaved(fns, args.reps)
            if amx:  # the same q8 call with and without the tiles (`_amx_off_for_vnni`, untimed), as a pair of their
                # own: after the fp32 call the next one runs on a cold cache
                both = _interleaved({"q8": fns["q8"], "vnni": fns["q8"]}, args.reps, _amx_off_for_vnni)
                t |= {"q8_amx": both["q8"], "vnni": both["vnni"]}
            best = {k: min(v) for k, v in t.items()}
            rows.append({"op": name, "N": N, "K": K, "M": M, "rel_err": err,
                         **{f"{k}_ms": statistics.median(v) for k, v in t.items()},
                         **{f"{k}_best_ms": b for k, b in best.items()},
                         "q8_weight_gb_s": N * K / (best["q8"] * 1e-3) / 1e9,
                         "q8_vs_int8pack": best["int8pack"] / best["q8"], "q8_vs_fp32": best["fp32"] / best["q8"],
                         **({"q8_vs_vnni": best["vnni"] / best["q8_amx"]} if amx else {})})
    use_amx(amx)  # the last call above may have been the VNNI one
    x, res, nw, sc = torch.randn(8, 640), torch.randn(8, 640), torch.randn(640), torch.tensor([0.5])
    t = _interleaved({"fused": lambda: rms_norm_fused(x, nw, 1e-6, res, sc, impl="cpp"),
                      "torch": lambda: (res + F.rms_norm(x, (640,), nw, 1e-6)) * sc}, args.reps * 20)
    norm = {"op": "rms_norm+add+scale 8x640", **{f"{k}_best_us": min(v) * 1e3 for k, v in t.items()}}
    acts = []
    for M in (1, 16):
        gu, logits = torch.randn(M, 4096, generator=g), torch.randn(M, 98304, generator=g) * 10
        t = _interleaved(_act_fns(gu, logits), args.reps * 4)
        acts.append({"rows": M, **{f"{k}_best_us": min(v) * 1e3 for k, v in t.items()}})
    attention = _attention(args.reps, g)
    ok &= all(a["rel_err"] < 1e-5 for a in attention)
    draws = _draws(args.reps, g)
    ok &= all(d["same_tokens"] for d in draws)
    out = {"isa": build_isa(), "amx": amx, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "git_sha": git_sha(), "checks_ok": ok, "rows": rows, "norm": norm, "activations": acts,
           "attention": attention, "draws": draws}
    if not args.json:
        print(f"{'op':<8} {'N':>6} {'K':>5} {'M':>4} {'q8 ms':>8} {'int8pack':>9} {'fp32':>8} {'q8 GB/s':>8} "
              f"{'vs int8pack':>11} {'vs fp32':>8}{' vs no-AMX' if amx else ''}  (best of {args.reps}, interleaved; "
              "medians in the JSON)")
        for r in rows:
            print(f"{r['op']:<8} {r['N']:>6} {r['K']:>5} {r['M']:>4} {r['q8_best_ms']:>8.3f} "
                  f"{r['int8pack_best_ms']:>9.3f} {r['fp32_best_ms']:>8.3f} {r['q8_weight_gb_s']:>8.1f} "
                  f"{r['q8_vs_int8pack']:>10.2f}x {r['q8_vs_fp32']:>7.2f}x"
                  + (f" {r['q8_vs_vnni']:>8.2f}x" if amx else ""))
        print(f"norm, 8 rows of 640 with residual and scale: fused {norm['fused_best_us']:.1f} us, "
              f"torch {norm['torch_best_us']:.1f} us")
        for a in acts:
            print(f"{a['rows']:>2} rows: gelu(gate) * up of 2 x 2048: C++ {a['gelu_cpp_best_us']:.1f} us, torch "
                  f"{a['gelu_torch_best_us']:.1f} us; soft-cap of 98304 logits: C++ {a['softcap_cpp_best_us']:.1f} us, "
                  f"torch {a['softcap_torch_best_us']:.1f} us")
        for a in attention:
            print(f"attention, {a['case']} ({a['rows']} x 4 query heads, {a['keys']} + 1 keys): C++ "
                  f"{a['cpp_best_us']:.1f} us, torch {a['torch_best_us']:.1f} us")
        for d in draws:
            print(f"token draw, {d['rows']} x 98304 logits: C++ {d['cpp_best_us']:.1f} us (median "
                  f"{d['cpp_median_us']:.1f}), torch {d['torch_best_us']:.1f} us (median {d['torch_median_us']:.1f})")
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
