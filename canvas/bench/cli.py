"""`dcanvas bench ...`: every performance claim in BENCHMARKS.md comes from here, measured side by side in one run.

    dcanvas bench model  [--model DIR | --preset bench-15m] [--dtype auto] [--trim-vocab N] [--json] [--gpu --layers 4]
        per component (encode, an infill window's body / head / soft embedding / sampler / engine step, a full
        canvas), fp32 and this CPU's dtype, ours vs the transformers modules (see canvas.bench.model)
    dcanvas bench engine [--runs 5] [--json]
        ours vs transformers `generate` with identical tokens asserted (speedup, identical), per-step wall over
        bare decoder forward (step_overhead), peak extra memory of one sampler step in fp32 [B, 256, V] tensors
        (sampler_buffers), 8 canvases batched vs sequential (batch_gain), and diffusion vs AR tokens/s
    dcanvas bench kernels [--json]   (Triton kernels on CUDA; see kernels.bench)
    dcanvas bench load [--sessions 50 --seconds 60]   (see canvas.bench.load)
    dcanvas bench ar [--model DIR] [--batch 8] [--against-llama LLAMA_BENCH]   (see canvas.bench.ar)
    dcanvas bench soak [--minutes 60 --sessions 20 --faults all --seed 1]   (see canvas.soak.run)
    dcanvas bench drafts [--model DIR] [--drafts 8]   K batched AR drafts vs one (see canvas.bench.drafts)
    dcanvas bench typing --url URL [--keystrokes 10]   llama.vim's requests while typing (see canvas.bench.typing)
    dcanvas bench http [--prompt 256 --tokens 64 --runs 8]   plain continuation over HTTP vs llama-server on the same
        weights, alternating request by request (see canvas.bench.http)
Each figure is the median of several runs, ours and the reference alternating; the last line is one JSON object
with the machine noted. Presets use random weights (throughput does not depend on what the weights say); token
identity over 48 steps wants trained weights (`--model DIR`): with random weights every slot's entropy is within
float rounding of log(V), so which slot is accepted first is decided by the last bit of the arithmetic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from canvas.bench.common import machine, median_time, paired, peak_extra_bytes, print_table, random_pair
from canvas.model import PRESETS, DiffusionModel, ModelConfig


# ---- engine --------------------------------------------------------------------------------------------------------
def bench_engine(args: argparse.Namespace) -> dict[str, Any]:
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    from canvas.bench.model import reference_sampler
    from canvas.engine.core import Engine, GenRequest
    from canvas.engine.generate import generate_static
    from canvas.sampling.sampler import ReferenceNoise, SamplerConfig, select_accepted, step_stats

    if args.model is not None:
        from transformers import DiffusionGemmaForBlockDiffusion

        ours = DiffusionModel.from_pretrained(str(args.model))
        ref = DiffusionGemmaForBlockDiffusion.from_pretrained(str(args.model)).eval()
        cfg = ours.config
    else:
        cfg = ModelConfig.from_name(args.preset)
        with tempfile.TemporaryDirectory() as tmp:
            ours, ref = random_pair(cfg, Path(tmp))
    V, L, steps = cfg.vocab_size, cfg.canvas_length, args.steps
    prompt = torch.randint(3, V, (1, args.prompt), generator=torch.Generator().manual_seed(2))
    sconf = SamplerConfig(max_steps=steps)
    results: dict[str, list[torch.Tensor]] = {"ours": [], "ref": []}

    def run_ours() -> None:
        torch.manual_seed(123)
        results["ours"].append(generate_static(ours, prompt, sconf, max_new_tokens=L, noise=ReferenceNoise()).sequences)

    def run_ref() -> None:
        torch.manual_seed(123)
        with torch.no_grad():
            out = ref.generate(prompt, max_new_tokens=L, max_denoising_steps=steps, t_min=sconf.t_min,
                               t_max=sconf.t_max, sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1),
                               stability_threshold=1, confidence_threshold=0.005)
        results["ref"].append(out.sequences)

    t = paired({"ours": run_ours, "ref": run_ref}, args.runs)
    identical = all(torch.equal(a, b) for a, b in zip(results["ours"], results["ref"], strict=True))
    speedup = t["ref"] / t["ours"]

    # Per-step wall of the interactive engine (fast noise) over the bare decoder forward with self-conditioning.
    engine = Engine(ours)
    ctx = tuple(prompt[0].tolist())

    def timed(requests: list[GenRequest], batch: int) -> tuple[float, list[Any]]:
        """Wall seconds of a fresh engine running `requests` to completion, and their `Done`s."""
        eng = Engine(ours, max_batch=batch)
        hs = [eng.submit(r) for r in requests]
        t0 = time.perf_counter()
        eng.run_until_idle()
        wall = time.perf_counter() - t0
        dones = [h.wait(0) for h in hs]
        assert all(d.status == "completed" for d in dones)
        return wall, dones

    def engine_run(n: int = 1, batch: int = 8) -> float:
        return timed([GenRequest(ctx, config=SamplerConfig(max_steps=steps, seed=i)) for i in range(n)], batch)[0]

    engine.submit(GenRequest(ctx, config=SamplerConfig(max_steps=2, seed=0)))
    engine.run_until_idle()  # warm the context cache and the allocator
    _, cache = ours.encode(prompt, logits="none")
    canvas = torch.randint(0, V, (1, L))
    sc = torch.randn(1, L, V)
    bare = median_time(lambda: ours.denoise(canvas, cache, sc), args.runs)
    per_step = statistics.median(engine_run(1) for _ in range(max(3, args.runs // 2))) / steps
    step_overhead = per_step / bare

    # An editor infill: a 32-token gap between 64 pinned tokens on each side uses 160 of the canvas's slots, and
    # the forward covers only those. Early stopping off, so both walls are exactly `steps` steps.
    side, gap = min(64, (L - 1) // 4), min(32, (L - 1) // 2)
    window = 2 * side + gap
    slots = tuple(torch.randint(3, V, (window,), generator=torch.Generator().manual_seed(3)).tolist())
    pins = tuple(not side <= i < side + gap for i in range(window))
    fixed = SamplerConfig(max_steps=steps, stability_threshold=steps + 1, seed=0)

    def fixed_step(request: GenRequest) -> float:
        """Median seconds a step of `request` alone, stopping off so every run is exactly `steps` steps."""
        walls = []
        for _ in range(max(3, args.runs // 2)):
            wall, (done,) = timed([request], 1)
            assert done.steps == steps
            walls.append(wall)
        return statistics.median(walls) / steps

    full_step = fixed_step(GenRequest(ctx, config=fixed))
    infill_step = fixed_step(GenRequest(ctx, slots, pins, fixed))

    # Peak memory of one sampler step, ours vs the reference's ops, in fp32 (B, L, V) tensors (B = 1).
    unit = L * V * 4
    logits = torch.randn(1, L, V) * 3
    free = torch.ones(1, L, dtype=torch.bool)
    from canvas.sampling.sampler import GumbelNoise

    noise = GumbelNoise(0)

    def our_sampler() -> None:
        processed = logits.div_(1.0)
        stats = step_stats(processed, noise)
        acc = select_accepted(stats.entropy, free, 0.1)
        torch.where(acc, stats.sample, noise.uniform_tokens((1, L), V, logits.device))

    def ref_sampler() -> None:
        reference_sampler(logits / 1.0)

    ours_buffers = peak_extra_bytes(our_sampler) / unit
    ref_buffers = peak_extra_bytes(ref_sampler) / unit

    # 8 canvases batched vs one after another, and diffusion vs AR on the same model.
    seq = statistics.median(engine_run(8, batch=1) for _ in range(max(1, args.runs // 3)))
    bat = statistics.median(engine_run(8, batch=8) for _ in range(max(1, args.runs // 3)))
    batch_gain = seq / bat
    ar = Engine(ours)
    h = ar.submit(GenRequest(ctx, config=SamplerConfig(mode="ar")))
    t0 = time.perf_counter()
    ar.run_until_idle()
    ar_wall = time.perf_counter() - t0
    ar_tok_s = h.wait(0).generated / ar_wall
    diff_tok_s = L / (per_step * steps)
    out = {
        "speedup": speedup, "identical": identical, "step_overhead": step_overhead,
        "sampler_buffers": ours_buffers, "batch_gain": batch_gain,
        "ours_s": t["ours"], "reference_s": t["ref"], "steps": steps, "per_step_ms": per_step * 1e3,
        "bare_forward_ms": bare * 1e3, "reference_sampler_buffers": ref_buffers,
        "infill_window_slots": window, "infill_step_ms": infill_step * 1e3,
        "infill_step_vs_full": infill_step / full_step, "full_step_fixed_ms": full_step * 1e3,
        "diffusion_tok_s_fixed_steps": diff_tok_s, "ar_tok_s": ar_tok_s,
        "preset": cfg.name, "prompt_tokens": args.prompt, "runs": args.runs, "machine": machine(),
    }
    print_table(f"engine, {cfg.name}, prompt {args.prompt}, {steps} steps, 1 canvas of {L} (median of {args.runs})", [
        ("ours / reference generate s", f"{t['ours']:.2f} / {t['ref']:.2f}"),
        ("speedup (goal >= 4)", f"{speedup:.2f}x"),
        ("identical tokens", str(identical)),
        ("step / bare forward (goal <= 1.15)", f"{per_step * 1e3:.1f} / {bare * 1e3:.1f} ms = {step_overhead:.2f}"),
        (f"infill window of {window} slots / full canvas, ms a step",
         f"{infill_step * 1e3:.1f} / {full_step * 1e3:.1f} ms = {infill_step / full_step:.2f}"),
        ("sampler peak, fp32 [1,L,V] units (goal <= 1)", f"{ours_buffers:.2f} (reference {ref_buffers:.2f})"),
        ("8 canvases: sequential / batched s (goal >= 2.5)", f"{seq:.2f} / {bat:.2f} = {batch_gain:.2f}x"),
        ("tok/s diffusion (all steps) / AR", f"{diff_tok_s:.0f} / {ar_tok_s:.0f}"),
    ])
    return out


def register(parser: argparse.ArgumentParser) -> None:
    from canvas.bench.load import register as register_load
    from canvas.bench.model import register as register_model

    sub = parser.add_subparsers(dest="bench", metavar="WHAT", required=True)
    m = sub.add_parser("model", help="model components, fp32 and this CPU's dtype: ours vs the transformers modules")
    register_model(m)
    m.add_argument("--json", action="store_true")
    m.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    m.add_argument("--gpu", action="store_true", help="26B-A4B text shapes, random bf16 weights, on CUDA")
    m.add_argument("--layers", type=int, default=4, help="with --gpu: layers to build (scaled to 30)")
    m.set_defaults(func=_run, which="model")
    e = sub.add_parser("engine", help="ours vs transformers generate, step overhead, sampler memory, batching")
    e.add_argument("--preset", default="bench-15m", choices=sorted(PRESETS))
    e.add_argument("--model", type=Path, default=None, help="a model directory (trained weights) instead of a preset")
    e.add_argument("--prompt", type=int, default=64)
    e.add_argument("--steps", type=int, default=48)
    e.add_argument("--runs", type=int, default=5)
    e.add_argument("--json", action="store_true")
    e.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    e.set_defaults(func=_run, which="engine")
    register_load(sub.add_parser("load", help="concurrent dcanvas/1 sessions against a real server"))
    from canvas.bench.ar import register as register_ar
    from canvas.bench.drafts import register as register_drafts
    from canvas.soak.run import register as register_soak

    register_ar(sub.add_parser("ar", help="AR decode (batch 1 and K), prefill, the step's split; vs llama.cpp"))
    register_soak(sub.add_parser("soak", help="writers against a real server under scheduled faults, then a checker"))
    register_drafts(sub.add_parser("drafts", help="K batched AR drafts vs one: per step and per infill"))
    from canvas.bench.typing import register as register_typing

    register_typing(sub.add_parser("typing", help="a typing session replayed against a server's /infill, as llama.vim"))
    from canvas.bench.http import register as register_http

    register_http(sub.add_parser("http", help="plain continuation over HTTP: ours vs llama-server, alternating"))
    k = sub.add_parser("kernels", help="Triton kernels vs their references (CUDA)")
    k.add_argument("rest", nargs=argparse.REMAINDER)
    k.set_defaults(func=_run_kernels)


def _run(args: argparse.Namespace) -> int:
    from canvas.model.cpu import configure_allocator

    if args.threads:
        torch.set_num_threads(args.threads)
    configure_allocator()  # as a served model runs (load_backend): large temporaries reused, not page-faulted
    if args.which == "model" and args.gpu:
        from canvas.bench.gpu import bench_model_gpu

        out = bench_model_gpu(args)
    else:
        from canvas.bench.model import bench_model

        out = bench_model(args) if args.which == "model" else bench_engine(args)
    print(json.dumps(out))
    return 0


def _run_kernels(args: argparse.Namespace) -> int:
    from kernels.bench import main

    return main(args.rest)
