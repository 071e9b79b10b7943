"""Kernel benchmark: correctness at the real shapes, then Triton kernel vs torch reference vs torch.compile(reference).

Run: `python -m kernels.bench [--json] [--no-compile]` (or `dcanvas bench kernels`). On CUDA it
1. measures the device's copy bandwidth (1 GiB device-to-device copy) and bf16 matmul rate (8192^3);
2. checks every Triton kernel against its reference on random data at the DiffusionGemma 26B-A4B text shapes;
3. times each op with `triton.testing.do_bench` (median of runs with the L2 flushed; p20/p80 kept in the JSON)
   and reports ms, GB/s (ideal bytes: each input read once, each output written once) with % of the measured
   copy bandwidth, TFLOP/s with % of the measured matmul rate, and the extra device memory one call allocates.
The table goes to stdout, then one JSON line (GPU, torch, triton, git sha, shapes, rows) is the last line; `--json`
prints only that line. Exit status 1 if a correctness check fails. Expected wall time on one H100/H200: about
2-4 minutes, most of it `torch.compile`; a budget check skips the remaining compile baselines past 6 minutes.

Without CUDA it says so, times the references only at tiny shapes with `time.perf_counter` and exits 0.

Shapes (`BenchShapes.real`): hidden 2816, 128 experts, top-8, moe_intermediate_size 704, vocab 262144, canvas 256,
final-logit softcap 30, from the `text_config` of google/diffusiongemma-26B-A4B-it (copies of its config.json in
public repositories, found with the search tool; the same numbers as google/gemma-4-26B-A4B-it) and transformers
5.23.0 `DiffusionGemmaConfig` (canvas_length 256, vocab 262144). The transformers class defaults are a smaller model.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kernels._triton import HAS_TRITON
from kernels.moe import expert_ffn, fused_moe, fused_moe_ref
from kernels.rmsnorm import rms_norm_add, rms_norm_add_ref
from kernels.sampler_step import sampler_step, sampler_step_ref
from kernels.soft_embed import soft_embedding, soft_embedding_ref

__all__ = ["BenchShapes", "add_arguments", "build_cases", "git_sha", "main", "run"]

_COMPILE_BUDGET_S = 360.0  # stop adding torch.compile baselines after this much wall time


@dataclass(frozen=True, slots=True)
class BenchShapes:
    """Problem sizes. `real` = DiffusionGemma 26B-A4B text config (see module docstring); `tiny` = CPU smoke run."""

    tokens: int = 256  # one canvas of 256 slots at batch 1 (canvas_length)
    hidden: int = 2816
    experts: int = 128
    top_k: int = 8
    moe_inter: int = 704
    vocab: int = 262144
    softcap: float = 30.0  # final_logit_softcapping

    def __post_init__(self) -> None:
        for name in ("tokens", "hidden", "experts", "top_k", "moe_inter", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k {self.top_k} exceeds experts {self.experts}")

    @classmethod
    def real(cls) -> BenchShapes:
        return cls()

    @classmethod
    def tiny(cls) -> BenchShapes:
        return cls(tokens=16, hidden=64, experts=8, top_k=2, moe_inter=32, vocab=1024)


@dataclass(slots=True)
class Row:
    op: str
    impl: str
    ms: float | None
    p20_ms: float | None = None
    p80_ms: float | None = None
    gbps: float | None = None
    pct_bw: float | None = None
    tflops: float | None = None
    pct_mm: float | None = None
    extra_mb: float | None = None
    note: str = ""


@dataclass(slots=True)
class Case:
    """One op at one shape: the callables to time, and its ideal bytes and FLOPs."""

    op: str
    impls: dict[str, Callable[[], Any]]
    bytes: float
    flops: float
    check: Callable[[], str] | None = None  # returns "" when the kernel matches the reference, else a reason


def _moe_inputs(s: BenchShapes, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(s.tokens, s.hidden, device=device, generator=g).to(dtype)
    router = torch.randn(s.tokens, s.experts, device=device, generator=g)
    top_w, top_ids = router.softmax(-1).topk(s.top_k, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    wgu = (torch.randn(s.experts, 2 * s.moe_inter, s.hidden, device=device, generator=g) / s.hidden**0.5).to(dtype)
    wd = (torch.randn(s.experts, s.hidden, s.moe_inter, device=device, generator=g) / s.moe_inter**0.5).to(dtype)
    return x, top_w.float(), top_ids, wgu, wd


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def build_cases(s: BenchShapes, device: str, *, with_triton: bool, compile_ref: bool) -> list[Case]:
    """The four ops at shapes `s` on `device`: ref always, Triton (and its check) and compiled ref on request."""
    on_gpu = with_triton
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # bf16 is emulated, ~250x slower, on CPU
    item = torch.tensor([], dtype=dtype).element_size()
    cases: list[Case] = []

    # fused MoE
    x, w, ids, wgu, wd = _moe_inputs(s, device, dtype)
    hit = int(torch.unique(ids).numel())
    p = s.tokens * s.top_k
    moe_impls: dict[str, Callable[[], Any]] = {"ref": lambda: fused_moe_ref(x, w, ids, wgu, wd)}
    if on_gpu:
        moe_impls["triton"] = lambda: fused_moe(x, w, ids, wgu, wd, impl="triton")
    if compile_ref:
        ffn_c = torch.compile(expert_ffn, dynamic=True)
        moe_impls["compile(ref)"] = lambda: fused_moe_ref(x, w, ids, wgu, wd, ffn=ffn_c)

    def moe_check() -> str:
        err = _rel_err(fused_moe(x, w, ids, wgu, wd, impl="triton"), fused_moe_ref(x, w, ids, wgu, wd))
        return "" if err <= 2e-2 else f"max rel err {err:.3g} > 2e-2"

    cases.append(
        Case(
            f"fused_moe T={s.tokens} E={s.experts} K={s.top_k}",
            moe_impls,
            bytes=hit * 3 * s.moe_inter * s.hidden * item + 2 * s.tokens * s.hidden * item + p * 12,
            flops=6.0 * p * s.hidden * s.moe_inter,
            check=moe_check if on_gpu else None,
        )
    )

    # sampler step (seeded: the kernel draws its own Philox noise, the reference a torch.Generator stream)
    g = torch.Generator(device=device).manual_seed(1)
    logits = (torch.randn(s.tokens, s.vocab, device=device, generator=g) * 4).to(dtype)
    samp_impls: dict[str, Callable[[], Any]] = {"ref": lambda: sampler_step_ref(logits, 0.8, seed=3, softcap=s.softcap)}
    if on_gpu:
        samp_impls["triton"] = lambda: sampler_step(logits, 0.8, seed=3, softcap=s.softcap, impl="triton")
    if compile_ref:
        samp_c = torch.compile(sampler_step_ref)
        samp_impls["compile(ref)"] = lambda: samp_c(logits, 0.8, seed=3, softcap=s.softcap)

    def samp_check() -> str:
        u = torch.rand(s.tokens, s.vocab, device=device, generator=g)
        got = sampler_step(logits, 0.8, uniform=u, softcap=s.softcap, impl="triton")
        want = sampler_step_ref(logits, 0.8, uniform=u, softcap=s.softcap)
        agree = float((got.sample == want.sample).float().mean())
        ent = float((got.entropy - want.entropy).abs().max())
        if not torch.equal(got.argmax, want.argmax) or agree < 0.99 or ent > 1e-3:
            return f"argmax equal={torch.equal(got.argmax, want.argmax)} sample agree={agree:.3f} entropy err={ent:.2e}"
        return ""

    cases.append(
        Case(
            f"sampler_step N={s.tokens} V={s.vocab}",
            samp_impls,
            bytes=s.tokens * s.vocab * item + s.tokens * 20,
            flops=12.0 * s.tokens * s.vocab,
            check=samp_check if on_gpu else None,
        )
    )

    # soft embedding (self-conditioning)
    emb = (torch.randn(s.vocab, s.hidden, device=device, generator=g) * 0.02).to(dtype)
    scale = s.hidden**0.5
    soft_impls: dict[str, Callable[[], Any]] = {"ref": lambda: soft_embedding_ref(logits, emb, scale=scale)}
    if on_gpu:
        soft_impls["triton"] = lambda: soft_embedding(logits, emb, scale=scale, impl="triton")
    if compile_ref:
        soft_c = torch.compile(soft_embedding_ref)
        soft_impls["compile(ref)"] = lambda: soft_c(logits, emb, scale=scale)

    def soft_check() -> str:
        err = _rel_err(
            soft_embedding(logits, emb, scale=scale, impl="triton"), soft_embedding_ref(logits, emb, scale=scale)
        )
        return "" if err <= 2e-2 else f"max rel err {err:.3g} > 2e-2"

    cases.append(
        Case(
            f"soft_embedding N={s.tokens} V={s.vocab} D={s.hidden}",
            soft_impls,
            bytes=(s.tokens * s.vocab + s.vocab * s.hidden + s.tokens * s.hidden) * item,
            flops=2.0 * s.tokens * s.vocab * s.hidden,
            check=soft_check if on_gpu else None,
        )
    )

    # RMSNorm + residual add
    h = torch.randn(s.tokens, s.hidden, device=device, generator=g).to(dtype)
    res = torch.randn(s.tokens, s.hidden, device=device, generator=g).to(dtype)
    nw = torch.randn(s.hidden, device=device, generator=g).to(dtype)
    norm_impls: dict[str, Callable[[], Any]] = {"ref": lambda: rms_norm_add_ref(h, res, nw)}
    if on_gpu:
        norm_impls["triton"] = lambda: rms_norm_add(h, res, nw, impl="triton")
    if compile_ref:
        norm_c = torch.compile(rms_norm_add_ref)
        norm_impls["compile(ref)"] = lambda: norm_c(h, res, nw)

    def norm_check() -> str:
        err = _rel_err(rms_norm_add(h, res, nw, impl="triton"), rms_norm_add_ref(h, res, nw))
        return "" if err <= 2e-2 else f"max rel err {err:.3g} > 2e-2"

    cases.append(
        Case(
            f"rms_norm_add N={s.tokens} D={s.hidden}",
            norm_impls,
            bytes=3 * s.tokens * s.hidden * item + s.hidden * item,
            flops=5.0 * s.tokens * s.hidden,
            check=norm_check if on_gpu else None,
        )
    )
    return cases


def _time_gpu(fn: Callable[[], Any]) -> tuple[float, float, float, float]:
    """(median ms, p20 ms, p80 ms, extra MiB allocated by one call) with the L2 flushed between runs."""
    import triton.testing

    fn()  # compile / warm up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    med, p20, p80 = triton.testing.do_bench(fn, warmup=25, rep=200, quantiles=[0.5, 0.2, 0.8])
    return float(med), float(p20), float(p80), extra


def _time_cpu(fn: Callable[[], Any], reps: int = 5) -> tuple[float, float, float]:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=5) if len(times) >= 2 else [times[0]] * 4
    return statistics.median(times), q[0], q[-1]


def measure_peaks() -> tuple[float, float]:
    """Measured device copy bandwidth (GB/s, read + write bytes) and bf16 dense matmul rate (TFLOP/s)."""
    import triton.testing

    def copy_ms() -> float:
        src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")  # 1 GiB
        dst = torch.empty_like(src)
        return float(triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median"))

    def matmul_ms(n: int) -> float:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        return float(triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median"))

    n = 8192
    return 2 * 2**30 / (copy_ms() * 1e-3) / 1e9, 2 * n**3 / (matmul_ms(n) * 1e-3) / 1e12


def git_sha() -> str:
    """The checkout's HEAD commit, for a result's record ("unknown" outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_table(rows: list[Row]) -> str:
    head = f"{'op':<44} {'impl':<13} {'ms':>9} {'GB/s':>8} {'%BW':>6} {'TFLOP/s':>8} {'%MM':>6} {'extra MiB':>10}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.op:<44} {r.impl:<13} {_fmt(r.ms, '9.3f')} {_fmt(r.gbps, '8.1f')} {_fmt(r.pct_bw, '6.1f')} "
            f"{_fmt(r.tflops, '8.2f')} {_fmt(r.pct_mm, '6.1f')} {_fmt(r.extra_mb, '10.1f')}  {r.note}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    say: Callable[[str], None] = (lambda _m: None) if args.json else (lambda m: print(m, flush=True))
    start = time.perf_counter()
    on_gpu = torch.cuda.is_available() and HAS_TRITON
    info: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if on_gpu else None,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "git_sha": git_sha(),
        "python": platform.python_version(),
    }
    rows: list[Row] = []
    failures: dict[str, str] = {}
    if not on_gpu:
        why = "no CUDA device" if not torch.cuda.is_available() else "triton is not installed"
        say(f"kernels.bench: {why}; Triton kernels not run. Timing the torch references only, at tiny shapes (CPU).")
        shapes = BenchShapes.tiny()
        for case in build_cases(shapes, "cpu", with_triton=False, compile_ref=False):
            for impl, fn in case.impls.items():
                med, p20, p80 = _time_cpu(fn)
                rows.append(_row(case, impl, med, p20, p80, None, None, None))
        say(format_table(rows))
        print(json.dumps({**info, "device": "cpu", "shapes": asdict(shapes), "rows": [asdict(r) for r in rows]}))
        return 0

    shapes = BenchShapes.real()
    copy_gbps, mm_tflops = measure_peaks()
    say(f"{info['gpu']}: measured copy {copy_gbps:.0f} GB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s")
    cases = build_cases(shapes, "cuda", with_triton=True, compile_ref=not args.no_compile)
    for case in cases:
        if case.check is not None:
            reason = case.check()
            say(f"check {case.op}: {'ok' if not reason else 'FAILED ' + reason}")
            if reason:
                failures[case.op] = reason
    for case in cases:
        for impl, fn in case.impls.items():
            if impl == "compile(ref)" and time.perf_counter() - start > _COMPILE_BUDGET_S:
                rows.append(Row(case.op, impl, None, note="skipped: time budget"))
                continue
            try:
                med, p20, p80, extra = _time_gpu(fn)
            except Exception as exc:  # a failing baseline (e.g. a compile error) must not hide the other rows
                rows.append(Row(case.op, impl, None, note=f"error: {type(exc).__name__}: {exc}"[:120]))
                continue
            rows.append(_row(case, impl, med, p20, p80, extra, copy_gbps, mm_tflops))
        torch.cuda.empty_cache()
    say(format_table(rows))
    say(f"wall time {time.perf_counter() - start:.0f} s")
    print(
        json.dumps(
            {
                **info,
                "device": "cuda",
                "copy_gbps": round(copy_gbps, 1),
                "matmul_tflops": round(mm_tflops, 1),
                "shapes": asdict(shapes),
                "checks": {c.op: failures.get(c.op, "ok") for c in cases if c.check is not None},
                "rows": [asdict(r) for r in rows],
                "wall_s": round(time.perf_counter() - start, 1),
            }
        )
    )
    return 1 if failures else 0


def _row(
    case: Case,
    impl: str,
    med: float,
    p20: float,
    p80: float,
    extra: float | None,
    copy_gbps: float | None,
    mm_tflops: float | None,
) -> Row:
    gbps = case.bytes / (med * 1e-3) / 1e9
    tflops = case.flops / (med * 1e-3) / 1e12
    return Row(
        case.op,
        impl,
        round(med, 4),
        round(p20, 4),
        round(p80, 4),
        round(gbps, 1),
        round(100 * gbps / copy_gbps, 1) if copy_gbps else None,
        round(tflops, 3),
        round(100 * tflops / mm_tflops, 1) if mm_tflops else None,
        round(extra, 1) if extra is not None else None,
    )


def _triton_version() -> str | None:
    if not HAS_TRITON:
        return None
    import triton

    return str(triton.__version__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `python -m kernels.bench`; `dcanvas bench kernels` can register the same ones."""
    parser.add_argument("--json", action="store_true", help="print only the final JSON line")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile(reference) baselines")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench", description="Benchmark the Triton kernels.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
