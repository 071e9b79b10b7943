"""`dcanvas bench model` on the CPU: ours vs transformers' DiffusionGemmaForBlockDiffusion, component by component,
in fp32 and in the dtype this CPU serves with.

    dcanvas bench model [--model DIR | --preset bench-15m] [--prompt 128] [--window 158] [--gap 32] [--runs 5]
                        [--dtype auto|fp32|bf16] [--trim-vocab N] [--steps 6] [--threads N] [--no-reference] [--json]

Same checkpoint, same inputs, medians of `--runs` (ours and the reference alternating). Components:
- encode: the `--prompt`-token prefix through the encoder, with the last position's logits (what the engine reads);
- window: an editor infill, a `--gap`-token gap in the middle of a `--window`-slot canvas after the prefix.
  body: embeddings, self-conditioning input and the layers over every slot; head: final norm, LM head and softcap
  (ours: the free slots only, `denoise(logits_at=)`; the reference: every slot, as its forward does); soft
  embedding: the self-conditioning product (ours: the slots that need it, every used slot while self-conditioning
  is live, none while its MLP is all zeros; the reference: every slot); sampler (ours: `step_stats_at` over the
  free slots; the reference's sampler ops over every slot); step: ours is one `Engine` step (median over `--steps`
  fixed steps after the first), the reference its forward with self-conditioning logits plus its sampler ops;
- full: a whole canvas's decoder forward with self-conditioning, dense on both sides.
Rows come for fp32 and, when it differs, the dtype `--dtype` resolves to (`auto`: `canvas.model.cpu`'s rule), with
the ratios side by side and how often bf16's free-slot logits keep fp32's top-1. `--trim-vocab N` keeps the first N
embedding rows of both models, emulating a trimmed vocabulary. The last line is one JSON object; `machine` holds the
CPU kind and flags, the threads and the bf16 probe. Presets use random weights (throughput does not depend on them).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from canvas.model import DiffusionModel, ModelConfig, load_pretrained
from canvas.model.cpu import dtype_name, parameter_count, resolve_dtype
from canvas.model.io import read_config

# Acceptance targets for one window step (the issue "Fast on the CPU"), by CPU kind.
TARGET_STEP_S = {"amx": 0.15, "avx2": 0.35}
COMPONENTS = ("encode", "body", "head", "soft_embedding", "sampler", "step", "full")


def reference_sampler(processed: torch.Tensor, entropy_bound: float = 0.1) -> torch.Tensor:
    """The reference's sampler ops on processed logits (B, L, V) (transformers' EntropyBoundSampler: softmax,
    multinomial, argmax, Categorical entropy, sort, cumulative bound), returning the renoised canvas (B, L)."""
    B, L, V = processed.shape
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    sample = torch.multinomial(probs.view(-1, V), 1).view(B, L)
    torch.argmax(processed, dim=-1)
    ent = torch.distributions.Categorical(logits=processed).entropy()
    s, idx = torch.sort(ent, dim=-1)
    mask = torch.scatter(torch.zeros_like(s, dtype=torch.bool), -1, idx, (torch.cumsum(s, -1) - s) <= entropy_bound)
    return torch.where(mask, sample, torch.randint(0, V, (B, L)))


def trim_vocab(model: DiffusionModel, n: int) -> DiffusionModel:
    """Our model with only the first n embedding rows (tied head: the LM head shrinks with it)."""
    cfg = model.config
    eos = tuple(t for t in cfg.eos_token_ids if t < n) or (0,)
    small = dataclasses.replace(cfg, vocab_size=n, eos_token_ids=eos,
                                null_token_id=cfg.null_token_id if (cfg.null_token_id or 0) < n else None)
    out = DiffusionModel(small, init=False).to(model.dtype)
    state = dict(model.state_dict())
    state["embed"] = state["embed"][:n]
    out.load_state_dict(state)
    return out.eval()


def trim_reference(ref: Any, n: int) -> Any:
    """The transformers model with every vocabulary-sized matrix (embeddings, tied LM head) cut to n rows."""
    V = ref.config.get_text_config().vocab_size
    seen: set[int] = set()
    for p in ref.parameters():
        if id(p) not in seen and p.dim() == 2 and p.shape[0] == V:
            seen.add(id(p))
            p.data = p.data[:n].clone()
    return ref


def _engine_step_s(model: DiffusionModel, ctx: tuple[int, ...], slots: tuple[int, ...], pins: tuple[bool, ...],
                   steps: int, runs: int) -> float:
    """Median seconds of one engine step of this infill, over `steps` fixed steps after the first (which admits
    the request, encodes the prefix and runs without self-conditioning)."""
    from canvas.engine.core import Engine, GenRequest
    from canvas.sampling.sampler import SamplerConfig

    cfg = SamplerConfig(max_steps=steps + 1, stability_threshold=steps + 2, seed=0)
    walls = []
    for _ in range(runs):
        engine = Engine(model, max_batch=1)
        handle = engine.submit(GenRequest(ctx, slots, pins, cfg))
        engine.step()
        t0 = time.perf_counter()
        engine.run_until_idle()
        walls.append((time.perf_counter() - t0) / steps)
        assert handle.wait(0).steps == steps + 1
    return statistics.median(walls)


def _paired(fns: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    from canvas.bench.common import paired

    return paired(fns, runs)


def _rows(model_dir: Path, dtype: torch.dtype, args: argparse.Namespace, ref_too: bool) -> dict[str, Any]:
    """Every component for one dtype: {"ours_ms": {...}, "reference_ms": {...}, ...}."""
    from canvas.sampling.sampler import GumbelNoise, step_stats_at

    ours = load_pretrained(model_dir, dtype=dtype)
    ref = None
    if ref_too:
        from transformers import DiffusionGemmaForBlockDiffusion

        ref = DiffusionGemmaForBlockDiffusion.from_pretrained(str(model_dir), dtype=dtype).eval()
    if args.trim_vocab:
        ours = trim_vocab(ours, args.trim_vocab)
        ref = trim_reference(ref, args.trim_vocab) if ref is not None else None
    cfg = ours.config
    V, M, L, P, W = cfg.vocab_size, cfg.hidden_size, cfg.canvas_length, args.prompt, min(args.window, cfg.canvas_length)
    gap = min(args.gap, W)
    side = (W - gap) // 2
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, V, (1, P), generator=g)
    window = torch.randint(3, V, (1, W), generator=g)
    full = torch.randint(3, V, (1, L), generator=g)
    sc_window = torch.randn(1, W, V, generator=g) * 3
    sc_full = torch.randn(1, L, V, generator=g) * 3
    free = torch.zeros(W, dtype=torch.bool)
    free[side : side + gap] = True
    free_pos = free.nonzero().squeeze(1)
    live_sc = not ours.self_conditioning.inert()
    sc_slots = W if live_sc else 0  # the engine's soft embeddings: every used slot while live, else none
    _, cache = ours.encode(prompt, logits="none")
    soft_window = ours.soft_embeddings(sc_window) if live_sc else None
    soft_full = ours.soft_embeddings(sc_full) if live_sc else None
    h_free = torch.randn(gap, M, generator=g).to(dtype)
    processed_free = torch.randn(gap, V, generator=g) * 3
    processed_sc = torch.randn(sc_slots, V, generator=g) * 3
    noise = GumbelNoise(0)
    nothing = free_pos[:0]
    fns: dict[str, Callable[[], object]] = {
        "ours_encode": lambda: ours.encode(prompt, logits="last"),
        "ours_body": lambda: ours.denoise(window, cache, soft_embeddings=soft_window, logits_at=nothing),
        "ours_head": lambda: ours.logits(h_free),
        "ours_sampler": lambda: step_stats_at(processed_free, free_pos, W, noise),
        "ours_full": lambda: ours.denoise(full, cache, soft_embeddings=soft_full),
    }
    if sc_slots:
        fns["ours_soft_embedding"] = lambda: ours.soft_embeddings(processed_sc)
    if ref is not None:
        from transformers import DynamicCache

        ref_cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
        with torch.no_grad():
            ref.model.encoder(input_ids=prompt, past_key_values=ref_cache)
        cap = ref.config.get_text_config().final_logit_softcapping
        embed = ref.model.decoder.embed_tokens
        h_window = torch.randn(1, W, M, generator=g).to(dtype)

        @torch.no_grad()
        def ref_encode() -> None:
            c = DynamicCache(config=ref.config.get_text_config(decoder=True))
            h = ref.model.encoder(input_ids=prompt, past_key_values=c).last_hidden_state
            torch.tanh(ref.lm_head(h[:, -1:]).float() / cap) * cap

        @torch.no_grad()
        def ref_step() -> None:
            logits = ref(decoder_input_ids=window, past_key_values=ref_cache, self_conditioning_logits=sc_window).logits
            reference_sampler(logits / 0.6)

        fns |= {
            "ref_encode": ref_encode,
            "ref_body": torch.no_grad()(lambda: ref.model.decoder(decoder_input_ids=window, past_key_values=ref_cache)),
            "ref_head": torch.no_grad()(lambda: torch.tanh(ref.lm_head(h_window).float() / cap) * cap),
            "ref_soft_embedding": torch.no_grad()(lambda: torch.matmul(
                sc_window.softmax(-1, dtype=torch.float32).to(dtype), embed.weight) * embed.embed_scale.to(dtype)),
            "ref_sampler": lambda: reference_sampler(sc_window),
            "ref_step": ref_step,
            "ref_full": torch.no_grad()(lambda: ref(decoder_input_ids=full, past_key_values=ref_cache,
                                                    self_conditioning_logits=sc_full)),
        }
    t = _paired(fns, args.runs)
    ctx = tuple(prompt[0].tolist())
    pins = tuple(not bool(f) for f in free)
    t["ours_step"] = _engine_step_s(ours, ctx, tuple(window[0].tolist()), pins, args.steps, args.runs)
    t.setdefault("ours_soft_embedding", 0.0)
    free_logits = ours.denoise(window, cache, logits_at=free_pos)  # (gap, V): for the bf16 / fp32 agreement
    out: dict[str, Any] = {
        "ours_ms": {c: t[f"ours_{c}"] * 1e3 for c in COMPONENTS},
        "reference_ms": {c: t[f"ref_{c}"] * 1e3 for c in COMPONENTS} if ref is not None else None,
        "self_conditioning_live": live_sc, "soft_embedding_slots": sc_slots, "head_slots": gap,
        "shape": {"vocab": V, "prompt": P, "window": W, "gap": gap, "canvas": L},
    }
    if ref is not None:
        out["speedup"] = {c: t[f"ref_{c}"] / t[f"ours_{c}"] if t[f"ours_{c}"] > 0 else None for c in COMPONENTS}
    return out | {"_free_logits": free_logits}


def bench_model(args: argparse.Namespace) -> dict[str, Any]:
    from canvas.bench.common import machine

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            torch.manual_seed(0)
            DiffusionModel(ModelConfig.from_name(args.preset)).save_pretrained(tmp)
        model_dir = Path(tmp) if args.model is None else Path(args.model)
        cfg = read_config(model_dir)
        name, params = cfg.name, parameter_count(cfg)
        chosen = resolve_dtype(args.dtype, params=params)
        dtypes = [torch.float32] + ([chosen] if chosen != torch.float32 else [])
        rows = {}
        for d in dtypes:
            rows[dtype_name(d)] = _rows(model_dir, d, args, not args.no_reference)
            gc.collect()  # the previous dtype's two models (~2 GB in fp32 for a 270M model) before the next
    logits = {k: v.pop("_free_logits") for k, v in rows.items()}
    chosen_name = dtype_name(chosen)
    out: dict[str, Any] = {"model": name, "parameters": params, "trim_vocab": args.trim_vocab,
                           "dtype_chosen": chosen_name, "rows": rows, "runs": args.runs, "steps": args.steps}
    if chosen_name != "fp32":
        a, b = logits["fp32"], logits[chosen_name]
        out[f"{chosen_name}_vs_fp32"] = {
            "ours_ratio": {c: rows[chosen_name]["ours_ms"][c] / rows["fp32"]["ours_ms"][c]
                           if rows["fp32"]["ours_ms"][c] > 0 else None for c in COMPONENTS},
            "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "max_abs_logit_diff": float((a - b).abs().max()), "logit_rms": float(a.pow(2).mean().sqrt()),
        }
    main = rows[chosen_name]
    ref_ms = main["reference_ms"]
    # The keys the earlier `bench model` printed (the chosen dtype's encode and full-canvas rows).
    for key, comp in (("encoder_ms", "encode"), ("decoder_ms", "full")):
        out[key] = {"ours": main["ours_ms"][comp], "reference": ref_ms[comp] if ref_ms else None,
                    "speedup": main.get("speedup", {}).get(comp)}
    info = machine()
    step_s = main["ours_ms"]["step"] / 1e3
    target = TARGET_STEP_S.get(info["cpu_kind"])
    out["acceptance"] = {"window_step_s": step_s, "targets_s": TARGET_STEP_S, "target_here_s": target,
                         "meets_target_here": step_s <= target if target is not None else None}
    out["machine"] = info
    _print(out)
    return out


def _print(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = out["rows"]
    shape = next(iter(rows.values()))["shape"]
    table = Table(title=f"model {out['model']}, vocab {shape['vocab']}, prefix {shape['prompt']}, window "
                        f"{shape['window']} with a {shape['gap']}-slot gap, canvas {shape['canvas']} "
                        f"(ms, median of {out['runs']}; {out['machine']['cpu_kind']}, "
                        f"{out['machine']['threads']} threads)")
    table.add_column("component")
    for dt in rows:
        table.add_column(f"{dt} ours / ref", justify="right")
    if len(rows) > 1:
        table.add_column(f"{out['dtype_chosen']} / fp32 (ours)", justify="right")
    for c in COMPONENTS:
        cells = []
        for r in rows.values():
            ours, ref = r["ours_ms"][c], (r["reference_ms"] or {}).get(c)
            mine = f"{ours:.1f}" if ours else "skipped"  # soft embeddings while self-conditioning is inert
            cells.append(f"{mine} / {ref:.1f}" + (f" ({ref / ours:.1f}x)" if ours else "") if ref else mine)
        if len(rows) > 1:
            ratio = out[f"{out['dtype_chosen']}_vs_fp32"]["ours_ratio"][c]
            cells.append(f"{ratio:.2f}" if ratio is not None else "-")
        table.add_row(c, *cells)
    Console(stderr=True).print(table)


def register(m: argparse.ArgumentParser) -> None:
    """The `bench model` options (the --gpu path lives in canvas.bench.gpu)."""
    from canvas.model import PRESETS

    m.add_argument("--preset", default="bench-15m", choices=sorted(PRESETS))
    m.add_argument("--model", type=Path, default=None, help="a model directory instead of a random preset")
    m.add_argument("--prompt", type=int, default=128, help="prefix tokens before the canvas")
    m.add_argument("--window", type=int, default=158, help="canvas slots of the infill window")
    m.add_argument("--gap", type=int, default=32, help="free slots in the middle of the window")
    m.add_argument("--runs", type=int, default=5)
    m.add_argument("--steps", type=int, default=6, help="engine steps timed per run (after the first)")
    m.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="the dtype compared with fp32 (auto: what this CPU would serve with)")
    m.add_argument("--trim-vocab", type=int, default=0, help="keep the first N embedding rows (a trimmed vocab)")
    m.add_argument("--no-reference", action="store_true", help="ours only (the reference is slow on big vocabs)")
