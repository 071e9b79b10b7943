"""`dcanvas bench drafts`: what K batched AR drafts cost against one, per engine step and per infill.

    dcanvas bench drafts [--model DIR | --preset bench-15m] [--drafts 8] [--gaps 32,64] [--prompt 192] [--runs 5]

Per step: the median time of one batched `model.encode` of (K, 1) tokens over K lanes of one context
(`canvas.engine.ar.ARBatch.step`, the call the engine makes each step) against the same for one lane; goal: batch 8
<= 1.5x a single draft. Beside it, the lanes' token draw that follows each step (`canvas.engine.ar.draw`), and the
two together: what an engine step costs. With --model the engine is the server's (`load_backend`: its dtype, int8
decode weights and tokenizer facts). Per infill: the wall of a whole seam-aware AR infill through the engine (K
drafts, their seam scoring, the choice) against the plain one-draft fill, for each gap size, with the seam tokens and
endings the model directory (or the sampler's defaults) sets. The last line is one JSON object with the machine noted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from canvas.engine.core import Engine
from canvas.model import PRESETS, DiffusionModel, KVCache


def _model(args: argparse.Namespace) -> tuple[DiffusionModel, str, Any, Engine]:
    """The model, its name, its sampler defaults and an engine on it with the tokenizer facts the server's has (so a
    model built with the FIM format drafts in it, as served)."""
    from canvas.sampling.sampler import SamplerConfig, load_sampler_defaults

    if args.model is not None:
        from canvas.engine.backend import load_backend

        backend = load_backend(args.model, max_batch=1, threads=args.threads or None)
        engine = backend.engine.twin(max_batch=1, context_cache_mb=0)
        return engine.model, Path(args.model).name, load_sampler_defaults(args.model), engine
    torch.manual_seed(0)
    model = DiffusionModel(PRESETS[args.preset]).eval()
    return model, args.preset, SamplerConfig(), Engine(model, max_batch=1, context_cache_mb=0)


def bench_drafts(args: argparse.Namespace) -> dict[str, Any]:
    from canvas.bench.common import machine, print_table
    from canvas.engine.ar import ARBatch, draw
    from canvas.engine.core import GenRequest

    model, name, defaults, engine = _model(args)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(3, cfg.vocab_size, (1, args.prompt), generator=g)
    head, context = model.encode(ctx, cache=model.new_cache(1, args.prompt + 1), logits="last")
    assert head is not None
    last = head[0, -1].float()  # (V,): the logits a draw reads
    def step_time(k: int) -> float:
        """Median seconds of one batched step of k lanes of the context: the engine's per-step AR call."""
        steps = 16
        batch = ARBatch(model)

        class _Lane:  # the part of an `ARWalk` the batch reads
            serial, lanes, rows = 1, k, k
            budget_left = steps + 1
            moved: dict[int, tuple[int, int]] = {}

            @staticmethod
            def source(row: int) -> KVCache:
                return context

            @staticmethod
            def feed() -> torch.Tensor:
                return torch.randint(3, cfg.vocab_size, (k,), generator=g)

        walks: Any = [_Lane()]
        batch.step(walks)  # builds the lanes' cache (a copy of the context per lane): not a step's cost
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            batch.step(walks)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def draw_time(k: int) -> float:
        """Median seconds of the k lanes' token draw after a step (`canvas.engine.ar.draw`, as a scored draft
        draws: its sentinel and EOS bans, a no-repeat ban a lane, the model's temperature)."""
        logits = last.repeat(k, 1)  # (k, V): a step's head output
        bans = [[0, 1, 2, 3, 4, 5, 6 + lane] for lane in range(k)]
        temperature = defaults.ar_temperature or 0.7
        times = []
        for _ in range(16):
            t0 = time.perf_counter()
            draw(logits, bans, temperature, defaults, g)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    singles, batched, draws_1, draws_k = [], [], [], []
    for _ in range(args.runs):  # alternate, so load from other processes hits both alike
        singles.append(step_time(1))
        batched.append(step_time(args.drafts))
        draws_1.append(draw_time(1))
        draws_k.append(draw_time(args.drafts))
    single, multi = statistics.median(singles), statistics.median(batched)
    draw_1, draw_k = statistics.median(draws_1), statistics.median(draws_k)

    base = dataclasses.replace(defaults, mode="ar", seed=0, ar_temperature=defaults.ar_temperature or 0.7)
    seam = dataclasses.replace(base, ar_drafts=args.drafts, ar_seam_tokens=defaults.ar_seam_tokens or 8)
    plain = dataclasses.replace(base, ar_drafts=1, ar_seam_tokens=0)
    side = min(64, (cfg.canvas_length - max(args.gaps)) // 2)
    infills: dict[str, dict[str, float]] = {}
    for gap in args.gaps:
        slots = tuple(torch.randint(3, cfg.vocab_size, (2 * side + gap,), generator=g).tolist())
        pins = tuple(not side <= i < side + gap for i in range(len(slots)))
        walls: dict[str, list[float]] = {"plain": [], "drafts": []}
        for _ in range(max(1, args.runs // 2)):
            for key, sampler in (("plain", plain), ("drafts", seam)):
                h = engine.submit(GenRequest(tuple(ctx[0].tolist()), slots, pins, sampler))
                t0 = time.perf_counter()
                engine.run_until_idle()
                walls[key].append(time.perf_counter() - t0)
                assert h.wait(0).status == "completed"
        infills[str(gap)] = {k: statistics.median(v) for k, v in walls.items()}
    out = {
        "model": name, "dtype": str(model.dtype).removeprefix("torch."), "prompt_tokens": args.prompt,
        "drafts": args.drafts, "step_single_ms": single * 1e3, "step_batch_ms": multi * 1e3,
        "step_ratio": multi / single, "draw_single_ms": draw_1 * 1e3, "draw_batch_ms": draw_k * 1e3,
        "step_draw_ratio": (multi + draw_k) / (single + draw_1), "infill_s": infills,
        "seam_tokens": seam.ar_seam_tokens,
        "runs": args.runs, "machine": machine(),
    }
    rows = [(f"one AR step: 1 lane / {args.drafts} lanes (goal <= 1.5x)",
             f"{single * 1e3:.1f} / {multi * 1e3:.1f} ms = {multi / single:.2f}x"),
            ("the lanes' token draw after it: 1 / K", f"{draw_1 * 1e3:.2f} / {draw_k * 1e3:.2f} ms"),
            ("step and draw: 1 lane / K lanes", f"{(single + draw_1) * 1e3:.1f} / {(multi + draw_k) * 1e3:.1f} ms = "
             f"{(multi + draw_k) / (single + draw_1):.2f}x")]
    for gap, w in infills.items():
        rows.append((f"{gap}-token infill: plain fill / {args.drafts} drafts + seam ({seam.ar_seam_tokens} tokens)",
                     f"{w['plain']:.2f} / {w['drafts']:.2f} s"))
    print_table(f"AR drafts, {name} ({out['dtype']}), prompt {args.prompt} (median of {args.runs})", rows)
    return out


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="bench-15m", choices=sorted(PRESETS))
    parser.add_argument("--model", type=Path, default=None, help="a model directory instead of a preset")
    parser.add_argument("--drafts", type=int, default=8, help="K, the drafts stepped together")
    parser.add_argument("--gaps", type=lambda s: tuple(int(x) for x in s.split(",")), default=(32, 64))
    parser.add_argument("--prompt", type=int, default=192, help="context tokens before the canvas")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from canvas.model.cpu import configure_allocator

    if args.drafts < 1 or args.runs < 1:
        raise SystemExit("--drafts and --runs must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    configure_allocator()
    print(json.dumps(bench_drafts(args)))
    return 0
